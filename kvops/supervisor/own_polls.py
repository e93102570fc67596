"""The access-log lines of the supervisor's own polls of an engine it manages, which its log forwarding drops.

A uvicorn server (vLLM) logs every request: with the supervisor reading /metrics twice a second, those lines were
all an operator saw of the engine's log. A vLLM that has --disable-access-log-for-endpoints is started with it
(kvops.vllm.flags); for one that has not, the forwarding drops a line when it is uvicorn's access-log line of a GET
of a path the supervisor polls, sent from one of this process's own connections to the engine: the client address
in the line is the local end of a TCP connection this process holds to the engine's port. A client's requests,
and another process's GET /metrics (a Prometheus), stay in the log.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from kvops.vllm.flags import POLLED_ENDPOINTS

# What the supervisor asks an engine for (kvops.watching, kvops.adapters.engine_client): the endpoints it polls, a
# vLLM's model list (once per client) and a kvops engine's /stats.
OWN_POLL_PATHS = frozenset({*POLLED_ENDPOINTS, "/v1/models", "/stats"})
# uvicorn's access-log format, `%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s`:
# `INFO:     127.0.0.1:38996 - "GET /metrics HTTP/1.1" 200 OK`
_ACCESS_LINE = re.compile(r'^[A-Z]+:\s+(?P<client>\S+):(?P<port>\d+) - "(?P<method>[A-Z]+) (?P<target>\S+) '
                          r'HTTP/[\d.]+" \d{3}\b')

Address = tuple[str, int]


@dataclass(frozen=True)
class AccessLine:
    client: Address
    method: str
    path: str  # without the query


def access_line(line: str) -> AccessLine | None:
    """The request of a uvicorn access-log line; None for any other line."""
    found = _ACCESS_LINE.match(line)
    if found is None:
        return None
    client = _plain(found["client"].removeprefix("[").removesuffix("]"))  # an IPv6 address may come in brackets
    return AccessLine((client, int(found["port"])), found["method"], found["target"].split("?", 1)[0])


def _plain(ip: str) -> str:
    # A dual-stack server sees an IPv4 client as ::ffff:127.0.0.1, where psutil gives the socket's 127.0.0.1.
    return ip.removeprefix("::ffff:")


def connections_to(port: int) -> set[Address]:
    """The local ends of this process's TCP connections to `port`: how an engine on that port sees this process's
    clients. Empty when they cannot be read."""
    process = psutil.Process()
    read = getattr(process, "net_connections", None) or process.connections  # psutil < 6 names it connections
    try:
        found = read("tcp")
    except (psutil.Error, OSError):
        return set()
    return {(_plain(c.laddr.ip), c.laddr.port) for c in found if c.raddr and c.raddr.port == port}


class OwnPolls:
    """Tells the access-log lines of this process's polls of the engine on `port`, and counts those it told.

    The local ends of this process's connections are read again only when a line's client is not among those last
    read (the supervisor keeps its connection alive, so that is about once per connection); the two latest readings
    are kept, so a line read after the connection that sent it was replaced still counts as this process's."""

    def __init__(self, port: int, connections: Callable[[int], set[Address]] = connections_to) -> None:
        self.port = port
        self.connections = connections
        self.hidden = 0  # lines told as this process's polls (and dropped by the forwarding)
        self._latest: set[Address] = set()
        self._before: set[Address] = set()

    def learn(self) -> None:
        """Read this process's connections to the engine now: before a client that made a request closes."""
        self._before, self._latest = self._latest, self.connections(self.port)

    def is_own_poll(self, line: str) -> bool:
        request = access_line(line)
        if request is None or request.method != "GET" or request.path not in OWN_POLL_PATHS:
            return False
        if request.client not in self._latest | self._before:
            self.learn()
            if request.client not in self._latest:
                return False
        self.hidden += 1
        return True
