"""`kvops gateway`: its flags, and the gateway built from them and served until SIGTERM."""

from __future__ import annotations

import argparse
import os

import structlog

from kvops.gateway.policy import load_policy_file
from kvops.gateway.state import Gateway, GatewaySettings, MiB
from kvops.gateway.upstream import Upstream, UpstreamKind, UpstreamTimeouts
from kvops.schema.errors import ConfigError
from kvops.tenancy.api_keys import load_api_keys

log = structlog.get_logger("kvops.gateway")
DEFAULT_LISTEN = "127.0.0.1:9500"


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="the OpenAI-compatible server to relay to, e.g. http://127.0.0.1:8000 (a vLLM)")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help="address to bind (default: %(default)s, loopback only; 0.0.0.0:PORT to take other hosts)")
    parser.add_argument("--upstream-kind", default="auto", choices=[kind.value for kind in UpstreamKind],
                        help="what the upstream is: decides whether cache_salt is sent (vllm only); auto asks its "
                             "/v1/models (default: %(default)s)")
    parser.add_argument("--upstream-api-key-env", default=None, metavar="VAR",
                        help="an environment variable holding the key the upstream wants (vLLM's --api-key); the "
                             "clients' keys are never passed on")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="API keys that decide the tenant, one `TENANT KEY` per line (the engine's format); "
                             "without keys every request is tenant 'default'")
    parser.add_argument("--api-keys-env", default=None, metavar="VAR",
                        help="an environment variable holding API keys as tenant=key,tenant2=key2")
    parser.add_argument("--policy-file", default=None, metavar="FILE",
                        help="TOML: [default] and [tenants.NAME] cache policy, normalization and limits "
                             "(docs/gateway.md)")
    parser.add_argument("--admin-token-env", default=None, metavar="VAR",
                        help="an environment variable holding the bearer token of /admin; without one /admin answers "
                             "403")
    parser.add_argument("--max-body-size", type=int, default=4 * MiB, metavar="BYTES",
                        help="largest request body; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                        help="seconds a client has to send its whole request body, else 408 (default: %(default)s)")
    parser.add_argument("--keep-alive-timeout", type=int, default=5, metavar="S",
                        help="seconds an idle client connection is kept open (default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=1000, metavar="N",
                        help="client connections at once; more get 503 (default: %(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=3.0, metavar="S",
                        help="seconds to connect to the upstream before answering 502 (default: %(default)s)")
    parser.add_argument("--upstream-timeout", type=float, default=600.0, metavar="S",
                        help="seconds to wait for the upstream's answer, or for its next streamed chunk, before "
                             "answering 504 or ending the stream (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                        help="seconds SIGTERM waits for in-flight requests (default: %(default)s)")


def gateway_flags() -> list[str]:
    """Every `kvops gateway` flag, as the snake_case name [engines.gateway] args use."""
    parser = argparse.ArgumentParser(add_help=False)
    add_gateway_args(parser)
    return list(vars(parser.parse_args(["--upstream", "http://127.0.0.1:8000"])))


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {listen!r}: write HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.strip("[]"), int(port)


def _env(flag: str, name: str | None) -> str | None:
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{flag} {name}: the environment variable is not set or empty")
    return value


def build_from_args(args: argparse.Namespace) -> Gateway:
    """The gateway of these flags; ConfigError for a bad key file, policy file or missing variable."""
    if not args.upstream.startswith(("http://", "https://")):
        raise ConfigError(f"--upstream {args.upstream!r}: write the server's URL, e.g. http://127.0.0.1:8000")
    for flag, value in (("--max-body-size", args.max_body_size), ("--body-timeout", args.body_timeout),
                        ("--keep-alive-timeout", args.keep_alive_timeout), ("--max-connections", args.max_connections),
                        ("--connect-timeout", args.connect_timeout), ("--upstream-timeout", args.upstream_timeout)):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: must be above 0")
    keys = load_api_keys(args.api_keys_file, args.api_keys_env)
    policies = load_policy_file(args.policy_file)
    timeouts = UpstreamTimeouts(connect=args.connect_timeout, read=args.upstream_timeout)
    upstream = Upstream(args.upstream, UpstreamKind(args.upstream_kind), timeouts,
                        api_key=_env("--upstream-api-key-env", args.upstream_api_key_env))
    settings = GatewaySettings(max_body_bytes=args.max_body_size, body_timeout_s=args.body_timeout,
                               admin_token=_env("--admin-token-env", args.admin_token_env),
                               admin_token_env=args.admin_token_env)
    return Gateway(upstream, keys, policies, settings)


def run_gateway(args: argparse.Namespace) -> int:
    from kvops.gateway.app import build_gateway_app
    from kvops.serving import serve

    host, port = parse_listen(args.listen)
    gateway = build_from_args(args)
    if gateway.keys is None:
        log.warning("gateway without API keys: every request is tenant 'default' (give --api-keys-file or "
                    "--api-keys-env to tell tenants apart)")
    else:
        log.info("gateway API keys", keys=len(gateway.keys), tenants=len(gateway.keys.tenants))
    log.info("gateway listening", listen=f"http://{host}:{port}", upstream=gateway.upstream.url,
             upstream_kind=str(gateway.upstream.kind), admin="on" if gateway.settings.admin_token else "off",
             default_policy=gateway.policies.default.model_dump())
    app = build_gateway_app(gateway)
    return serve(app, host, port, args.drain_timeout, timeout_keep_alive_s=args.keep_alive_timeout,
                 limit_concurrency=args.max_connections)
