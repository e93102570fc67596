"""`kvops bench profile` on the session's engine: the phases add up to the step, the forward pass splits
into op groups, and the engine is left as it was (no wrapper, no sequence, no held block)."""

from __future__ import annotations

import pytest

from kvops.bench.step_profile import PHASES, _prompts, group_of, main, profile_offline


@pytest.mark.parametrize(("op", "group"), [
    ("mkldnn::_linear_pointwise", "matmul"), ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::index", "gather/copy"),
    ("aten::copy_", "gather/copy"), ("aten::rsqrt", "other ops"), ("aten::silu", "other ops")])
def test_ops_fall_into_their_groups(op: str, group: str):
    assert group_of(op) == group


def test_a_decode_step_splits_into_phases_and_op_groups(llm):
    engine = llm.engine
    forward = type(engine.model).forward
    report = profile_offline(None, steps=2, max_tokens=4, llm=llm)
    assert set(report["phases_ms"]) == set(PHASES)
    assert sum(report["phases_ms"].values()) == pytest.approx(report["step_ms"], rel=0.02)
    assert report["phases_ms"]["forward"] > 0 and report["phases_ms"]["sample"] > 0
    groups = report["forward_ms_by_group"]
    assert groups["matmul"] > 0 and groups["attention"] > 0  # compiled too: the one call records its parts
    assert sum(groups.values()) == pytest.approx(report["phases_ms"]["forward"], rel=0.02)
    assert report["sequences"] == 16 and report["top_ops"]
    # The bandwidth limit: SmolLM2-135M's weights in fp32 (538 MB) over a measured read rate.
    assert 500 < report["weight_mb"] < 560 and report["read_gb_s"] > 0
    assert report["step_floor_ms"] == pytest.approx(report["weight_mb"] / report["read_gb_s"], rel=0.02)
    assert 0 < report["share_of_best_read"] == pytest.approx(report["step_floor_ms"] / report["step_ms"], abs=0.002)
    # the matmuls' weights (the embedding once, as the head), summed one after another
    assert report["weights_summed_by_matrix_ms"] > 0
    # The paired pass: one pair (2 steps, then the read rate), its share the headline; the best read of the run
    # bounds every pair's rate, so no pair's limit is below the run's floor.
    [pair] = report["pairs"]
    assert report["share_of_limit"] == pair["share"] > 0 and 0 < pair["read_gb_s"] <= report["read_gb_s"]
    assert pair["share"] == pytest.approx(report["weight_mb"] / pair["read_gb_s"] / pair["step_ms"], rel=0.02)
    # Left as found: the class's own methods, nothing running, every block free or cached.
    assert "forward" not in vars(engine.model) and type(engine.model).forward is forward
    assert "schedule" not in vars(engine.scheduler) and "_prepare" not in vars(engine)
    assert not engine.has_unfinished()


def test_one_stream(llm):
    report = profile_offline(None, steps=2, max_tokens=4, llm=llm, sequences=1)
    assert report["sequences"] == 1 and report["step_ms"] > report["step_floor_ms"] * 0.5


def test_bad_options_say_what_to_give(capsys):
    assert main(["--steps", "10", "--max-tokens", "5"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--sequences", "0"]) == 2
    assert "--sequences" in capsys.readouterr().err
    assert main(["--context", "100", "--shared-prefix", "100"]) == 2
    assert "not both" in capsys.readouterr().err


def test_shared_prefix_prompts_start_alike_and_end_apart(llm):
    prompts = _prompts(llm.engine, None, 4, shared_prefix=96)
    assert all(p[:96] == prompts[0][:96] for p in prompts)
    assert len({tuple(p[96:]) for p in prompts}) == 4
