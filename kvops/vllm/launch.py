"""The command line and environment that start vLLM's OpenAI server, and stopping it.

What it takes on a CPU (docs/vllm.md): `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script can fail on missing package metadata), VLLM_USE_AOT_COMPILE=0 (AOT compile fails on the CPU build),
and the KV budget as VLLM_CPU_KVCACHE_SPACE in GiB, since --gpu-memory-utilization means nothing there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

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
    env["PYTHONSAFEPATH"] = "1"  # see neutral_cwd: the caller's directory must not shadow vLLM's imports
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
    return subprocess.Popen(server_argv(python, settings), env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=neutral_cwd())


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


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (vLLM's API server plus its engine core)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total
