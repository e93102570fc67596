"""`kvops run`'s flags, apart from the supervisor: every kvops command builds the whole CLI parser at
start, and importing kvops.supervisor.run (config, rules, alerting) for these lines cost each of them
~0.4 s (kvops doctor's budget is 2 s: docs/doctor.md)."""

from __future__ import annotations

import argparse


def add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config (see kvops.example.toml); where it names no "
                        "[[engines]] (or without one), kvops manages one engine on the default model, unless "
                        "--engine-url names one to watch")
    parser.add_argument("--check-config", action="store_true", help="validate the config and exit")
    parser.add_argument("--listen", help="address of the supervisor API and /metrics (default 127.0.0.1:9400)")
    parser.add_argument("--state-dir", help="where the alert outbox and the audit log live")
    parser.add_argument("--poll-interval", type=float, help="seconds between snapshots (default 0.5)")
    parser.add_argument("--engine-url", action="append", default=[], metavar="URL",
                        help="watch an engine kvops does not manage: a kvops engine, or a vLLM or SGLang server "
                        "(recognised from its /metrics; repeatable); where no [[engines]] are configured, only "
                        "these are watched: no engine is started")
    parser.add_argument("--no-managed", action="store_true",
                        help="start no engine: only watch the --engine-url ones and the config's watched engines "
                        "(url = ...)")
    parser.add_argument("--policy", action="append", default=[], metavar="RULE=POLICY",
                        help="fix policy of a rule: off, suggest or auto (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="any config setting by its TOML path, e.g. engines.0.args.block_size=32 (repeatable)")
