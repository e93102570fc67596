"""kvops.example.toml runs as shipped: `--check-config` and `kvops run` say the same about its unset webhook
secret (a warning, that receiver disabled), and the supervisor starts, brings its managed engine up and raises the
disabled receiver as a diagnosis of its own. Only the ports and the state folder are moved out of the way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from kvops.processes import free_port
from tests.helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "kvops.example.toml"
WARNING = ("warning: {source}: alerting.receivers[0] ('oncall-webhook'): hmac_secret_env names the environment "
           "variable 'KVOPS_WEBHOOK_SECRET', which is not set")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("KVOPS_WEBHOOK_SECRET", "SHARED_GPU_1_TOKEN")}


def test_the_example_config_runs_as_shipped(tmp_path: Path):
    listen = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "kvops", "run", "--config", str(EXAMPLE), "--listen", listen,
            "--state-dir", str(tmp_path / "state"), "--set", f"engines.0.port={free_port()}"]
    check = subprocess.run([*args, "--check-config"], capture_output=True, text=True, env=_env(), timeout=60)
    assert check.returncode == 0, check.stderr
    assert WARNING.format(source=EXAMPLE) in check.stderr
    assert "2 alert receiver(s) (1 disabled: oncall-webhook)" in check.stdout

    log = tmp_path / "run.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=_env())
    api = f"http://{listen}"
    try:
        def default_up() -> bool:
            engines = {e["name"]: e for e in httpx.get(f"{api}/api/engines", timeout=5).json()}
            return engines["default"]["up"]

        wait_for("the example's managed engine to be up", default_up, 180, (proc,), every_s=0.5)
        engines = httpx.get(f"{api}/api/engines", timeout=5).json()
        assert [e["name"] for e in engines] == ["default", "shared-gpu-1", "vllm-a100"]
        diagnoses = httpx.get(f"{api}/api/diagnoses", timeout=5).json()
        disabled = [d for d in diagnoses if d["rule"] == "alert_receiver_disabled"]
        assert [d["subject"] for d in disabled] == ["oncall-webhook"], diagnoses
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    assert code == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert WARNING.format(source=EXAMPLE) in text  # word for word what --check-config said
    assert "Traceback" not in text
