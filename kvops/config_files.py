"""Reading TOML config files and saying what is wrong with them in one line: shared by the supervisor's
config, the load generator's workload files and anything else a person writes by hand."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvops.schema.errors import ConfigError


def first_error(exc: ValidationError) -> str:
    """The first validation error as "key.path: what is wrong (got VALUE)"."""
    error = exc.errors()[0]
    where = location(error.get("loc", ()))
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = "unknown key"
    given = error.get("input")
    shown = f" (got {given!r})" if error.get("type") not in ("extra_forbidden", "missing") and not isinstance(
        given, dict | list) else ""
    return f"{where}: {message}{shown}" if where else f"{message}{shown}"


def location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a TOML key path: engines[0].args.block_size."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def read_toml(path: str | Path, what: str, example: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """A TOML file as a mapping; `error` names the file and, when it is missing, a file to start from."""
    file = Path(path)
    if not file.is_file():
        raise error(f"{path}: no such {what} ({example} is one to start from)")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None
