"""Continuous batching: which sequences run this step and how many tokens each.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first (decodes
and unfinished prefill chunks, in admission order), then waiting ones, up to `max_num_seqs`.
When blocks run out the most recently admitted sequence is preempted (its blocks released, to
be recomputed later), so the oldest requests always make progress and nothing deadlocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvops.engine.block_manager import BlockManager
from kvops.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_admit: Callable[[Sequence, int], None] = lambda seq, hits: None,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_admit = on_admit  # called once per request, at its first admission, with its hit tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, aborted: bool) -> None:
        """Take a finished or aborted sequence out of the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.bm.seqs:
            if aborted:
                self.bm.abort(seq.seq_id)
            else:
                self.bm.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed, budget)
            while not self.bm.append_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = self._victim(seq, index)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                index += 1
                continue
            break

        skipped: list[Sequence] = []  # held back by their tenant's quota; others may go ahead
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting.popleft()
            hits, hashes = self.bm.lookup(seq.token_ids, seq.salt)
            num_cached = len(hits) * self.bm.block_size
            num_new = min(len(seq.token_ids) - num_cached, budget)
            if not self.bm.allocate(seq.seq_id, num_cached + num_new, tenant=seq.tenant, salt=seq.salt,
                                    hit_block_ids=hits, hashes=hashes):
                if self.bm.quota_limited(seq.tenant):
                    skipped.append(seq)
                    continue
                self.waiting.appendleft(seq)
                break
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = num_cached
                self.on_admit(seq, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def _victim(self, needy: Sequence, first_unscheduled: int) -> Sequence:
        """Whom to preempt so `needy` (at `first_unscheduled`) can grow: the most recently admitted
        sequence not yet scheduled this step, or, when a tenant quota is what blocks `needy`, the
        most recent such sequence of its own tenant (possibly `needy` itself)."""
        candidates = self.running[first_unscheduled:]
        if self.bm.quota_limited(needy.tenant):
            return next(s for s in reversed(candidates) if s.tenant == needy.tenant)
        return candidates[-1]

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-mode preemption: release the blocks (full ones stay cached), requeue first."""
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1
