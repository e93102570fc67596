"""What a managed gateway would be started with is checked before anything starts, by `kvops run --check-config` and
by `kvops run` alike: its API key file and variable (the gateway's own rules, kvops.tenancy.api_keys), its policy
file, the variables [engines.gateway] names and the values of its `args` (the gateway's own parser). Refused: exit 2,
one line naming the config file, the engine, the file and line or the flag, and what to write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvops.schema.errors import ConfigError
from kvops.supervisor.config import parse_config
from kvops.supervisor.run import check_gateways

GOOD_KEYS = "# tenants of the chat service\nteam-a 0123456789abcdef\n"
SHORT_KEYS = "# tenants of the chat service\nteam-a 0123456789abcdef\nteam-b 0123456789\n"  # team-b's: 10 characters


def _write_config(tmp_path: Path, gateway: str) -> Path:
    path = tmp_path / "kvops.toml"
    path.write_text(f'[supervisor]\nstate_dir = "{tmp_path / "state"}"\nlisten = "127.0.0.1:0"\n'
                    f'[[engines]]\nname = "chat"\nurl = "http://127.0.0.1:9"\n[engines.gateway]\n{gateway}\n')
    return path


def _kvops_run(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(config), *flags],
                          capture_output=True, text=True, timeout=120, check=False)


def _refusal(tmp_path: Path, gateway: dict[str, Any]) -> str:
    config = parse_config({"supervisor": {"state_dir": str(tmp_path / "state")},
                           "engines": [{"name": "chat", "url": "http://127.0.0.1:9", "gateway": gateway}]}, "t")
    with pytest.raises(ConfigError) as error:
        check_gateways(config, "kvops.toml")
    message = str(error.value)
    assert message.startswith("kvops.toml: engines[0] (chat): gateway: ") and "\n" not in message, message
    return message


def test_check_config_refuses_a_key_file_with_a_short_key_naming_its_line(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(SHORT_KEYS)
    config = _write_config(tmp_path, f'api_keys_file = "{keys}"')
    done = _kvops_run(config, "--check-config")
    assert done.returncode == 2 and "OK" not in done.stdout, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert f"{config}: engines[0] (chat): gateway: {keys} line 3:" in line  # the config, the engine, the file's line
    assert "team-b" in line and "at least 16" in line and "openssl rand -hex 24" in line  # and how to make one
    keys.write_text(GOOD_KEYS)
    done = _kvops_run(config, "--check-config")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


def test_kvops_run_refuses_it_before_anything_starts(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(SHORT_KEYS)
    done = _kvops_run(_write_config(tmp_path, f'api_keys_file = "{keys}"'))
    assert done.returncode == 2 and f"{keys} line 3" in done.stderr, done.stderr
    assert not (tmp_path / "state" / "gateway-chat.log").exists()  # no gateway was started


def test_check_config_refuses_a_flag_value_the_gateway_would_refuse(tmp_path: Path) -> None:
    done = _kvops_run(_write_config(tmp_path, 'args = { max_body_size = "8 MiB" }'), "--check-config")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "gateway: args: argument --max-body-size: invalid int value: '8 MiB'" in done.stderr, done.stderr


def test_check_config_refuses_an_unknown_gateway_flag(tmp_path: Path) -> None:
    done = _kvops_run(_write_config(tmp_path, "args = { max_bodysize = 1024 }"), "--check-config")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "args.max_bodysize is not a `kvops gateway` flag" in done.stderr, done.stderr


@pytest.mark.parametrize(("args", "expected"), [
    ({"max_body_size": 0}, "--max-body-size 0: must be above 0"),
    ({"upstream_timeout": "soon"}, "argument --upstream-timeout: invalid float value: 'soon'"),
])
def test_a_flag_value_is_checked_as_the_gateway_checks_it(tmp_path: Path, args: dict[str, Any], expected: str) -> None:
    assert expected in _refusal(tmp_path, {"args": args})


def test_a_bad_policy_file_is_named_with_its_key(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[default]\ncache = "everywhere"\n')
    message = _refusal(tmp_path, {"policy_file": str(policy)})
    assert str(policy) in message and "cache" in message, message


@pytest.mark.parametrize("key", ["api_keys_env", "upstream_api_key_env", "admin_token_env"])
def test_an_unset_variable_the_table_names_is_refused(tmp_path: Path, key: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVOPS_TEST_UNSET", raising=False)
    message = _refusal(tmp_path, {key: "KVOPS_TEST_UNSET"})
    assert "KVOPS_TEST_UNSET: the environment variable is not set or empty" in message, message


def test_keys_in_a_variable_are_checked_like_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOPS_TEST_KEYS", "team-a=0123456789abcdef,team-b=short")
    message = _refusal(tmp_path, {"api_keys_env": "KVOPS_TEST_KEYS"})
    assert "$KVOPS_TEST_KEYS entry 2" in message and "at least 16" in message, message


def test_an_external_gateway_is_not_checked_as_one_kvops_starts(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVOPS_TEST_UNSET", raising=False)
    config = parse_config({"supervisor": {"state_dir": str(tmp_path / "state")},
                           "engines": [{"name": "chat", "url": "http://127.0.0.1:9",
                                        "gateway": {"url": "http://127.0.0.1:9500",
                                                    "admin_token_env": "KVOPS_TEST_UNSET"}}]}, "t")
    check_gateways(config, "kvops.toml")  # kvops starts no gateway there: its own command is checked by it
