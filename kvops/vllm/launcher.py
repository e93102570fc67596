"""vLLM's OpenAI server as an engine `kvops run` manages: its command line from the configured interpreter,
KV cache events on and the access log of kvops's own polls off where the vLLM has those flags, and a restart
fix's settings as its flags. It takes plain values (the supervisor's registry, kvops.supervisor.launchers, reads
them from the engine's config entry) and sits beside the process tools it uses; it has no kvops admin API, so it
gets no admin token."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from kvops.processes import Launch
from kvops.schema.errors import ConfigError
from kvops.vllm.flags import (
    InstalledFlags,
    args_for_fix,
    installed_flags,
    require_vllm,
    resolve_python,
    server_settings,
    with_drain,
    without_poll_logs,
)
from kvops.vllm.install import neutral_cwd
from kvops.vllm.launch import (
    KV_EVENTS_FLAG,
    KV_EVENTS_KEY,
    KvEventsEndpoints,
    kv_events_config,
    prepare_ipc_dirs,
    server_argv,
    server_env,
)

log = logging.getLogger(__name__)

PROMPT_DETAILS_KEY = "enable_prompt_tokens_details"  # --enable-prompt-tokens-details, on for a vLLM kvops starts
# vLLM compiles at its first start (~4 min on 2 cores), ~1 min later.
HEALTH_TIMEOUT_S = 600.0


class VllmLauncher:
    """One managed vLLM: `name` (for the log), the interpreter that has it, its configured args, and where kvops
    reads its KV events (None: off)."""

    tail_streams = ("stdout", "stderr")  # vLLM logs to stdout

    def __init__(self, name: str, python: str | None, args: Mapping[str, Any],
                 kv_events: KvEventsEndpoints | None) -> None:
        self.name = name
        self.python: Path = resolve_python(python)
        self.configured = dict(args)
        self.kv_events = kv_events
        # Whether this vLLM has KV cache events: asked at the first start that needs it (None: not yet).
        self.kv_events_supported: bool | None = None

    def publishes_kv_events(self) -> bool:
        """Whether this vLLM publishes the events kvops reads: not when they are off, or when kvops would add them
        and this vLLM is older than the events. A --kv-events-config of the user's own (args.kv_events_config)
        goes to vLLM as given, whatever its version."""
        if self.kv_events is None:
            return False
        if KV_EVENTS_KEY in self.configured:
            return True
        if self.kv_events_supported is None:
            flags = self.installed
            self.kv_events_supported = flags is None or KV_EVENTS_FLAG in flags.flags
            if not self.kv_events_supported:
                log.warning("the vLLM of %s has no --kv-events-config (vLLM 0.9.0 and later): engine %s runs without "
                            "KV cache events, so kvops draws no block map for it", self.python, self.name)
        return self.kv_events_supported

    def launch(self, host: str, port: int, args: Mapping[str, Any], drain_timeout_s: float,
               admin_token: str) -> Launch:
        # Cached prompt tokens in each response's usage (prompt_tokens_details), which a gateway in front of this
        # vLLM counts per tenant (docs/gateway.md); `enable_prompt_tokens_details = false` in the args turns it off.
        args = without_poll_logs({PROMPT_DETAILS_KEY: True, **args}, self.installed)
        settings = server_settings(with_drain(self._with_events(args), drain_timeout_s), host, port)
        env = {**server_env(settings), "PYTHONUNBUFFERED": "1"}
        return Launch(server_argv(self.python, settings), env, str(neutral_cwd()))

    @cached_property
    def installed(self) -> InstalledFlags | None:
        """The flags of this vLLM (asked once per installation, then cached on disk); None when kvops cannot tell,
        and then it adds none of the flags it would only pass to a vLLM that has them."""
        return ask_flags(self.python, self.configured)

    def _with_events(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The args with kvops's --kv-events-config added where kvops reads the events and the args do not say."""
        endpoints = self.kv_events
        if endpoints is None or not self.publishes_kv_events() or KV_EVENTS_KEY in args:
            return dict(args)
        try:
            prepare_ipc_dirs(endpoints)
        except OSError as exc:  # the engine still starts: kvops shows its event stream as stale
            log.warning("vLLM %s starts without KV cache events: %s", self.name, exc)
            return dict(args)
        return {**args, KV_EVENTS_KEY: kv_events_config(endpoints)}

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return args_for_fix(args, params)


def ask_flags(python: Path, args: Mapping[str, Any]) -> InstalledFlags | None:
    """The flags of the vLLM of `python` as `kvops run --check-config` reads them (asked once per installation,
    then cached); None, said in the log, when they cannot be read."""
    try:
        return installed_flags(python, require_vllm(python, args), say=log.info)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        log.info("cannot read the flags of the vLLM of %s (%s): assuming it has KV cache events, and leaving its "
                 "access log as vLLM sets it", python, exc)
        return None


def preflight(python: str | None, args: Mapping[str, Any], drain_timeout_s: float, flags: bool) -> None:
    """The engine's interpreter has vLLM and (flags) every setting in its args is a flag of that vLLM;
    ConfigError says what to do."""
    interpreter = resolve_python(python)
    location = require_vllm(interpreter, args)
    if flags:
        asked = installed_flags(interpreter, location, say=lambda text: print(text, file=sys.stderr, flush=True))
        problem = asked.problem(with_drain(args, drain_timeout_s))
        if problem:
            raise ConfigError(problem)
