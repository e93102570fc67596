"""Shared fixtures: the default model is converted once per machine and loaded per engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from alerting_outbox import Receiver

from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.logs import configure_logging

configure_logging("info", json_logs=False)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain how a hash table works.",
    "List three uses of copper.",
    "How do I reverse a string in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and German.",
    "Describe a cat to someone who has never seen one, in detail, covering its fur, eyes and habits.",
    "What is 17 times 23?",
    "Write a limerick about a programmer.",
    "Name the planets of the solar system.",
    "How does a refrigerator keep food cold?",
]


@pytest.fixture(scope="session")
def llm() -> LLM:
    """One engine on the default model for tests that only read its behaviour."""
    return LLM(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024))


@pytest.fixture(scope="session")
def chat_prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="session")
def hf_greedy(llm: LLM, chat_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy `generate`, one prompt at a time, fp32, 64 new tokens: the ground truth."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for ids in chat_prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, top_p=None, top_k=None,
                                 temperature=None, pad_token_id=model.config.eos_token_id)
            generated = out[0, len(ids):].tolist()
            eos = model.generation_config.eos_token_id
            eos_ids = set(eos if isinstance(eos, list) else [eos])
            # generate pads nothing for a single prompt, but keep only up to and including the first EOS
            for i, token in enumerate(generated):
                if token in eos_ids:
                    generated = generated[: i + 1]
                    break
            outputs.append(generated)
    del model
    return outputs


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    """Webhook receivers a test starts (it appends them); stopped after the test."""
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.stop()
