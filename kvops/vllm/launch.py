"""The command line and environment that start vLLM's OpenAI server, and stopping it.

What it takes on a CPU (docs/vllm.md): `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script can fail on missing package metadata), VLLM_USE_AOT_COMPILE=0 (AOT compile fails on the CPU build),
and the KV budget as VLLM_CPU_KVCACHE_SPACE in GiB, since --gpu-memory-utilization means nothing there.

KV cache events (`--kv-events-config`, vLLM 0.9.0 and later): a vLLM kvops starts publishes them on two unix
sockets of its own (docs/vllm.md, "KV cache events"), never on a TCP port: vLLM binds ipc:// endpoints, and a
unix socket stays on the host, where a wildcard TCP bind would offer the token stream to the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvops.processes import process_tree, start_in_own_session
from kvops.vllm.install import neutral_cwd


@dataclass
class ServerSettings:
    model: Path
    served_model_name: str | None = "smollm2"  # None (also dtype, max_model_len): vLLM's default
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str | None = "float32"
    max_model_len: int | None = 2048
    # The KV budget on CPU: VLLM_CPU_KVCACHE_SPACE takes whole GiB only (vLLM 0.32 parses it with int()) and
    # overrides --kv-cache-memory-bytes when set, so a budget under 1 GiB goes as bytes and the variable is unset.
    kv_cache_space_gib: int = 1
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None  # None: vLLM's default (128 on CPU)
    enable_prefix_caching: bool | None = None  # None: vLLM's default (on)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_argv(python: Path | str, settings: ServerSettings) -> list[str]:
    model = Path(settings.model).expanduser()
    # A local directory goes absolute (vLLM runs in neutral_cwd); anything else is a model id for vLLM to fetch.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model.resolve()) if model.exists() else str(settings.model)]
    for flag, value in (("--served-model-name", settings.served_model_name), ("--dtype", settings.dtype),
                        ("--max-model-len", settings.max_model_len)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--host", settings.host, "--port", str(settings.port)]
    if settings.block_size is not None:
        argv += ["--block-size", str(settings.block_size)]
    if settings.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching")
    if settings.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    if settings.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(settings.max_num_seqs)]
    if settings.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    return argv + list(settings.extra_args)


def server_env(settings: ServerSettings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables vLLM needs on a CPU, on top of `base` (the current environment by default)."""
    env = dict(os.environ if base is None else base)
    if settings.kv_cache_memory_bytes is None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
    else:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["VLLM_USE_AOT_COMPILE"] = "0"
    return env


def start_server(python: Path | str, settings: ServerSettings, log: IO[bytes],
                 env_overrides: Mapping[str, str | None] | None = None) -> subprocess.Popen[bytes]:
    """Start vLLM in its own process group (its engine core is a child process), logging to `log`;
    `env_overrides` sets variables on top of server_env (None unsets one, e.g. OMP_NUM_THREADS).
    Wait for it with kvops.processes.wait_healthy.

    It runs in an empty directory (neutral_cwd): the model path must be absolute.
    """
    env = server_env(settings)
    for key, value in (env_overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return start_in_own_session(server_argv(python, settings), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=neutral_cwd())


def stop_server(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left, so no engine-core child outlives it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    # Children that ignored SIGTERM, or survived their parent.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# ---------------------------------------------------------------- KV cache events

KV_EVENTS_KEY = "kv_events_config"  # the [engines.args] key of --kv-events-config
KV_EVENTS_FLAG = "--kv-events-config"
KV_EVENTS_SINCE = "0.9.0"  # the first release with vllm/distributed/kv_events.py and the flag
KV_EVENTS_TOPIC = "kv"  # the topic of the events of a vLLM kvops starts
VLLM_DEFAULT_ENDPOINT = "tcp://*:5557"  # KVEventsConfig's defaults: what vLLM does with a config that omits them
VLLM_DEFAULT_TOPIC = ""
# sun_path is 108 bytes on Linux, one of them the terminating NUL.
IPC_PATH_MAX = 107


@dataclass(frozen=True)
class KvEventsEndpoints:
    """Where a vLLM publishes its KV events: the strings of its --kv-events-config."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


def kv_events_config(endpoints: KvEventsEndpoints) -> dict[str, Any]:
    """The --kv-events-config of a vLLM kvops starts (a dict: kvops.vllm.flags writes it as JSON)."""
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoints.endpoint}
    if endpoints.replay_endpoint is not None:
        config["replay_endpoint"] = endpoints.replay_endpoint
    config["topic"] = endpoints.topic
    return config


def _enabled(value: Any) -> bool:
    # vLLM parses the JSON into a pydantic dataclass, which takes "true"/"True" strings too (LMCache's docs use them).
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return value is True


def read_kv_events_config(value: Any) -> KvEventsEndpoints | None:
    """A --kv-events-config given in [engines.args] (a table, or its JSON text): where that vLLM publishes, with
    vLLM's defaults for what it omits; None when it publishes nothing (events off, or the null publisher).
    ValueError says what is wrong with it."""
    config = value
    if isinstance(value, str):
        try:
            config = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{KV_EVENTS_KEY} is not JSON ({exc}): write it as a table, e.g. {KV_EVENTS_KEY} = "
                             "{ enable_kv_cache_events = true, endpoint = \"ipc:///run/kvops/vllm.kv\" }") from None
    if not isinstance(config, dict):
        raise ValueError(f"{KV_EVENTS_KEY} must be a table (vLLM's KVEventsConfig), got {value!r}")
    if not _enabled(config.get("enable_kv_cache_events", False)):
        return None
    if config.get("publisher", "zmq") not in ("zmq", None):
        return None  # "null": vLLM keeps its events to itself
    replay = config.get("replay_endpoint")
    return KvEventsEndpoints(str(config.get("endpoint", VLLM_DEFAULT_ENDPOINT)),
                             None if replay is None else str(replay), str(config.get("topic", VLLM_DEFAULT_TOPIC)))


def _short_socket_dirs() -> list[Path]:
    """Folders for sockets whose state-dir path is too long, shortest-lived first: the user's runtime dir (a
    tmpfs only they can enter), then a folder of their own under the temp dir, then under /tmp."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        found.append(Path(runtime) / "kvops")
    found.append(Path(tempfile.gettempdir()) / f"kvops-{os.getuid()}")
    found.append(Path("/tmp") / f"kvops-{os.getuid()}")
    return found


def managed_event_endpoints(state_dir: Path, engine: str) -> KvEventsEndpoints:
    """The ipc:// endpoints of the vLLM kvops runs as `engine`: <state dir>/<engine>.kv and .kv-replay, or,
    where that path is longer than a unix socket's, the same under a short folder, named by a hash of the state
    dir and engine (so two supervisors with long state dirs do not share sockets)."""
    base = Path(state_dir).expanduser().absolute() / engine
    if len(f"{base}.kv-replay".encode()) > IPC_PATH_MAX:
        key = hashlib.sha256(f"{base}".encode()).hexdigest()[:16]
        base = next((folder / key for folder in _short_socket_dirs()
                     if len(f"{folder / key}.kv-replay".encode()) <= IPC_PATH_MAX), Path("/tmp") / key)
    return KvEventsEndpoints(f"ipc://{base}.kv", f"ipc://{base}.kv-replay", KV_EVENTS_TOPIC)


def prepare_ipc_dirs(endpoints: KvEventsEndpoints) -> None:
    """Create the folders of ipc:// endpoints (only the user may enter a new one). A folder under a shared temp
    dir that someone else owns is refused: they could read the token stream or stand in for the publisher."""
    for endpoint in (endpoints.endpoint, endpoints.replay_endpoint):
        if endpoint is None or not endpoint.startswith("ipc://"):
            continue
        folder = Path(endpoint[len("ipc://"):]).parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = folder.stat().st_uid
        if owner != os.getuid():
            raise PermissionError(f"{folder} (for the KV events socket {endpoint}) belongs to uid {owner}, not to "
                                  f"this user: remove it, or set the supervisor's state_dir to a shorter path")


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (vLLM's API server plus its engine core)."""
    import psutil

    total = 0
    for proc in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total
