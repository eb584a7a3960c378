"""A run is one run: id reuse, racing starts, crashed owners, tampered rows, failed starts.

Each test's docstring is one row of docs/reliability.md.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from dmi_sglang import open_store
from dmi_sglang.adapters.clickhouse import ClickHouseRunClaims, ClickHouseSink, connect
from dmi_sglang.app import cli
from dmi_sglang.app.composition import PipelineFactory, claim_new_run, release_unused_claim
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import CapacityError, RunExistsError

from ._faults import commit, embedded, ended, record, run_info, store_with_run


def _settings(url: str, run_id: str | None = "run", **kw: str) -> Settings:
    values = {"dmx_db_url": url, **kw}
    if run_id is not None:
        values["dmx_model_id"] = run_id
    return Settings.from_kwargs(values, env={}).resolve(model_path="/models/toy")


def test_bad_input_starting_a_run_whose_id_is_in_the_store(tmp_path: Path) -> None:
    """A second engine start with the id of a committed run (DMI's "my-run" habit) -> refused
    in the main process before any scheduler starts, naming the run, its status and
    `dmi-sglang rm`; the first run's rows stay its own."""
    config = store_with_run(tmp_path / "s", "my-run", "request-0")
    with pytest.raises(RunExistsError) as info:
        PipelineFactory().claim_run(_settings(f"chdb://{config.path}", "my-run"))
    text = str(info.value)
    assert "run 'my-run' already exists" in text
    assert "status committed" in text
    assert "dmi-sglang rm my-run" in text
    assert open_store(f"chdb://{config.path}").handle("my-run", "request-0").available


def test_fault_two_starts_race_for_one_id(tmp_path: Path) -> None:
    """Eight starts claim one run id at the same moment -> exactly one wins; the others
    are refused; `dmi-sglang rm` frees the id for a new run."""
    config = embedded(tmp_path / "s")
    claims = ClickHouseRunClaims(config)
    claims.claim("warm-up")  # create the store first, so the racers only race the claim
    barrier = threading.Barrier(8)
    won: list[bool] = []

    def start() -> None:
        barrier.wait()
        won.append(claims.claim("contended").won)

    racers = [threading.Thread(target=start) for _ in range(8)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(30)
    assert sorted(won) == [False] * 7 + [True]
    assert cli.main(["rm", "contended", "--yes", "--db", f"chdb://{config.path}"]) == 0
    assert claims.claim("contended").won


def test_bad_input_sequential_plain_engines_in_one_process(
        request: pytest.FixtureRequest) -> None:
    """Two plain sglang.Engine starts in one process with DMX_* set and no run id -> each
    gets its own fresh run id (the first one's resolved id is not reused); an id the user
    chose is kept."""
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    saved = dict(os.environ)  # the hook writes every resolved DMX_* into os.environ
    request.addfinalizer(lambda: (os.environ.clear(), os.environ.update(saved)))
    for key in [k for k in os.environ if k.startswith("DMX_")]:
        del os.environ[key]
    os.environ["DMX_DB_URL"] = "none"
    ids = []
    for _ in range(2):
        args = SimpleNamespace(model_path="/models/toy", disable_prefill_cuda_graph=True,
                               disable_radix_cache=True)
        runtime_hooks.before_resolve_once(args)
        ids.append(os.environ["DMX_MODEL_ID"])
    assert ids[0] != ids[1]
    later = Settings.from_kwargs({}).resolve(model_path="/models/toy")  # a DMIEngine next
    assert later.model_id not in ids
    os.environ["DMX_MODEL_ID"] = "chosen-id"
    runtime_hooks.before_resolve_once(SimpleNamespace(
        model_path="/m", disable_prefill_cuda_graph=True, disable_radix_cache=True))
    assert os.environ["DMX_MODEL_ID"] == "chosen-id"


_KILLED_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.columns import RecordBatch
from reliability._faults import embedded, record, run_info
sink = ClickHouseSink(embedded(__import__("pathlib").Path(sys.argv[1])))
sink.start_run(run_info("killed"))
sink.put(RecordBatch.from_records([record(request="r", start=0, end=3, model_id="killed")]))
sink.flush()
print(os.getpid(), flush=True)
os._exit(9)  # killed: no finish, no close
"""


def test_fault_the_capturing_process_is_killed(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The process capturing into an embedded store dies mid-run -> the run reads as
    interrupted (never committed, never running forever); `ls RUN` marks its request
    incomplete; show refuses it; `show --partial` reads what was stored."""
    path = tmp_path / "s"
    tests_dir = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path), tests_dir],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 9, proc.stderr
    store = open_store(f"chdb://{path}")
    run = store.run("killed")
    assert run is not None
    assert run.status is RunStatus.INTERRUPTED
    assert run.owner == f"{socket.gethostname()}:{proc.stdout.split()[-1]}"
    assert "killed or crashed" in run.error
    assert not store.handle("killed", "r").available
    db = ["--db", f"chdb://{path}"]
    assert cli.main(["ls", "killed", *db]) == 0
    listing = capsys.readouterr().out
    assert "run killed: interrupted" in listing
    assert "NO: run 'killed' is interrupted" in listing
    assert cli.main(["show", "killed", "r", *db]) != 0
    assert "--partial" in capsys.readouterr().err
    assert cli.main(["show", "killed", "r", "--partial", *db]) == 0
    assert "blocks.hook_resid_pre.0@0-3" in capsys.readouterr().out


_KILLED_SCHEDULER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from dmi_sglang.app.composition import open_capture_sink
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.settings import Settings
from reliability._faults import record, run_info
settings = Settings.from_kwargs({"dmx_db_url": sys.argv[1]}, env={}).resolve(model_path="/m")
sink = open_capture_sink(settings)
sink.start_run(run_info("killed"))
sink.put(RecordBatch.from_records([record(request="r", start=0, end=3, model_id="killed")]))
sink.flush()
print("owner", sink.pid, flush=True)
os._exit(9)  # killed: no finish, no close; the owner's stdin closes with this process
"""


def test_fault_the_scheduler_holding_a_store_owner_is_killed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The process that started a store owner (a scheduler capturing into the embedded
    store) dies mid-run -> the owner stores what it took, removes its channels and ends
    (the store is free); the run reads as interrupted, never committed; `show --partial`
    reads what was stored."""
    path, channels = tmp_path / "s", tmp_path / "tmp"
    channels.mkdir(mode=0o700)
    tests_dir = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _KILLED_SCHEDULER, f"chdb://{path}",
                           tests_dir], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(channels)}, check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]
    owner = int(proc.stdout.split("owner ", 1)[1].split()[0])
    deadline = time.monotonic() + 60  # run() returned when the owner closed the stdout
    while not ended(owner):  # it shares with the killed process: it has ended, or is ending
        assert time.monotonic() < deadline, f"the store owner {owner} did not end"
        time.sleep(0.05)
    assert list(channels.iterdir()) == []
    run = open_store(f"chdb://{path}").run("killed")
    assert run is not None
    assert run.status is RunStatus.INTERRUPTED
    db = ["--db", f"chdb://{path}"]
    assert cli.main(["show", "killed", "r", "--partial", *db]) == 0
    assert "blocks.hook_resid_pre.0@0-3" in capsys.readouterr().out


_FORKED_SCHEDULER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from dmi_sglang.app.composition import open_capture_sink
from dmi_sglang.domain.settings import Settings
from reliability._faults import run_info
settings = Settings.from_kwargs({"dmx_db_url": sys.argv[1]}, env={}).resolve(model_path="/m")
sink = open_capture_sink(settings)
sink.start_run(run_info("forked"))
child = os.fork()
if child == 0:  # keeps a copy of every descriptor, the owner's stdin pipe among them
    time.sleep(120)
    os._exit(0)
print("owner", sink.pid, "child", child, flush=True)
os._exit(9)
"""


def test_fault_a_child_of_the_dead_scheduler_holds_the_owners_stdin(tmp_path: Path) -> None:
    """The scheduler dies while a process it forked keeps a copy of the store owner's stdin
    pipe (so the pipe never ends) -> the owner sees its parent gone within seconds, closes
    the store and ends; the run reads as interrupted."""
    path = tmp_path / "s"
    tests_dir = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-c", _FORKED_SCHEDULER, f"chdb://{path}",
                             tests_dir], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout is not None
    line = next(ln for ln in proc.stdout if ln.startswith("owner "))
    _, owner, _, child = line.split()
    proc.wait(60)
    try:
        deadline = time.monotonic() + 30
        while not ended(int(owner)):
            assert time.monotonic() < deadline, "the owner kept the store for its parent's child"
            time.sleep(0.05)
    finally:
        os.kill(int(child), 9)
        proc.stdout.close()
    run = open_store(f"chdb://{path}").run("forked")
    assert run is not None
    assert run.status is RunStatus.INTERRUPTED


def test_bad_input_partial_read_of_a_request_that_stored_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request with a manifest but not one stored position (it ended before its first
    rows reached the store) -> `show --partial` and `export --partial` refuse in one line
    naming it, instead of an empty listing or file; a request that stored some positions
    still reads partially."""
    config = embedded(tmp_path / "s")
    sink = ClickHouseSink(config)
    run = run_info("run")
    sink.start_run(run)
    sink.put(RecordBatch.from_records([record(request="late", start=1, end=3,
                                              model_id="run")]))
    commit(sink, run, {"empty": 2, "late": 2})
    sink.close()
    capsys.readouterr()  # the sink's log lines
    db = ["--db", f"chdb://{config.path}"]
    out = tmp_path / "x.safetensors"
    assert cli.main(["show", "run", "empty", "--partial", *db]) != 0
    captured = capsys.readouterr()
    assert "capture" not in captured.out  # not even the header of an empty listing
    assert "request 'empty' of run 'run' has no stored positions" in captured.err
    assert cli.main(["export", "run", "empty", "--partial", "--out", str(out), *db]) != 0
    assert "nothing to read, even with --partial" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["show", "run", "late", "--partial", *db]) == 0
    assert "blocks.hook_resid_pre.0@1-3" in capsys.readouterr().out


def test_bad_input_a_tampered_run_status(tmp_path: Path) -> None:
    """A runs-table row whose status was edited to an unknown value -> that run alone reads
    as unreadable with the reason; the listing and the other runs still work;
    `available` is False with the reason instead of raising."""
    config = store_with_run(tmp_path / "s", "good")
    client = connect(config)
    try:
        client.command("INSERT INTO `default`.`offload_runs` VALUES ('bad', '/m', [], [], "
                       "'2026-12-01', '', 'hacked', '', 99999999999999999999)")
    finally:
        client.close()
    store = open_store(f"chdb://{config.path}")
    runs = {r.run_id: r for r in store.runs()}
    assert runs["good"].status is RunStatus.COMMITTED
    assert runs["bad"].status is RunStatus.UNREADABLE
    assert "hacked" in runs["bad"].error
    handle = store.handle("bad", "r")
    assert handle.available is False
    assert "unreadable" in handle.missing[0]


def test_fault_the_ring_cannot_be_allocated(tmp_path: Path) -> None:
    """The capture ring cannot hold one capture tensor at startup -> CapacityError naming
    both sizes, the store is released, and no run row is left behind (the run starts only
    once the transport exists)."""
    import attrs

    from dmi_sglang.domain.hooks import CATALOG, ModelHooks
    from dmi_sglang.domain.ports import CaptureSpec
    from dmi_sglang.domain.shapes import ModelShape

    shape = ModelShape(num_layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2,
                       intermediate=6, vocab=10)
    settings = _settings(f"chdb://{tmp_path / 's'}", "no-ring", dmx_ring_payload_mb="1",
                         dmx_hook_selection="resid_pre")
    selection = settings.selection.resolve(
        ModelHooks("ToyForCausalLM", frozenset(h.name for h in CATALOG), 2))
    spec = CaptureSpec(settings=settings, run=attrs.evolve(run_info("no-ring")),
                       selection=selection, shape=shape, max_graph_batch=1, device="cpu",
                       max_prefill_tokens=10**6, max_requests=1)
    claim_new_run(settings)  # as the main process does before the scheduler starts
    with pytest.raises(CapacityError, match="ring"):
        PipelineFactory().open(spec)
    assert open_store(f"chdb://{tmp_path / 's'}").run("no-ring") is None
    assert not ClickHouseRunClaims(settings.store()).claimed("no-ring")  # the id is free


def test_a_top_k_run_records_the_selection_it_ran(tmp_path: Path) -> None:
    """``DMX_TOPK_KERNEL=auto`` -> the run's settings name what it resolved
    to (``dmi.topk_kernel``): here, without FlashInfer, ``none``; a run without a top-k
    names none."""
    import attrs

    from dmi_sglang.domain.hooks import CATALOG, ModelHooks
    from dmi_sglang.domain.ports import CaptureSpec
    from dmi_sglang.domain.records import TOPK_KERNEL_KEY
    from dmi_sglang.domain.shapes import ModelShape

    shape = ModelShape(num_layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2,
                       intermediate=6, vocab=10)
    hooks = ModelHooks("ToyForCausalLM", frozenset(h.name for h in CATALOG), 2)
    recorded = {}
    for run_id, text in (("topk", "final_logits:topk(3)"), ("plain", "resid_pre")):
        settings = _settings(f"chdb://{tmp_path / 's'}", run_id, dmx_hook_selection=text,
                             dmx_topk_kernel="auto")
        assert settings.topk_kernel == "auto"
        spec = CaptureSpec(settings=settings, run=attrs.evolve(run_info(run_id)),
                           selection=settings.selection.resolve(hooks), shape=shape,
                           max_graph_batch=1, device="cpu", max_prefill_tokens=64,
                           max_requests=1)
        claim_new_run(settings)
        opened = PipelineFactory().open(spec)
        opened.session.stop()
        run = open_store(f"chdb://{tmp_path / 's'}").run(run_id)
        assert run is not None
        recorded[run_id] = dict(run.settings)
    assert recorded["topk"][TOPK_KERNEL_KEY] == "none"
    assert TOPK_KERNEL_KEY not in recorded["plain"]


def test_fault_a_failed_start_never_frees_another_starts_claim(tmp_path: Path) -> None:
    """A start that fails after another start claimed the same id -> the other start's
    claim stays; only a claim this process won is released."""
    settings = _settings(f"chdb://{tmp_path / 's'}", "theirs")
    claims = ClickHouseRunClaims(settings.store())
    assert claims.claim("theirs").won  # another process's start
    with pytest.raises(RunExistsError):
        claim_new_run(settings)
    release_unused_claim(settings.store(), "theirs")
    assert claims.claimed("theirs")
    mine = _settings(f"chdb://{tmp_path / 's'}", "mine")
    claim_new_run(mine)
    release_unused_claim(mine.store(), "mine")
    assert not claims.claimed("mine")


def test_fault_a_server_store_run_stops_beating(tmp_path: Path) -> None:
    """A server-store run whose owner stopped rewriting its row (heartbeat) -> read as
    running while the last heartbeat is under 60 s old, interrupted after; an embedded
    run being captured by a sink of the reading process reads as running."""
    import time

    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.adapters.clickhouse._rows import run_row
    from dmi_sglang.domain.records import STALE_AFTER_S
    from dmi_sglang.domain.store_config import StoreConfig, StoreKind

    reader = ClickHouseReader(StoreConfig(kind=StoreKind.SERVER, host="h"))
    row = run_row(run_info("remote"))
    fresh = [*row[:8], time.time_ns()]
    stale = [*row[:8], time.time_ns() - int((STALE_AFTER_S + 5) * 1e9)]
    assert reader._observed(fresh).status is RunStatus.RUNNING
    late = reader._observed(stale)
    assert late.status is RunStatus.INTERRUPTED
    assert "last heartbeat is" in late.error
    config = embedded(tmp_path / "s")
    sink = ClickHouseSink(config)
    sink.start_run(run_info("local"))
    try:
        local = open_store(f"chdb://{config.path}").run("local")
        assert local is not None
        assert local.status is RunStatus.RUNNING
    finally:
        sink.close()
    after = open_store(f"chdb://{config.path}").run("local")
    assert after is not None
    assert after.status is RunStatus.INTERRUPTED


def test_fault_the_heartbeat_keeps_a_flushing_run_alive(tmp_path: Path) -> None:
    """A sink with a heartbeat rewrites the running row while the run lives and stops
    before the final row, run after run -> the final status is never overwritten by a
    late beat, and a later run of the same sink beats too."""
    import time

    class Recording(ClickHouseSink):
        writes: ClassVar[list[str]] = []

        def _write_control(self, layout: Any, rows: list[list[object]], what: str) -> None:
            type(self).writes.append(what.split(maxsplit=1)[0])
            super()._write_control(layout, rows, what)

    config = embedded(tmp_path / "s")
    sink = Recording(config, heartbeat_s=0.02)
    run = run_info("beating")
    sink.start_run(run)
    time.sleep(0.3)
    sink.put(RecordBatch.from_records([record(request="r", model_id="beating")]))
    commit(sink, run, {"r": 2})
    time.sleep(0.1)
    first = len(Recording.writes)
    second = run_info("beating-again")  # the same sink's next run beats too
    sink.start_run(second)
    time.sleep(0.3)
    commit(sink, second, {})
    sink.close()
    writes = Recording.writes
    for one in (writes[:first], writes[first:]):
        assert one[0] == "recording"
        assert one.count("heartbeat") >= 3
        assert one[-1] == "finishing"  # no beat after the final row
    store = open_store(f"chdb://{config.path}")
    for run_id in ("beating", "beating-again"):
        final = store.run(run_id)
        assert final is not None
        assert final.status is RunStatus.COMMITTED


def test_a_selection_from_the_last_prompt_position_keeps_the_radix_cache(
        request: pytest.FixtureRequest) -> None:
    """Monitoring forces the radix cache off, unless nothing selected needs a prompt
    position before the last one (SGLang always computes that one)."""
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    saved = dict(os.environ)
    request.addfinalizer(lambda: (os.environ.clear(), os.environ.update(saved)))
    for key in [k for k in os.environ if k.startswith("DMX_")]:
        del os.environ[key]
    os.environ["DMX_DB_URL"] = "none"
    kept = []
    # found in review: final_logits (its rows decide tokens: from the last prompt
    # position on) turned the cache off beside resid_pre:last
    for selection in ("resid_pre:last_prompt,final_logits:generated", "resid_pre",
                      "resid_pre:last,final_logits", "resid_pre:last,final_logits:topk(64)",
                      "resid_pre:last,final_logits:positions(0-3)"):
        os.environ["DMX_HOOK_SELECTION"] = selection
        os.environ.pop("DMX_MODEL_ID", None)
        args = SimpleNamespace(model_path="/models/toy", disable_prefill_cuda_graph=True,
                               disable_radix_cache=False)
        runtime_hooks.before_resolve_once(args)
        kept.append(not args.disable_radix_cache)
    assert kept == [True, False, True, True, False]
