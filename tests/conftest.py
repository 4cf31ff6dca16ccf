"""Test-session setup: W&B off, one torch thread per pytest-xdist worker, the `slow` tier, and the
xdist groups that keep a module's shared fixture on one worker. Shared helpers live in
tests/helpers/ (imported as `helpers`)."""

import os

import pytest

from helpers.config import TINY, compose

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each of the -n workers gets one core: intra-op threads beyond it (here, and in the
    # processes tests start) would only make the workers fight over the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The libraries and collected tests live as long as the worker: frozen out of the cyclic garbage
    collector, whose full collections otherwise rescan them all the time (about a quarter of the fast
    tier's CPU time, measured with gc.callbacks). Objects made by the tests are collected as usual."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def tiny_cfg():
    return lambda *extra: compose(TINY + list(extra))


SHARED_SCOPES = ("class", "module", "package")  # fixtures several tests of one module reuse


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item.module, "__name__", "")
        # --dist loadgroup: a test using a module's shared fixture (spawned ranks, tiny models saved
        # to disk) runs on the worker that already built it, instead of every worker building it.
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures and any(d.scope in SHARED_SCOPES for defs in fixtures.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(module))


RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_rank_environment_leaks(request):
    """A test that leaves torchrun's variables set makes every later test in its worker a 'rank'."""
    before = {k: os.environ.get(k) for k in RANK_VARIABLES}
    yield
    after = {k: os.environ.get(k) for k in RANK_VARIABLES}
    if after != before:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        pytest.fail(f"{request.node.nodeid} left torchrun's variables set: "
                    f"{ {k: v for k, v in after.items() if v != before[k]} }")
