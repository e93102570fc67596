"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvops.engine.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1 (got {self.max_tokens})", "max_tokens")
        if not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be between 0 and 100 (got {self.temperature})",
                                      "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be 0 (off) or positive (got {self.top_k})", "top_k")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and the softmax to NaN (1e-300 took down the step
        # loop); the distribution is one-hot long before that anyway. vLLM uses the same cut-off.
        return self.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [rows, vocab] (float32)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        scores = row / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token when the tokens before it already cover top_p; the first always stays.
            drop = (cumulative - sorted_scores.softmax(-1)) >= p.top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokens
