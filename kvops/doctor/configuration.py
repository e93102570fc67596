"""Configuration: does the KV budget hold one max_model_len request (needed vs available, the largest
that fits), how many fit at once, which block size decodes fastest on this device, and whether the KV
dtype works here.

Statically from an engine config (the engine's own capacity planner, without loading weights), or from a
running engine's snapshot.
"""

from __future__ import annotations

import json
import math

from kvops.doctor.report import Check, Status
from kvops.engine.capacity import Capacity, plan_capacity
from kvops.engine.config import EngineConfig, format_bytes
from kvops.engine.errors import CapacityError
from kvops.kinds import Capability, Remedy, profile_of
from kvops.rules import block_size_mismatch
from kvops.rules.common import blocks_for
from kvops.schema.errors import ConfigError
from kvops.schema.reports import BlockSizeProfile
from kvops.schema.snapshot import Snapshot

SECTION = "Configuration"


def model_shape(model: str | None) -> dict[str, int]:
    """Layers, KV heads, head dim and context limit from the model's config.json (no weights read; the
    default model's GGUF is converted once if no engine has started before)."""
    from kvops.engine.weights import resolve_model_dir

    _, directory = resolve_model_dir(model)
    hf = json.loads((directory / "config.json").read_text())
    heads = int(hf["num_attention_heads"])
    return {
        "num_layers": int(hf["num_hidden_layers"]),
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or hf["hidden_size"] // heads),
        "max_position_embeddings": int(hf.get("max_position_embeddings") or 2048),
    }


def static_checks(name: str, config: EngineConfig) -> list[Check]:
    prefix = f"[{name}] " if name != "default" else ""
    try:
        shape = model_shape(config.model)
    except (ConfigError, OSError, KeyError, ValueError) as exc:
        return [Check(section=SECTION, title=f"{prefix}Model", status=Status.FAIL, evidence=str(exc),
                      remedy="give --model a local Hugging Face directory or .gguf file")]
    max_model_len = config.max_model_len or shape["max_position_embeddings"]
    checks = []
    if max_model_len > shape["max_position_embeddings"]:
        checks.append(Check(section=SECTION, title=f"{prefix}max_model_len", status=Status.FAIL,
                            evidence=f"{max_model_len} is more than the model's max_position_embeddings "
                                     f"{shape['max_position_embeddings']}",
                            remedy=f"--max-model-len {shape['max_position_embeddings']} or less"))
        return checks
    try:
        bytes_per_token = _bytes_per_token(config, shape)
        capacity = plan_capacity(int(config.kv_cache_memory), config.block_size, bytes_per_token, max_model_len)
    except CapacityError as exc:
        message = str(exc)
        evidence, _, remedy = message.partition(": lower ")
        return [*checks, Check(section=SECTION, title=f"{prefix}KV budget fits max_model_len", status=Status.FAIL,
                               evidence=evidence, remedy=("lower " + remedy) if remedy else message,
                               detail=[f"the engine refuses to start with: {message}"])]
    except ConfigError as exc:
        return [*checks, Check(section=SECTION, title=f"{prefix}KV dtype", status=Status.FAIL, evidence=str(exc))]
    checks.append(_fits(prefix, capacity, int(config.kv_cache_memory)))
    checks.append(_concurrency(prefix, capacity, config.max_num_seqs))
    checks.append(kv_dtype_check(config.kv_cache_dtype, "cpu", prefix))
    checks.append(Check(section=SECTION, title=f"{prefix}Block size {config.block_size}", status=Status.SKIPPED,
                        evidence="measured on a running engine against 8, 16, 32 and 64",
                        remedy="start it, then: kvops doctor --url URL --admin-token TOKEN"))
    return checks


def _bytes_per_token(config: EngineConfig, shape: dict[str, int]) -> int:
    import torch

    from kvops.engine.kv_pool import layer_kv_dtypes
    from kvops.kernels.kv_cache import layer_bytes_per_token

    # The engine's own arithmetic (kv_pool.allocate_kv_pool), without allocating anything.
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[config.dtype]
    kinds = layer_kv_dtypes(config, shape["num_layers"], shape["head_dim"])
    return sum(layer_bytes_per_token(kind, shape["num_kv_heads"], shape["head_dim"], dtype,
                                     config.kv_cache_group_size) for kind in kinds)


def _fits(prefix: str, capacity: Capacity, budget: int) -> Check:
    needed = blocks_for(capacity.max_model_len, capacity.block_size) * capacity.block_size * capacity.bytes_per_token
    return Check(section=SECTION, title=f"{prefix}KV budget fits max_model_len", status=Status.OK,
                 evidence=f"one request of {capacity.max_model_len} tokens needs {format_bytes(needed)} of "
                          f"{format_bytes(budget)}; the largest max_model_len that fits is {capacity.tokens}",
                 detail=[capacity.describe()])


def _concurrency(prefix: str, capacity: Capacity, max_num_seqs: int) -> Check:
    fit = capacity.max_concurrency
    evidence = (f"{fit:.2f} requests of max_model_len {capacity.max_model_len} fit at once "
                f"(max_num_seqs {max_num_seqs})")
    if fit >= max_num_seqs:
        return Check(section=SECTION, title=f"{prefix}Maximum concurrency", status=Status.OK, evidence=evidence)
    # Overcommit is how paged engines run (most requests are short): a fact, not a fault (kv_oom_start is info).
    per_request = blocks_for(capacity.max_model_len, capacity.block_size)
    budget = max_num_seqs * per_request * capacity.block_size * capacity.bytes_per_token
    return Check(section=SECTION, title=f"{prefix}Maximum concurrency", status=Status.INFO, evidence=evidence,
                 remedy=f"for {max_num_seqs} max-length requests at once: --kv-cache-memory {format_bytes(budget)}, "
                        f"or --max-num-seqs {max(1, math.floor(fit))}",
                 rule="kv_oom_start")


def kv_dtype_check(kv_cache_dtype: str, device: str, prefix: str = "") -> Check:
    """Whether torch on `device` can hold and dequantize this KV dtype (the reference kernels need no more)."""
    title = f"{prefix}KV dtype {kv_cache_dtype}"
    if kv_cache_dtype in ("auto", "int8", "int4", "float32", "bfloat16", "float16"):
        return Check(section=SECTION, title=title, status=Status.OK, evidence=f"supported on {device}")
    if kv_cache_dtype == "fp8":
        import torch  # only here: importing it costs the doctor a second and more (docs/doctor.md, time)

        try:
            torch.zeros(2, dtype=torch.float8_e4m3fn, device="cpu" if device == "unknown" else device).float()
        except (AttributeError, RuntimeError, TypeError) as exc:
            return Check(section=SECTION, title=title, status=Status.FAIL,
                         evidence=f"fp8 (e4m3) is not usable on {device}: {exc}",
                         remedy="--kv-cache-dtype int8 (same bytes per token plus scales)")
        return Check(section=SECTION, title=title, status=Status.OK, evidence=f"fp8 e4m3 works on {device}")
    return Check(section=SECTION, title=title, status=Status.FAIL, evidence="not a kvops KV dtype",
                 remedy="--kv-cache-dtype auto, int8, fp8 or int4")


def snapshot_checks(snap: Snapshot) -> list[Check]:
    """The configuration a running engine reports (for vLLM and SGLang, what their scrape shows of it)."""
    engine = snap.engine
    kind = profile_of(snap)
    checks: list[Check] = []
    known = all(snap.knows(f"engine.{key}")
                for key in ("bytes_per_token", "num_blocks", "max_model_len", "max_num_seqs"))
    if known and engine.bytes_per_token > 0 and engine.max_model_len > 0:
        capacity = Capacity(engine.num_blocks, engine.block_size, engine.bytes_per_token, engine.max_model_len)
        checks.append(_fits("", capacity, engine.kv_cache_bytes))
        checks.append(_concurrency("", capacity, engine.max_num_seqs))
    elif snap.knows("engine.num_blocks") and snap.knows("engine.max_model_len") and engine.max_model_len > 0:
        pool = engine.num_blocks * engine.block_size
        per_request = blocks_for(engine.max_model_len, engine.block_size)
        fit = engine.num_blocks / per_request
        status = Status.OK if fit >= 1 else Status.FAIL
        checks.append(Check(section=SECTION, title="KV pool vs max_model_len", status=status,
                            evidence=f"{engine.num_blocks} blocks × {engine.block_size} = {pool} tokens: {fit:.2f} "
                                     f"requests of max_model_len {engine.max_model_len} fit at once",
                            remedy="" if fit >= 1 else f"--max-model-len {pool}"))
    else:
        missing = [p for p in ("engine.num_blocks", "engine.max_model_len", "engine.bytes_per_token")
                   if not snap.knows(p)]
        remedy = ("max_model_len comes from /v1/models: kvops doctor --url URL" if "engine.num_blocks" not in missing
                  else f"the pool size is in the server's start-up log ({kind.remedy(Remedy.POOL_SIZE_LOG)})")
        checks.append(Check(section=SECTION, title="KV budget vs max_model_len", status=Status.SKIPPED,
                            evidence=f"{snap.source} does not report {', '.join(missing)}", remedy=remedy))
    if snap.knows("engine.kv_cache_dtype"):
        if kind.can(Capability.KV_QUANTIZATION):  # kvops's own KV dtypes: does this one work on its device
            checks.append(kv_dtype_check(engine.kv_cache_dtype if engine.kv_cache_dtype != engine.dtype else "auto",
                                         engine.device))
        else:
            checks.append(Check(section=SECTION, title=f"KV dtype {engine.kv_cache_dtype}", status=Status.OK,
                                evidence=f"in use by the {snap.source} server"))
    if snap.knows("engine.enable_prefix_caching") and not engine.enable_prefix_caching:
        checks.append(Check(section=SECTION, title="Prefix caching", status=Status.WARN,
                            evidence="off: shared prompt prefixes are recomputed every time",
                            remedy=kind.remedy(Remedy.PREFIX_CACHING_ON)))
    return checks


def block_size_check(snap: Snapshot, profile: BlockSizeProfile | None, why_not: str) -> Check:
    """The measured decode-step time of the configured block size against the alternatives, judged with the
    block_size_mismatch rule's criteria (faster by its margin, beyond the noise, not much more fragmentation)."""
    title = f"Block size {snap.engine.block_size}"
    if profile is None:
        return Check(section=SECTION, title=title, status=Status.SKIPPED, evidence=why_not,
                     remedy="kvops doctor --url URL --admin-token TOKEN"
                     if profile_of(snap).can(Capability.PROFILES) else "")
    configured = next((c for c in profile.candidates if c.block_size == profile.configured), None)
    detail = [f"{c.block_size}: {c.decode_step_ms:.3f} ms/step (IQR {c.iqr_ms:.3f}), fragmentation "
              f"{c.fragmentation:.1%}" for c in profile.candidates]
    detail.append(f"batch {profile.batch_size}, context lengths {profile.context_lens} ({profile.lengths_from}), "
                  f"{profile.duration_s:.1f} s")
    if configured is None:
        return Check(section=SECTION, title=title, status=Status.SKIPPED, evidence="the profile lacks it",
                     detail=detail)
    # The rule itself ignores profiles on the default lengths (nothing served yet); doctor shows them anyway.
    better = block_size_mismatch.faster_block_size(profile, configured, block_size_mismatch.Settings())
    if better is None:
        return Check(section=SECTION, title=title, status=Status.OK,
                     evidence=f"{configured.decode_step_ms:.2f} ms/decode step; no candidate of "
                              f"{', '.join(str(c.block_size) for c in profile.candidates)} is clearly faster here",
                     detail=detail)
    gain = configured.decode_step_ms / better.decode_step_ms - 1
    return Check(section=SECTION, title=title, status=Status.WARN,
                 evidence=f"block size {better.block_size} decodes {gain:.0%} faster ({better.decode_step_ms:.2f} vs "
                          f"{configured.decode_step_ms:.2f} ms/step) on this device",
                 remedy=f"restart with --block-size {better.block_size}", detail=detail, rule="block_size_mismatch")
