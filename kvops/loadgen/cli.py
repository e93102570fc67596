"""`kvops bench load`: one stream from flags or the streams of a TOML workload; a table per tenant."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvops.loadgen.runner import start_load
from kvops.loadgen.spec import DEFAULT_MODEL, LoadError, LoadSpec, load_workload

# Flags of the single command-line stream named like the Stream field they set (--shared-prefix-tokens).
_STREAM_FLAGS = ("rate", "arrival", "concurrency", "shared_prefix_tokens", "prefix_groups", "noise", "tenant",
                 "unique", "max_requests")
_PROMPT_FLAGS = ("prompt_tokens", "prompt_dist", "prompt_low", "prompt_high", "prompt_median", "prompt_sigma",
                 "prompt_min", "prompt_max", "prompt_trace")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvops bench load",
        description="Send traffic to an engine over its OpenAI API: one stream from the flags, or the streams of a "
                    "TOML workload (docs/loadgen.md). Prints a table per tenant; --json writes the full report.",
    )
    p.add_argument("--url", required=True, help="the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", metavar="FILE.toml", help="streams from a workload file (then no stream flags)")
    one = p.add_argument_group("a single stream (without --workload)")
    one.add_argument("--rate", type=float, help="requests/s, open loop")
    one.add_argument("--arrival", choices=("poisson", "fixed"), help="arrivals of --rate (default: poisson)")
    one.add_argument("--concurrency", type=int, help="requests always in flight, closed loop")
    one.add_argument("--prompt-tokens", type=int, help="tokens of each prompt's unique part (default: 200)")
    one.add_argument("--prompt-dist", choices=("fixed", "uniform", "lognormal", "trace"))
    one.add_argument("--prompt-low", type=int, help="uniform: shortest")
    one.add_argument("--prompt-high", type=int, help="uniform: longest")
    one.add_argument("--prompt-median", type=float, help="lognormal: median tokens")
    one.add_argument("--prompt-sigma", type=float, help="lognormal: sigma of the log")
    one.add_argument("--prompt-min", type=int, help="clamp")
    one.add_argument("--prompt-max", type=int, help="clamp")
    one.add_argument("--prompt-trace", metavar="FILE.jsonl", help="trace: replay prompt_tokens (and arrival_s, "
                     "output_tokens, tenant) from a JSONL file")
    one.add_argument("--output-tokens", type=int, help="tokens generated per request (default: 32)")
    one.add_argument("--shared-prefix-tokens", type=int, help="each prompt starts with one of --prefix-groups "
                     "fixed prefixes of this many tokens")
    one.add_argument("--prefix-groups", type=int)
    one.add_argument("--noise", type=float, help="probability of whitespace noise on a prompt")
    one.add_argument("--tenant", help="the OpenAI user field (default: default)")
    one.add_argument("--unique", action="store_true", default=None, help="no shared prefix, new text every time")
    one.add_argument("--max-requests", type=int)
    p.add_argument("--duration", type=float, help="seconds (default: the workload's, else 30)")
    p.add_argument("--seed", type=int, help="default: the workload's, else 0")
    p.add_argument("--model", help=f"model name sent (default: the workload's, else {DEFAULT_MODEL})")
    p.add_argument("--timeout", type=float, help="per request, seconds (default: 120)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    """The LoadSpec the command line describes; LoadError names the file or the flag."""
    from kvops.config_files import first_error

    overrides = {k: v for k, v in (("duration_s", args.duration), ("seed", args.seed), ("model", args.model),
                                   ("timeout_s", args.timeout)) if v is not None}
    stream_flags = [k for k in (*_STREAM_FLAGS, *_PROMPT_FLAGS, "output_tokens") if getattr(args, k) is not None]
    if args.workload:
        if stream_flags:
            flag = "--" + stream_flags[0].replace("_", "-")
            raise LoadError(f"{flag} describes a single stream and cannot be combined with --workload: put it in "
                            f"{args.workload}")
        spec = load_workload(args.workload)
        data = {**spec.model_dump(exclude_unset=True), **overrides}
        context = {"base_dir": Path(args.workload).parent}
    else:
        data = {"streams": [_stream_from_args(args)], **overrides}
        context = {"base_dir": Path.cwd()}
    try:
        return LoadSpec.model_validate(data, context=context)
    except ValidationError as exc:
        message = first_error(exc)
        if args.workload:
            raise LoadError(f"{args.workload} with the command line's overrides: {message}") from None
        raise LoadError(f"command line: {_as_flags(message)}") from None


_FLAG_OF = {"duration_s": "--duration", "timeout_s": "--timeout", "seed": "--seed", "model": "--model",
            "output": "--output-tokens", "output.value": "--output-tokens", "prompt.value": "--prompt-tokens",
            **{f"prompt.{name}": f"--prompt-{name}" for name in ("dist", "low", "high", "median", "sigma", "min",
                                                                 "max", "trace")},
            **{name: "--" + name.replace("_", "-") for name in _STREAM_FLAGS}}


def _as_flags(message: str) -> str:
    """An error about the command line's single stream, with its location given as the flag."""
    where, sep, what = message.partition(": ")
    where = where.removeprefix("streams[0]").removeprefix(".")
    if not sep:
        return message
    if not where:
        return what
    return f"{_FLAG_OF.get(where, where)}: {what}"


def _stream_from_args(args: argparse.Namespace) -> dict[str, Any]:
    stream: dict[str, Any] = {name: getattr(args, name) for name in _STREAM_FLAGS if getattr(args, name) is not None}
    prompt: dict[str, Any] = {}
    if args.prompt_tokens is not None:
        prompt = {"dist": "fixed", "value": args.prompt_tokens}
    if args.prompt_dist is not None:
        prompt["dist"] = args.prompt_dist
    for name in ("low", "high", "median", "sigma", "min", "max", "trace"):
        if getattr(args, f"prompt_{name}") is not None:
            prompt[name] = getattr(args, f"prompt_{name}")
    if prompt:
        stream["prompt"] = prompt
    if args.output_tokens is not None:
        stream["output"] = args.output_tokens
    return stream


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        run = start_load(args.url, spec, progress=not args.no_progress)
    except LoadError as exc:
        print(f"kvops bench load: error: {exc}", file=sys.stderr)
        return 2
    interrupted = False
    try:
        report = run.join()
    except KeyboardInterrupt:  # stop, and still report what was measured
        interrupted = True
        run.stop()
        report = run.join()
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.model_dump_json(indent=2) + "\n")
        print(f"[kvops load] report written to {path}", file=sys.stderr)
    print(report.table(), flush=True)
    if interrupted:
        return 130
    return 0 if report.total.requests_finished else 1


if __name__ == "__main__":
    raise SystemExit(main())
