"""`kvops run --engine-url` and `--no-managed`: which engines the supervisor gets (config_from_args).

An operator's first `kvops run --engine-url http://127.0.0.1:8000` against their own vLLM used to start a kvops engine
on the default model beside it (1.7 GB, both CPUs, a kv_oom_start proposal about an engine nobody asked for); and
`--no-managed` with a config of watched engines dropped those too, ending in "no engine: configure at least one
[[engines]] entry"."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvops.schema.errors import ConfigError
from kvops.supervisor.run import config_from_args
from kvops.supervisor.run_args import add_run_args

WATCHED = """
[[engines]]
name = "vllm-0"
url = "http://127.0.0.1:8000"
kind = "vllm"
"""

MIXED = WATCHED + """
[[engines]]
name = "local"
"""


def engines(*argv: str) -> list[tuple[str, bool]]:
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    config = config_from_args(parser.parse_args(list(argv)))
    return [(spec.name, spec.managed) for spec in config.engines]


def test_engine_url_alone_watches_that_server_and_starts_nothing() -> None:
    assert engines("--engine-url", "http://127.0.0.1:8000") == [("watched-0", False)]
    assert engines() == [("default", True)]  # nothing named: the default engine, as before


def test_engine_url_adds_to_the_engines_a_config_or_set_names(tmp_path: Path) -> None:
    config = tmp_path / "kvops.toml"
    config.write_text(MIXED)
    assert engines("--config", str(config), "--engine-url", "http://h:1") == [
        ("vllm-0", False), ("local", True), ("watched-0", False)]
    assert engines("--set", "engines.0.args.block_size=32", "--engine-url", "http://h:1") == [
        ("default", True), ("watched-0", False)]


def test_no_managed_keeps_the_configs_watched_engines(tmp_path: Path) -> None:
    config = tmp_path / "kvops.toml"
    config.write_text(MIXED)
    assert engines("--config", str(config), "--no-managed") == [("vllm-0", False)]
    assert engines("--config", str(config), "--no-managed", "--engine-url", "http://h:1") == [
        ("vllm-0", False), ("watched-0", False)]


def test_no_managed_with_nothing_to_watch_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "kvops.toml"
    config.write_text('[[engines]]\nname = "local"\n')
    with pytest.raises(ConfigError, match="no engine"):
        engines("--config", str(config), "--no-managed")
