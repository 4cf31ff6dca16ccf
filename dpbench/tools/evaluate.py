"""dpbench-evaluate: the test metric of a run's saved model, computed again from its weights.

    dpbench-evaluate outputs/runs/<run>                       # the run's own test set
    dpbench-evaluate outputs/runs/<run> dataset.root=DIR      # dataset.* overrides (also device=, threads=)

The task, model and algorithm are rebuilt from the config saved in `model.safetensors`
(dpbench/saved_model.py) and its weights loaded; on the run's own test set the figure equals the
run's final "test acc". Evaluating the released model is post-processing: it spends no epsilon.
It prints one line and writes nothing (dpbench.api.evaluate_saved records a figure in results.json).
"""

from __future__ import annotations

import argparse
import sys

from dpbench.errors import UserError

EXIT_BAD_INPUT = 2  # as dpbench's: a one-line error naming the fix


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="dpbench-evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run folder holding model.safetensors (outputs/runs/<run>)")
    parser.add_argument("overrides", nargs="*", help="dataset.KEY=VALUE (and device=, threads=) for another test set")
    return parser.parse_args(argv)


def evaluate(run_dir: str, overrides: list[str] | None = None) -> tuple[str, dict]:
    """(the metric's name, the task's test metrics) of the saved model."""
    from pathlib import Path

    from dpbench.api import rebuild

    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir} is not a folder; give a run folder such as outputs/runs/<run>")
    job = rebuild(Path(run_dir), overrides)
    return job.task.metric_name, job.task.evaluate(job.model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        metric, metrics = evaluate(args.run_dir, args.overrides)
    except UserError as error:
        print(f"dpbench-evaluate: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    name = "test acc" if metric == "accuracy" else f"test {metric}"
    loss = metrics.get("loss")
    print(f"{name} {metrics['accuracy']:.4f}" + ("" if loss is None else f"  test loss {loss:.4f}")
          + f"  (saved model of {args.run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
