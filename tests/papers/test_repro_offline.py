"""Offline, language tasks fail at once with one line naming what to set (no hub retries)."""

from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf

from dpbench.data import text
from dpbench.errors import UserError
from dpbench.models.language import load_tokenizer


@pytest.fixture
def isolated_offline_state(monkeypatch):
    """Let the code under test flip the offline switches; put them back afterwards."""
    import datasets.config
    import huggingface_hub.constants

    for variable in text._OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, flag):
            monkeypatch.setattr(datasets.config, flag, getattr(datasets.config, flag))
    text.hub_offline.cache_clear()
    yield monkeypatch
    text.hub_offline.cache_clear()


def test_offline_variable_or_failed_probe_means_offline(isolated_offline_state):
    import huggingface_hub.constants

    isolated_offline_state.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    started = time.perf_counter()
    assert text.hub_offline() is True
    assert time.perf_counter() - started < 5
    text.hub_offline.cache_clear()
    isolated_offline_state.setenv("HF_HUB_OFFLINE", "1")
    assert text.hub_offline() is True


def test_missing_weights_and_data_fail_fast_naming_the_setting(isolated_offline_state):
    isolated_offline_state.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(UserError, match=r"offline and not in the local cache.*model\.path="):
        load_tokenizer(OmegaConf.create({"name": "roberta", "size": "large", "path": None}))
    with pytest.raises(UserError, match=r"glue/sst2 \(offline and not in the local cache\).*dataset\.path="):
        text.load_text_splits(OmegaConf.create({"hub": ["glue", "sst2"], "path": None}), {"train": "train"})
    assert time.perf_counter() - started < 15  # one attempt each from the cache, no network retries
