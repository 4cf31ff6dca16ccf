"""dpbench: memory-efficient differentially private training, measured.

`dpbench` (the console script, dpbench/cli.py) composes the Hydra config groups in conf/ and
hands the result to dpbench.run.run_job. docs/architecture.md describes the seams for contributors.
"""

from dpbench import _compat  # noqa: F401  (must run before anything imports timm/torchvision)

__version__ = "0.1.0"
