"""Requests as a user sends them: sampling options, stops, bad input, aborts and the snapshot."""

from __future__ import annotations

import pytest

from kvops.engine.errors import InvalidRequestError
from kvops.engine.sampling import SamplingParams
from kvops.schema.snapshot import OWNER_CODES, Snapshot, decode_block_map


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(llm, chat_prompts):
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=seed, ignore_eos=True)
        return llm.generate([chat_prompts[1]], params)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy(llm, chat_prompts):
    greedy = llm.generate(chat_prompts[:3], SamplingParams(temperature=0, max_tokens=16))
    top1 = llm.generate(chat_prompts[:3], SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=1))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_string_ends_output_before_the_stop(llm, chat_prompts):
    full = llm.generate([chat_prompts[14]], SamplingParams(temperature=0, max_tokens=48))[0]
    words = full.text.split()
    assert len(words) > 4
    stop = words[3]
    out = llm.generate([chat_prompts[14]], SamplingParams(temperature=0, max_tokens=48, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)


def test_stop_token_id_and_max_tokens(llm, chat_prompts):
    full = llm.generate([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=20))[0]
    stop_token = full.token_ids[5]
    out = llm.generate([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]))
    assert out[0].token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert out[0].stop_reason == stop_token
    assert full.finish_reason == "length" and len(full.token_ids) == 20


def test_eos_stops_unless_ignored(llm, chat_prompts):
    short = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=64))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    long = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert len(long.token_ids) == 64


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", None, "prompt is empty"),
        ([], None, "prompt is empty"),
        ([1] * 1025, None, "prompt has 1025 tokens, more than max_model_len 1024"),
        ([10**9], None, "outside the vocabulary"),
    ],
)
def test_bad_requests_are_refused_with_the_limit(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.engine.add_request(prompt, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, r"max_tokens must be at least 1 \(got 0\)"),
        ({"max_tokens": -3}, r"max_tokens must be at least 1 \(got -3\)"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_parameters_name_the_field(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**kwargs)
    assert info.value.field == next(iter(kwargs))


def test_a_prompt_at_max_model_len_still_gets_one_token(llm):
    out = llm.generate([[1] * 1024], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_abort_sends_blocks_through_pending_free(llm, chat_prompts):
    engine = llm.engine
    request = engine.add_request(chat_prompts[11], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(20):
        engine.step()
    held = len(engine.block_manager.block_table(request))
    assert engine.abort_request(request)
    counts = engine.snapshot(include_gpu=False).blocks.counts
    assert counts["pending_free"] == held and counts["filling"] == counts["full"] == 0
    engine.step()  # nothing to run, but the step reclaims pending blocks
    assert engine.snapshot(include_gpu=False).blocks.counts["pending_free"] == 0
    assert not engine.abort_request(request)


def test_snapshot_reports_what_happened(llm, chat_prompts):
    before = llm.engine.snapshot().requests
    llm.generate(chat_prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 tenants=["a", "a", "b", "b"])
    snap = Snapshot.model_validate_json(llm.engine.snapshot().model_dump_json())
    # 4 first tokens, 7 more each; latencies are real, positive times
    assert snap.requests.ttft_count - before.ttft_count == 4
    assert snap.requests.itl_count - before.itl_count == 28
    assert snap.requests.ttft_seconds_sum > before.ttft_seconds_sum
    assert snap.requests.itl_seconds_sum > before.itl_seconds_sum
    # the owner map names the tenant of every block that is not free, as many as it owns
    owners = decode_block_map(snap.blocks.owner_map)
    assert len(owners) == snap.engine.num_blocks
    for letter, tenant in zip(OWNER_CODES, snap.blocks.owners, strict=False):
        assert owners.count(letter) == snap.tenants[tenant].blocks_owned
    assert {"a", "b"} <= set(snap.blocks.owners)
    states = decode_block_map(snap.blocks.state_map)
    assert all((o == ".") == (s == ".") for o, s in zip(owners, states, strict=True))
    assert sum(snap.blocks.counts.values()) == snap.engine.num_blocks
    assert len(decode_block_map(snap.blocks.state_map)) == snap.engine.num_blocks
    assert snap.tenants["a"].requests_total >= 2 and snap.tenants["b"].prompt_tokens_total > 0
    assert snap.prompt_lengths.count >= 4 and snap.prompt_lengths.p50 is not None
    assert snap.steps and snap.steps[-1].duration_s > 0
    assert snap.process.rss_bytes > 0 and snap.process.gpu_status  # no GPU here: reported, not raised
    assert snap.engine.bytes_per_token == 2 * 30 * 3 * 64 * 4
