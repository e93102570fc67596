"""API keys → tenants: the keys a server accepts, each naming the tenant its requests are accounted to.

Keys come from a file (`--api-keys-file`) and/or an environment variable (`--api-keys-env`); see
docs/server.md, "Authentication and tenants". The engine and the tenant gateway read them the same way. Only
the sha256 digest of each key is kept, so a key cannot leak through a server's state, a repr, a log line or
`/stats`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvops.schema.errors import ConfigError
from kvops.tenancy.names import tenant_name_problem

MIN_KEY_LENGTH = 16
_KEY = re.compile(r"[!-~]+")  # printable ASCII, no space: the last field of a key-file line
KEY_EXAMPLE = "generate one with: openssl rand -hex 24"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """The configured keys as (sha256 digest, tenant) pairs; never the keys themselves."""

    _entries: tuple[tuple[bytes, str], ...]

    def tenant_for(self, key: str) -> str | None:
        """The tenant of `key`, or None. Compares against every entry in constant time per entry, without an
        early exit, so the answer's timing does not tell how close a guess came or which entry matched."""
        digest, found = _digest(key), None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(tenant for _, tenant in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys, {len(self.tenants)} tenants)"


def _entry(tenant: str, key: str, where: str, fix: str) -> tuple[str, str]:
    """Check one (tenant, key) pair; ConfigError says where it is and what to write instead."""
    if not tenant:
        raise ConfigError(f"{where}: the tenant name is empty; {fix}")
    problem = tenant_name_problem(tenant)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    if not _KEY.fullmatch(key) or len(key) < MIN_KEY_LENGTH:
        # The key itself is not shown: it may be a real one with a typo.
        raise ConfigError(f"{where}: the key of tenant {tenant!r} must be at least {MIN_KEY_LENGTH} printable ASCII "
                          f"characters without spaces ({KEY_EXAMPLE})")
    return tenant, key


def parse_key_file(text: str, path: str) -> list[tuple[str, str, str]]:
    """Lines `TENANT KEY` (the key is the last whitespace-separated field); `#` at the start of a line is a
    comment. Returns (tenant, key, where) triples."""
    fix = "write one `TENANT KEY` per line, e.g. `team-a 3f9c...` (lines starting with # are comments)"
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path} line {number}"
        parts = stripped.rsplit(None, 1)
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected a tenant name and a key separated by a space; {fix}")
        entries.append((*_entry(parts[0].strip(), parts[1], where, fix), where))
    return entries


def parse_key_env(value: str, name: str) -> list[tuple[str, str, str]]:
    """`tenant=key,tenant2=key2` (spaces around entries ignored). Returns (tenant, key, where) triples."""
    fix = f"write {name}=tenant=key,tenant2=key2"
    entries = []
    for number, item in enumerate(value.split(","), start=1):
        item = item.strip()
        where = f"${name} entry {number}"
        if not item:
            raise ConfigError(f"{where} is empty; {fix}")
        tenant, sep, key = item.partition("=")
        if not sep:
            raise ConfigError(f"{where}: expected tenant=key; {fix}")
        entries.append((*_entry(tenant.strip(), key.strip(), where, fix), where))
    return entries


def _build(entries: Iterable[tuple[str, str, str]]) -> ApiKeys:
    seen: dict[bytes, str] = {}
    pairs = []
    for tenant, key, where in entries:
        digest = _digest(key)
        if digest in seen:
            raise ConfigError(f"{where}: this key (tenant {tenant!r}) is already given at {seen[digest]}; every key "
                              f"must be unique, so that it names one tenant ({KEY_EXAMPLE})")
        seen[digest] = where
        pairs.append((digest, tenant))
    return ApiKeys(tuple(pairs))


def load_api_keys(path: str | None, env_name: str | None) -> ApiKeys | None:
    """The keys of `--api-keys-file` and `--api-keys-env` together; None when neither is set (trusted mode).
    ConfigError for a missing or unreadable file, an unset variable, a malformed entry or a duplicate key."""
    if not path and not env_name:
        return None
    entries: list[tuple[str, str, str]] = []
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"--api-keys-file {path}: no such file; create it with one `TENANT KEY` per line") \
                from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"--api-keys-file {path}: cannot be read ({reason}); make it a UTF-8 text file "
                              "readable by the engine's user") from None
        entries += parse_key_file(text, path)
    if env_name:
        value = os.environ.get(env_name)
        if not value:
            raise ConfigError(f"--api-keys-env {env_name}: the environment variable is not set or empty; set it to "
                              "tenant=key,tenant2=key2")
        entries += parse_key_env(value, env_name)
    if not entries:
        raise ConfigError(f"--api-keys-file {path}: no keys in it; write one `TENANT KEY` per line (an empty key "
                          "file would lock every client out)")
    return _build(entries)
