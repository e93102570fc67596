"""The supervisor's config: the example file is valid, and every kind of mistake is refused with
the file, the key and what is allowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvops.schema.errors import ConfigError
from kvops.supervisor.config import apply_override, load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "kvops.example.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvops.toml"
    path.write_text(text)
    return path


def test_the_example_config_is_valid():
    config = load_config(EXAMPLE)
    assert [e.name for e in config.engines][:1] == ["default"]
    assert config.engines[0].managed
    assert any(not e.managed for e in config.engines)


def test_defaults_manage_one_engine():
    config = load_config(None)
    assert len(config.engines) == 1 and config.engines[0].managed and config.supervisor.listen == "127.0.0.1:9400"
    assert config.policy("swap_storm") == "suggest"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[supervisor]\nlisten = 9400\n", r"kvops.toml: supervisor.listen: Input should be a valid string"),
        ("[supervisor]\nlisten = \"localhost\"\n", "is not host:port"),
        ("[supervisor]\npoll_intervall_s = 1\n", r"supervisor.poll_intervall_s: unknown key"),
        ("[[engines]]\nname = \"a\"\nurl = \"ftp://x\"\n", r"engines\[0\].url: 'ftp://x' is not an http\(s\) URL"),
        ("[[engines]]\nname = \"a\"\n[engines.args]\nblok_size = 8\n",
         r"engines\[0\].args: unknown engine setting 'blok_size'; allowed: model, dtype, block_size"),
        ("[[engines]]\nname = \"a\"\n[engines.args]\nkv_cache_dtype = \"int2\"\n", "--kv-cache-dtype 'int2'"),
        ("[[engines]]\nname = \"a\"\n[[engines]]\nname = \"a\"\n", "two engines are named 'a'"),
        ("[[engines]]\nname = \"w\"\nmanaged = false\n", "a watched engine .* needs url"),
        ("[rules.no_such_rule]\npolicy = \"auto\"\n", "unknown rule 'no_such_rule'; rules: "),
        ("[rules.swap_storm]\npolicy = \"always\"\n", r"rules.swap_storm.policy: Input should be 'off', 'suggest'"),
        ("[rules.swap_storm.settings]\nno_threshold = 1\n", "rule swap_storm: no_threshold: unknown key"),
        ("engines = [\n", "kvops.toml: not valid TOML"),
        ("[[engines]]\nname = \"s\"\nkind = \"sglang\"\n", "kvops manages kvops and vLLM engines: a sglang"),
        ("[[engines]]\nname = \"v\"\nkind = \"vllm\"\n[engines.args]\nBlockSize = 32\n",
         r"engines\[0\].args: 'BlockSize' is not a vLLM flag in snake_case"),
        ("[[engines]]\nname = \"v\"\nkind = \"vllm\"\n[engines.args]\nkv_cache_memory = \"lots\"\n",
         "kv_cache_memory: cannot read 'lots' as a size"),
        ("[[engines]]\nname = \"k\"\npython = \"/usr/bin/python3\"\n", "python applies to a managed vLLM"),
    ],
)
def test_broken_configs_name_file_key_and_what_is_allowed(tmp_path: Path, text: str, message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_missing_file_says_so(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_overrides_reach_any_setting(tmp_path: Path):
    config = load_config(EXAMPLE, ["engines.0.args.block_size=32", "rules.swap_storm.policy=\"auto\"",
                                   "supervisor.poll_interval_s=2"])
    assert config.engines[0].args["block_size"] == 32
    assert config.policy("swap_storm") == "auto" and config.supervisor.poll_interval_s == 2
    data: dict = {}
    apply_override(data, "engines.0.port=8123")
    assert data == {"engines": [{"name": "default", "port": 8123}]}
    with pytest.raises(ConfigError, match=r"write key\.path=value"):
        apply_override({}, "nonsense")


def test_check_config_cli_validates_and_starts_nothing(tmp_path: Path):
    ok = subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(EXAMPLE), "--check-config"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    bad = _write(tmp_path, "[supervisor]\nlisten = \"nowhere\"\n")
    broken = subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode == 2
    assert f"{bad}: supervisor.listen: 'nowhere' is not host:port" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_the_example_managed_vllm_is_valid_uncommented(tmp_path: Path):
    text = EXAMPLE.read_text()
    start = text.index("#[[engines]]\n#name = \"vllm-local\"")
    block = text[start:text.index("\n\n", start)]
    config = load_config(_write(tmp_path, "\n".join(line[1:] for line in block.splitlines())))
    engine = config.engines[0]
    assert engine.kind == "vllm" and engine.managed and engine.args["block_size"] == 32
    assert engine.health_timeout_s == 600
    assert load_config(None, ["engines.0.kind=\"vllm\""]).engines[0].health_timeout_s == 600  # its default
