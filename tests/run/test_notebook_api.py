"""dpbench from a notebook: `run` returns its folder and can be silent, `grid` runs a product of
values into the CLI's folder names and resumes, `load_runs` reads a folder into a DataFrame."""

from __future__ import annotations

from helpers.config import FIXED_SIGMA, TINY

from dpbench import api


def test_a_quiet_grid_returns_its_runs_resumes_and_loads_as_a_dataframe(tmp_path, capsys):
    base = TINY + FIXED_SIGMA + ["train.steps=2", "train.eval_every=0", "train.save_model=false"]
    folder = tmp_path / "mine"
    results = api.grid(base, {"algo": ["dpsgd", "adam"], "seed": [0]}, folder)
    assert [r.algo for r in results] == ["dpsgd", "adam"]
    assert [r.run_dir.name for r in results] == ["algo=dpsgd,seed=0", "algo=adam,seed=0"]
    assert all((r.run_dir / "results.json").is_file() for r in results)
    assert capsys.readouterr().err == ""  # quiet: no bar, no table, no notes
    first = (results[0].run_dir / "results.json").stat().st_mtime_ns
    again = api.grid(base, {"algo": ["dpsgd"], "seed": [0]}, folder)  # finished: read back, not rerun
    assert (again[0].run_dir / "results.json").stat().st_mtime_ns == first
    frame = api.load_runs(folder)
    assert sorted(frame["algo"]) == ["adam", "dpsgd"] and len(frame) == 2
    by_algo = frame.set_index("algo")
    assert by_algo.loc["dpsgd", "privacy/epsilon"] > 0 and by_algo.loc["adam", "privacy/private"] == False  # noqa: E712
    assert set(frame["run_dir"]) == {str(r.run_dir) for r in results}


def test_an_empty_folder_is_an_empty_frame(tmp_path):
    frame = api.load_runs(tmp_path)
    assert frame.empty and "algo" in frame.columns
