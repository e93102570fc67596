"""The admin-action table (kvops/schema/admin.py): planning before/undo, the URLs and bodies the client
sends, the engine's handlers, the rules that use each action, and the docs that list them."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvops.adapters.engine_client import EngineClient
from kvops.rules import RULES
from kvops.schema.admin import (
    ADMIN_ACTIONS,
    SET_NORMALIZATION,
    SET_PREFIX_CACHING,
    SET_TENANT_QUOTA,
    AdminAction,
    AdminChange,
)
from kvops.schema.diagnosis import FixKind

DOCS = Path(__file__).resolve().parent.parent / "docs"
KNOBS = {"enable_prefix_caching": True, "eviction_policy": "lru", "normalize_prompts": "off",
         "tenant_salts": {"batch": "shared"}, "tenant_quotas": {"batch": 64}}


def test_one_knob_actions_undo_to_the_old_value() -> None:
    assert SET_NORMALIZATION.plan(KNOBS, {"mode": "on"}) == AdminChange(
        params={"mode": "on"}, before={"normalize_prompts": "off"}, undo={"mode": "off"})
    assert SET_PREFIX_CACHING.plan(KNOBS, {"enabled": False}) == AdminChange(
        params={"enabled": False}, before={"enable_prefix_caching": True}, undo={"enabled": True})


def test_tenant_quota_keeps_the_tenants_salt_both_ways() -> None:
    change = SET_TENANT_QUOTA.plan(KNOBS, {"tenant": "batch", "quota_blocks": 32})
    assert change.params == {"tenant": "batch", "quota_blocks": 32, "cache_salt": "shared"}
    assert change.before == {"tenant": "batch", "quota_blocks": 64}
    assert change.undo == {"tenant": "batch", "quota_blocks": 64, "cache_salt": "shared"}
    fresh = SET_TENANT_QUOTA.plan(KNOBS, {"tenant": "new", "quota_blocks": 32})
    assert fresh.params == {"tenant": "new", "quota_blocks": 32}  # no salt of its own to keep
    assert fresh.undo == {"tenant": "new", "quota_blocks": None}


def test_the_client_quotes_each_path_field_whole_and_bodies_leave_them_out() -> None:
    assert SET_TENANT_QUOTA.path_params == ("tenant",) and SET_NORMALIZATION.path_params == ()
    assert SET_TENANT_QUOTA.request_body({"tenant": "x", "quota_blocks": 5}) == {"quota_blocks": 5}
    with pytest.raises(ValueError, match="mode"):
        SET_NORMALIZATION.request_body({"mode": "loud"})  # refused before anything is sent
    sent: list[tuple[str, str, object]] = []

    class Recording(EngineClient):
        def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
            sent.append((method, path, kwargs.get("json")))
            return httpx.Response(200, json={})

    client = Recording("http://engine", "token")
    client.admin("set_tenant_quota", {"tenant": "team/a b", "quota_blocks": 64})
    client.admin("set_normalization", {"mode": "on"})
    assert sent == [("PUT", "/admin/tenants/team%2Fa%20b", {"quota_blocks": 64}),
                    ("PUT", "/admin/normalization", {"mode": "on"})]
    with pytest.raises(KeyError):
        client.admin("set_tenant_quota", {"quota_blocks": 64})
    with pytest.raises(ValueError, match="unknown admin action"):
        client.admin("set_everything", {})
    client.close()


def test_every_action_is_bound_to_an_engine_handler_taking_its_path_fields() -> None:
    from kvops.engine.serving.admin_routes import ADMIN_HANDLERS

    assert set(ADMIN_HANDLERS) == set(ADMIN_ACTIONS)
    for name, action in ADMIN_ACTIONS.items():
        assert action.name == name and action.method in {"PUT", "POST"} and action.path.startswith("/admin/")
        handler_params = list(inspect.signature(ADMIN_HANDLERS[name]).parameters)
        assert handler_params == ["engine", "body", *action.path_params]


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_rules_build_admin_fixes_only_from_the_table(rule_id: str) -> None:
    module = importlib.import_module(f"kvops.rules.{rule_id}")
    used = {value.name for value in vars(module).values() if isinstance(value, AdminAction)}
    assert used == {a.name for a in ADMIN_ACTIONS.values() if rule_id in a.rules}
    assert "FixKind.ADMIN" not in inspect.getsource(module)  # never a hand-written action name


def test_the_table_names_existing_rules_and_builds_admin_fixes() -> None:
    for action in ADMIN_ACTIONS.values():
        assert set(action.rules) <= set(RULES)
        fix = action.fix({}, "d")
        assert fix.kind is FixKind.ADMIN and fix.action == action.name


def test_the_wire_layer_imports_no_engine_supervisor_or_web_framework() -> None:
    code = ("import sys, kvops.schema.admin, kvops.schema.diagnosis, kvops.schema.audit\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'starlette')\n"
            "       or m.startswith(('kvops.engine', 'kvops.supervisor'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _table_rows(path: Path, heading: str) -> dict[str, list[str]]:
    """The rows of the first table after `heading`, by their first cell (backticks stripped)."""
    text = path.read_text().split(heading, 1)[1]
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            if rows:
                break
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def _rules_cell(action: AdminAction) -> str:
    return ", ".join(f"`{r}`" for r in action.rules) or "—"


def test_the_docs_list_the_table_as_it_is() -> None:
    server = _table_rows(DOCS / "server.md", "## Admin actions")
    assert set(server) == set(ADMIN_ACTIONS)
    for name, (endpoint, body, undo, rules) in server.items():
        action = ADMIN_ACTIONS[name]
        assert endpoint == f"`{action.method} {action.path}`" and body == f"`{action.body.__name__}`"
        assert undo == action.undo and rules == _rules_cell(action)
    listed = _table_rows(DOCS / "rules.md", "Admin actions are defined in")
    assert set(listed) == set(ADMIN_ACTIONS)
    for name, (_, undo, rules) in listed.items():
        assert undo == ADMIN_ACTIONS[name].undo and rules == _rules_cell(ADMIN_ACTIONS[name])
