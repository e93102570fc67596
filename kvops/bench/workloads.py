"""The workloads of `kvops bench`: chat questions, prose, and the token-id prompts built from them.

The prose (`kvops.prose`) and the questions are shared: `kvops bench kv-quant` scores perplexity on
the prose and asks `CHAT_QUESTIONS`, and the load generator builds its prompts from the prose's
sentences, so every benchmark reads the same text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from kvops.prose import SENTENCES

WORKLOADS = ("chat", "mixed", "single")

# Sixteen varied user questions: chat-templated with the model's default system prompt they
# come to ~30-40 tokens each.
CHAT_QUESTIONS = [
    "How do vaccines train the immune system?",
    "What is the difference between a list and a tuple in Python?",
    "Why does bread go stale?",
    "Can you suggest a name for my new bakery?",
    "How far away is the Moon?",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten year old.",
    "Is coffee bad for your heart?",
    "How do I politely decline a meeting invitation?",
    "What causes thunder during a storm?",
    "Write a short poem about the sea.",
    "How does compound interest work?",
    "Which houseplants need very little light?",
    "What is the best way to learn a new language?",
    "Why do cats purr?",
    "How do noise cancelling headphones work?",
]


@dataclass
class Workload:
    """Requests every system generates alike: the same prompt token ids, the same token counts."""

    name: str
    description: str
    prompts: list[list[int]]  # token ids, identical for every system
    max_tokens: list[int]  # exact number of new tokens each request generates

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def requested_tokens(self) -> int:
        return sum(self.max_tokens)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def text_prompt(tokenizer: Any, rng: random.Random, index: int, length: int) -> list[int]:
    """Exactly `length` token ids of prose, distinct from the first block on (no accidental prefix hits)."""
    text = f"Notes {index}. Read these notes and continue them in the same style.\n"
    ids: list[int] = tokenizer(text).input_ids
    while len(ids) < length:
        text += " ".join(rng.choice(SENTENCES) for _ in range(8)) + "\n"
        ids = tokenizer(text).input_ids
    return list(ids[:length])


def build_workloads(engine: Any, quick: bool, seed: int) -> dict[str, Workload]:
    """Every workload of WORKLOADS, tokenized with the engine's tokenizer and chat template."""
    tokenizer = engine.tokenizer
    num_chat, chat_tokens = (4, 8) if quick else (16, 64)
    chat = [engine.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:num_chat]]

    rng = random.Random(seed)
    if quick:
        num_mixed, prompt_range, output_range = 6, (20, 200), (4, 16)
    else:
        num_mixed, prompt_range, output_range = 32, (20, 1500), (16, 256)
    prompt_lens = [_log_uniform(rng, *prompt_range) for _ in range(num_mixed)]
    output_lens = [_log_uniform(rng, *output_range) for _ in range(num_mixed)]
    # Make sure both ends of each range are exercised, at different positions.
    prompt_lens[0], prompt_lens[1] = prompt_range[1], prompt_range[0]
    output_lens[0], output_lens[2] = output_range[0], output_range[1]
    mixed = [text_prompt(tokenizer, rng, i, n) for i, n in enumerate(prompt_lens)]

    return {
        "chat": Workload("chat", f"{num_chat} chat prompts x {chat_tokens} new tokens", chat,
                         [chat_tokens] * num_chat),
        "mixed": Workload(
            "mixed",
            f"{num_mixed} requests, prompts {min(prompt_lens)}-{max(prompt_lens)} tokens, "
            f"outputs {min(output_lens)}-{max(output_lens)} tokens (seed {seed})",
            mixed, output_lens),
        "single": Workload("single", f"1 chat prompt x {chat_tokens} new tokens", chat[:1], [chat_tokens]),
    }

