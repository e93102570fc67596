"""The snapshot schema's compact block map."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvops.snapshot import BLOCK_STATE_CODES, decode_block_map, encode_block_map

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
