"""Requests behind one long prefix, all arriving together: the prefix is computed once (the later ones wait a
step for the prefix cache instead of computing the same blocks beside the first), decode reads the shared
blocks once for all of them (the compiled step's spans, kvops/engine/step_attention.cpp; unfused, the cascade of
kvops/kernels/cascade_attention.py), and greedy outputs stay transformers' own."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvops.bench.workloads import text_prompt
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams
from kvops.kernels import cascade_attention

TAILS = ["What happens next?", "Summarize the notes.", "Who wrote them?", "Give the notes a title.",
         "List three facts from them.", "Translate the first line into French."]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def shared_prompts(llm: LLM) -> list[list[int]]:
    prefix = text_prompt(llm.tokenizer, random.Random(7), 7007, 200)
    return [prefix + llm.tokenizer(f"\n{tail}\n").input_ids for tail in TAILS]


@pytest.fixture(scope="module")
def hf_outputs(llm: LLM, shared_prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, top_p=None,
                               top_k=None, temperature=None, pad_token_id=model.config.eos_token_id
                               )[0, len(ids):].tolist() for ids in shared_prompts]


def test_a_shared_prefix_is_computed_once_read_once_and_exact(llm: LLM, shared_prompts: list[list[int]],
                                                               hf_outputs: list[list[int]],
                                                               monkeypatch: pytest.MonkeyPatch):
    model = llm.engine.model
    shared: list[tuple[int, int]] = []  # (rows, tokens) read once for those rows, in the steps' decode attention
    if model.ops is not None:  # compiled: the spans each decode step's block tables give its kernel
        decode_layers = model._decode_layers

        def recording(x: Any, positions: Any, meta: Any, kv_cache: Any, observer: Any) -> Any:
            out = decode_layers(x, positions, meta, kv_cache, observer)
            if out is not None:
                _, spans = model.ops.decode_spans(meta.decode_block_tables, meta.decode_context_lens, meta.block_size)
                shared.extend((count, tokens) for _, count, tokens in spans.tolist())
            return out

        monkeypatch.setattr(model, "_decode_layers", recording)
    else:
        plan = cascade_attention.plan

        def recording_plan(meta: Any) -> Any:
            found = plan(meta)
            shared.extend((len(g.rows), g.prefix_blocks.numel() * meta.block_size) for g in (found.groups if found
                                                                                              else []))
            return found

        monkeypatch.setattr(cascade_attention, "plan", recording_plan)
    deferred = llm.engine.scheduler.deferred_total
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(shared_prompts, params, tenants=["shared-prefix-test"] * len(shared_prompts))

    # Computed once: every request after the first found the 192 tokens of whole prefix blocks cached.
    assert outputs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outputs[1:]] == [192] * (len(TAILS) - 1)
    assert llm.engine.scheduler.deferred_total - deferred >= len(TAILS) - 1
    # Read once: decode steps found all six rows on the same 12 blocks.
    assert shared, "no decode step attended over the shared prefix once"
    assert any(rows == len(TAILS) and tokens == 192 for rows, tokens in shared), shared
    assert [o.token_ids for o in outputs] == hf_outputs
