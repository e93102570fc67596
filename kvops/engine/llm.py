"""Offline use of the engine: hand it prompts, get completions (what `kvops bench` and tests use)."""

from __future__ import annotations

from collections.abc import Sequence

from kvops.engine.config import EngineConfig
from kvops.engine.engine import LLMEngine, RequestOutput
from kvops.engine.sampling import SamplingParams


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        self.engine = LLMEngine(config or EngineConfig(**overrides))  # type: ignore[arg-type]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tenants: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs in prompt order."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [
            self.engine.add_request(prompt, p, tenant=tenants[i] if tenants else "default")
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True))
        ]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
