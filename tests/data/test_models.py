"""The default model named as a user would name it: by its short name or its Hub id, wherever a model is."""

import logging

import pytest
import torch

from gradspec.data import models
from gradspec.data.models import DEFAULT_HUB_ID, DEFAULT_MODEL, check_model, load_model, names_default
from gradspec.options import OptionError


@pytest.fixture
def offline(monkeypatch):
    """No Hub: neither in the local cache nor reachable (as on this machine, deterministically)."""
    import huggingface_hub

    models._hub_gives_default.cache_clear()
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    yield
    models._hub_gives_default.cache_clear()


@pytest.mark.parametrize("name", [DEFAULT_MODEL, DEFAULT_MODEL.lower(), DEFAULT_HUB_ID])
def test_the_default_loads_by_its_short_name_and_its_hub_id(smol, offline, name, caplog):
    check_model(name, "base")  # refused before: "no such folder, and not a Hub model id"
    with caplog.at_level(logging.WARNING, "gradspec"):
        model, _ = load_model(name, progress=False)
    default = smol[0].state_dict()
    assert all(torch.equal(value, default[key]) for key, value in model.state_dict().items())
    assert ("GGUF" in caplog.text) == (name == DEFAULT_HUB_ID)  # the stand-in for the Hub's copy is said


def test_a_folder_of_the_default_s_name_is_that_folder(tmp_path, monkeypatch, offline):
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_MODEL).mkdir()
    assert not names_default(DEFAULT_MODEL)
    with pytest.raises(OptionError, match="no config.json"):
        check_model(DEFAULT_MODEL)


def test_the_hub_s_own_copy_is_the_hub_id_where_the_hub_gives_it(monkeypatch):
    models._hub_gives_default.cache_clear()
    monkeypatch.setattr(models, "hub_reachable", lambda: True)
    try:
        assert not names_default(DEFAULT_HUB_ID) and names_default(DEFAULT_MODEL) and names_default(None)
    finally:
        models._hub_gives_default.cache_clear()


def test_hub_offline_mode_lets_the_gguf_stand_in(monkeypatch):
    """HF_HUB_OFFLINE: the Hub is not asked (hub_reachable says yes without a probe there), so the default's
    Hub id is the GGUF's weights unless the Hub's copy is cached."""
    import huggingface_hub
    from huggingface_hub import constants

    models._hub_gives_default.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    try:
        assert names_default(DEFAULT_HUB_ID)
    finally:
        models._hub_gives_default.cache_clear()


def test_a_run_of_the_default_by_its_name_has_the_default_s_identity(smol, offline):
    """A run given --model SmolLM2-135M-Instruct resumes without --model, and the other way round."""
    from gradspec.runs.run_folder import model_identity

    assert model_identity(None) is not None
    assert model_identity(DEFAULT_MODEL) == model_identity(DEFAULT_HUB_ID) == model_identity(None)
