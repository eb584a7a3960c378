"""``dmi-sglang``: capture a generation into the store, and read captures back.

::

    dmi-sglang reference-capture          # no GPU: transformers on CPU, demo checkpoint
    dmi-sglang demo-model ./qwen3-demo
    dmi-sglang capture --model ./qwen3-demo --prompt "w1 w2 w3" --max-new-tokens 8
    dmi-sglang serve --model-path ./qwen3-demo --port 30000   # SGLang's HTTP server
    dmi-sglang ls [RUN]
    dmi-sglang show RUN REQUEST
    dmi-sglang export RUN REQUEST --out capture.safetensors   # or --out - (stdout)
    dmi-sglang rm RUN [--yes] [--force]
    python -m dmi_sglang --version

Every command takes ``--db URL`` (default: ``$DMX_DB_URL``, else the embedded store
``./dmi-captures``). ``rm`` asks on a terminal and needs ``--yes`` elsewhere. Any
other ``--option`` of ``capture`` is passed to SGLang's ServerArgs unchanged, and of
``serve`` to SGLang's server. Errors are one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import DMIError

__all__ = ["main"]

EXIT_ERROR = 2
REFERENCE_LAYERS = 2
"""Layers of the demo checkpoint ``reference-capture`` generates by default."""
REFERENCE_PROMPTS = ("w1 w2 w3", "w10 w11 w12 w13 w14")
"""``reference-capture``'s prompts by default (words of the demo checkpoint's vocabulary)."""


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="dmi-sglang",
        description="Capture what a model computes while SGLang 0.5.19 serves it, and read "
        "the captures back.",
    )
    from dmi_sglang import __version__

    top.add_argument("--version", action="version", version=f"dmi-sglang {__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--db", help="store URL: chdb:///abs/path or http(s)://host:port/db "
                       "(default: $DMX_DB_URL, else embedded ./dmi-captures)")
        return p

    cap = with_db(sub.add_parser(
        "capture", help="run a monitored generation into the store",
        epilog="Every other --option is passed to SGLang's ServerArgs unchanged "
        "(e.g. --attention-backend triton --mem-fraction-static 0.3)."))
    cap.add_argument("--model", required=True, help="model directory (a Qwen3 checkpoint)")
    src = cap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The capital of France is",
                     help="one prompt (default: %(default)r)")
    src.add_argument("--prompts", type=Path, help="a file with one prompt per line")
    cap.add_argument("--hooks", default=None,
                     help="hook selection (default: $DMX_HOOK_SELECTION, else sglang-full)")
    cap.add_argument("--run-id", default=None,
                     help="capture run id (default: $DMX_MODEL_ID, else generated)")
    cap.add_argument("--max-new-tokens", type=_positive, default=32,
                     help="tokens generated per prompt (default: %(default)s)")
    cap.add_argument("--batch", type=_positive, default=64,
                     help="prompts per generate call (default: %(default)s)")

    ls = with_db(sub.add_parser("ls", help="list runs, or the requests of one run"))
    ls.add_argument("run", nargs="?")
    show = with_db(sub.add_parser("show", help="hooks, layers, shapes and norms of a request"))
    show.add_argument("run")
    show.add_argument("request")
    show.add_argument("--partial", action="store_true",
                      help="what an interrupted or failed run stored (never by default)")
    exp = with_db(sub.add_parser("export", help="write a request's captures as safetensors"))
    exp.add_argument("run")
    exp.add_argument("request")
    exp.add_argument("--out", required=True,
                     help="a new .safetensors file, or - for standard output")
    exp.add_argument("--force", action="store_true", help="replace an existing --out file")
    exp.add_argument("--partial", action="store_true",
                     help="what an interrupted or failed run stored, tensors named "
                     "hook.layer@start-end (positions [start, end); @start-end:K every K-th "
                     "of them; never by default)")
    rm = with_db(sub.add_parser("rm", help="delete a run"))
    rm.add_argument("run")
    rm.add_argument("--force", action="store_true", help="also a run that is still running")
    rm.add_argument("--yes", action="store_true", help="do not ask before deleting")
    ref = with_db(sub.add_parser(
        "reference-capture",
        help="no GPU: capture a greedy generation run by transformers on CPU (a CPU "
        "reference capture, labelled cpu-reference in ls)",
        description="Run a greedy generation with transformers on the CPU and store what it "
        "computes as a normal committed run: the same hook names, the same row rules and the "
        "same store as `capture`, labelled cpu-reference (runs-table setting dmi.source). "
        "Needs no GPU and no SGLang; try ls, show, export and open_store(...) on it."))
    ref.add_argument("--model", type=Path, default=None,
                     help="a Qwen3ForCausalLM checkpoint directory; unset: a fresh random-"
                     "weight demo checkpoint in a temporary directory")
    ref.add_argument("--layers", type=_positive, default=None,
                     help=f"layers of that demo checkpoint; unset: {REFERENCE_LAYERS} "
                     "(not with --model)")
    ref_src = ref.add_mutually_exclusive_group()
    ref_src.add_argument("--prompt", action="append", default=None,
                         help="a prompt (repeat for more); unset: "
                         + " and ".join(repr(p) for p in REFERENCE_PROMPTS))
    ref_src.add_argument("--prompts", type=Path, help="a file with one prompt per line")
    ref.add_argument("--hooks", default=None,
                     help="hook selection; unset: $DMX_HOOK_SELECTION, else sglang-full")
    ref.add_argument("--run-id", default=None, help="run id (default: generated)")
    ref.add_argument("--max-new-tokens", type=_positive, default=8,
                     help="tokens generated per prompt, fewer when the end of sequence "
                     "token comes first (default: 8)")
    from dmi_sglang.app.cli_plan import add_plan_parser

    add_plan_parser(sub, _positive)
    from dmi_sglang.app.cli_serve import add_serve_parser

    add_serve_parser(sub)
    demo = sub.add_parser("demo-model", help="write a small random-weight Qwen3 checkpoint")
    demo.add_argument("dir", type=Path)
    demo.add_argument("--layers", type=_positive, default=4)
    return top


def _positive(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        msg = f"{text!r} is not a positive integer"
        raise argparse.ArgumentTypeError(msg)
    return value


def _logs_to_stderr() -> None:
    """Log lines go to standard error, which they share with the commands' errors:
    standard output carries a command's data (an export's bytes with ``--out -``, a
    listing). A caller's own structlog logger factory is kept; clickhouse-connect's own
    warnings (an unreachable server) are left out: the command's error says it once."""
    import logging

    import structlog

    if isinstance(structlog.get_config()["logger_factory"], structlog.PrintLoggerFactory):
        # structlog's own printing (to stdout by default): to stderr, looked up per line
        structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))
    logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmi-sglang`` command."""
    _logs_to_stderr()
    args, extra = _parser().parse_known_args(argv)
    if extra and args.command not in ("capture", "serve"):
        from dmi_sglang.domain.settings import redact_url

        shown = " ".join(redact_url(a) if _may_hold_a_password(a) else a for a in extra)
        print(f"dmi-sglang {args.command}: unknown arguments {shown}", file=sys.stderr)
        return EXIT_ERROR
    from dmi_sglang.app import cli_commands as cmd

    try:
        if args.command == "capture":
            return cmd.capture(args, extra)
        if args.command == "serve":
            from dmi_sglang.app.cli_serve import serve

            return serve(args, extra, gpu_problem=cmd.gpu_problem)
        if args.command == "demo-model":
            return cmd.demo_model(args.dir, layers=args.layers)
        if args.command == "plan":
            from dmi_sglang.app.cli_plan import plan

            return plan(args)
        store = _store(args.db)
        if args.command == "reference-capture":
            return cmd.reference_capture(args, default_layers=REFERENCE_LAYERS,
                                         default_prompts=REFERENCE_PROMPTS)
        handler: dict[str, Any] = {
            "ls": lambda: cmd.ls(store, args.run),
            "show": lambda: cmd.show(store, args.run, args.request, partial=args.partial),
            "export": lambda: cmd.export(store, args.run, args.request, args.out,
                                         force=args.force, partial=args.partial),
            "rm": lambda: cmd.rm(store, args.run, force=args.force, yes=args.yes),
        }
        return int(handler[args.command]())
    except BrokenPipeError:  # `dmi-sglang ls | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.command == "export":  # a capture that did not arrive whole is an error
            print("dmi-sglang export: the reader of standard output went away",
                  file=sys.stderr)
            return EXIT_ERROR
        return 0
    except ModuleNotFoundError as exc:  # an optional dependency of this command
        wanted = "demo" if args.command in ("demo-model", "reference-capture") else "read"
        print(f"dmi-sglang {args.command}: needs the {exc.name} package: "
              f"pip install 'dmi-sglang[{wanted}]'", file=sys.stderr)
        return EXIT_ERROR
    except (DMIError, OSError, ValueError) as exc:
        print(f"dmi-sglang {args.command}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _may_hold_a_password(arg: str) -> bool:
    """A URL, or ``user:password@host`` (a mistyped ``--db``), not ``resid_pre@0-3``."""
    before, at, _ = arg.partition("@")
    return "://" in arg or (bool(at) and ":" in before)


def _store(db: str | None) -> StoreConfig:
    """The store ``--db`` (or the environment) names; a bad ``--db`` is named as such."""
    from dmi_sglang.app.cli_commands import check_db_flag
    from dmi_sglang.app.reading import store_config

    check_db_flag(db)
    return store_config(db)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) < 600 else text[:597] + "..."


if __name__ == "__main__":
    sys.exit(main())
