"""The deployment recipe's files (deploy/, docs/deployment.md) are checked, not just shown: valid YAML, the
sidecar's kvops config accepted by `kvops run --check-config`, and the parts that must agree with each other doing
so (ports, the KV events socket and its shared folder, the config file's path), and the Prometheus config accepted
by promtool where it is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SIDECAR = DEPLOY / "kubernetes" / "vllm-with-kvops.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"


def _documents(path: Path) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_yaml_with_a_kind_or_a_prometheus_config(path: Path):
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert documents, path
    for doc in documents:
        assert "kind" in doc or "scrape_configs" in doc, (path, list(doc))


def test_the_sidecars_config_is_accepted_by_kvops_run_check_config(tmp_path: Path):
    config = tmp_path / "kvops.toml"
    config.write_text(_documents(SIDECAR)["ConfigMap"]["data"]["kvops.toml"])
    env = {**os.environ, "KVOPS_ADMIN_TOKEN": "t", "GATEWAY_API_KEYS": "team-a=key-a,team-b=key-b"}
    done = subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(config), "--check-config"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout


def test_the_sidecars_parts_agree():
    docs = _documents(SIDECAR)
    config = tomllib.loads(docs["ConfigMap"]["data"]["kvops.toml"])
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    vllm, kvops = containers["vllm"], containers["kvops"]
    ports = {p["name"]: p["containerPort"] for p in kvops["ports"]}
    [engine] = config["engines"]
    # kvops listens where its container says, the gateway too, and the Service sends clients to the gateway.
    assert _port(config["supervisor"]["listen"]) == ports["kvops"]
    assert _port(engine["gateway"]["listen"]) == ports["gateway"]
    targets = {p["name"]: p["targetPort"] for p in docs["Service"]["spec"]["ports"]}
    assert set(targets.values()) <= set(ports) and targets["http"] == "gateway"
    # kvops reads the vLLM in the pod: its port, its events endpoint, a folder both containers mount.
    flags = dict((*arg.removeprefix("--").split("=", 1), "")[:2] for arg in vllm["args"])
    assert _port(engine["url"]) == int(flags["port"]) and flags["host"] == "127.0.0.1"
    events = yaml.safe_load(flags["kv-events-config"])
    assert (events["endpoint"], events["replay_endpoint"], events["topic"]) == (
        engine["events"], engine["events_replay"], engine["events_topic"])
    folder = str(Path(engine["events"].removeprefix("ipc://")).parent)
    mounted = {c: {m["mountPath"]: m["name"] for m in containers[c]["volumeMounts"]} for c in containers}
    assert mounted["vllm"][folder] == mounted["kvops"][folder]
    # the gateway's tenants need vLLM's cached-token counts in its usage answers
    assert "enable-prompt-tokens-details" in flags
    # `kvops run --config PATH`: PATH is the ConfigMap's key in the mounted config volume.
    args = kvops["args"]
    path = Path(args[args.index("--config") + 1])
    assert args[0] == "run" and path.name in docs["ConfigMap"]["data"]
    assert mounted["kvops"][str(path.parent)] == "config"
    # every secret the config names is in the container's environment
    names = {e["name"] for e in kvops["env"]}
    assert {config["supervisor"]["admin_token_env"], engine["gateway"]["api_keys_env"]} <= names
    assert config["supervisor"]["state_dir"] in mounted["kvops"]


def test_prometheus_keeps_the_port_the_sidecar_names_and_labels_its_supervisor():
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = config["scrape_configs"]
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    pod = _documents(SIDECAR)["Deployment"]["spec"]["template"]["spec"]
    names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
    assert [n for n in names if re.fullmatch(keep["regex"], n)] == ["kvops"]
    assert any(r.get("target_label") == "supervisor_url" for r in job["relabel_configs"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH (Debian's prometheus package)")
def test_promtool_accepts_the_prometheus_config(tmp_path: Path):
    text = PROMETHEUS.read_text().replace("/etc/prometheus/rules/kvops.rules.yml",
                                          str(ROOT / "alerts" / "kvops.rules.yml"))
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    if "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        # Debian builds Prometheus without Kubernetes service discovery: check everything else, the discovery
        # replaced by a static target.
        parsed = yaml.safe_load(text)
        for job in parsed["scrape_configs"]:
            job.pop("kubernetes_sd_configs")
            job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
        config.write_text(yaml.safe_dump(parsed))
        done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
