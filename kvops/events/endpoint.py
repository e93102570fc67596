"""Where an engine's KV events come from, and how kvops's sockets must open it.

The endpoint is exactly the string given to vLLM's `--kv-events-config` "endpoint". vLLM's publisher
(`_socket_setup` in vllm/distributed/kv_events.py) BINDS its PUB socket when the endpoint has a wildcard
(`*` or `::` anywhere in it) or is ipc:// or inproc://, and CONNECTS to any other tcp address; its replay
ROUTER always binds. Two binders never meet and two connectors never meet, so kvops mirrors it: it connects
to what vLLM binds and binds what vLLM connects to. A wildcard is reached at the engine's host, and kvops
itself never binds a wildcard (that would offer the token stream to the whole network).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SocketRole = Literal["connect", "bind"]

# sun_path is 108 bytes on Linux, one of them the terminating NUL (104 on macOS: kvops runs on Linux).
IPC_PATH_MAX = 107

_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.%a-zA-Z0-9]+\]|[^:/\[\]\s]+):(?P<port>[0-9]+)$")
_FORMS = "tcp://HOST:PORT (vLLM connects, kvops binds), tcp://*:PORT (vLLM binds, kvops connects) or ipc:///ABSOLUTE/PATH"


@dataclass(frozen=True)
class EventSource:
    endpoint: str  # exactly the string given to vLLM's --kv-events-config "endpoint"
    replay_endpoint: str | None = None  # its "replay_endpoint": a ROUTER vLLM binds
    topic: str = ""


def _is_vllm_bind(endpoint: str) -> bool:
    """vLLM's own test (ZmqEventPublisher._is_bind_endpoint), character for character."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _check(endpoint: str, what: str) -> None:
    """ValueError naming what is wrong with one endpoint and the forms that work."""
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise ValueError(f"the KV events {what} is empty: give {_FORMS}")
    if endpoint.startswith("inproc://"):
        raise ValueError(f"the KV events {what} {endpoint!r} is inproc://, which only reaches sockets in the same "
                         f"process, and vLLM publishes from its engine-core process: use ipc:// or tcp:// "
                         f"(give {_FORMS})")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError(f"the KV events {what} {endpoint!r} needs an absolute path after ipc:// "
                             f"(ipc:///run/kvops/vllm.kv): vLLM and kvops run in different directories")
        if len(path.encode()) > IPC_PATH_MAX:
            raise ValueError(f"the KV events {what} {endpoint!r} has a path of {len(path.encode())} bytes; a unix "
                             f"socket path is at most {IPC_PATH_MAX}: choose a shorter one (under /tmp or /run)")
        return
    match = _TCP.match(endpoint)
    if match is None:
        hint = (" (write an IPv6 address in brackets: tcp://[::1]:5557)" if endpoint.startswith("tcp://")
                and endpoint.count(":") > 2 else "")
        raise ValueError(f"the KV events {what} {endpoint!r} is not one kvops can read{hint}: give {_FORMS}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"the KV events {what} {endpoint!r} has port {port}: give a port from 1 to 65535 (vLLM "
                         f"binds tcp://*:0 on a port only its log tells, so kvops cannot follow it)")
    if match["host"] in ("0.0.0.0", "[0:0:0:0:0:0:0:0]") and not _is_vllm_bind(endpoint):
        raise ValueError(f"the KV events {what} {endpoint!r}: vLLM connects to 0.0.0.0 and kvops would have to bind "
                         f"every interface, offering the token stream to the network: give tcp://*:{port} for "
                         f"vLLM to bind, or tcp://127.0.0.1:{port} for kvops to bind on loopback")


def parse_source(endpoint: str, replay: str | None = None, topic: str = "") -> EventSource:
    """An EventSource, or ValueError saying what is wrong with the endpoint (or replay endpoint)."""
    _check(endpoint, "endpoint")
    if replay is not None:
        _check(replay, "replay endpoint")
    if not isinstance(topic, str):
        raise ValueError(f"the KV events topic must be a string, got {topic!r}")
    return EventSource(endpoint=endpoint, replay_endpoint=replay, topic=topic)


def socket_role(endpoint: str) -> SocketRole:
    """How kvops's SUB socket opens `endpoint`: "connect" where vLLM binds, "bind" where vLLM connects."""
    _check(endpoint, "endpoint")
    return "connect" if _is_vllm_bind(endpoint) else "bind"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_wildcard(host: str) -> bool:
    return host in ("*", "[::]", "[0:0:0:0:0:0:0:0]")


def socket_address(endpoint: str, connect_host: str = "127.0.0.1") -> str:
    """The address kvops's socket uses for `endpoint`: itself, or a wildcard's host swapped for `connect_host`
    (the engine's host), since one cannot connect to a wildcard."""
    _check(endpoint, "endpoint")
    match = _TCP.match(endpoint)
    if match is None or not _is_wildcard(match["host"]):
        return endpoint
    return f"tcp://{_bracketed(connect_host)}:{match['port']}"


def needs_ipv6(address: str) -> bool:
    """ZMQ refuses an IPv6 literal unless the socket has IPV6 set."""
    return address.startswith("tcp://[")
