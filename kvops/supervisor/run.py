"""`kvops run`: load the config, start the supervisor, serve its API and /metrics until SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvops.supervisor.config import KvopsConfig, load_config, parse_config


def config_from_args(args: argparse.Namespace) -> KvopsConfig:
    overrides = list(args.overrides)
    for flag, key in ((args.listen, "supervisor.listen"), (args.state_dir, "supervisor.state_dir"),
                      (args.poll_interval, "supervisor.poll_interval_s")):
        if flag is not None:
            overrides.append(f"{key}={flag!r}" if isinstance(flag, str) else f"{key}={flag}")
    for item in args.policy:
        rule, sep, policy = item.partition("=")
        overrides.append(f"rules.{rule}.policy={policy!r}" if sep else f"rules.{item}.policy=")
    config = load_config(args.config, overrides)
    if args.engine_url or args.no_managed:
        data: dict[str, Any] = config.model_dump()
        # The default managed engine only stands in for a configuration that names no engine: with --engine-url
        # the operator named one, and `kvops run --engine-url URL` must not also load a model beside their server.
        engines = data["engines"] if "engines" in config.model_fields_set else []
        if args.no_managed:  # the configured engines kvops only watches stay watched
            engines = [e for e in engines if not e["managed"]]
        engines += [{"name": f"watched-{i}", "url": url, "managed": False} for i, url in enumerate(args.engine_url)]
        data["engines"] = engines
        config = parse_config(data, args.config or "flags")
    return config


def check_managed_engines(config: KvopsConfig, source: str, flags: bool) -> None:
    """Each managed engine whose kind checks its install before a start (a vLLM: its interpreter has vLLM and,
    with flags, every setting in its args is a flag of that vLLM). ConfigError (one line, exit 2) naming the
    engine and what to do."""
    from kvops.schema.errors import ConfigError
    from kvops.supervisor.launchers import managed_kind

    for index, spec in enumerate(config.engines):
        how = managed_kind(spec.kind) if spec.managed else None
        if how is None or how.preflight is None:
            continue
        try:
            how.preflight(spec.start(), flags)
        except ConfigError as exc:
            raise ConfigError(f"{source}: engines[{index}] ({spec.name}): {exc}") from None


def check_gateways(config: KvopsConfig, source: str) -> None:
    """Each gateway kvops would start: its key file, policy file, variables and flags, as the gateway checks them
    (kvops.supervisor.gateway_preflight). ConfigError (one line, exit 2) naming the engine and what to do, so a
    gateway that would refuse to start is refused here, before anything starts."""
    from kvops.schema.errors import ConfigError
    from kvops.supervisor.gateway_preflight import UPSTREAM_PLACEHOLDER, check_gateway

    for index, spec in enumerate(config.engines):
        if spec.gateway is None:
            continue
        try:
            check_gateway(spec.gateway, spec.url or UPSTREAM_PLACEHOLDER)
        except ConfigError as exc:
            raise ConfigError(f"{source}: engines[{index}] ({spec.name}): gateway: {exc}") from None


def warn_disabled_receivers(config: KvopsConfig, source: str) -> list[str]:
    """The receivers a missing secret disables, one warning line each on stderr: the same lines from `kvops run`
    and from `kvops run --check-config` (kvops.alerting.receiver_problems decides for both). Their names."""
    from kvops.alerting import receiver_problems

    problems = receiver_problems(config.alerting)
    for problem in problems:
        print(f"warning: {source}: {problem.message}", file=sys.stderr, flush=True)
    return [p.receiver for p in problems]


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    source = args.config or "config"
    check_managed_engines(config, source, flags=args.check_config)
    check_gateways(config, source)
    disabled = warn_disabled_receivers(config, source)
    if args.check_config:
        engines = ", ".join(f"{e.name} ({'managed' if e.managed else e.url})" for e in config.engines)
        receivers = f"{len(config.alerting.receivers)} alert receiver(s)"
        if disabled:
            receivers += f" ({len(disabled)} disabled: {', '.join(disabled)})"
        print(f"{args.config or 'defaults'}: OK — engines: {engines}; listen {config.supervisor.listen}; {receivers}")
        return 0
    from kvops.serving import serve
    from kvops.supervisor.api import build_supervisor_app
    from kvops.supervisor.supervisor import Supervisor

    supervisor = Supervisor(config, admin_token=os.environ.get(config.supervisor.admin_token_env))
    host, port = config.supervisor.listen.rsplit(":", 1)
    supervisor.start()
    try:
        code = serve(build_supervisor_app(supervisor), host, int(port), drain_timeout_s=5)
    finally:
        supervisor.stop()
    return code
