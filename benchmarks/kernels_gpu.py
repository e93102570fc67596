"""GPU benchmark for the Triton kernels: correctness against the torch reference, then paged decode
attention's effective bandwidth against the device's copy bandwidth and against SDPA on contiguous KV.

    python benchmarks/kernels_gpu.py [--quick] [--json kernels_gpu.json] [--max-gib 48]

Effective bandwidth = the KV bytes a decode step must read (K and V of every context token, scales
included) / its time. The target is at least 70% of the measured copy bandwidth at long contexts.
Without a CUDA device (or without triton) it says so and exits 0, so it is safe to run anywhere. The
measuring functions live in `kvops.bench.kernel_bench`, shared with `scripts/gpu-check`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from kvops import kernels
from kvops.bench.kernel_bench import (
    TARGET,
    Row,
    copy_bandwidth_gbs,
    correctness,
    decode_bandwidth,
    kv_gib,
    long_context_verdict,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", default="kernels_gpu.json", help="where to write the results")
    parser.add_argument("--max-gib", type=float, default=48.0, help="skip shapes whose KV exceeds this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing measured. Run it on a machine with a GPU.")
        return 0
    if not kernels.dispatch.triton_available():
        print("kernels_gpu: triton is not installed (pip install triton); nothing measured.")
        return 0
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}")
    checks = correctness()
    for c in checks:
        print(f"  {'ok ' if c.ok else 'BAD'} {c.op:24} {c.case:32} max err {c.max_abs_err:.2e}")
    failed = [c for c in checks if not c.ok]
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} ok")

    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    contexts = [1024, 8192, 32768, 131072] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072]
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 64]
    rows: list[Row] = []
    print(f"{'kind':5} {'batch':>5} {'context':>8} {'KV GiB':>7} {'ms':>8} {'GB/s':>7} {'of copy':>7} "
          f"{'SDPA ms':>8} {'SDPA GB/s':>9}")
    for kind in ("auto", "int8", "fp8", "int4"):
        for batch in batches if kind == "auto" else [16]:
            for context in contexts:
                gib = kv_gib(kind, batch, context)
                if gib * (2 if kind == "auto" else 1) > args.max_gib:
                    continue
                row = decode_bandwidth(kind, batch, context, copy_gbs)
                rows.append(row)
                sdpa = f"{row.sdpa_ms:8.3f} {row.sdpa_gbs:9.0f}" if row.sdpa_ms is not None else ""
                print(f"{kind:5} {batch:5} {context:8} {row.kv_gib:7.2f} {row.kernel_ms:8.3f} {row.kernel_gbs:7.0f} "
                      f"{row.of_copy:7.0%} {sdpa}")
    verdict = long_context_verdict(rows)
    met = verdict.met
    print(f"target: >= {TARGET:.0%} of copy bandwidth at long contexts: {'met' if met else 'NOT met'} "
          f"(best {verdict.best:.0%}, worst {verdict.worst:.0%})")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs, "target_met": met,
                   "checks": [asdict(c) for c in checks], "decode": [asdict(r) for r in rows]}, f, indent=2)
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
