"""`scripts/gpu-check`: the kvops engine and kernels on one CUDA device, in one command and one JSON file.

    scripts/gpu-check [--out gpu-check.json] [--device cuda:0]
    scripts/gpu-check --device cpu --smoke          # the script's own plumbing, tiny sizes, no GPU needed

Four parts (`kvops.bench.gpu_check_parts`): greedy parity with transformers (float32 exact, bfloat16's
divergence), throughput at 16 concurrent chats against transformers' batched `generate`, the Triton decode
kernel's bandwidth against the device's copy bandwidth, and the int8 / fp8 / int4 KV error. Each part runs
in a child process under its own time budget, so a crash, a CUDA fault or a hang costs that part only; the
budgets keep the whole run under 8 minutes. The JSON records the machine, the command, and per part its
status, wall time, result and error. Exit status: 0 when every part ran, 1 when one failed or was cut
short, 2 when the command cannot run here (no CUDA device, bad arguments).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from kvops.processes import start_in_own_session

PROG = "scripts/gpu-check"
PART_ORDER = ("parity", "throughput", "bandwidth", "kv_quant")
# Seconds per part, start-up included (torch, CUDA context, model load, Triton compiles; the first part
# may also convert the GGUF weights once, about 20 s). They sum to 450 s; TOTAL_S bounds the whole run
# under 8 minutes with the machine facts and process starts.
BUDGETS_S = {"parity": 135, "throughput": 90, "bandwidth": 75, "kv_quant": 150}
TOTAL_S = 465.0
MIN_PART_S = 15.0  # less time than this left: the part is skipped, not started to be killed at once
LOG_TAIL_CHARS = 4000


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check.json", help="the JSON report (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu with --smoke (default: cuda)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (2 prompts x 4 tokens, 2 chats x 4 tokens, one quantized KV dtype, no "
                             "bandwidth part): checks the script itself, measures nothing")
    parser.add_argument("--parts", default=",".join(PART_ORDER),
                        help=f"comma-separated subset of {','.join(PART_ORDER)} (default: all)")
    parser.add_argument("--child", choices=PART_ORDER, help=argparse.SUPPRESS)  # internal: run one part
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PART_ORDER]
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(PART_ORDER)}")
    if args.device == "cpu" and not args.smoke and not args.child:
        parser.error("--device cpu needs --smoke: the full sizes are meant for a GPU")
    if not args.child and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist")
    return args


def cuda_problem(device: str) -> str | None:
    """Why `device` cannot be used here, in one line, or None. Imports torch."""
    import torch

    if device == "cpu":
        return None
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        return f"{PROG}: --device {device!r}: use cuda, cuda:N, or cpu with --smoke"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            build = f"torch {torch.__version__} is a CPU build"
        else:
            hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
            build = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no device: no "
                     "NVIDIA driver" + (f", or CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None
                                        else ""))
        return (f"{PROG}: no CUDA device is visible to torch ({build}): run it on a machine with an NVIDIA GPU "
                "(or --device cpu --smoke to check the script itself)")
    count = torch.cuda.device_count()
    if device.startswith("cuda:") and int(device[5:]) >= count:
        return f"{PROG}: --device {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py or no driver library: the report says null rather than failing
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def machine_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "device": device, "gpu": None, "gpu_memory_bytes": None, "gpu_memory_gib": None,
        "compute_capability": None, "multiprocessors": None, "driver": _driver_version() if device != "cpu" else None,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cudnn": None, "triton": _version("triton"),
        "transformers": _version("transformers"), "python": platform.python_version(), "platform": platform.platform(),
        "hostname": platform.node(), "cpu_count": os.cpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "kvops_commit": _git_commit(),
        # TF32 matmuls would break float32 parity for both systems alike; torch's default is off.
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    if device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device))
        facts.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory),
                     gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                     cudnn=torch.backends.cudnn.version())
    return facts


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: a reader (or a killed writer) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _child_env(device: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":  # kv_quant.measure's engines take --device auto: hide any GPU from a CPU check
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_part(name: str, args: argparse.Namespace, budget_s: float, workdir: Path) -> dict[str, Any]:
    """One part in a child process, killed (its whole process group) at `budget_s`."""
    out, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    command = [sys.executable, "-m", "kvops.bench.gpu_check", "--child", name, "--child-out", str(out),
               "--device", args.device, *(["--smoke"] if args.smoke else [])]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        child = start_in_own_session(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(args.device))
        returncode: int | None = None
        try:
            returncode = child.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # past its budget, or this process is being stopped (Ctrl-C): leave nothing on the device
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    wall = round(time.monotonic() - started, 1)
    record = _read_json(out) or {}
    entry: dict[str, Any] = {"status": record.get("status", "crashed"), "wall_s": wall, "budget_s": budget_s,
                             "error": record.get("error"), "result": record.get("result")}
    if returncode is None:
        entry.update(status="timeout", error=f"cut short at its budget of {budget_s:.0f} s; result holds what it "
                                             "had finished")
    elif entry["status"] in ("partial", "crashed"):  # died without saying why: a signal, the OOM killer, abort()
        entry.update(status="crashed", error=f"the child process exited with status {returncode} without a result")
    if entry["status"] != "ok":
        entry["traceback"] = record.get("traceback")
        entry["log_tail"] = log_path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
    return entry


def child_main(args: argparse.Namespace) -> int:
    """Runs one part and writes {status, result, error, traceback} to --child-out, saving partial results."""
    import torch

    from kvops.bench.gpu_check_parts import FULL, PARTS, SMOKE, PartContext
    from kvops.bench.report import configure_logging

    configure_logging()
    if args.device == "cpu":  # the CPU smoke runs in CI beside other work, where 2+ torch threads collapse
        torch.set_num_threads(1)
    out = Path(args.child_out)
    device = torch.device(args.device)
    if device.type == "cuda":
        # The parts' own helpers (kernel_bench, kv_quant's engines on --device auto) say plain "cuda": the
        # current device, which must be the one under test.
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    ctx = PartContext(device, SMOKE if args.smoke else FULL,
                      lambda partial: _write_json(out, {"status": "partial", "result": partial}))
    try:
        result = PARTS[args.child](ctx)
    except Exception as exc:
        partial = (_read_json(out) or {}).get("result")
        _write_json(out, {"status": "error", "error": f"{type(exc).__name__}: {exc}", "result": partial,
                          "traceback": traceback.format_exc()})
        return 1
    _write_json(out, {"status": "ok", "result": result})
    return 0


def summarize(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of the parts that produced them (None where a part did not)."""
    def result(name: str) -> dict[str, Any]:
        entry = parts.get(name) or {}
        return (entry.get("result") or {}) if entry.get("status") == "ok" else {}

    parity, throughput, bandwidth, kv = (result(n) for n in PART_ORDER)
    fp32, bf16 = parity.get("float32") or {}, parity.get("bfloat16") or {}
    target = bandwidth.get("target") or {}
    return {
        "float32_parity_all_matched": fp32.get("all_matched"),
        "bfloat16_mean_match_fraction": bf16.get("mean_match_fraction"),
        "bfloat16_earliest_first_diff": bf16.get("earliest_first_diff"),
        "throughput_dtype": throughput.get("dtype"),
        "throughput_ratio_vs_transformers": throughput.get("ratio"),
        "copy_gbs": bandwidth.get("copy_gbs"),
        "decode_best_of_copy": target.get("best"), "decode_worst_of_copy": target.get("worst"),
        "decode_target_met": target.get("met"),
        "kv_quant": {v["variant"]: {"greedy_agreement": v.get("greedy_agreement", 1.0),
                                    "min_layer_cosine": v.get("min_layer_cosine"),
                                    "perplexity_change": v.get("perplexity_change", 0.0)}
                     for v in kv.get("variants", [])},
    }


def _deliberate_skip(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if name not in args.parts:
        return {"status": "skipped", "reason": "not in --parts"}
    if name == "bandwidth" and args.smoke:
        return {"status": "skipped", "reason": "--smoke: the Triton bandwidth part needs a CUDA device and full sizes"}
    return None


def _announce(name: str, entry: dict[str, Any]) -> None:
    error = f": {entry['error']}" if entry["error"] else ""
    print(f"{PROG}: {name}: {entry['status']} in {entry['wall_s']:.1f} s{error}", file=sys.stderr, flush=True)


def run_in_turn(args: argparse.Namespace, report: dict[str, Any], workdir: Path, started: float) -> None:
    """One part after another (measurements must not share the device), each within its budget and what is
    left of the total; the report is rewritten after each, so a run killed from outside keeps what it did."""
    for name in PART_ORDER:
        left = TOTAL_S - (time.monotonic() - started)
        entry = _deliberate_skip(name, args)
        if entry is None and left < MIN_PART_S:
            entry = {"status": "skipped", "reason": f"only {left:.0f} s of the {TOTAL_S:.0f} s total left"}
        if entry is None:
            print(f"{PROG}: {name} (budget {min(BUDGETS_S[name], left):.0f} s) ...", file=sys.stderr, flush=True)
            entry = run_part(name, args, min(BUDGETS_S[name], left), workdir)
            _announce(name, entry)
        report["parts"][name] = entry
        _write_json(Path(args.out), report)


def run_together(args: argparse.Namespace, report: dict[str, Any], workdir: Path) -> None:
    """--smoke measures nothing, so its parts need not take turns: run at once they take the longest part's
    time rather than the sum (it runs in CI)."""
    skipped = {name: _deliberate_skip(name, args) for name in PART_ORDER}
    todo = [name for name in PART_ORDER if skipped[name] is None]
    print(f"{PROG}: --smoke: {', '.join(todo)} at once ...", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        futures = {name: pool.submit(run_part, name, args, BUDGETS_S[name], workdir) for name in todo}
    for name in PART_ORDER:
        entry = skipped[name] or futures[name].result()
        if name in futures:
            _announce(name, entry)
        report["parts"][name] = entry


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the 8-minute bound counts from here, torch's import included
    args = _parse(argv)
    if args.child:
        return child_main(args)
    problem = cuda_problem(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    out = Path(args.out)
    report: dict[str, Any] = {
        "tool": PROG, "schema": 1, "date": _now(), "finished": None,
        "command": shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)]),
        "smoke": args.smoke, "machine": machine_facts(args.device),
        "budget_s": {"total": TOTAL_S, **BUDGETS_S}, "wall_s": None, "all_parts_ran": None, "summary": None,
        "parts": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if args.smoke:
            run_together(args, report, Path(tmp))
        else:
            run_in_turn(args, report, Path(tmp), started)
        _write_json(out, report)
    deliberate = ("not in --parts", "--smoke")
    report["all_parts_ran"] = all(e["status"] == "ok" or e.get("reason", "").startswith(deliberate)
                                  for e in report["parts"].values())
    report["summary"] = summarize(report["parts"])
    report["wall_s"], report["finished"] = round(time.monotonic() - started, 1), _now()
    _write_json(out, report)
    print(f"{PROG}: wrote {out} ({report['wall_s']:.0f} s); "
          f"{'every part ran' if report['all_parts_ran'] else 'NOT every part ran'}", file=sys.stderr)
    return 0 if report["all_parts_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
