"""The transformers systems `kvops bench` measures the engine against.

- ``hf-generate``: transformers ``generate``, one prompt at a time;
- ``hf-padded``: transformers ``generate`` on one left-padded batch of every prompt;
- ``hf-cb``: transformers' own continuous batching (``generate_batch``, paged KV cache).

Each runner returns a `Run` timed around the generation call(s) only. torch and transformers are
imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvops.bench.report import Run, log
from kvops.bench.workloads import Workload
from kvops.logs import quiet_transformers


def load_model(model_dir: str | Path) -> Any:
    """The engine's model, loaded by transformers in fp32 (the dtype every system runs in)."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    log(f"transformers model loaded in {time.perf_counter() - started:.1f} s "
        f"(attn_implementation={model.config._attn_implementation})")
    return model


def run_generate(model: Any, pad_id: int, w: Workload) -> Run:
    """``hf-generate``: one ``generate`` call per prompt."""
    import torch

    outputs: list[list[int]] = []
    with quiet_transformers(), torch.inference_mode():
        started = time.perf_counter()
        for ids, n in zip(w.prompts, w.max_tokens, strict=True):
            inp = torch.tensor([ids], dtype=torch.long)
            # eos_token_id=-1: EOS never ends a request, like the engine's ignore_eos, so every system
            # generates the same tokens (min_new_tokens would mask EOS out and change the continuation).
            out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n,
                                 do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
            outputs.append(out[0, len(ids):].tolist())
        wall = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return Run(wall, tokens, tokens, outputs)


def run_padded(model: Any, pad_id: int, w: Workload) -> Run:
    """``hf-padded``: every prompt in one left-padded ``generate`` call."""
    import torch

    width = max(len(p) for p in w.prompts)
    longest = max(w.max_tokens)
    with quiet_transformers(), torch.inference_mode():
        started = time.perf_counter()
        inp = torch.full((w.num_requests, width), pad_id, dtype=torch.long)
        mask = torch.zeros((w.num_requests, width), dtype=torch.long)
        for row, ids in enumerate(w.prompts):
            inp[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids):] = 1
        out = model.generate(inp, attention_mask=mask, max_new_tokens=longest,
                             do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
        wall = time.perf_counter() - started
    generated = out[:, width:]
    # The batch runs to the longest requested output; only each request's own tokens are useful.
    outputs = [generated[row, :n].tolist() for row, n in enumerate(w.max_tokens)]
    return Run(wall, sum(len(o) for o in outputs), int(generated.numel()), outputs,
               {"padded_prompt_tokens": int(inp.numel()), "decode_steps": int(generated.shape[1])})


def continuous_batching_config(max_batch_tokens: int, max_requests: int, bytes_per_token: int,
                               pool_bytes: int) -> Any:
    """transformers' continuous batching sized like the engine: the same KV budget, batch-token budget
    and request cap. On CPU the default would claim 60% of RAM for the cache. Page size stays
    transformers' default."""
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests,
                                      use_cuda_graph=False, auto_switch_to_flash=False)
    config.num_blocks = max(1, pool_bytes // (config.page_size * bytes_per_token))
    return config


def run_continuous_batching(model: Any, pad_id: int, cb_config: Any, w: Workload) -> Run:
    """``hf-cb``: ``generate_batch``, or its request-by-request form when output lengths differ."""
    import torch
    from transformers import GenerationConfig

    longest = max(w.max_tokens)
    gen_config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    with quiet_transformers(), torch.inference_mode():
        if len(set(w.max_tokens)) == 1:
            started = time.perf_counter()
            results = model.generate_batch(w.prompts, generation_config=gen_config,
                                           continuous_batching_config=cb_config, progress_bar=False)
            wall = time.perf_counter() - started
            ordered = list(results.values())
        else:
            # Per-request output lengths: what generate_batch wraps, with max_new_tokens per request.
            started = time.perf_counter()
            ordered = _cb_per_request(model, w, gen_config, cb_config)
            wall = time.perf_counter() - started
    errors = [r.error for r in ordered if r.error]
    if len(ordered) != w.num_requests or errors:
        raise RuntimeError(f"transformers continuous batching returned {len(ordered)} of "
                           f"{w.num_requests} results; errors: {errors[:3]}")
    outputs = [list(r.generated_tokens) for r in ordered]
    tokens = sum(len(o) for o in outputs)
    return Run(wall, tokens, tokens, outputs, {"page_size": cb_config.page_size, "num_blocks": cb_config.num_blocks})


def _cb_per_request(model: Any, w: Workload, gen_config: Any, cb_config: Any) -> list[Any]:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                          max_generated_length=max(w.max_tokens), num_requests=w.num_requests)
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=5,
                                                   continuous_batching_config=cb_config,
                                                   workload_hints=hints) as manager:
        ids = [manager.add_request(p, request_id=f"bench-{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(w.prompts, w.max_tokens, strict=True))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                break
    return [results[i] for i in ids if i in results]
