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

from kvops.vllm.install import default_venv_dir, venv_python

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SIDECAR = DEPLOY / "kubernetes" / "vllm-with-kvops.yaml"
MANAGED = DEPLOY / "kubernetes" / "vllm-managed-by-kvops.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile.vllm-kvops"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
VLLM_PYTHON = venv_python(default_venv_dir())
# The gateway's keys as the Secret would hold them: at least 16 characters each, or the gateway would refuse them
# (and `kvops run --check-config` does first).
POD_ENV = {"POD_IP": "10.1.2.3", "KVOPS_ADMIN_TOKEN": "t",
           "GATEWAY_API_KEYS": "team-a=team-a-key-0123456789,team-b=team-b-key-0123456789"}


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


def _container_args(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's args as Kubernetes gives them: $(VAR) replaced by the container's environment."""
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]


def _check_config(path: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`kvops run --check-config` on the manifest's ConfigMap, with its kvops container's args."""
    docs = _documents(path)
    config = tmp_path / "kvops.toml"
    config.write_text(next(iter(docs["ConfigMap"]["data"].values())))
    [kvops] = [c for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"] if c["name"] == "kvops"]
    args = _container_args(kvops, POD_ENV)
    args[args.index("--config") + 1] = str(config)
    return subprocess.run([sys.executable, "-m", "kvops", *args, "--check-config", *extra], capture_output=True,
                          text=True, env={**os.environ, **POD_ENV}, timeout=120)


def test_the_sidecars_config_is_accepted_by_kvops_run_check_config(tmp_path: Path):
    done = _check_config(SIDECAR, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM at {VLLM_PYTHON}: `kvops vllm setup` makes one (check-"
                                                      "config asks the vLLM that kvops would start for its flags)")
def test_the_managed_vllms_config_is_accepted_by_kvops_run_check_config(tmp_path: Path):
    # In the image kvops runs from vLLM's Python; here that is the venv of `kvops vllm setup`.
    done = _check_config(MANAGED, tmp_path, f'--set=engines.0.python="{VLLM_PYTHON}"')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vllm (managed)" in done.stdout
    refused = _check_config(MANAGED, tmp_path, f'--set=engines.0.python="{VLLM_PYTHON}"',
                            "--set=engines.0.args.max_num_seqz=8")
    assert refused.returncode == 2 and "no flag --max-num-seqz" in refused.stderr


def test_the_managed_vllms_parts_agree():
    docs = _documents(MANAGED)
    config = tomllib.loads(docs["ConfigMap"]["data"]["kvops.toml"])
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    [kvops] = pod["containers"]  # one container: kvops starts vLLM in it
    ports = {p["name"]: p["containerPort"] for p in kvops["ports"]}
    [engine] = config["engines"]
    assert engine["kind"] == "vllm" and "url" not in engine and engine["host"] == "127.0.0.1"
    assert _port(config["supervisor"]["listen"]) == ports["kvops"]
    assert _port(engine["gateway"]["listen"]) == ports["gateway"]
    targets = {p["name"]: p["targetPort"] for p in docs["Service"]["spec"]["ports"]}
    assert targets["http"] == "gateway" and set(targets.values()) <= set(ports)
    assert "nvidia.com/gpu" in kvops["resources"]["limits"]
    # kvops drains vLLM on SIGTERM: the pod must wait longer than the drain
    assert pod["terminationGracePeriodSeconds"] > engine["drain_timeout_s"]
    mounted = {m["mountPath"]: m["name"] for m in kvops["volumeMounts"]}
    assert config["supervisor"]["state_dir"] in mounted
    names = {e["name"] for e in kvops["env"]}
    assert {config["supervisor"]["admin_token_env"], engine["gateway"]["api_keys_env"]} <= names
    # its image (deploy/docker/Dockerfile.vllm-kvops): vLLM's own, kvops installed into its Python, kvops the
    # entrypoint the args follow
    dockerfile = [line for line in DOCKERFILE.read_text().splitlines() if line and not line.startswith("#")]
    assert dockerfile[0].startswith("FROM vllm/vllm-openai")
    assert any("pip install" in line and "/opt/kvops" in line for line in dockerfile)
    assert dockerfile[-1] == 'ENTRYPOINT ["kvops"]' and kvops["args"][0] == "run"


@pytest.mark.parametrize("path", [SIDECAR, MANAGED], ids=lambda p: p.name)
def test_each_supervisor_exports_its_pod_address_for_the_fleet_view(path: Path):
    """`kvops top --prometheus` drills down to kvops_supervisor_info's supervisor_url: the pod's IP, not 0.0.0.0."""
    [kvops] = [c for c in _documents(path)["Deployment"]["spec"]["template"]["spec"]["containers"]
               if c["name"] == "kvops"]
    pod_ip = next(e for e in kvops["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in kvops["ports"]}
    assert f'--set=supervisor.external_url="http://10.1.2.3:{ports["kvops"]}"' in _container_args(kvops, POD_ENV)


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


@pytest.mark.parametrize("path", [SIDECAR, MANAGED], ids=lambda p: p.name)
def test_prometheus_keeps_the_port_each_manifest_names(path: Path):
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "kvops-supervisor"  # the job `kvops top --prometheus` lists even when never up
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    pod = _documents(path)["Deployment"]["spec"]["template"]["spec"]
    names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
    assert [n for n in names if re.fullmatch(keep["regex"], n)] == ["kvops"]
    # the supervisor's own supervisor_url label must reach Prometheus as it is (not renamed exported_...)
    assert not any(r.get("target_label") == "supervisor_url" for r in job["relabel_configs"])


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
