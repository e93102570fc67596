"""The volatile-value masks (kvops.gateway.volatile) and a tenant's `mask` policy, live, in front of a recording
upstream."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvops.gateway.policy import TenantPolicy
from kvops.gateway.volatile import CATALOG, check_mask, found, mask_text
from tests.helpers.gateway_servers import ADMIN, Recorder, auth, gateway_in_front_of, serving


@pytest.mark.parametrize("name", list(CATALOG))
def test_each_pattern_matches_its_example_whole(name: str) -> None:
    volatile = CATALOG[name]
    assert volatile.pattern.fullmatch(volatile.example)
    assert mask_text(f"at {volatile.example}.", [name]) == f"at {volatile.placeholder}."


@pytest.mark.parametrize("text", [
    "1234567890123456789",  # a number is not an id
    "deadbeefdeadbeef",  # hex, but no digit: a word
    "version 2026-12-04",  # a date alone is not a timestamp
    "x2026-12-04T03:12:14Zy",  # inside a word
    "123e4567-e89b-12d3-a456-426614174000a",  # a longer token than a uuid
])
def test_values_that_are_not_volatile_stay(text: str) -> None:
    assert mask_text(text, list(CATALOG)) == text and found(text) == {}


def test_every_timestamp_form_of_logs_and_iso_8601() -> None:
    for value in ("2026-12-04T03:12:14Z", "2026-12-04 03:12:14", "2026-12-04T03:12:14.123456+01:00",
                  "2026-12-04 03:12 UTC", "2026-12-04T03:12:14,5-0500"):
        assert mask_text(f"now {value} go", ["timestamp"]) == "now <timestamp> go", value


def test_found_counts_the_characters_each_pattern_takes() -> None:
    text = "t=2026-12-04T03:12:14Z id=4bf92f3577b34da6a3ce929d0e0e4736 id=4bf92f3577b34da6a3ce929d0e0e4737"
    assert found(text) == {"timestamp": 20, "hex_id": 64}


def test_a_mask_names_catalog_patterns_only() -> None:
    assert check_mask(["hex_id", "timestamp", "hex_id"]) == ["timestamp", "hex_id"]
    with pytest.raises(ValueError, match="'ip' is not a volatile pattern; a list of timestamp, uuid, hex_id"):
        check_mask(["ip"])
    with pytest.raises(ValueError, match="not a volatile pattern"):
        TenantPolicy(mask=["date"])


def test_a_tenants_mask_changes_live_what_reaches_the_upstream(tmp_path: Path) -> None:
    recorder = Recorder()
    chat = {"model": "m", "messages": [{"role": "system", "content": "Now:  2026-12-04T03:12:14Z.  Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "2026-12-04T03:12:14Z"}]}]}
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        put = httpx.put(f"{url}/admin/tenants/team-a", json={"mask": ["timestamp"]}, headers=ADMIN)
        assert put.status_code == 200 and put.json()["before"]["mask"] == [] and put.json()["after"]["mask"] == [
            "timestamp"]
        httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth("team-a"))
        sent = recorder.bodies[-1]["messages"]
        assert sent[0]["content"] == "Now:  <timestamp>.  Be brief."  # masked, whitespace as sent (normalize off)
        assert sent[1] == chat["messages"][1]  # content parts: left as they are
        httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["2026-12-04 03:12:14 a", "b"]},
                   headers=auth("team-a"))
        assert recorder.bodies[-1]["prompt"] == ["<timestamp> a", "b"]
        httpx.put(f"{url}/admin/tenants/team-a", json={"normalize": True}, headers=ADMIN)
        httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth("team-a"))
        assert recorder.bodies[-1]["messages"][0]["content"] == "Now: <timestamp>. Be brief."  # both
        httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth("team-b"))  # another tenant: untouched
        assert recorder.bodies[-1]["messages"][0]["content"] == chat["messages"][0]["content"]
        assert httpx.put(f"{url}/admin/tenants/team-a", json={"mask": None}, headers=ADMIN).json()["after"][
            "mask"] == []
        bad = httpx.put(f"{url}/admin/tenants/team-a", json={"mask": ["ip"]}, headers=ADMIN)
        assert bad.status_code == 400 and "not a volatile pattern" in bad.text
