"""Hysteresis: a diagnosis clears only after its rule stayed quiet for clear_for_s; one that comes back soon after
clearing is a flap, counted."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvops.rules import RULES
from kvops.schema.diagnosis import Diagnosis, Severity
from kvops.supervisor import exporter
from kvops.supervisor.config import parse_config
from kvops.supervisor.hysteresis import Hysteresis
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.synthetic import T0


def _diagnosis(rule: str = "queueing", subject: str = "") -> Diagnosis:
    return Diagnosis(rule=rule, engine="e", subject=subject, severity=Severity.WARNING, title="t", summary="s",
                     evidence={})


def test_a_diagnosis_is_held_until_its_rule_stayed_quiet_for_clear_for_s():
    h = Hysteresis(lambda rule: 30.0)
    assert [d.key for d in h.update([_diagnosis()], T0)] == [("queueing", "e", "")]
    held = h.update([], T0 + 10)
    assert len(held) == 1 and held[0].clearing_since == T0
    assert len(h.update([], T0 + 29.9)) == 1
    assert h.update([], T0 + 30) == []
    assert not h.flaps


def test_raised_again_inside_clear_for_s_it_never_cleared_and_is_no_flap():
    h = Hysteresis(lambda rule: 30.0)
    for t in range(0, 300, 10):  # a value at the threshold: raised every other poll
        h.update([_diagnosis()] if t % 20 == 0 else [], T0 + t)
    assert not h.flaps
    assert h.update([], T0 + 300)[0].clearing_since == T0 + 280


def test_raised_again_soon_after_clearing_is_a_flap():
    h = Hysteresis(lambda rule: 5.0, flap_window_s=600)
    h.update([_diagnosis()], T0)
    assert h.update([], T0 + 6) == []  # cleared
    h.update([_diagnosis()], T0 + 60)
    assert h.flaps == {("queueing", "e"): 1}
    h.update([], T0 + 70)
    h.update([_diagnosis()], T0 + 1000)  # long after clearing: a new episode, not a flap
    assert h.flaps == {("queueing", "e"): 1}


def test_clear_for_s_is_per_rule_and_subject():
    h = Hysteresis(lambda rule: 0.0 if rule == "crash_loop" else 30.0)
    h.update([_diagnosis("crash_loop"), _diagnosis("tenant_pollution", "a"), _diagnosis("tenant_pollution", "b")],
             T0)
    active = h.update([_diagnosis("tenant_pollution", "a")], T0 + 1)
    assert sorted((d.rule, d.subject, d.clearing_since) for d in active) == [
        ("tenant_pollution", "a", None), ("tenant_pollution", "b", T0)]


def test_config_sets_clear_for_s_per_rule_over_the_rules_default():
    config = parse_config({"rules": {"queueing": {"clear_for_s": 120}}}, "test")
    assert config.clear_for_s("queueing") == 120
    assert config.clear_for_s("engine_down") == RULES["engine_down"].clear_for_s == 10
    assert config.clear_for_s("kv_oom_runtime") == 30


def _supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(parse_config({
        "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
        "engines": [{"name": "gone", "url": "http://127.0.0.1:9"}],  # nothing listens on the discard port
    }, "test"))


def _samples(sup: Supervisor, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = exporter.render(sup)[0].decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_flaps_are_exported(tmp_path: Path):
    sup = _supervisor(tmp_path)
    sup.hysteresis.update([_diagnosis("queueing").model_copy(update={"engine": "gone"})], T0)
    sup.hysteresis.update([], T0 + 31)
    sup.hysteresis.update([_diagnosis("queueing").model_copy(update={"engine": "gone"})], T0 + 40)
    assert _samples(sup, "kvops_diagnosis_flaps")[(("engine", "gone"), ("kind", "auto"), ("rule", "queueing"))] == 1
