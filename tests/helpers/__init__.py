"""Shared test helpers, imported as `helpers` (tests/ is on pytest's pythonpath, pyproject.toml).

    helpers.config        REPO, TINY, OFFLINE and compose(): the config `dpbench <overrides>` runs
    helpers.cli           dpbench(): the console script in a subprocess (for tests marked slow)
    helpers.algorithms    build_algorithm(), tiny_model(), record_updates()
    helpers.projected     TensorTask, tiny_vit(), image_task(), build() for the projected-Adam family
    helpers.per_sample    assert_per_sample_grads_match(): Opacus per-sample gradients vs autograd
    helpers.text_data     fixture text datasets in the hub's field layout
    helpers.wandb_records the records of an offline W&B run file
    helpers.distributed_worker, distributed_failures, release_worker, audit_worker
                          one rank of the spawned gloo runs (tests/run/test_distributed.py,
                          tests/privacy/test_release.py, tests/tools/audit/test_audit_sharded.py)
    helpers.make_engine_reference
                          the script that made tests/fixtures/engine_reference.pt (not re-run)

Tests mirror the package: tests/privacy, tests/algorithms, tests/run (config, CLI, trainer,
checkpoints, precision, devices), tests/tools, tests/models, tests/data, tests/papers (presets
and reproduction), tests/docs. Test modules import helpers, never each other.
"""
