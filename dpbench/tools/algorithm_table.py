"""The documentation's algorithm page (docs/algorithms.md), generated from the registry: what each
registered algorithm is (its module's first sentence), its defaults (conf/algo/<name>.yaml, else its
options dataclass) and what it declares on its class for the features that read it.

    python -m dpbench.tools.algorithm_table --write docs/algorithms.md

tests/docs/test_algorithm_table.py fails when the page and the registry disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from dpbench.algorithms import ALGORITHMS
from dpbench.paths import config_dir

HEADER = """# Algorithms

<!-- generated from the registry: python -m dpbench.tools.algorithm_table --write docs/algorithms.md -->

Every algorithm `algo=<name>` runs, as its class and its `conf/algo/<name>.yaml` declare it (this page
is generated from the registry, and a test fails when they disagree; a new algorithm appears here
once its two files exist: [Contributing](contributing.md#adding-an-algorithm)). Columns:

- *lr (family)*, *C*: `default_lr` and `lr_family` (a data set's rate for the family wins),
  `default_clip_norm`: what `dpbench algo=<name>` trains with
  ([Defaults](running.md#defaults-every-algorithm-learns));
- *engine*: whether it forms per-example gradients with a per-example engine, and whether its options
  let `algo.per_sample` choose one ([Engines](engines.md));
- *canaries*: `canary_site`, where the one-run audit's canaries enter ([Auditing](auditing.md));
- *sharded*: `shardable`, stated by the class itself ([Sharded training](sharding.md));
- *trains named modules*: `trained_modules_option`, the option that keeps modules trained in full
  beside what it adapts (the one-run audit's canary layer joins it);
- *learns default job*: `learns_default_job`, held to twice chance by the slow tier.
"""


def defaults(name: str) -> dict:
    """The algorithm's options as its YAML gives them, else its options dataclass's defaults."""
    options = ALGORITHMS.options(name)
    values = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
              for f in dataclasses.fields(options)} if options else {}
    path = Path(config_dir()) / "algo" / f"{name}.yaml"
    if path.is_file():
        own = OmegaConf.to_container(OmegaConf.load(path))
        values.update({k: v for k, v in own.items() if k != "defaults"})
    return values


def summary(name: str) -> str:
    """The first sentence of the algorithm's module docstring."""
    module = sys.modules[ALGORITHMS.get(name).__module__]
    paragraph = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<!\bal)\.\s+(?=[A-Z])", paragraph, maxsplit=1)[0]  # not at "et al."
    return sentence if sentence.endswith(".") else sentence + "."


def row(name: str) -> str:
    cls, values = ALGORITHMS.get(name), defaults(name)
    family = getattr(values.get("lr_family"), "value", values.get("lr_family"))
    engine = "–"
    if cls.per_example_engine:
        engine = "any (`algo.per_sample`)" if "per_sample" in values else "materialize"
    option = cls.trained_modules_option
    cells = [f"`{name}`", "yes" if cls.private else "no", f"{values.get('default_lr'):g} ({family})",
             f"{values.get('default_clip_norm'):g}" if cls.private else "–", engine,
             f"`{cls.canary_site}`" if cls.private and cls.canary_site else "–",
             "yes" if cls.stated("shardable") else "–", f"`algo.{option}`" if option else "–",
             ("yes" if cls.learns_default_job else "no") if cls.private else "–"]
    return "| " + " | ".join(cells) + " |"


def algorithm_page() -> str:
    names = ALGORITHMS.names()
    lines = [HEADER, "| algo | private | lr (family) | C | engine | canaries | sharded | trains named modules "
                     "| learns default job |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [row(name) for name in names]
    lines += ["", "## What each one is", ""]
    lines += [f"- `{name}`: {summary(name)}" for name in names]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, default=None, help="write the page there (default: print it)")
    args = parser.parse_args(argv)
    page = algorithm_page()
    if args.write is None:
        print(page, end="")
    else:
        args.write.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
