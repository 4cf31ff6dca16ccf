"""The `dpbench` console script: compose the Hydra config, run the job, map errors to exit codes.

    dpbench                                   # DP-GRAPE, tiny ViT, bundled digits, eps=8
    dpbench algo=dpsgd privacy.epsilon=3      # any config value can be overridden
    dpbench -m algo=adam,dpadam seed=0,1      # a grid; finished jobs are skipped on rerun
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dpbench.errors import DivergedError, UserError
from dpbench.paths import config_dir


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _main(cfg: DictConfig) -> None:
    from dpbench.logging.console import console
    from dpbench.run import run_job

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_job(cfg, run_dir)
    except UserError as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        sys.exit(2)
    except DivergedError as error:
        console.print(f"[bold red]diverged:[/] {error}", soft_wrap=True)
        if HydraConfig.get().mode != RunMode.MULTIRUN:  # a grid goes on to its next job
            sys.exit(1)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
