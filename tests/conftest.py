"""Shared fixtures: the default model is converted once per machine and loaded per engine."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.logs import configure_logging
from tests.helpers.alerting_outbox import Receiver

configure_logging("info", json_logs=False)

# `pytest -n 2`: the clock tests on one worker with the machine to themselves, the rest beside them in the background.
pytest_plugins = ["tests.helpers.clock_worker"]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain how a hash table works.",
    "List three uses of copper.",
    "How do I reverse a string in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and German.",
    "Describe a cat to someone who has never seen one, in detail, covering its fur, eyes and habits.",
    "What is 17 times 23?",
    "Write a limerick about a programmer.",
    "Name the planets of the solar system.",
    "How does a refrigerator keep food cold?",
]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The compiled step (kvops/engine/compiled.py) is built before any test starts an engine: a first build takes
    ~20-30 s here, and engines started later, in this process or as `kvops engine serve`, load it in
    milliseconds instead of waiting for it within their tests' start timeouts."""
    from kvops.engine.compiled import compile_step

    compile_step("auto", torch.device("cpu"), "torch")


@pytest.fixture(scope="session")
def llm() -> LLM:
    """One engine on the default model for tests that only read its behaviour."""
    return LLM(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024))


@pytest.fixture(scope="session")
def chat_prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


# transformers' greedy outputs for `chat_prompts`, recorded (about a minute of CPU per session otherwise) and keyed
# by what decides them: the GGUF's bytes and the versions of transformers, torch and gguf that convert and run it.
# A session whose key or prompts differ computes them afresh; KVOPS_RECORD_REFERENCE=1 rewrites the file, and
# tests/test_engine_correctness.py's slow test checks the recording against a live run.
HF_GREEDY_FILE = Path(__file__).parent / "fixtures" / "hf-greedy" / "smollm2-chat-64.json"


def hf_reference_key() -> dict[str, str]:
    from importlib.metadata import version

    import transformers

    from kvops.engine.weights import default_gguf_path

    return {"gguf_sha256": hashlib.sha256(default_gguf_path().read_bytes()).hexdigest(),
            "transformers": transformers.__version__, "torch": torch.__version__, "gguf": version("gguf")}


def hf_greedy_live(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy `generate`, one prompt at a time, fp32, 64 new tokens: the ground truth."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, top_p=None, top_k=None,
                                 temperature=None, pad_token_id=model.config.eos_token_id)
            generated = out[0, len(ids):].tolist()
            eos = model.generation_config.eos_token_id
            eos_ids = set(eos if isinstance(eos, list) else [eos])
            # generate pads nothing for a single prompt, but keep only up to and including the first EOS
            for i, token in enumerate(generated):
                if token in eos_ids:
                    generated = generated[: i + 1]
                    break
            outputs.append(generated)
    del model
    return outputs


@pytest.fixture(scope="session")
def hf_greedy(llm: LLM, chat_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy outputs for chat_prompts: the recording when it was made by the same model and
    versions from the same prompts, else a live run (HF_GREEDY_FILE says why)."""
    key = hf_reference_key()
    if HF_GREEDY_FILE.is_file() and not os.environ.get("KVOPS_RECORD_REFERENCE"):
        stored = json.loads(HF_GREEDY_FILE.read_text())
        if stored["key"] == key and stored["prompts"] == chat_prompts:
            return stored["outputs"]
        print(f"\n{HF_GREEDY_FILE.name} is from another model, version or prompt set: transformers runs live")
    outputs = hf_greedy_live(llm, chat_prompts)
    if os.environ.get("KVOPS_RECORD_REFERENCE"):
        HF_GREEDY_FILE.parent.mkdir(parents=True, exist_ok=True)
        HF_GREEDY_FILE.write_text(json.dumps({"key": key, "prompts": chat_prompts, "outputs": outputs}) + "\n")
    return outputs


# Session-wide servers stop right after the last selected test that uses them, not at the end of the session: they
# would sit idle through the files after it, and test_scenarios stops any child process it finds before each
# scenario, so that nothing competes with a scenario's timing.
_LAST_USER: dict[str, str] = {}  # fixture name -> node id of the last selected test that uses it
_STOPS: dict[str, Callable[[], None]] = {}  # fixture name -> how to stop its server, while it runs
SHARED_SERVERS = ("shared_engine", "shared_vllm")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what will not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in SHARED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    for name, nodeid in _LAST_USER.items():
        if nodeid == item.nodeid and name in _STOPS:
            _STOPS.pop(name)()


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One `kvops engine serve` (64 MiB of KV, max_model_len 1024, no tokens) for the tests that only send it
    requests and read their own answers (test_bench's compare, test_loadgen), instead of one per file: an engine
    start is ~5-8 s of both CPUs here. Yields its base URL."""
    from kvops.processes import free_port, start_engine_server, wait_healthy

    port = free_port()
    log_path = tmp_path_factory.mktemp("shared-engine") / "engine.log"
    with log_path.open("wb") as log:  # a file, not a pipe nobody reads: a long session's log would fill a pipe
        proc = start_engine_server(port, ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"], log)

    def stop() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    _STOPS["shared_engine"] = stop
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180, "the shared engine", log_path)
        yield url
    finally:
        if _STOPS.pop("shared_engine", None):
            stop()


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The one real vLLM of a test session (a vLLM start costs about a minute here): managed by a supervisor in
    this process with its API on a real port (test_vllm_managed kills and restarts it), and watched as a server kvops
    did not start by test_vllm_live, which runs first (files run in name order) and needs its first block size, 128.
    The vLLM tests skip themselves (marker `real`) before asking for it when `kvops vllm setup` has not run."""
    from kvops.processes import free_port
    from kvops.supervisor.config import parse_config
    from tests.helpers.waiting import wait_for
    from tests.test_vllm_managed import VLLM_PYTHON, Served

    state = tmp_path_factory.mktemp("state")
    config = parse_config({
        "supervisor": {"listen": f"127.0.0.1:{free_port()}", "state_dir": str(state), "poll_interval_s": 0.5,
                       "verify_after_s": 20, "alert_warmup_s": 0},
        "engines": [{"name": "vllm", "kind": "vllm", "python": str(VLLM_PYTHON),
                     # Eager (no torch.compile): each of the session's three or four vLLM starts takes ~15 s less
                     # here, for ~10% slower steps; what the tests check does not depend on vLLM's speed.
                     # 96 MiB: 17 blocks of 128 tokens (a max_model_len request needs 8). A pool this small is
                     # what lets test_vllm_live_events show thrash with a few 4-block prompts, ~6000 prompt tokens
                     # (with 256 MiB, 45 blocks, it took 20 prompts of 896 tokens: ~150 s at ~120 tokens/s).
                     "args": {"block_size": 128, "kv_cache_memory": "96MiB", "max_model_len": 1024,
                              "enforce_eager": True},
                     "restart": {"initial_backoff_s": 0.5}}],
        # test_vllm_live_events's loads last seconds to a minute, not the ten minutes the default windows read: its
        # thrash load (two rounds of 6 prompts of 4 blocks, ~6000 tokens) takes ~50 s on a machine whose vLLM-CPU
        # prefills ~120 tokens/s, and the window must hold both rounds; they store ~50 blocks, not the default floor
        # of 100. Not longer: the rule reads nothing until its snapshots cover half the window, and with 200 s (for
        # the old load of 20 prompts of 896 tokens) a fast machine ended the load before vLLM had been up 100 s.
        "rules": {"prefix_cache_thrash": {"settings": {"window_s": 80, "min_stores": 40}},
                  "low_hit_cause": {"settings": {"window_s": 30}}},
    }, "test")
    served = Served(config, "secret")

    def stop() -> None:
        served.sup.stop()
        served.server.should_exit = True
        served.thread.join(timeout=10)

    served.thread.start()
    started = time.monotonic()
    # vLLM's development endpoints (POST /reset_prefix_cache, which test_vllm_live_events calls): for this test
    # vLLM only, never one kvops starts for a user. vLLM inherits the environment of this process.
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    served.sup.start()
    _STOPS["shared_vllm"] = stop
    try:
        try:
            wait_for("vLLM up", lambda: served.engine()["up"], 420, every_s=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {served.engine()}") from None
        print(f"\nvLLM managed by kvops: up in {time.monotonic() - started:.0f} s")
        yield served
    finally:
        if _STOPS.pop("shared_vllm", None):
            stop()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    """Webhook receivers a test starts (it appends them); stopped after the test."""
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.stop()


@pytest.fixture
def utc() -> Iterator[None]:
    """The local time zone is UTC for the test: screens that show clock times compare equal on any machine."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        os.environ.pop("TZ")
    else:
        os.environ["TZ"] = before
    time.tzset()
