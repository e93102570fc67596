"""The shared-prefix lines of `kvops top`'s KV events panel: the resident chains, and what each served, every number
named by its source.

The events say which blocks are resident and how they link, but vLLM publishes a block once, when it first
caches it: a later request that finds it cached publishes nothing, unless that request asks for
kv_cache_report_mode "full" (then vLLM publishes the blocks it found, and the index counts them as the chain's
`hits`). So a chain that branches shows its reuse by itself (each leaf ends another request's path, and only one
of those requests can have stored the head: at least leaves - 1 found it cached), while a linear one (every
request's own tail shorter than a block, so never cached) shows nothing. Its reuse then comes from counters: its
tenant's cached prompt tokens (a `kvops gateway`'s usage.prompt_tokens_details.cached_tokens) where its cache
salt names gateway tenants, else the engine's (vLLM's vllm:prefix_cache_hits over vllm:prefix_cache_queries).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvops.schema.gateway import GROUP_PREFIX, ISOLATED, TENANT_SALT_PREFIX
from kvops.schema.kv_events import NO_TENANT, KvEventStats, ResidentChain
from kvops.schema.snapshot import Snapshot

# The panel under the map has 11 lines: the stream's 4 or 5, a sentence that may wrap, a header and these.
CHAINS_SHOWN = 3
GATEWAY_SOURCE = "gateway's usage.cached_tokens"
EVENTS_SOURCE = "KV events"
ENGINE = "the engine"


@dataclass(frozen=True)
class Reuse:
    """What is known of one chain's reuse. served: True (reused), False (known not hit again), None (not known for
    this chain: at most the engine's counters over every chain)."""

    served: bool | None
    subject: str  # whose counters: "tenant a", "tenants a, b", "the engine"; "" for the chain's own events
    amount: str  # "94%", "0%", "12 requests", "at least 23 requests"
    source: str
    requests: int = 0  # from the events: requests that found the chain's head cached, or at least that many
    at_least: bool = False

    def phrase(self, first: bool = True) -> str:
        """The summary's words for a counter: the first of a source in full, the next ones short ("tenant b 96%")."""
        return f"{self.subject} {self.amount} of prompt tokens from cache" if first else f"{self.subject} {self.amount}"


def prefix_lines(s: Snapshot) -> list[str]:
    """The resident chains of the snapshot's events: a sentence on them all, then the branch points (the largest
    shared prefixes) or, where nothing branches, one line per chain with its reuse."""
    ev = s.kv_events
    if ev is None:
        return []
    if not sum(ev.resident.values()):
        return ["no shared prefix: no resident blocks"]
    lines = branch_lines(ev)
    if not ev.resident_chains:  # a supervisor that predates them, or a large index not counted yet
        return lines or ["no branch point among the resident blocks; resident chains not reported yet"]
    reuses = [chain_reuse(chain, s) for chain in ev.resident_chains]
    lines.insert(0, summary(ev, reuses, nothing_hit=_engine_counted(s) and not s.prefix_cache.hits_total))
    if not ev.shared_prefixes:
        lines.append("resident prefixes: blocks, longest path (tokens), tenant, head, reuse")
        lines.extend(chain_line(chain, reuse) for chain, reuse in
                     zip(ev.resident_chains[:CHAINS_SHOWN], reuses, strict=False))
    return lines


def branch_lines(ev: KvEventStats) -> list[str]:
    if not ev.shared_prefixes:
        return []
    return ["largest shared prefixes: blocks below, depth (tokens), tenant, head",
            *(f"  {p.descendants:>6}  {p.depth:>4} blk ({p.tokens:,} tok)  {_tenant(p.tenant)}  {p.block_hash[:12]}"
              for p in ev.shared_prefixes)]


def chain_line(chain: ResidentChain, reuse: Reuse) -> str:
    if not reuse.subject:
        how = f"reused by {reuse.amount}"
    elif reuse.served is None and reuse.amount == "-":
        how = "reuse not counted"
    elif reuse.subject == ENGINE:  # the same for every chain: the sentence above says what it is
        how = f"engine-wide {reuse.amount} from cache"
    else:
        how = f"{reuse.subject} {reuse.amount} from cache"
    head = f"{chain.block_hash[:12]}{' (parent not resident)' if chain.detached else ''}"
    return (f"  {chain.blocks:>6}  {chain.depth:>4} blk ({chain.tokens:,} tok)  {_tenant(chain.tenant)}  {head}  "
            f"{how}")


def summary(ev: KvEventStats, reuses: list[Reuse], nothing_hit: bool = False) -> str:
    """One sentence on every resident chain; "no shared prefix" only when each is known not to have been hit
    (each shown one, and the rest too: all of them, or `nothing_hit`, the engine's counters say no hit at all)."""
    total = ev.resident_chains_total
    count = f"{total} resident prefix{'' if total == 1 else 'es'} ({sizes(ev.resident_chains, total)})"
    if all(r.served is False for r in reuses) and (total == len(reuses) or nothing_hit):
        return f"no shared prefix: {count}, none hit again: {_joined(reuses)}"
    parts = []
    served = [r for r in reuses if r.served]
    if served:
        parts.append(f"reused: {_joined(served)}")
    missed = [r for r in reuses if r.served is False]
    if missed:
        parts.append(f"not hit again: {_joined(missed)}")
    unknown = [r for r in reuses if r.served is None]
    if unknown:
        if len(unknown) < len(reuses):
            which = f"{len(unknown)} more {'was' if len(unknown) == 1 else 'were'}"
        elif total > len(reuses):  # the smaller chains are not in the snapshot: nothing is said of them
            which = f"the largest {len(reuses)} were"
        else:
            which = "it was" if total == 1 else "they were"
        counted = [r for r in unknown if r.amount != "-"]
        parts.append(f"the events cannot say whether {which} hit again"
                     + (f"; {_joined(counted)}" if counted else ", and no counter does"))
    return f"{count}, {'; '.join(parts)}"


def sizes(chains: list[ResidentChain], total: int) -> str:
    """"10 blocks each", "19, 10 and 2 blocks", "largest 64 blocks"."""
    blocks = [c.blocks for c in chains]
    unit = "block" if blocks == [1] else "blocks"
    if total == len(blocks) and len(set(blocks)) == 1:
        return f"{blocks[0]} {unit}{' each' if total > 1 else ''}"
    if total == len(blocks) and total <= 3:
        return f"{', '.join(map(str, blocks[:-1]))} and {blocks[-1]} blocks"
    return f"largest {blocks[0]} {unit}"


def _joined(reuses: list[Reuse]) -> str:
    """Phrases by source, the source named after them: the events' requests added up, every other phrase once
    ("tenant a 94% of prompt tokens from cache, tenant b 96% (gateway's usage.cached_tokens)")."""
    groups: dict[str, list[str]] = {}
    events = [r for r in reuses if r.source == EVENTS_SOURCE]
    if events:
        requests = sum(r.requests for r in events)
        amount = f"{'at least ' if any(r.at_least for r in events) else ''}{requests} request{'s' * (requests != 1)}"
        groups[EVENTS_SOURCE] = [f"by {amount}"]
    for r in dict.fromkeys(r for r in reuses if r.source != EVENTS_SOURCE):
        words = groups.setdefault(r.source, [])
        words.append(r.phrase(first=not words))
    return ", ".join(f"{', '.join(words)} ({source})" for source, words in groups.items())


def chain_reuse(chain: ResidentChain, s: Snapshot) -> Reuse:
    """The best the snapshot knows of one chain's reuse: its own events, else its tenants' cached tokens, else the
    engine's."""
    if chain.hits:
        return Reuse(True, "", f"{chain.hits} request{'s' * (chain.hits != 1)}", EVENTS_SOURCE, chain.hits)
    if chain.leaves > 1:
        found = chain.leaves - 1
        return Reuse(True, "", f"at least {found} request{'s' * (found != 1)}", EVENTS_SOURCE, found, True)
    return tenant_reuse(chain, s) or engine_reuse(s)


def tenant_reuse(chain: ResidentChain, s: Snapshot) -> Reuse | None:
    """The chain's gateway tenants' cached prompt tokens; None where its salt names none, or where the gateway's
    counts cannot be trusted to be zero (it saw no cached_tokens at all while the engine counted hits: vLLM leaves
    usage.prompt_tokens_details out unless --enable-prompt-tokens-details)."""
    if s.gateway is None:
        return None
    names = [name for name, tenant in sorted(s.gateway.tenants.items())
             if name in s.tenants and gateway_salt(name, tenant.cache) == chain.tenant]
    counted = [s.tenants[name] for name in names]
    prompt = sum(t.prompt_tokens_total for t in counted)
    if not prompt:
        return None
    hits = sum(t.hit_tokens_total for t in counted)
    if not hits and not any(t.hit_tokens_total for t in s.tenants.values()) and _engine_counted(s) \
            and s.prefix_cache.hits_total:
        return None
    subject = f"tenant {names[0]}" if len(names) == 1 else f"tenants {', '.join(names)}"
    return Reuse(hits > 0, subject, _pct(hits, prompt), GATEWAY_SOURCE)


def engine_reuse(s: Snapshot) -> Reuse:
    """The engine's own prefix-cache counters, since it started: every chain's reuse together."""
    if not _engine_counted(s):
        return Reuse(None, ENGINE, "-", "no prefix-cache counters")
    hits = s.prefix_cache.hits_total
    names = [(s.metrics_read.get(f"prefix_cache.{field}_total") or [""])[0] for field in ("hits", "queries")]
    source = " / ".join(names) if all(names) else "the engine's prefix-cache counters"
    # Hits somewhere are not hits of this chain; none anywhere are none of it either.
    return Reuse(False if not hits else None, ENGINE, _pct(hits, s.prefix_cache.queries_total), source)


def gateway_salt(name: str, cache: str) -> str:
    """The cache salt a gateway tenant's requests carry, as the events name it (kvops.gateway.policy.salt_for):
    its own for an isolated tenant, its group's, or none (NO_TENANT) for a shared one."""
    if cache == ISOLATED:
        return f"{TENANT_SALT_PREFIX}{name}"
    return cache if cache.startswith(GROUP_PREFIX) else NO_TENANT


def _engine_counted(s: Snapshot) -> bool:
    """The engine's prefix-cache counters are read, and it has looked prompts up."""
    return s.knows("prefix_cache.hits_total") and s.knows("prefix_cache.queries_total") \
        and s.prefix_cache.queries_total > 0


def _pct(part: int, whole: int) -> str:
    share = part / whole
    return f"{share * 100:.0f}%" if share == 0 or share >= 0.01 else "<1%"


def _tenant(name: str) -> str:
    return name if name != NO_TENANT else "(none)"
