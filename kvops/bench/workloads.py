"""The workloads of `kvops bench`: chat questions, prose, and the token-id prompts built from them.

The prose and the questions are shared: `kvops bench kv-quant` scores perplexity on `PROSE` and
asks `CHAT_QUESTIONS`, and the load generator (`kvops.loadgen.prompts`) builds its prompts from
`SENTENCES`, so every benchmark reads the same text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

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

# Plain prose (written for this benchmark) that the mixed workload's prompts are sampled from,
# sentence by sentence, with a seeded generator.
PROSE = """\
The harbour town woke slowly, with gulls circling the fish market before the first boats came in.
Mara kept the lighthouse log in a green notebook, writing the wind, the tide and every ship she saw.
A storage engineer once told me that most outages begin with a disk that nobody was watching.
The recipe calls for two cups of flour, a pinch of salt, and butter cold enough to crack.
In the spring the river rises over the low meadow and the herons stand in the flooded grass.
Caching works because programs tend to reuse the data they touched a moment ago.
The committee met on Thursday and agreed to postpone the vote until the budget was clearer.
Old maps of the valley show a mill where the car park stands today.
He tuned the violin by ear, then played a slow air that his grandmother used to hum.
Every request that arrives at the server is queued, scheduled, and answered in turn.
The desert at night is colder than most travellers expect, so they pack wool as well as linen.
Our team measured latency at the ninety-ninth percentile, because averages hide the slow tail.
A good bicycle chain needs a little oil, a clean rag, and patience on a quiet afternoon.
The museum's new wing holds ceramics from the coast, glazed in blues that look like deep water.
When memory runs short the operating system starts to swap, and everything slows to a crawl.
Children in the village learned to read from the same worn books their parents had used.
The forecast promised rain, but the afternoon stayed bright and the washing dried on the line.
Photosynthesis turns light, water and carbon dioxide into sugar and the oxygen we breathe.
She wrote the letter three times before she was happy with the opening sentence.
The train left the city at dawn and reached the mountains by the middle of the morning.
A block of memory is only useful if someone remembers who owns it and when it can be freed.
Bees return to the hive and dance to tell the others where the flowers are.
The library stays open late during exams, and the reading room fills with quiet students.
Good documentation answers the question the reader actually has, not the one the author imagined.
At the edge of the forest the path forks, and the left branch climbs toward the ridge.
The bakery sells out of rye loaves before nine, so regular customers arrive early.
Engineers argue about block sizes the way sailors argue about knots, with conviction and little data.
A thunderstorm rolled in from the west and the streetlights came on in the middle of the afternoon.
The old clock in the hall gained a minute every week, and nobody ever corrected it.
Compression saves space, but every byte saved must be paid for with time to decode it.
Farmers along the coast plant windbreaks of pine to protect the young crops from salt spray.
The conference talk ran long, and the questions at the end were better than the slides.
Tea grown on high slopes ripens slowly in the cool air and tastes lighter than lowland tea.
He fixed the leaking tap with a new washer and felt unreasonably proud for the rest of the day.
A scheduler that never says no will eventually say yes to more work than it can finish.
The island has one road, two shops, and a ferry that runs when the weather allows.
Starlings gather over the marsh in winter and move like smoke against the evening sky.
The report recommends smaller batches, better monitoring, and a clear owner for each alarm.
In the workshop the smell of sawdust and linseed oil hangs in the air long after the saws stop.
Most people remember the melody of a song long after they have forgotten the words.
"""
SENTENCES = [line.strip() for line in PROSE.splitlines() if line.strip()]


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

