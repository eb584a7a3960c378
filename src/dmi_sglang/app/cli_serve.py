"""``dmi-sglang serve``: SGLang's HTTP server, with capture.

Runs ``python -m sglang.launch_server`` with every SGLang argument it was given, after
checking its own arguments, resolving the run (its id and store) and exporting them as
``DMX_*`` variables: the server that starts is exactly the one ``python -m
sglang.launch_server`` starts with those variables set, and the plugin does the rest
(``adapters/sglang_v0519/server.py``). By default it captures only the requests that ask
(``custom_params: {"dmi_capture": true}``), with every layer's residual stream at each
request's last position, which the bandwidth plan shows keeps up at full serving speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from dmi_sglang.domain.sampling import CAPTURE_PARAM
from dmi_sglang.domain.settings import PREFIX, Enable, Settings, redact_url
from dmi_sglang.errors import ConfigurationError, UsageError

__all__ = ["SERVE_HOOKS", "SERVE_REQUEST_SAMPLE", "add_serve_parser", "serve"]

SERVE_HOOKS = "resid_pre:last"
"""The hook selection ``serve`` captures unless told (``--hooks`` / ``DMX_HOOK_SELECTION``)."""
SERVE_REQUEST_SAMPLE = 0.0
"""The request sample ``serve`` uses unless told: only requests that ask are captured."""

EXIT_NO_GPU = 3
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN = "dmi"
_SERVER_MODULE = "sglang.launch_server"


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``serve`` subcommand's own arguments (every other one goes to SGLang)."""
    p = sub.add_parser(
        "serve", help="serve a model over HTTP with SGLang, capturing what requests ask for",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Start SGLang's HTTP server (python -m sglang.launch_server) with capture. "
        "A request is captured when it asks, with custom_params {\"dmi_capture\": true} in "
        "/generate's sampling_params or in the body of /v1/completions and "
        "/v1/chat/completions, or when --request-sample picks it. GET /dmi/status reports "
        "the run; POST /dmi/stop, Ctrl-C or SIGTERM make it durable. Each start is a new run.",
        epilog="Every other --option is passed to SGLang's server unchanged "
        "(e.g. --port 30000 --attention-backend triton --api-key KEY).")
    p.add_argument("--model-path", required=True,
                   help="model directory (a Qwen3 checkpoint); passed on to SGLang")
    p.add_argument("--hooks", default=None,
                   help=f"hook selection; unset: $DMX_HOOK_SELECTION, else {SERVE_HOOKS}")
    p.add_argument("--request-sample", default=None,
                   help="fraction of all requests captured without asking, chosen by request "
                   f"id; unset: $DMX_REQUEST_SAMPLE, else {SERVE_REQUEST_SAMPLE:g} (only "
                   "requests that ask)")
    p.add_argument("--store-max-gb", default=None,
                   help="stop capturing new requests once the store holds this many GB "
                   "(requests already captured finish; GET /dmi/status says paused); unset: "
                   "$DMX_STORE_MAX_GB, else no cap (new captures stop anyway while the "
                   "store's disk has under 2 GB free)")
    p.add_argument("--run-id", default=None, help="capture run id (default: generated)")
    p.add_argument("--db", help="store URL: chdb:///abs/path or http(s)://host:port/db "
                   "(default: $DMX_DB_URL, else embedded ./dmi-captures)")


def serve(args: argparse.Namespace, extra: Sequence[str], *,
          gpu_problem: Callable[[], str | None],
          execv: Callable[[str, list[str]], object] = os.execv) -> int:
    """Check, resolve the run, say where it goes, and become SGLang's server.

    Returns only when it cannot start (exit status); otherwise ``execv`` replaces the
    process.

    Raises:
        UsageError: a bad argument, named, before anything else is looked at.
    """
    _refuse_other_servers(extra)
    settings = _settings(args)
    _plugin_will_load()
    problem = gpu_problem()
    if problem is not None:
        print(f"dmi-sglang serve: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    store = settings.store()
    run_id = settings.model_id or ""
    for key in [k for k in os.environ if k.startswith(PREFIX)]:  # the resolved settings
        del os.environ[key]  # are the server's whole truth (a flag replaced some of them)
    os.environ.update({**settings.to_env(), PREFIX + "SGLANG_ENABLE": "1"})
    who = (f"requests that ask (custom_params {{\"{CAPTURE_PARAM}\": true}})"
           if settings.request_sample == 0 else
           f"{settings.request_sample:g} of requests, and those that ask")
    print(f"dmi-sglang serve: run {run_id} captures {settings.hook_selection} of {who} "
          f"into {store.url}", flush=True)
    print("  GET /dmi/status reports it; POST /dmi/stop, Ctrl-C or SIGTERM make it durable",
          flush=True)
    credentials = store.kind.value != "embedded" and (store.password or store.user != "default")
    secret = (" (with the store's user and password in the URL, which are not printed)"
              if credentials else "")
    print(f"  then read it: dmi-sglang ls {run_id} --db {store.url}{secret}   "
          f"(or dmi_sglang.open_store({store.url!r}))", flush=True)
    argv = [sys.executable, "-m", _SERVER_MODULE, "--model-path", str(args.model_path), *extra]
    execv(sys.executable, argv)
    return 0  # only when execv is not the real one


def _plugin_will_load() -> None:
    """Refuse a start whose server would not load the plugin (it would serve, capturing
    nothing, after this command said it captures).

    Raises:
        UsageError: no ``dmi`` entry point in ``sglang.srt.plugins`` (the package is not
            installed as a distribution), or ``SGLANG_PLUGINS`` leaves it out.
    """
    from importlib.metadata import entry_points

    if not any(ep.name == PLUGIN for ep in entry_points(group=PLUGIN_GROUP)):
        msg = (f"the {PLUGIN_GROUP} entry point {PLUGIN!r} is not installed, so SGLang would "
               "not load the capture: install dmi-sglang as a package (pip install), not "
               "through PYTHONPATH")
        raise UsageError(msg)
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and PLUGIN not in [name.strip() for name in allowed.split(",")]:
        msg = (f"SGLANG_PLUGINS={allowed!r} leaves out the {PLUGIN!r} plugin: add it, or "
               "unset SGLANG_PLUGINS")
        raise UsageError(msg)


OTHER_SERVERS = ("--encoder-only", "--smg-grpc-mode", "--grpc-mode", "--use-ray")
"""SGLang 0.5.19 flags that start another server than its HTTP server (``launch_server``
picks it before the HTTP server), which the capture does not follow: no ``/dmi`` routes,
no stop at exit, and a capture failure would end the scheduler."""


def _refuse_other_servers(extra: Sequence[str]) -> None:
    """Raises UsageError for a flag of :data:`OTHER_SERVERS` among SGLang's arguments, as
    SGLang's own parser reads them (an abbreviation, a ``--config`` file setting it)."""
    from dmi_sglang.app.composition import sglang_flags_set

    given = [arg.partition("=")[0] for arg in extra]
    for flag in [*given, *sglang_flags_set(extra, OTHER_SERVERS)]:
        if flag in OTHER_SERVERS:
            msg = (f"{flag} starts another server than SGLang's HTTP server, which the "
                   "capture does not follow (no /dmi routes, no stop at exit); accepted: "
                   "SGLang's HTTP server (leave out " + ", ".join(OTHER_SERVERS) + ")")
            raise UsageError(msg)


def _settings(args: argparse.Namespace) -> Settings:
    """The run's settings: flags over ``DMX_*`` variables over serve's defaults; resolved."""
    from dmi_sglang.app.cli_commands import check_db_flag, check_run_id_flag, require_model_dir

    model = require_model_dir("--model-path", args.model_path)
    check_run_id_flag(args.run_id)
    check_db_flag(args.db)
    flags = {"dmx_hook_selection": args.hooks, "dmx_request_sample": args.request_sample,
             "dmx_model_id": args.run_id, "dmx_db_url": args.db,
             "dmx_store_max_gb": args.store_max_gb}
    defaults = {PREFIX + "HOOK_SELECTION": SERVE_HOOKS,
                PREFIX + "REQUEST_SAMPLE": f"{SERVE_REQUEST_SAMPLE:g}"}
    env = {**defaults, **{k: v for k, v in os.environ.items() if k.startswith(PREFIX) and v}}
    for flag, key in (("--hooks", "dmx_hook_selection"),
                      ("--request-sample", "dmx_request_sample"),
                      ("--run-id", "dmx_model_id"), ("--db", "dmx_db_url"),
                      ("--store-max-gb", "dmx_store_max_gb")):
        value = flags[key]
        if value is None:
            continue
        try:
            Settings.from_kwargs({key: value}, env={})
        except ConfigurationError as exc:
            shown = redact_url(str(value)) if flag == "--db" else value
            msg = f"{flag} {shown!r}: {exc}"
            raise UsageError(msg) from None
    settings = Settings.from_kwargs({k: v for k, v in flags.items() if v is not None}, env=env)
    if settings.enable is Enable.OFF:
        msg = ("DMX_SGLANG_ENABLE=0 asks for no monitoring, which dmi-sglang serve always "
               "does; accepted: 1 or auto (unset it), or python -m sglang.launch_server "
               "for an unmonitored server")
        raise UsageError(msg)
    from dmi_sglang.app.cli_plan import check_selection

    check_selection(model, settings.hook_selection)
    return settings.resolve(model_path=str(model))
