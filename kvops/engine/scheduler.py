"""Continuous batching: which sequences run this step and how many tokens each.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first (decodes
and unfinished prefill chunks, in admission order), then swapped-out ones coming back, then
waiting ones, up to `max_num_seqs`. A waiting sequence whose next prompt block a running one is
still computing waits for the prefix cache instead of computing it again. When blocks run out the
most recently admitted sequence is preempted, so the oldest requests always make progress and
nothing deadlocks:

- recompute mode: its blocks are released and it goes back to the front of the waiting queue;
  its K/V is recomputed when it is admitted again (full blocks stay cached, so often hit).
- swap mode: its K/V is copied to the host pool and its device blocks released; it resumes
  where it stopped once blocks are free again. When the host pool is full it is recomputed.

Swapped sequences resume in arrival order and before any waiting sequence is admitted (first
come, first served; one held back only by its tenant's quota lets others pass, as in the waiting
queue), and only in a step that preempted nothing. The copies a step needs are in its
`SchedulerOutput`; the engine performs all swap-outs, then all swap-ins, before the forward pass,
even in a step that schedules nothing (a sequence can preempt itself).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvops.engine.block_manager import BlockManager
from kvops.engine.config import PREEMPTION_MODES
from kvops.engine.hashing import BlockHash
from kvops.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # swapped out or sent back to wait
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)  # also in `scheduled`

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
        preemption_mode: str = "recompute",
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption mode {preemption_mode!r}: choose one of "
                             f"{', '.join(PREEMPTION_MODES)}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_admit = on_admit  # called once per request, at its first admission, with its hit tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # in arrival order
        self.preemption_mode = preemption_mode
        self.preemptions_total = 0
        self.swap_preemptions_total = 0  # preemptions that swapped the sequence out
        self.swap_fallbacks_total = 0  # swap-mode preemptions recomputed because the host pool was full
        self.deferred_total = 0  # admissions put off a step: their next prefix block was being computed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence, aborted: bool) -> None:
        """Take a finished or aborted sequence out of the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        if seq.seq_id in self.bm.seqs:
            if aborted:
                self.bm.abort(seq.seq_id)
            else:
                self.bm.free(seq.seq_id)
        elif seq.seq_id in self.bm.swapped:
            self.bm.drop_swapped(seq.seq_id)
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
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                index += 1
                continue
            break

        # Blocks a preemption just freed are for the running sequences, not for anyone coming back.
        stalled = bool(out.preempted)
        if not stalled:
            stalled, budget = self._resume_swapped(out, budget)
        skipped: list[Sequence] = []  # held back (quota, or a prefix being computed); others may go ahead
        in_flight = self._blocks_in_flight() if self.waiting and self.bm.enable_prefix_caching else set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not stalled:
            seq = self.waiting.popleft()
            hits, hashes = self.bm.lookup(seq.token_ids, seq.salt)
            if _next_block_in_flight(seq, hits, hashes, in_flight, self.bm.block_size):
                skipped.append(seq)
                self.deferred_total += 1
                continue
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
            in_flight.update(hashes[len(hits):])
        self.waiting.extendleft(reversed(skipped))
        return out

    def _blocks_in_flight(self) -> set[BlockHash]:
        """Hashes of full blocks that running sequences have still to compute (this step or later)."""
        found: set[BlockHash] = set()
        for seq in self.running:
            if seq.num_uncomputed > 1 and seq.seq_id in self.bm.seqs:
                found.update(self.bm.seqs[seq.seq_id].hashes[seq.num_computed_tokens // self.bm.block_size:])
        return found

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> tuple[bool, int]:
        """Swap sequences back in, oldest first, while blocks, budget and `max_num_seqs` allow.

        Returns whether one is left waiting for device blocks (then no new sequence may be admitted
        ahead of it) and the budget left. One held back only by its tenant's quota lets others pass.
        """
        skipped: list[Sequence] = []
        stalled = False
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped.popleft()
            num_new = min(seq.num_uncomputed, budget)
            copies = self.bm.swap_in(seq.seq_id, seq.num_computed_tokens + num_new)
            if copies is None:
                if self.bm.quota_limited(seq.tenant):
                    skipped.append(seq)
                    continue
                self.swapped.appendleft(seq)
                stalled = True
                break
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.blocks_to_swap_in.extend(copies)
            out.swapped_in.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.swapped.extendleft(reversed(skipped))
        return stalled, budget

    def _victim(self, needy: Sequence, first_unscheduled: int) -> Sequence:
        """Whom to preempt so `needy` (at `first_unscheduled`) can grow: the most recently admitted
        sequence not yet scheduled this step, or, when a tenant quota is what blocks `needy`, the
        most recent such sequence of its own tenant (possibly `needy` itself)."""
        candidates = self.running[first_unscheduled:]
        if self.bm.quota_limited(needy.tenant):
            return next(s for s in reversed(candidates) if s.tenant == needy.tenant)
        return candidates[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap the sequence out when in swap mode and the host pool has room; otherwise release its
        blocks (full ones stay cached) and requeue it first, to be recomputed."""
        seq.num_preemptions += 1
        self.preemptions_total += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap":
            if self.bm.can_swap_out(seq.seq_id):
                out.blocks_to_swap_out.extend(self.bm.swap_out(seq.seq_id))
                out.swapped_out.append(seq)
                seq.status = SequenceStatus.SWAPPED
                self._enqueue_swapped(seq)
                self.swap_preemptions_total += 1
                return
            self.swap_fallbacks_total += 1
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _enqueue_swapped(self, seq: Sequence) -> None:
        """Keep the swapped queue in arrival order: one step swaps out its youngest victims first,
        yet the oldest must come back first."""
        index = len(self.swapped)
        while index > 0 and self.swapped[index - 1].arrival_time > seq.arrival_time:
            index -= 1
        self.swapped.insert(index, seq)


def _next_block_in_flight(seq: Sequence, hits: list[int], hashes: list[BlockHash], in_flight: set[BlockHash],
                          block_size: int) -> bool:
    """True when the first block `seq` would compute is one a running sequence is computing already.

    Admitting it now would compute the same K/V twice (identical blocks computed in one step are not
    shared); a step later it finds them in the prefix cache. Sixteen requests behind one long prefix
    arriving together cost one prefix, not the three or four that fit in the first step's budget.
    """
    following = len(hits)
    hittable = min((len(seq.token_ids) - 1) // block_size, len(hashes))
    return following < hittable and hashes[following] in in_flight
