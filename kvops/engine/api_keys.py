"""API keys → tenants, and the rule for tenant names.

Keys come from a file (`--api-keys-file`) and/or an environment variable (`--api-keys-env`); see
docs/server.md, "Authentication and tenants". Only the sha256 digest of each key is kept, so a key
cannot leak through the engine's state, a repr, a log line or `/stats`. Torch-free, like the config.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvops.engine.errors import InvalidRequestError
from kvops.schema.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from kvops.engine.config import EngineConfig

# Printable ASCII without leading or trailing space: '/', ' ', '?', '#', '%' are allowed (URLs quote them),
# control characters (forged log lines), non-ASCII look-alikes and unbounded lengths are not.
TENANT_NAME_RULE = "1 to 64 printable ASCII characters, not starting or ending with a space"
_TENANT_NAME = re.compile(r"[!-~](?:[ -~]{0,62}[!-~])?")
MIN_KEY_LENGTH = 16
_KEY = re.compile(r"[!-~]+")  # printable ASCII, no space: the last field of a key-file line
KEY_EXAMPLE = "generate one with: openssl rand -hex 24"


class AuthenticationError(EngineError):
    """A request without a valid API key; the server answers 401 with this message."""


def tenant_name_problem(name: str) -> str | None:
    """Why `name` is not a valid tenant name, or None when it is."""
    if _TENANT_NAME.fullmatch(name):
        return None
    shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
    return f"tenant name {shown} is not valid: use {TENANT_NAME_RULE}"


def check_client_tenant(name: str, field: str) -> str:
    """A tenant named by a request (`user`, `X-Tenant`, an admin path): the name, or a 400 naming the field."""
    problem = tenant_name_problem(name)
    if problem is not None:
        raise InvalidRequestError(f"{field}: {problem}", field)
    return name


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


class TenantResolver:
    """Which tenant a request is accounted to.

    No keys: the client names it (`user`, else `X-Tenant`, else `default`), the trusted mode. With keys: a valid
    `Authorization: Bearer <key>` is required and its tenant is the request's; `user` and `X-Tenant` are ignored,
    unless `trust_client_tenant` lets an authenticated client (a gateway) name the tenant itself.
    """

    def __init__(self, keys: ApiKeys | None, trust_client_tenant: bool = False) -> None:
        self.keys = keys
        self.trust_client_tenant = trust_client_tenant or keys is None

    @classmethod
    def from_config(cls, config: EngineConfig) -> TenantResolver:
        """The engine's keys (`--api-keys-file`, `--api-keys-env`); ConfigError for a bad key file."""
        return cls(load_api_keys(config.api_keys_file, config.api_keys_env), config.trust_client_tenant)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key's tenant (None without keys); AuthenticationError for a missing or unknown key."""
        if self.keys is None:
            return None
        send = "send 'Authorization: Bearer <API key>' with the key you were given for your tenant"
        if not authorization or not authorization.startswith("Bearer "):
            raise AuthenticationError(f"this engine needs an API key: {send}")
        tenant = self.keys.tenant_for(authorization.removeprefix("Bearer ").strip())
        if tenant is None:
            raise AuthenticationError(f"the API key is not valid: {send}")
        return tenant

    def tenant(self, key_tenant: str | None, user: str | None, header: str | None) -> str:
        """The request's tenant, given what `authenticate` returned; a 400 for a client-named tenant that breaks
        the name rule. Ignored client names are not checked: they cannot change anything."""
        if self.trust_client_tenant:
            if user:
                return check_client_tenant(user, "user")
            if header:
                return check_client_tenant(header, "X-Tenant")
        return key_tenant or "default"


def admin_refusal(admin_token: str | None, authorization: str | None) -> tuple[int, str, str] | None:
    """Why an admin request is refused, as (HTTP status, message, error type), or None when its token is right.
    The admin token is apart from the API keys: a tenant's key never opens /admin."""
    if admin_token is None:
        return 404, "admin endpoints are disabled: start the engine with --admin-token", "not_found_error"
    if not authorization or not authorization.startswith("Bearer "):
        return 401, "admin endpoints need 'Authorization: Bearer <admin token>'", "authentication_error"
    if not hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), admin_token.encode()):
        return 403, "the admin token is wrong", "permission_error"
    return None
