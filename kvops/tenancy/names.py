"""The rule for tenant names, wherever one comes from: a key file, a request, an admin path, a gateway policy."""

from __future__ import annotations

import re

# Printable ASCII without leading or trailing space: '/', ' ', '?', '#', '%' are allowed (URLs quote them),
# control characters (forged log lines), non-ASCII look-alikes and unbounded lengths are not.
TENANT_NAME_RULE = "1 to 64 printable ASCII characters, not starting or ending with a space"
_TENANT_NAME = re.compile(r"[!-~](?:[ -~]{0,62}[!-~])?")


def tenant_name_problem(name: str) -> str | None:
    """Why `name` is not a valid tenant name, or None when it is."""
    if _TENANT_NAME.fullmatch(name):
        return None
    shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
    return f"tenant name {shown} is not valid: use {TENANT_NAME_RULE}"
