"""API keys decide the tenant: keys from a file or the environment, held only as digests, checked on every
request; client-named tenants only in the trusted mode; tenant names checked where they enter."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvops.engine.config import EngineConfig
from kvops.engine.serving.app import build_app
from kvops.engine.serving.auth import TenantResolver
from kvops.schema.errors import ConfigError
from kvops.tenancy.api_keys import ApiKeys, load_api_keys
from kvops.tenancy.names import tenant_name_problem

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "admin-token-for-keys"
KEY_A = "key-a-0123456789abcdef"
KEY_A2 = "key-a-rotated-0123456789"
KEY_B = "key-b-0123456789abcdef"
KEY_FILE = f"""# tenant  key
team-a {KEY_A}

team-a   {KEY_A2}
   team/b c\t{KEY_B}
"""


def _key_file(tmp_path: Path, text: str = KEY_FILE) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_keys_from_a_file_name_their_tenants(tmp_path: Path):
    keys = load_api_keys(_key_file(tmp_path), None)
    assert keys is not None and len(keys) == 3 and keys.tenants == {"team-a", "team/b c"}
    assert keys.tenant_for(KEY_A) == keys.tenant_for(KEY_A2) == "team-a"  # a tenant may have several (rotation)
    assert keys.tenant_for(KEY_B) == "team/b c"
    assert keys.tenant_for("key-a-0123456789abcdeX") is None and keys.tenant_for("") is None


def test_keys_from_the_environment_and_a_file_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVOPS_TEST_KEYS", f" ops={'o' * 16}, batch=b=64-chars-of-base64ish== ")
    keys = load_api_keys(None, "KVOPS_TEST_KEYS")
    assert keys is not None and keys.tenant_for("o" * 16) == "ops"
    assert keys.tenant_for("b=64-chars-of-base64ish==") == "batch"  # the key is everything after the first '='
    both = load_api_keys(_key_file(tmp_path), "KVOPS_TEST_KEYS")
    assert both is not None and both.tenants == {"team-a", "team/b c", "ops", "batch"}
    assert load_api_keys(None, None) is None  # no keys: the trusted mode


def test_keys_are_held_only_as_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    keys = load_api_keys(_key_file(tmp_path), None)
    assert keys is not None
    assert KEY_A not in repr(keys) and KEY_A not in str(keys) and repr(keys) == "ApiKeys(3 keys, 2 tenants)"
    held = b"".join(digest + tenant.encode() for digest, tenant in keys._entries)
    assert KEY_A.encode() not in held and hashlib.sha256(KEY_A.encode()).digest() in held
    assert set(vars(keys)) == {"_entries"}  # nothing else is kept


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"team-a {KEY_A}\nteam-b\n", "line 2: expected a tenant name and a key separated by a space"),
        (f"# keys\nteam-a {KEY_A}\nteam-b {KEY_A}\n", "line 3: this key (tenant 'team-b') is already given at"),
        ("team-a short\n", "line 1: the key of tenant 'team-a' must be at least 16"),
        (f"t\u00e9am {KEY_A}\n", "line 1: tenant name 't\u00e9am' is not valid: use 1 to 64 printable ASCII"),
        (f"{'x' * 65} {KEY_A}\n", "is not valid: use 1 to 64 printable ASCII"),
        ("# only comments\n\n", "no keys in it"),
    ],
)
def test_malformed_key_files_say_where_and_what_to_write(tmp_path: Path, text: str, message: str):
    path = _key_file(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_api_keys(path, None)
    assert message in str(error.value) and path in str(error.value)
    assert KEY_A not in str(error.value)  # a key never shows in a message


def test_missing_unreadable_and_environment_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ConfigError, match="no such file; create it with one `TENANT KEY` per line"):
        load_api_keys(str(tmp_path / "absent"), None)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_api_keys(str(tmp_path), None)  # a directory
    monkeypatch.delenv("KVOPS_TEST_KEYS", raising=False)
    with pytest.raises(ConfigError, match="KVOPS_TEST_KEYS: the environment variable is not set"):
        load_api_keys(None, "KVOPS_TEST_KEYS")
    monkeypatch.setenv("KVOPS_TEST_KEYS", f"={KEY_A}")
    with pytest.raises(ConfigError, match=r"\$KVOPS_TEST_KEYS entry 1: the tenant name is empty"):
        load_api_keys(None, "KVOPS_TEST_KEYS")
    monkeypatch.setenv("KVOPS_TEST_KEYS", f"a={KEY_A},,b={KEY_B}")
    with pytest.raises(ConfigError, match=r"entry 2 is empty"):
        load_api_keys(None, "KVOPS_TEST_KEYS")
    monkeypatch.setenv("KVOPS_TEST_KEYS", f"a={KEY_A}")
    with pytest.raises(ConfigError, match=r"\$KVOPS_TEST_KEYS entry 1: this key .* already given at .*line 2"):
        load_api_keys(_key_file(tmp_path), "KVOPS_TEST_KEYS")
    with pytest.raises(ConfigError, match="not an environment variable name"):
        EngineConfig(api_keys_env=f"a={KEY_A}")
    with pytest.raises(ConfigError, match="--max-tenant-labels must be at least 1"):
        EngineConfig(max_tenant_labels=0)


def test_a_bad_key_file_stops_engine_serve_with_exit_2_and_no_traceback(tmp_path: Path):
    path = _key_file(tmp_path, "team-a\n")
    result = subprocess.run([sys.executable, "-m", "kvops", "engine", "serve", "--port", "0", "--kv-cache-memory",
                             "32MiB", "--max-model-len", "256", "--api-keys-file", path],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"{path} line 1: expected a tenant name and a key" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["a", "team-a", "user@example.com", "a/b c", "?#%&=", "x" * 64, "other"])
def test_valid_tenant_names(name: str):
    assert tenant_name_problem(name) is None


@pytest.mark.parametrize("name", ["", " lead", "trail ", "x" * 65, "new\nline", "tab\there", "caf\u00e9", "\u202e"])
def test_invalid_tenant_names(name: str):
    assert "1 to 64 printable ASCII characters" in str(tenant_name_problem(name))


# ------------------------------------------------------------------ the server, with keys


def _app(llm, tmp_path: Path, trust: bool = False) -> TestClient:
    keys = load_api_keys(_key_file(tmp_path), None)
    return TestClient(build_app(llm.engine, admin_token=ADMIN, tenants=TenantResolver(keys, trust)))


@pytest.fixture
def keyed(llm, tmp_path: Path) -> Iterator[TestClient]:
    with _app(llm, tmp_path) as http:
        yield http
    llm.engine.block_manager.quotas.clear()
    llm.engine.tenant_salts.clear()


def _complete(http: TestClient, key: str | None, **extra: object) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(extra.pop("headers", {}))  # type: ignore[arg-type]
    body = {"model": MODEL, "prompt": "Tell me about keys.", "max_tokens": 2, "temperature": 0, **extra}
    response = http.post("/v1/completions", json=body, headers=headers)
    return response.status_code, response.json()


def _requests(http: TestClient, tenant: str) -> int:
    stats = http.get("/stats").json()["tenants"].get(tenant)
    return stats["requests_total"] if stats else 0


def test_requests_without_a_valid_key_get_401_saying_what_to_send(keyed: TestClient):
    for key in (None, "not-a-key-0123456789", KEY_A + "x"):
        status, body = _complete(keyed, key)
        assert status == 401 and body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
        assert "Authorization: Bearer <API key>" in body["error"]["message"]
    status, body = _complete(keyed, None, max_tokens="lots")  # refused before the body is looked at
    assert status == 401
    chat = keyed.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 401
    assert keyed.get("/v1/models").status_code == keyed.get("/health").status_code == 200  # discovery stays open


def test_the_key_decides_the_tenant_whatever_user_or_x_tenant_say(keyed: TestClient):
    before = _requests(keyed, "team-a"), _requests(keyed, "team/b c")
    assert _complete(keyed, KEY_A)[0] == 200
    assert _complete(keyed, KEY_A2, user="team/b c", headers={"X-Tenant": "someone-else"})[0] == 200
    assert _complete(keyed, KEY_B, user="bad\nname")[0] == 200  # ignored, so not checked either
    assert (_requests(keyed, "team-a"), _requests(keyed, "team/b c")) == (before[0] + 2, before[1] + 1)
    assert "someone-else" not in keyed.get("/stats").json()["tenants"]


def test_a_quota_on_the_keys_tenant_cannot_be_bypassed_by_changing_user(keyed: TestClient, llm):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert keyed.put("/admin/tenants/team-a", json={"quota_blocks": 64},
                     headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403  # a tenant key is no admin
    assert keyed.put("/admin/tenants/team-a", json={"quota_blocks": 64}, headers=admin).status_code == 200
    before = _requests(keyed, "team-a")
    for user in ("fresh-tenant-1", "fresh-tenant-2"):
        status, _ = _complete(keyed, KEY_A, user=user, prompt="A long prompt " * 40, max_tokens=4)
        assert status == 200
    tenants = keyed.get("/stats").json()["tenants"]
    assert tenants["team-a"]["requests_total"] == before + 2 and tenants["team-a"]["quota_blocks"] == 64
    assert tenants["team-a"]["blocks_owned"] <= 64
    assert "fresh-tenant-1" not in tenants and "fresh-tenant-2" not in tenants
    assert llm.engine.block_manager.quotas == {"team-a": 64}


def test_the_trust_switch_lets_an_authenticated_gateway_name_the_tenant(llm, tmp_path: Path):
    with _app(llm, tmp_path, trust=True) as http:
        assert _complete(http, None, user="gateway-user")[0] == 401  # still a key first
        before = _requests(http, "gateway-user")
        assert _complete(http, KEY_A, user="gateway-user")[0] == 200
        assert _complete(http, KEY_A, headers={"X-Tenant": "gateway-user"})[0] == 200
        assert _requests(http, "gateway-user") == before + 2
        status, body = _complete(http, KEY_A, user="bad\nname")
        assert status == 400 and body["error"]["param"] == "user" and "printable ASCII" in body["error"]["message"]


def test_without_keys_clients_name_tenants_and_bad_names_get_400(llm):
    with TestClient(build_app(llm.engine, admin_token=ADMIN)) as http:  # the engine's config: no keys
        before = _requests(http, "trusted@example.com")
        assert _complete(http, "anything-at-all", user="trusted@example.com")[0] == 200
        assert _requests(http, "trusted@example.com") == before + 1
        status, body = _complete(http, None, user="x" * 65)
        assert status == 400 and body["error"]["param"] == "user"
        status, body = _complete(http, None, headers={"X-Tenant": " padded"})
        assert status == 400 and body["error"]["param"] == "X-Tenant"
        bad = http.put("/admin/tenants/" + "y" * 65, json={"quota_blocks": None},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and "tenant: tenant name" in bad.json()["error"]["message"]


def test_the_keys_never_reach_stats_or_the_engine_state(keyed: TestClient, llm):
    assert _complete(keyed, KEY_A)[0] == 200
    exposed = keyed.get("/stats").text + keyed.get("/metrics").text
    exposed += keyed.get("/admin/config", headers={"Authorization": f"Bearer {ADMIN}"}).text
    exposed += repr(llm.engine.config) + repr(keyed.app.state._state)
    for key in (KEY_A, KEY_A2, KEY_B):
        assert key not in exposed
    assert isinstance(keyed.app.state.tenants.keys, ApiKeys)


@pytest.mark.parametrize("name", ["a/b", "gpu 0", "", "x" * 65, "caf\u00e9", "a?b"])
def test_engine_names_outside_the_rule_are_refused_with_what_is_allowed(name: str):
    from kvops.supervisor.config import parse_config

    with pytest.raises(ConfigError) as error:
        parse_config({"engines": [{"name": name}]}, "kvops.toml")
    assert "kvops.toml: engines[0].name: an engine name is 1 to 64 characters of letters, digits, '.', '_' and '-'" \
        in str(error.value)
    assert parse_config({"engines": [{"name": "gpu-0.a_b"}]}, "kvops.toml").engines[0].name == "gpu-0.a_b"
