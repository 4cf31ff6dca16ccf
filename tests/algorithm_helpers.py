"""Old import path of tests/helpers/algorithms.py, kept only for the test files that still import
it; new code imports `helpers`. Delete this file once nothing imports it."""

from helpers.algorithms import build_algorithm, record_updates, tiny_model  # noqa: F401
from helpers.config import OFFLINE, compose


def compose_config(*overrides: str):
    return compose([*OFFLINE, *overrides])
