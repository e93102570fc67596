"""The step-loop thread builds the engine it steps (`kvops engine serve`), and a failed build reaches the caller."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from kvops.engine.serving.app import build_app
from kvops.engine.serving.async_engine import AsyncEngine
from kvops.schema.errors import ConfigError


def test_the_engine_is_built_on_the_thread_that_steps_it(llm):
    built_on: list[int] = []

    def build():
        built_on.append(threading.get_ident())
        return llm.engine

    runner = AsyncEngine.built_on_loop_thread(build)
    assert runner.engine is llm.engine and built_on and built_on[0] != threading.get_ident()
    with TestClient(build_app(runner)) as http:  # the app starts this runner's loop, on that same thread
        assert http.get("/health").status_code == 200
        assert runner.call(threading.get_ident).result(timeout=30) == built_on[0]
        answer = http.post("/v1/completions", json={"model": llm.engine.model_name, "prompt": [1, 2, 3],
                                                        "max_tokens": 3, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    assert not runner.alive


def test_a_failed_build_is_raised_to_the_caller_and_its_thread_ends():
    def build():
        raise ConfigError("weight 'model.norm.weight' is missing from the checkpoint")

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=r"model\.norm\.weight"):
        AsyncEngine.built_on_loop_thread(build)
    for thread in threading.enumerate():
        if thread.ident not in before and thread.name == "kvops-step-loop":
            thread.join(5)
            assert not thread.is_alive()


def test_a_runner_stopped_before_it_started_ends_its_thread(llm):
    runner = AsyncEngine.built_on_loop_thread(lambda: llm.engine)
    runner.stop(timeout=10)
    assert not runner._thread.is_alive()
