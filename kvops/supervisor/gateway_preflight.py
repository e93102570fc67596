"""Before anything starts: what a managed gateway would be started with, checked as the gateway itself checks it.

A gateway refusing its configuration exits 2 with the reason in its own log, which nobody reads while the engine
looks up. So `kvops run` and `kvops run --check-config` parse the very flags the managed gateway gets
(kvops.supervisor.managed_gateway.gateway_argv) with the gateway's own parser (kvops.gateway.run.add_gateway_args),
and build the gateway from them with its own builder (`build_from_args`: the API key file and variable through
kvops.tenancy.api_keys, the policy file through kvops.gateway.policy, the upstream key's variable, the limits), so
the two can never disagree. Only the admin token is left out: kvops sets its variable itself at each start.
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from kvops.gateway.run import add_gateway_args, build_from_args
from kvops.schema.errors import ConfigError
from kvops.supervisor.engine_spec import GatewaySpec
from kvops.supervisor.managed_gateway import gateway_argv

# Stands for the engine's URL, which a managed engine only has once its port is chosen: the gateway needs an
# http(s) URL there and does not connect to it at start.
UPSTREAM_PLACEHOLDER = "http://127.0.0.1:8000"


class _RefusingParser(argparse.ArgumentParser):
    """The gateway's parser, raising its complaint instead of printing it and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def check_gateway(spec: GatewaySpec, upstream: str = UPSTREAM_PLACEHOLDER) -> None:
    """ConfigError (one line: the flag, file and line, variable, and what to write) when the managed gateway of
    `spec` would refuse to start; nothing for an external gateway, which kvops does not start."""
    if not spec.managed:
        return
    if spec.admin_token_env is not None and not os.environ.get(spec.admin_token_env):
        raise ConfigError(f"admin_token_env {spec.admin_token_env}: the environment variable is not set or empty; "
                          "set it to the gateway's admin token, or remove admin_token_env to have kvops make a "
                          "fresh one at each start")
    parser = _RefusingParser(prog="kvops gateway", add_help=False)
    add_gateway_args(parser)
    try:
        args = parser.parse_args(gateway_argv(spec, upstream, spec.listen))
    except ConfigError as exc:
        raise ConfigError(f"args: {exc}: give each flag a value of its type (`kvops gateway --help` lists "
                          "them)") from None
    args.admin_token_env = None  # kvops's own variable, set only in the child's environment
    build_from_args(args)
