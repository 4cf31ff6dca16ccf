"""Text datasets through Hugging Face `datasets`, and the papers' few-shot samplings.

`dataset.path` (a `save_to_disk` folder, or a folder of `<split>.jsonl` / `<split>.json` files
with the hub's field names) is read offline; otherwise the hub id in the dataset config is used.
Samplings are pure functions of (labels or sizes, k, seed), so a split is reproducible:
* LM-BFF / MeZO RoBERTa (`k_shot_split`): per class, the first k examples of a seeded
  permutation are train and the next k are dev; the test set is the original dev/test split,
  subsampled to 1000 with seed 42 (LM-BFF's tools/generate_k_shot_data.py).
* MeZO OPT (`sample_subset`): 1000 train + 500 dev drawn without replacement from the train
  split with the data seed (dev = the last 500), 1000 test from the validation split.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from dpbench.errors import UserError

_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@lru_cache(maxsize=1)
def hub_offline() -> bool:
    """Whether the model/dataset hub is out of reach: an *_OFFLINE variable is set, or one TCP
    probe of the hub endpoint fails. Decided once per process and then enforced (`use_offline_mode`),
    because transformers and datasets otherwise retry every request several times (~30 s) before
    falling back to the cache or failing."""
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in _OFFLINE_VARIABLES):
        return True
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=3).close()
    except OSError:
        return True
    return False


def use_offline_mode() -> None:
    """Make huggingface_hub, transformers and datasets read only their caches from now on."""
    for variable in _OFFLINE_VARIABLES:
        os.environ[variable] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        import datasets.config
    except ImportError:
        return
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, flag):
            setattr(datasets.config, flag, True)


def load_text_splits(dataset_cfg, splits: dict[str, str]) -> dict[str, list[dict]]:
    """{role: rows} for roles like {'train': 'train', 'test': 'validation'} (role -> split name)."""
    import datasets

    datasets.disable_progress_bars()
    path = dataset_cfg.get("path")
    if path:
        folder = Path(str(path)).expanduser()
        if not folder.is_dir():
            raise UserError(f"dataset.path={folder} is not a folder; point it at a save_to_disk folder or <split>.jsonl files")
        if (folder / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(folder))
            return {role: list(loaded[split]) for role, split in splits.items()}
        result = {}
        for role, split in splits.items():
            files = [folder / f"{split}{ext}" for ext in (".jsonl", ".json")]
            found = next((f for f in files if f.exists()), None)
            if found is None:
                raise UserError(f"dataset.path={folder} has no {split}.jsonl or {split}.json for the {role} split")
            result[role] = list(datasets.load_dataset("json", data_files=str(found), split="train"))
        return result
    hub = list(dataset_cfg.hub)
    offline = hub_offline()
    if offline:
        use_offline_mode()
    try:
        return {role: list(datasets.load_dataset(*hub, split=split)) for role, split in splits.items()}
    except Exception as error:  # network, missing dataset, auth: all the user's to fix
        where = "offline and not in the local cache" if offline else type(error).__name__
        raise UserError(
            f"cannot load dataset {'/'.join(hub)} ({where}); save it on a machine with access "
            f"(datasets' save_to_disk, or <split>.jsonl files) and set dataset.path=FOLDER"
        ) from error


def k_shot_split(labels: list, k: int, seed: int) -> tuple[list[int], list[int]]:
    """LM-BFF k-shot sampling: (train indices, dev indices), k per class each, disjoint."""
    order = np.random.RandomState(seed).permutation(len(labels))
    train, dev, taken = [], [], {}
    for index in order:
        label = labels[index]
        count = taken.get(label, 0)
        if count < k:
            train.append(int(index))
        elif count < 2 * k:
            dev.append(int(index))
        taken[label] = count + 1
    return train, dev


def sample_subset(size: int, num: int, seed: int) -> list[int]:
    """MeZO's sample_subset: `num` indices without replacement (all of them if fewer exist)."""
    if num >= size:
        return list(np.random.RandomState(seed).permutation(size))
    return [int(i) for i in np.random.RandomState(seed).choice(size, num, replace=False)]
