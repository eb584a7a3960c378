"""The ``dmi-sglang`` subcommands (parsing lives in ``cli.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dmi_sglang.app.export import tensor_name
from dmi_sglang.app.reading import CaptureStore
from dmi_sglang.app.reference import ENGINE_KEY
from dmi_sglang.domain.hooks import ModelHooks
from dmi_sglang.domain.records import RunSource
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import (
    ConfigurationError,
    IncompleteCaptureError,
    NotInStoreError,
    UsageError,
)

__all__ = ["capture", "check_db_flag", "demo_model", "export", "gpu_problem", "ls",
           "read_back_hints", "reference_capture", "require_model_dir", "rm", "show"]


def _out(line: str = "") -> None:
    print(line, flush=True)


def _shown(text: str) -> str:
    """``text`` safe for a terminal: control and other unprintable characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape",
                                                       "backslashreplace").decode("ascii")


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.2f} MiB"


def _db_flag(store: StoreConfig) -> str:
    """`` --db URL`` for a suggested command, or nothing for the default store (the URL
    redacted, shell-quoted)."""
    from dmi_sglang.domain.settings import redact_url

    if store.kind.value == "embedded" and (
            os.path.abspath(store.path) == os.path.abspath("dmi-captures")):
        return ""
    return f" --db {shlex.quote(redact_url(store.url))}"


def ls(store: StoreConfig, run_id: str | None) -> int:
    """List runs, or one run's requests, with sizes."""
    if store.kind.value == "embedded" and not os.path.isdir(store.path):
        db = _db_flag(store)
        msg = (f"no capture store at {store.path} yet: capture into it with `dmi-sglang "
               f"capture --model DIR --prompt TEXT{db}` (needs a GPU), or make a CPU "
               f"reference capture with `dmi-sglang reference-capture{db}`, or pass --db "
               "URL of another store")
        raise UsageError(msg)
    captures = CaptureStore(store)
    with captures.session():
        if run_id is None:
            runs = captures.runs()
            if not runs:
                _out(f"no runs in {store.url}")
                return 0
            _out(f"{'run':<44} {'status':<10} {'requests':>8} {'records':>10} {'size':>14}  "
                 f"{'started':<32}  source")
            for run in runs:
                reqs = captures.requests(run.run_id)
                records = sum(r.records for r in reqs)
                size = sum(r.bytes for r in reqs)
                _out(f"{_shown(run.run_id):<44} {run.status.value:<10} {len(reqs):>8} "
                     f"{records:>10} {_mib(size):>14}  {run.started_at:<32}  "
                     f"{_shown(run.source)}")
            return 0
        run = captures.require_run(run_id)
        requests = captures.requests(run_id)
        _out(f"run {_shown(run_id)}: {run.status.value}"
             + (f" ({_shown(run.error)})" if run.error else ""))
        if run.source == RunSource.CPU_REFERENCE.value:
            engine = dict(run.settings).get(ENGINE_KEY, "transformers on CPU")
            _out(f"CPU reference capture ({_shown(engine)}), not SGLang")
        _out(f"{'request':<40} {'records':>10} {'size':>14}  complete")
        for req in requests:
            missing = captures.handle(run_id, req.request_id).missing
            verdict = "yes" if not missing else "NO: " + _shown(missing[0])
            _out(f"{_shown(req.request_id):<40} {req.records:>10} {_mib(req.bytes):>14}  "
                 f"{verdict}")
    return 0


class _PartialRead:
    """What a ``--partial`` read found besides its tensors: whether the request was
    complete after all, and the captures that stored no position."""

    def __init__(self) -> None:
        self.complete = False
        self.left_out: list[str] = []

    def said(self) -> str:
        """How the read went, for the line a command prints after it."""
        if self.complete:
            return ("the request is complete: every position is in it (named as --partial "
                    "names them, NAME@START-STOP)")
        said = "partial, the stored positions only"
        if self.left_out:
            said += (f"; nothing stored of {len(self.left_out)} capture(s): "
                     f"{', '.join(self.left_out)}")
        return said


def _tensors(store: StoreConfig, run_id: str, request_id: str,
             partial: _PartialRead | None = None) -> Iterator[tuple[str, str, range, Any]]:
    """``(request id, name, positions, tensor)`` of every capture of a request, in the
    run's capture order; the request id as stored (``request_id`` may be the escaped form
    ``ls`` printed). ``partial``: what was stored, each hook up to its first missing
    position (what else the read found is noted in it)."""
    captures = CaptureStore(store)
    with captures.session():
        captures.require_run(run_id)
        request_id = _typed_request_id(captures, run_id, request_id)
        if not captures.holds(run_id, request_id):
            msg = (f"run '{_shown(run_id)}' holds nothing of a request '{_shown(request_id)}' "
                   f"(`dmi-sglang ls {_shown(run_id)}{_db_flag(store)}` lists its requests)")
            raise NotInStoreError(msg)
        if partial is not None:
            for name, kept, tensor in _partial_tensors(captures, run_id, request_id, partial):
                yield request_id, name, kept, tensor
            return
        handle = captures.handle(run_id, request_id)
        missing = handle.missing
        if missing:
            raise IncompleteCaptureError(
                f"request {request_id!r} of run {run_id!r} is not complete: {missing[0]} "
                "(--partial reads what was stored)"
            )
        for act, layer in handle.captures:
            which = None if layer < 0 else layer
            yield (request_id, tensor_name(act, layer), handle.positions(act, which),
                   handle.get(act, which))


def _encodable(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (safetensors metadata): not an id holding
    a lone surrogate, which only its escaped form can name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _typed_request_id(captures: CaptureStore, run_id: str, typed: str) -> str:
    """The request a command-line id names: as typed, or, when ``ls`` printed it escaped
    (control characters, lone surrogates), the id that escaped form stands for."""
    if "\\" not in typed:
        return typed
    try:
        unescaped = typed.encode("ascii", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return typed
    known = {r.request_id for r in captures.requests(run_id)}
    return unescaped if typed not in known and unescaped in known else typed


def _partial_tensors(captures: CaptureStore, run_id: str, request_id: str,
                     report: _PartialRead) -> Iterator[tuple[str, range, Any]]:
    """What ``--partial`` reads: each capture up to its first missing position; whether
    the request is complete, and the captures that stored none, go into ``report``
    (before the first tensor, and as they are met).

    Raises:
        IncompleteCaptureError: no capture of the request stored a position (nothing
            to read, even partially).
    """
    report.complete = captures.handle(run_id, request_id).available
    handle = captures.handle(run_id, request_id, partial=True)
    found = False
    for act, layer in handle.captures:
        layer_arg = None if layer < 0 else layer
        name = tensor_name(act, layer)
        try:
            kept = handle.partial_positions(act, layer_arg)
        except IncompleteCaptureError:  # nothing of it was stored
            report.left_out.append(name)
            continue
        found = True
        every = f":{kept.step}" if kept.step > 1 else ""
        # the rows of the positions just named (a live run may store more meanwhile)
        yield (f"{name}@{kept.start}-{kept.stop}{every}", kept,
               handle.get(act, layer_arg, start=kept.start, end=kept.stop))
    if not found:
        msg = (f"request '{_shown(request_id)}' of run '{_shown(run_id)}' has no stored "
               "positions in any capture: nothing to read, even with --partial")
        raise IncompleteCaptureError(msg)


def show(store: StoreConfig, run_id: str, request_id: str, *, partial: bool = False) -> int:
    """Hooks, layers, shapes, dtypes and norms of one request."""
    read = _PartialRead() if partial else None
    titled = False
    for _, name, span, tensor in _tensors(store, run_id, request_id, read):
        if not titled:  # only once the request resolved
            title = f"run {_shown(run_id)}  request {_shown(request_id)}"
            if read is not None:  # known before the first tensor
                title += ("  (--partial: the request is complete)" if read.complete
                          else "  (partial: stored positions only)")
            _out(title)
            _out(f"{'capture':<36} {'positions':<18} {'shape':<22} {'dtype':<16} {'norm':>12}")
            titled = True
        norm = f"{float(tensor.float().norm()):>12.4f}" if tensor.is_floating_point() else (
            f"{'-':>12}")
        shape = "x".join(str(d) for d in tensor.shape)
        where = f"[{span.start}, {span.stop})"  # as get(start=, end=) takes them
        where += f" every {span.step}" if span.step > 1 else ""
        _out(f"{name:<36} {where:<18} {shape:<22} {tensor.dtype!s:<16} {norm}")
    if read is not None and read.left_out:
        _out(read.said())
    return 0


def export(store: StoreConfig, run_id: str, request_id: str, out: str, *,
           force: bool = False, partial: bool = False) -> int:
    """Write one request's captures as a safetensors file (``out == "-"``: to stdout).

    The file is written next to the target and renamed into place, so a reader never
    sees half a file. Only a new path or, with ``force``, an existing regular file is
    accepted: symlinks, directories, devices and FIFOs are refused.
    """
    target = _export_target(out, force=force)
    from safetensors.torch import save

    tensors: dict[str, Any] = {}
    positions: dict[str, list[int]] = {}  # as the server's export names them
    named = request_id
    read = _PartialRead() if partial else None
    for stored, name, span, t in _tensors(store, run_id, request_id, read):
        named = stored if _encodable(stored) else request_id  # the id, not its escaped form
        if span:  # a capture that kept no position has no rows to write (nor does the server)
            tensors[name] = t.contiguous()
            positions[name] = [span.start, span.stop, span.step]
    data = save(tensors, metadata={"run_id": run_id, "request_id": named,
                                   "positions": json.dumps(positions)})
    if target is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        if read is not None:  # the file went to stdout: the note goes to stderr
            print(f"exported {len(tensors)} tensors to stdout: {read.said()}", file=sys.stderr)
        return 0
    try:
        _write_atomically(target, data)
    except OSError as exc:  # the user's path, not the temporary file beside it
        msg = f"--out {out}: {exc.strerror or exc}; give a file path in a writable directory"
        raise UsageError(msg) from None
    said = f"wrote {len(tensors)} tensors ({_mib(len(data))}) to {target}"
    if read is not None:
        said += f": {read.said()}"
    _out(said)
    return 0


def _write_atomically(target: Path, data: bytes) -> None:
    """``data`` as the file ``target``: written next to it and renamed into place; a
    replaced file keeps its mode (a private capture stays private)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~umask  # as a plain new file would be, not mkstemp's 0600
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _export_target(out: str, *, force: bool) -> Path | None:
    """The regular file ``--out`` names (None: standard output), or a one-line refusal."""
    if out == "-":
        return None
    if not out.strip():
        msg = "--out is empty; give a file path, or - for standard output"
        raise UsageError(msg)
    if out.endswith(os.sep):  # Path() would drop the slash and write a file there
        msg = f"--out {out} names a directory; give a file path, or - for standard output"
        raise UsageError(msg)
    path = Path(out)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return path
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else None if stat.S_ISREG(st.st_mode) else "not a regular file (a device or FIFO)")
    if kind is not None:
        msg = f"--out {out} is {kind}; give a new file path, or - for standard output"
        raise UsageError(msg)
    if not force:
        msg = f"--out {out} exists; pass --force to replace it"
        raise UsageError(msg)
    return path


def rm(store: StoreConfig, run_id: str, *, force: bool = False, yes: bool = False) -> int:
    """Delete a run (a running one only with ``force``), after asking on a terminal;
    elsewhere ``yes`` is required."""
    captures = CaptureStore(store)
    if not yes:
        if not sys.stdin.isatty():
            msg = f"rm deletes run {run_id!r} for good: pass --yes (no terminal to ask on)"
            raise UsageError(msg)
        captures.check_deletable(run_id, force=force)  # no question about what cannot go
        try:
            answer = input(f"delete run {_shown(run_id)} from {store.url} for good? [y/N] ")
        except EOFError:  # end of input (Ctrl-D): no answer is no
            _out()
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            _out("kept")
            return 1
    n = captures.delete_run(run_id, force=force)
    _out(f"deleted run {run_id} ({n} records)")
    return 0


def demo_model(path: Path, *, layers: int) -> int:
    """Write the small random-weight Qwen3 checkpoint (never over another checkpoint).

    Raises:
        UsageError: ``path`` holds a checkpoint already (a ``config.json``), or it
            cannot be written (a file, under a file, not writable).
    """
    from dmi_sglang.app.composition import write_demo_checkpoint

    if (path / "config.json").exists():
        msg = (f"{path} already holds a checkpoint (config.json), which demo-model would "
               "overwrite; give a new or empty directory")
        raise UsageError(msg)
    try:
        where = write_demo_checkpoint(path, layers=layers)
    except OSError as exc:  # named by the user's path, not the library's raw error
        msg = f"{path}: {exc.strerror or exc}; give a new or empty directory"
        raise UsageError(msg) from None
    _out(f"wrote a {layers}-layer random-weight Qwen3 checkpoint to {where}")
    _out(f"try: dmi-sglang capture --model {shlex.quote(str(where))} --prompt 'w1 w2 w3'")
    return 0


def gpu_problem() -> str | None:
    """Why SGLang cannot run here (no SGLang, no CUDA device), or None."""
    try:
        import torch

        import sglang  # noqa: F401
    except ImportError as exc:
        return (f"needs SGLang 0.5.19 and an NVIDIA GPU; {exc.name} is not installed "
                "(pip install 'dmi-sglang[sglang]')")
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU with CUDA; none is visible on this machine"
    return None


def _sglang_kwargs(model: str, extra: Sequence[str]) -> dict[str, Any]:
    """ServerArgs keywords from ``--option value`` pairs, typed by SGLang's own parser."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", model, *extra])
    return {k: v for k, v in vars(ns).items()
            if k == "model_path" or v != parser.get_default(k)}


def capture(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run a monitored generation into the store and print a summary."""
    _validate_capture(args)
    problem = gpu_problem()
    if problem is not None:
        print(f"dmi-sglang capture: {problem}", file=sys.stderr)
        return 3
    prompts = _read_prompts(args)
    kwargs = _sglang_kwargs(str(args.model), extra)
    dmx = _capture_settings(args)
    from dmi_sglang.app.engine import DMIEngine

    engine = DMIEngine(**kwargs, **dmx)
    try:
        t0 = time.perf_counter()
        outputs: list[dict[str, Any]] = []
        for i in range(0, len(prompts), args.batch):
            chunk = prompts[i: i + args.batch]
            outputs += engine.generate(
                prompt=chunk,
                sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens},
            )
            if len(prompts) > 1:
                print(f"[{len(outputs)}/{len(prompts)}] requests done", file=sys.stderr,
                      flush=True)
        engine.dmi_stop_monitoring()
        elapsed = time.perf_counter() - t0
    finally:
        engine.shutdown()
    _summary(engine, outputs, elapsed)
    return 0


def require_model_dir(flag: str, value: str | Path) -> Path:
    """The model directory ``flag`` names, refused (naming the flag) unless it holds a
    ``config.json``.

    Raises:
        UsageError: the value is empty, or the directory does not exist or holds no
            config.json.
    """
    if not str(value).strip():
        msg = f"{flag} {str(value)!r} is empty; give a Hugging Face model directory"
        raise UsageError(msg)
    model = Path(value)
    if not (model / "config.json").is_file():
        what = "does not exist" if not model.exists() else "holds no config.json"
        msg = f"{flag} {value} {what}; give a Hugging Face model directory"
        raise UsageError(msg)
    return model


def check_db_flag(db: str | None) -> None:
    """Refuse a ``--db`` value that is not a store URL, naming ``--db``.

    Raises:
        UsageError: ``db`` is given and not a store URL.
    """
    if db is None:
        return
    from dmi_sglang.domain.settings import STORE_URL_FORMS, StoreUrl, redact_url

    try:
        StoreUrl.parse(db)
    except ConfigurationError as exc:
        msg = (f"--db {redact_url(db)!r} is not a store URL; accepted: {STORE_URL_FORMS} "
               f"({exc})")
        raise UsageError(msg) from None


def check_run_id_flag(run_id: str | None) -> None:
    """Refuse an empty ``--run-id`` (as a setting an empty value means unset, which would
    quietly give the run a generated id).

    Raises:
        UsageError: ``run_id`` is given and blank.
    """
    if run_id is not None and not run_id.strip():
        msg = (f"--run-id {run_id!r} is empty; give a run id, or leave --run-id out for a "
               "generated one")
        raise UsageError(msg)


def _capture_settings(args: argparse.Namespace) -> dict[str, str]:
    """The ``dmx_*`` keywords the flags of ``capture`` and ``reference-capture`` give
    (flags win over ``DMX_*`` variables)."""
    return {k: v for k, v in (("dmx_hook_selection", args.hooks), ("dmx_db_url", args.db),
                              ("dmx_model_id", args.run_id)) if v is not None}


def _validate_capture(args: argparse.Namespace) -> None:
    """Refuse bad capture arguments and settings (the flags, then the ``DMX_*``
    variables they join) before looking for a GPU or starting anything."""
    require_model_dir("--model", args.model)
    check_run_id_flag(args.run_id)
    if args.prompts is not None:
        _read_prompts(args)
    elif not args.prompt.strip():
        msg = f"--prompt {args.prompt!r} is empty; give the text to generate from"
        raise UsageError(msg)
    for flag, key, value in (("--hooks", "dmx_hook_selection", args.hooks),
                             ("--run-id", "dmx_model_id", args.run_id)):
        if value is None:
            continue
        try:
            Settings.from_kwargs({key: value}, env={})
        except ConfigurationError as exc:  # worded for the variable: name the flag
            text, variable = str(exc), f"{key.upper()}={value!r}"
            msg = (f"{flag} {value!r}{text.removeprefix(variable)}"
                   if text.startswith(variable) else f"{flag} {value!r}: {text}")
            raise UsageError(msg) from None
    check_db_flag(args.db)
    settings = Settings.from_kwargs(_capture_settings(args))  # with the environment's DMX_*
    from dmi_sglang.app.cli_plan import check_selection

    check_selection(Path(args.model), settings.hook_selection)


def _reference_prompts(args: argparse.Namespace, default: Sequence[str]) -> list[str]:
    if args.prompts is not None:
        return _read_prompts(args)
    if args.prompt is None:
        return list(default)
    blank = next((p for p in args.prompt if not p.strip()), None)
    if blank is not None:
        msg = f"--prompt {blank!r} is blank; give a prompt with words"
        raise UsageError(msg)
    return list(args.prompt)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts is not None:
        try:
            text = args.prompts.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            msg = f"--prompts {args.prompts}: {why}; give a text file, one prompt per line"
            raise UsageError(msg) from None
        prompts = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not prompts:
            msg = f"--prompts {args.prompts} holds no prompt (one prompt per line)"
            raise UsageError(msg)
        return prompts
    return [args.prompt]


def _summary(engine: Any, outputs: list[dict[str, Any]], elapsed: float) -> None:
    store = engine.dmi_settings.store()
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs)
    _out(f"run id       {engine.dmi_run_id}")
    _out(f"requests     {len(outputs)}  (prompt tokens {prompt}, generated {completion})")
    _out(f"throughput   {completion / elapsed:,.1f} generated tokens/s until durable "
         f"({elapsed:.2f} s)")
    _out(f"stored in    {store.url}")
    if store.kind.value == "none":
        return
    _hook_table(store, engine.dmi_run_id)


def _hook_table(store: StoreConfig, run_id: str) -> None:
    totals = CaptureStore(store).hook_totals(run_id)
    _out(f"{'hook':<32} {'layers':>6} {'records':>9} {'rows':>10} {'size':>14}")
    for t in totals:
        _out(f"{t.act_name:<32} {t.layers:>6} {t.records:>9} {t.rows:>10} {_mib(t.bytes):>14}")


def reference_capture(args: argparse.Namespace, *, default_layers: int,
                      default_prompts: Sequence[str]) -> int:
    """A CPU reference capture (transformers on CPU) into the store, then a summary and
    the commands that read it back. Every argument is checked before any work."""
    from dmi_sglang.app.composition import run_reference_capture

    settings, prompts = _validate_reference(args, default_layers, default_prompts)
    layers = args.layers or default_layers
    result = run_reference_capture(settings, prompts, model_dir=args.model, layers=layers,
                                   max_new_tokens=args.max_new_tokens)
    store = settings.store()
    run = result.run
    prompt = sum(m.prompt_tokens for m in result.manifests)
    completion = sum(m.completion_tokens for m in result.manifests)
    _out(f"a CPU reference capture (transformers on CPU, not SGLang), labelled {run.source}")
    _out(f"run id       {run.run_id}")
    _out(f"model        {run.model_path}"
         + (f"  (generated: {layers} layers, random weights)" if args.model is None else ""))
    _out(f"engine       {dict(run.settings).get(ENGINE_KEY, '')}")
    _out(f"requests     {len(result.manifests)}  (prompt tokens {prompt}, generated "
         f"{completion}; {result.forwards} forwards in {result.seconds:.2f} s)")
    _out(f"stored in    {store.url}")
    _hook_table(store, run.run_id)
    _out("read it back:")
    for line in read_back_hints(store, run.run_id, result.manifests[0].request_id):
        _out(f"  {line}")
    return 0


def read_back_hints(store: StoreConfig, run_id: str, request_id: str) -> list[str]:
    """The commands that read one captured request back, for ``store`` (a password in its
    URL is shown as ``***``, never printed), each one shell-quoted as it is run."""
    db = _db_flag(store)
    ids = f"{shlex.quote(run_id)} {shlex.quote(request_id)}"
    return [
        f"dmi-sglang ls{db}",
        f"dmi-sglang show {ids}{db}",
        f"dmi-sglang export {ids} --out capture.safetensors{db}",
        "python -c " + shlex.quote(
            f"import dmi_sglang; h = dmi_sglang.open_store({_literal(store.url)})"
            f".handle({_literal(run_id)}, {_literal(request_id)}); "
            "print(h.missing, h.hidden_states[0].shape)"),
    ]


def _literal(text: str) -> str:
    """``text`` as a Python string literal (``repr``: every character round-trips), in
    double quotes where ``text`` holds none, so that the shell-quoted ``-c`` program
    needs no escaping in the usual case."""
    literal = repr(text)
    if literal[0] == "'" and '"' not in text:  # then no quote inside is escaped
        literal = f'"{literal[1:-1]}"'
    return literal


def _validate_reference(args: argparse.Namespace, default_layers: int,
                        default_prompts: Sequence[str]) -> tuple[Settings, list[str]]:
    """The resolved settings and the prompts of ``reference-capture``; every bad argument
    is refused here, before a model is made, loaded or the store opened."""
    from dmi_sglang.app.composition import DEMO_MODEL_NAME
    from dmi_sglang.domain.hooks import parse_selection

    hooks, shape = _reference_model(args, args.layers or default_layers)
    prompts = _reference_prompts(args, default_prompts)
    check_run_id_flag(args.run_id)
    if args.run_id is not None:
        try:
            Settings.from_kwargs({"dmx_model_id": args.run_id}, env={})
        except ConfigurationError as exc:
            msg = f"--run-id {args.run_id!r} is not a run id: {exc}"
            raise UsageError(msg) from None
    if args.hooks is not None:
        try:
            parse_selection(args.hooks).resolve(hooks)
            Settings.from_kwargs({"dmx_hook_selection": args.hooks}, env={})
        except ConfigurationError as exc:
            msg = f"--hooks {args.hooks!r}: {exc}"
            raise UsageError(msg) from None
    settings = Settings.from_kwargs(_capture_settings(args)).resolve(
        model_path=str(args.model) if args.model is not None else DEMO_MODEL_NAME)
    where = f"--hooks {args.hooks!r}" if args.hooks is not None else \
        f"DMX_HOOK_SELECTION={settings.hook_selection!r}"
    try:  # the selection ($DMX_HOOK_SELECTION when --hooks is unset) and its row shapes
        selection = settings.selection.resolve(hooks)
        for hook, layer in selection.captures():
            shape.capture_row(selection, hook, layer)
    except ConfigurationError as exc:
        msg = f"{where}: {exc}"
        raise UsageError(msg) from None
    if settings.request_sample < 1:
        msg = (f"DMX_REQUEST_SAMPLE={settings.request_sample:g}: a reference capture stores "
               "every prompt it is given; accepted: 1 (unset it)")
        raise UsageError(msg)
    if settings.store().kind.value == "none":
        msg = "the store is 'none': a reference capture would store nothing; pass --db URL"
        raise UsageError(msg)
    return settings, prompts


def _reference_model(args: argparse.Namespace, layers: int) -> tuple[ModelHooks, ModelShape]:
    """The hooks and row shapes of ``reference-capture``'s model (``--model``, else the
    demo checkpoint of ``layers`` layers), from its config alone; ``--model``,
    ``--layers`` and ``--max-new-tokens`` checked against it."""
    from dmi_sglang.app.composition import reference_limits

    if args.model is not None:
        if args.layers is not None:
            msg = (f"--layers {args.layers} sets the layers of the generated demo checkpoint; "
                   f"--model {args.model} has its own: give one of them")
            raise UsageError(msg)
        if not (args.model / "config.json").is_file():
            what = "does not exist" if not args.model.exists() else "holds no config.json"
            msg = f"--model {args.model} {what}; give a Qwen3ForCausalLM checkpoint directory"
            raise UsageError(msg)
    try:
        hooks, shape, context = reference_limits(args.model, layers=layers)
    except ConfigurationError as exc:
        msg = f"--model {args.model}: {exc}"
        raise UsageError(msg) from None
    if context is not None and args.max_new_tokens >= context:
        msg = (f"--max-new-tokens {args.max_new_tokens} reaches the model's context of "
               f"{context} tokens with any prompt; accepted: fewer, prompt included")
        raise UsageError(msg)
    return hooks, shape
