"""The snapshot schema: the compact block and owner maps, the block states and the histogram percentiles."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvops.schema.snapshot import (
    BLOCK_STATE_CODES,
    HISTOGRAM_PERCENTILES,
    OTHER_OWNER_CODE,
    OWNER_CODES,
    Histogram,
    decode_block_map,
    encode_block_map,
    encode_owner_map,
    percentile_fields,
)

CODES = "".join(BLOCK_STATE_CODES.values())


@given(st.text(alphabet=CODES, max_size=500))
def test_block_map_round_trips(codes):
    assert decode_block_map(encode_block_map(codes)) == codes


def test_block_map_of_100k_blocks_stays_small():
    # A busy pool: runs of each state of realistic lengths (sequences hold runs of blocks).
    rng = random.Random(0)
    codes = []
    while len(codes) < 100_000:
        codes.extend(rng.choice(CODES) * rng.randint(4, 64))
    codes_str = "".join(codes[:100_000])
    encoded = encode_block_map(codes_str)
    assert len(encoded) < 20_000  # vs 100,000 characters raw
    assert decode_block_map(encoded) == codes_str


def test_owner_map_letters_follow_first_appearance_and_cap_at_52_tenants():
    owners = [None, "audit-log", "audit-log", "chat", None, "audit-log"]
    encoded, tenants = encode_owner_map(owners)
    assert tenants == ["audit-log", "chat"]
    assert decode_block_map(encoded) == ".aab.a"

    many = [f"t{i}" for i in range(60)]
    encoded, tenants = encode_owner_map(many)
    assert tenants == many[:52]  # a letter each; the rest share "+"
    assert decode_block_map(encoded) == OWNER_CODES + OTHER_OWNER_CODE * 8


def test_the_engine_block_states_are_the_schema_states():
    from kvops.engine.block import BlockState

    assert [state.value for state in BlockState] == list(BLOCK_STATE_CODES)
    assert "".join(state.code for state in BlockState) == CODES


def test_histogram_percentiles_come_from_the_histogram_fields():
    assert HISTOGRAM_PERCENTILES == (50, 95, 99)
    assert percentile_fields(lambda q: q / 100) == {"p50": 0.5, "p95": 0.95, "p99": 0.99}
    assert set(percentile_fields(lambda q: None)) <= set(Histogram.model_fields)
