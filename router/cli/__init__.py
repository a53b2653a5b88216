"""The ``kvgrid`` command line. What a command answers (tables, results, benchmark figures) goes to stdout;
diagnostics (warnings, retries, restarts) go through ``logging`` to stderr.

Each command's parser and handler live in a module by topic: ``demo`` (demo-model, generate), ``serve`` (serve,
config check, model-path), ``admin`` (scale, groups, advise), ``bench`` (bench ..., replay) and ``plan``; ``main`` here
builds the parser from them and turns every failure into one line."""

from __future__ import annotations

import argparse
import sys
import traceback

from common.logs import configure_logging
from router.cli.admin import add_advise, add_scale_and_groups
from router.cli.bench import add_bench, add_replay
from router.cli.demo import add_demo_model, add_generate
from router.cli.plan import add_plan
from router.cli.serve import (
    DEFAULT_TENANT,
    SECRET_FIELDS,
    SERVE_FLAGS,
    add_config,
    add_model_path,
    add_serve,
    is_loopback,
    redact_key,
    serve_config_from_args,
)
from router.cli.tenants import add_tenants_and_keys

__all__ = [
    "DEFAULT_TENANT",
    "SECRET_FIELDS",
    "SERVE_FLAGS",
    "build_parser",
    "configure_logging",
    "error_line",
    "is_loopback",
    "main",
    "redact_key",
    "serve_config_from_args",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgrid")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgrid", description="Multi-tenant LLM serving with exact prefix caching.")
    p.add_argument("--version", action="version", version=f"kvgrid {_version()}")
    p.add_argument("--debug", action="store_true", help="on an error, print its traceback too (kvgrid --debug CMD)")
    sub = p.add_subparsers(dest="command", required=True)
    add_demo_model(sub)
    add_config(sub)
    add_generate(sub)
    add_serve(sub)
    add_model_path(sub)
    add_scale_and_groups(sub)
    add_tenants_and_keys(sub)
    add_advise(sub)
    add_bench(sub)
    add_replay(sub)
    add_plan(sub)
    return p


def error_line(exc: BaseException, command: str = "") -> str:
    """What ``main`` prints after ``kvgrid: error:`` for an error a command raised: one line, its cause, then after
    ``; `` the fix: the message's own (kvgrid's errors say it), else one for the kind of error."""
    cause, fix = _cause_and_fix(exc, command)
    text = " ".join(cause.split()) or type(exc).__name__
    if len(text) > 1000:
        text = text[:997] + "..."
    return text if "; " in text else f"{text}; {fix}"


def _cause_and_fix(exc: BaseException, command: str) -> tuple[str, str]:
    debug = "rerun with kvgrid --debug for the traceback"
    library = type(exc).__module__.split(".")[0]
    if library == "ray":
        cause = getattr(exc, "cause", None)  # a RayTaskError: what the remote call raised
        if isinstance(cause, Exception):
            return _cause_and_fix(cause, command)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        return f"Ray: {type(exc).__name__}: {first}", f"check the Ray cluster (ray status); {debug}"
    if library == "redis":
        return f"Redis: {type(exc).__name__}: {exc}", "check that Redis runs and that --redis names it"
    if isinstance(exc, (ValueError, FileNotFoundError)):  # ConfigError, ModelError and kvgrid's other bad input
        return str(exc), f"see kvgrid {command} --help".replace("  ", " ")
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        return (f"{what}: {exc.filename}" if exc.filename else what), "check the path, the address and permissions"
    if isinstance(exc, RuntimeError):
        return str(exc), debug
    return f"unexpected {type(exc).__name__}: {exc}", f"{debug}, and report it"


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr, ``kvgrid: error: <cause>; <fix>``, and exit code 2
    (Ctrl-C: 130, quietly). ``kvgrid --debug ...`` prints the traceback first."""
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        sys.stdout.flush()
        command = " ".join(str(getattr(args, a)) for a in ("command", "bench") if getattr(args, a, None))
        print(f"kvgrid: error: {error_line(exc, command)}", file=sys.stderr, flush=True)
        return 2
