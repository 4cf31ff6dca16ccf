"""`dpbench-report --leaderboard --wandb`: the leaderboard as a W&B Table plus its figures, in a
run of its own. Offline unless WANDB_MODE says otherwise, as the training runs
(dpbench/logging/wandb_logger.py); `wandb sync` uploads it later."""

from __future__ import annotations

import io
import os
from pathlib import Path

from dpbench.tools.report.leaderboard import Board, records
from dpbench.tools.report.plots import task_slug


def log_leaderboard(boards: list[Board], figures: dict[str, dict[str, dict[str, bytes]]], out: Path, name: str,
                    project: str = "dpbench") -> str | None:
    """Log one `leaderboard` table (every board; task and ε as columns) and every figure (PNG).
    Returns the `wandb sync` command of an offline run (None online)."""
    import wandb
    from PIL import Image

    mode = os.environ.get("WANDB_MODE") or "offline"
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project, name=f"leaderboard-{name}", group=name, job_type="leaderboard", mode=mode,
                     dir=str(out), reinit="finish_previous", settings=wandb.Settings(console="off", silent=True, disable_git=True))
    columns, data = records(boards)
    logged = {"leaderboard": wandb.Table(columns=columns, data=data)}
    for task, named in figures.items():
        for figure, kinds in named.items():
            image = Image.open(io.BytesIO(kinds["png"]))
            logged[f"figures/{task_slug(task)}_{figure}"] = wandb.Image(image, caption=f"{figure.replace('_', ' ')}: {task}")
    run.log(logged)
    run_dir = Path(run.dir).parent if mode == "offline" else None
    run.finish()
    return f"wandb sync {run_dir}" if run_dir is not None else None
