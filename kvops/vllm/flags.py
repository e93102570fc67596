"""A managed vLLM's settings: the engine's `[engines.args]` to vLLM's command line, a restart fix's kvops
setting names to vLLM's, and the flags the installed vLLM really has.

`[engines.args]` of a `kind = "vllm"` engine holds vLLM's own flags in snake_case (`block_size = 32` is
`--block-size 32`, `enable_prefix_caching = false` is `--no-enable-prefix-caching`), plus kvops's
`kv_cache_memory` (a size such as "512MiB": `--kv-cache-memory-bytes`, the KV budget on CPU and GPU alike).
The flags an installation has are asked from its interpreter once (vLLM's own argument parser, in a
subprocess) and cached per installation, so `kvops run --check-config` refuses a flag vLLM does not have.
(The model export and the cache folder are imported where used: the config imports this module, and
watching an engine must not import torch.)
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.engine.config import parse_bytes
from kvops.schema.errors import ConfigError
from kvops.vllm.install import SETUP_COMMAND, default_venv_dir, neutral_cwd, venv_python
from kvops.vllm.launch import ServerSettings

KV_MEMORY_KEY = "kv_cache_memory"  # kvops's name for the KV budget, in bytes or a size string
# Given as the engine's own keys (host, port), never as vLLM flags.
SPEC_KEYS = ("host", "port")
# ServerSettings fields that [engines.args] sets directly; the rest become extra flags.
_SETTINGS_FIELDS = ("served_model_name", "dtype", "max_model_len", "block_size", "enable_prefix_caching",
                    "max_num_seqs", "max_num_batched_tokens")
# What the supervisor polls a vLLM for at every poll (two a second in an operator's setup): the lines of those
# polls in vLLM's access log would crowd out everything else in the engine log. --disable-access-log-for-endpoints
# (0.32 has it, older vLLMs do not) leaves them out and keeps every other request's line; the user's own setting of
# it, or of disable_uvicorn_access_log, wins. The supervisor's log forwarding drops what is left of its own polls.
ACCESS_LOG_KEY = "disable_access_log_for_endpoints"
ACCESS_LOG_FLAG = "--disable-access-log-for-endpoints"
ACCESS_LOG_OFF_KEY = "disable_uvicorn_access_log"  # vLLM's switch for the whole access log
POLLED_ENDPOINTS = ("/health", "/metrics")
LOCATE_TIMEOUT_S = 60.0
FLAGS_TIMEOUT_S = 300.0  # imports vLLM: 10-30 s on a small CPU
_MARK = "KVOPS_VLLM_FLAGS "
_LOCATE_CODE = (
    "import importlib.util, json, os; s = importlib.util.find_spec('vllm'); "
    f"print({_MARK!r} + json.dumps(None if s is None or not s.origin else "
    "[s.origin, os.stat(os.path.dirname(s.origin)).st_mtime]))"
)
_FLAGS_CODE = f"""
import importlib, json, vllm
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
for name in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
    try:
        module = importlib.import_module(name)
        break
    except ImportError:
        continue
parser = module.make_arg_parser(FlexibleArgumentParser())
flags = sorted({{o for a in parser._actions for o in a.option_strings if o.startswith("--")}})
print({_MARK!r} + json.dumps({{"version": vllm.__version__, "flags": flags}}))
"""


def _kv_cache_dtype(value: Any) -> str:
    """kvops's KV dtypes as vLLM's: auto and fp8 exist in both; int8 and int4 are kvops's own."""
    if value in ("auto", "fp8"):
        return str(value)
    raise ValueError(f"vLLM has no {value} KV cache: its --kv-cache-dtype takes auto or fp8 (and fp8 variants)")


# A restart fix's params (kvops setting names) -> the vLLM args key and the value in vLLM's terms. kvops settings
# not listed (kv_cache_dtype_skip_layers, normalize_prompts, swap_space, ...) have no vLLM flag.
FIX_SETTINGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "block_size": ("block_size", int),
    "enable_prefix_caching": ("enable_prefix_caching", bool),
    "kv_cache_dtype": ("kv_cache_dtype", _kv_cache_dtype),
    "max_num_seqs": ("max_num_seqs", int),
    "max_num_batched_tokens": ("max_num_batched_tokens", int),
    "max_model_len": ("max_model_len", int),
    "kv_cache_memory": (KV_MEMORY_KEY, parse_bytes),
    "dtype": ("dtype", str),
}


def args_for_fix(args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's args with a restart fix's settings applied as vLLM's; ValueError for one vLLM lacks."""
    new = dict(args)
    for name, value in params.items():
        if name not in FIX_SETTINGS:
            raise ValueError(f"the fix sets {name}, a kvops engine setting vLLM has no flag for; "
                             f"vLLM takes: {', '.join(FIX_SETTINGS)}")
        key, convert = FIX_SETTINGS[name]
        new[key] = convert(value)
    return new


def check_args(args: dict[str, Any]) -> dict[str, Any]:
    """What can be checked without asking vLLM: snake_case names, values a flag can take, the KV budget."""
    for key, value in args.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a vLLM flag in snake_case (write e.g. block_size for --block-size)")
        if key in SPEC_KEYS:
            raise ValueError(f"{key} is the engine's own key: write it beside name, not in [engines.args]")
        if not isinstance(value, str | int | float | bool | list | dict):
            raise ValueError(f"{key}: {value!r} cannot be given as a flag")
    if KV_MEMORY_KEY in args:
        try:
            parse_bytes(args[KV_MEMORY_KEY])
        except ConfigError as exc:
            raise ValueError(f"{KV_MEMORY_KEY}: {exc}") from None
    return args


def with_drain(args: Mapping[str, Any], drain_timeout_s: float) -> dict[str, Any]:
    """The args a managed vLLM starts with: the engine's drain timeout as vLLM's --shutdown-timeout (how long
    SIGTERM waits for in-flight requests) unless the args set it."""
    return {"shutdown_timeout": max(0, round(drain_timeout_s)), **args}


def without_poll_logs(args: Mapping[str, Any], installed: InstalledFlags | None) -> dict[str, Any]:
    """The args with vLLM's access log of the endpoints kvops polls turned off, where this vLLM has the flag
    (`installed`: its flags, None when kvops cannot tell, and then nothing is added) and the args say nothing of
    the access log."""
    if installed is None or ACCESS_LOG_FLAG not in installed.flags or ACCESS_LOG_KEY in args \
            or ACCESS_LOG_OFF_KEY in args:
        return dict(args)
    return {**args, ACCESS_LOG_KEY: ",".join(POLLED_ENDPOINTS)}


def cli_flags(args: Mapping[str, Any]) -> list[str]:
    """snake_case settings as vLLM flags: true -> --x, false -> --no-x, lists -> --x a b, dicts as JSON."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def server_settings(args: Mapping[str, Any], host: str, port: int) -> ServerSettings:
    """[engines.args] as the launch settings (kvops.vllm.launch builds the command line and environment).

    Without `model`, the shipped model exported by `kvops vllm setup`, served as smollm2 in float32 with a
    2048-token context; with one, vLLM's own defaults for what is not given."""
    from kvops.vllm.model_export import default_model_dir

    rest = dict(args)
    model = rest.pop("model", None)
    settings = ServerSettings(model=default_model_dir(), host=host, port=port)
    if model is not None:
        settings = ServerSettings(model=Path(str(model)).expanduser(), host=host, port=port,
                                  served_model_name=None, dtype=None, max_model_len=None)
    for name in _SETTINGS_FIELDS:
        if name in rest:
            setattr(settings, name, rest.pop(name))
    if KV_MEMORY_KEY in rest:
        settings.kv_cache_memory_bytes = parse_bytes(rest.pop(KV_MEMORY_KEY))
    if "kv_cache_memory_bytes" in rest:
        settings.kv_cache_memory_bytes = int(rest.pop("kv_cache_memory_bytes"))
    settings.extra_args = cli_flags(rest)
    return settings


# ---------------------------------------------------------------- the installation


def resolve_python(configured: str | None) -> Path:
    """The interpreter with vLLM: the configured one; else the one running kvops when it has vLLM; else the
    `kvops vllm setup` venv when it exists; else the one running kvops (which then reports vLLM missing)."""
    if configured:
        return Path(configured).expanduser()
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    setup_python = venv_python(default_venv_dir())
    return setup_python if setup_python.exists() else Path(sys.executable)


def _ask(python: Path, code: str, timeout_s: float) -> Any:
    """Run `code` with `python` in a neutral directory; the JSON it printed after the mark, or ConfigError."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=env, check=False, cwd=neutral_cwd())
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{python} did not answer within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise ConfigError(f"{python} does not run ({exc.strerror or exc}): set python to an interpreter that "
                          f"has vLLM, or run `{SETUP_COMMAND}`") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    raise ConfigError(f"{python} could not be asked about vLLM: {last[0].strip()}")


def require_vllm(python: Path, args: Mapping[str, Any]) -> tuple[str, float]:
    """Fast (no `import vllm`): where vLLM is for `python`, or ConfigError naming `kvops vllm setup`; also
    that the default model is exported when no model is configured."""
    from kvops.vllm.model_export import default_model_dir, export_is_complete

    found = _ask(python, _LOCATE_CODE, LOCATE_TIMEOUT_S)
    if not found:
        raise ConfigError(f"vLLM is not installed for {python}: run `{SETUP_COMMAND}`, or set the engine's python "
                          "to an interpreter that has vLLM")
    if "model" not in args and not export_is_complete(default_model_dir()):
        raise ConfigError(f"the shipped model is not exported for vLLM ({default_model_dir()}): run "
                          f"`{SETUP_COMMAND}`, or set args.model")
    return str(found[0]), float(found[1])


@dataclass(frozen=True)
class InstalledFlags:
    version: str
    flags: frozenset[str]

    def problem(self, args: Mapping[str, Any]) -> str | None:
        """The first setting this vLLM has no flag for, with the closest ones; None when all are known."""
        for key, value in args.items():
            if key == KV_MEMORY_KEY:
                continue
            flag = "--" + key.replace("_", "-")
            wanted = "--no-" + flag[2:] if value is False else flag
            if wanted in self.flags:
                continue
            if flag in self.flags:
                return f"args.{key}: vLLM {self.version}'s {flag} is a switch without a {wanted} form: drop it"
            close = difflib.get_close_matches(flag, sorted(self.flags), n=3, cutoff=0.6)
            hint = f"closest: {', '.join(close)}" if close else "see `python -m vllm.entrypoints.openai.api_server " \
                                                               "--help=all`"
            return f"args.{key}: vLLM {self.version} has no flag {flag}; {hint}"
        return None


def installed_flags(python: Path, location: tuple[str, float], cache_dir: Path | None = None,
                    say: Callable[[str], None] = lambda text: None) -> InstalledFlags:
    """The flags of the vLLM at `location` (from require_vllm), asked once per installation and cached."""
    from kvops.engine.weights import cache_root

    key = hashlib.sha256(json.dumps([str(python), *location]).encode()).hexdigest()[:16]
    path = (cache_dir or cache_root()) / "vllm-flags" / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        say(f"asking the vLLM of {python} for its flags (once per installation: up to a minute)")
        data = _ask(python, _FLAGS_CODE, FLAGS_TIMEOUT_S)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    return InstalledFlags(str(data["version"]), frozenset(data["flags"]))
