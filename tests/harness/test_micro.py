"""The component benchmarks (``python -m harness transport`` / ``store`` / ``hooks``) on CPU,
tiny sizes:
one result of the one schema, every row delivered, the bound and the spreads present, the
tables ``python -m harness docs`` renders, and bad arguments refused before any work."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.constants import SCHEMA

KEYS = {"schema", "kind", "name", "status", "commit", "code", "library", "command",
        "environment", "ran_at_utc", "finished_at_utc", "settings", "checks", "figures",
        "bound", "error"}
BOUND_KEYS = {"needed_bps", "d2h_bps", "kind", "limit_bps", "ratio"}
"""The keys of :func:`harness.bounds.bound`'s answer (a stored mode adds the disk's)."""
Ran = tuple[dict[str, Any], str]


def _needs_torch() -> None:
    if os.environ.get("CI", "").lower() != "true":  # under CI=true a missing torch fails
        pytest.importorskip("torch")


def _result(path: Path, kind: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    assert set(data) == KEYS
    assert (data["schema"], data["kind"], data["status"], data["error"]) == (
        SCHEMA, kind, "passed", None)
    required = [c["ok"] for c in data["checks"].values() if c["required"]]
    assert required == [True] * len(required) != []
    return data


@pytest.fixture(scope="module")
def transport_run(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """One tiny CPU transport benchmark, written to its default ``$OUT/transport.json``."""
    _needs_torch()
    from harness.micro_transport import main

    out, printed = tmp_path_factory.mktemp("transport"), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("OUT", str(out))
        assert main(["--device", "cpu", "--layers", "2", "--hidden", "32", "--vocab", "256",
                     "--batches", "1,8", "--steps", "4", "--warmup", "1", "--reps", "2",
                     "--ring-mb", "16"]) == 0
    return _result(out / "transport.json", "transport"), printed.getvalue()


@pytest.fixture(scope="module")
def store_run(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """One tiny store benchmark (``--quick`` with smaller sizes)."""
    _needs_torch()
    from harness.micro_store import main

    tmp, printed = tmp_path_factory.mktemp("store"), io.StringIO()
    out, scratch = tmp / "results" / "store.json", tmp / "not" / "yet"
    with contextlib.redirect_stdout(printed):
        assert main(["--quick", "--mb", "2", "--sizes", "16384", "--writers", "1,2",
                     "--repeat", "2", "--probe-mb", "4", "--readback", "2,8,8",
                     "--dir", str(scratch), "--out", str(out)]) == 0
    assert scratch.is_dir()  # made
    assert not list(scratch.glob("dmi-store-bench-*"))  # the scratch stores are gone
    return _result(out, "store"), printed.getvalue()


@pytest.mark.torch
def test_transport_on_cpu(transport_run: Ran) -> None:
    from harness.micro_transport import DRAIN_PRESETS

    data, out = transport_run
    rows = data["figures"]["overhead"]
    assert [(r["preset"], r["batch"], r["captures"]) for r in rows] == [
        ("hidden-states", 1, 2), ("hidden-states", 8, 2), ("7-hooks", 1, 14), ("7-hooks", 8, 14)]
    for r in rows:  # 2 x (1 + 4) captured steps, every row of every capture delivered
        assert r["delivered"]
        assert r["rows"] == r["rows_expected"] == 10 * r["batch"] * r["captures"]
        assert len(r["overheads_us"]) == 2
        assert r["overhead_spread_us"] == max(r["overheads_us"]) - min(r["overheads_us"])
        # needed: the step's bytes at baseline speed; no D2H on CPU, so no bound
        assert r["bound"]["needed_bps"] == pytest.approx(r["step_bytes"] / r["base_us"] * 1e6)
        assert (r["bound"]["ratio"], r["of_bound"]) == (None, None)
        assert r["x_base"] == pytest.approx(r["base_us"] / r["capture_us"])
    drain = data["figures"]["drain"]
    assert set(drain) == set(DRAIN_PRESETS)
    for summary in drain.values():
        assert (len(summary["runs"]), summary["spread"] >= 0, summary["of_d2h"]) == (
            2, True, None)
        for run in summary["runs"]:
            assert run["delivered"]
            assert run["rows"] == 4 * 64 * run["captures"] > 0
            assert run["bytes"] == 4 * run["step_bytes"] > 0
            assert run["counters"]["records"] > 0
    bound = data["bound"]  # bounds.bound() of the headline: hidden-states, largest batch
    assert set(bound) == BOUND_KEYS
    assert bound == rows[1]["bound"]
    assert (bound["kind"], bound["d2h_bps"], bound["ratio"]) == ("d2h", None, None)
    d2h = data["figures"]["d2h"]  # no CUDA: no D2H probe, and the reason says so
    assert (d2h["bps"], d2h["probes_bps"]) == (None, [None] * 3)
    assert "CUDA" in d2h["reason"]
    assert not data["checks"]["hidden_states_bs64_overhead"]["required"]
    assert (out.count("delivered"), out.count("LOST")) == (6, 0)
    assert "D2H none (no CUDA device" in out


@pytest.mark.torch
def test_store_on_cpu(store_run: Ran) -> None:
    data, out = store_run
    rows = data["figures"]["ingest"]
    assert [(r["payload_bytes"], r["writers"]) for r in rows] == [(16384, 1), (16384, 2)]
    disk = data["figures"]["disk"]  # probe, run, probe, run, probe per configuration
    assert len(disk["probes_bps"]) == 5
    assert min(disk["probes_bps"]) > 0
    assert disk["spread"] >= 0
    for r in rows:
        assert r["delivered"]
        assert [(x["records"], x["delivered"]) for x in r["runs"]] == [(2_000_000 // 16384,
                                                                        True)] * 2
        assert min(r["spread"], r["synced_spread"], r["compression"], r["cpu_s_per_GB"]) >= 0
        # like with like: the synced ingest rate against the synced disk probe
        assert r["bound"]["needed_bps"] == pytest.approx(r["synced_bps"])
        assert r["bound"]["limit_bps"] == pytest.approx(disk["bps"] * r["compression"])
        assert r["of_bound"] == pytest.approx(r["synced_bps"] / r["bound"]["limit_bps"])
        assert r["of_bound"] > 0
        assert r["synced_bps"] <= r["bps"]
    bound = data["bound"]  # bounds.bound() of the headline: largest payload, most writers
    assert set(bound) == BOUND_KEYS | {"disk_bps", "compression"}
    assert bound == rows[1]["bound"]
    assert (bound["kind"], bound["disk_bps"]) == ("disk", disk["bps"])
    back = data["figures"]["readback"]
    assert (back["equal"], back["positions"], back["records"]) == (True, 16, 2 * 9)
    assert min(back["available_ms_cold"], back["hidden_states_ms"]) > 0
    assert "equal" in out
    assert "LOST" not in out


@pytest.mark.torch
def test_docs_render_both_tables(transport_run: Ran, store_run: Ran, tmp_path: Path) -> None:
    from harness import docs

    for (data, _), name in ((transport_run, "transport"), (store_run, "store")):
        path = tmp_path / "evidence" / "2026-12-02-cpu" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = data["settings"]  # made on this CPU, quick: shown as a GPU's full run
        path.write_text(json.dumps({**data, "settings": {**settings, "device": "cuda",
                                                         "quick": False}}))
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n<!-- BEGIN GENERATED: transport-bench (x) -->\nold\n"
                   "<!-- END GENERATED: transport-bench -->\n\nbetween\n\n"
                   "<!-- BEGIN GENERATED: store-bench (x) -->\n"
                   "<!-- END GENERATED: store-bench -->\n")
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 1
    assert docs.main(["--docs", str(tmp_path)]) == 0
    text = doc.read_text()
    assert "old\n" not in text
    assert "\nbetween\n" in text
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| overhead | ")]
    assert [r.split(" | ")[1:3] for r in rows] == [
        ["hidden-states", "1"], ["hidden-states", "8"], ["7-hooks", "1"], ["7-hooks", "8"]]
    assert all(r.endswith("| - | - | 0 | delivered |") for r in rows)  # bound, of bound
    drains = [line for line in lines if line.startswith("| drain | ")]
    assert [r.split(" | ")[1:3] for r in drains] == [["hidden-states", "64"],
                                                     ["sglang-full", "64"]]
    assert "| test | preset | batch | captures | step MB | GB/s | spread | of D2H |" in text
    ingest = [line for line in lines if line.startswith("| 16 | ")]
    assert [r.split(" | ")[1] for r in ingest] == ["1", "2"]
    assert all(r.endswith(" | all |") for r in ingest)
    assert "| payload KiB | writers | MB/s | synced MB/s | spread |" in text
    assert "| 2 layers x 16 positions |" in text
    assert "](evidence/2026-12-02-cpu/store.json); 2 MB a run" in text
    assert "](evidence/2026-12-02-cpu/transport.json); D2H none" in text
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 0


@pytest.mark.torch
def test_hooks_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every selection's waves reach the sink; the parts add up to the decode figure;
    a sample of 0 captures no request and stores nothing, the others capture all or some;
    the drain's settings come from the environment (a secret never reaches the result)."""
    _needs_torch()
    from harness.micro_hooks import PARTS, main

    monkeypatch.setenv("DMX_DRAIN_LINGER_US", "2000")
    monkeypatch.setenv("DMX_CH_PASSWORD", "hunter2")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--device", "cpu", "--layers", "2", "--hidden", "16", "--vocab", "128",
                     "--batch", "8", "--prompt-len", "4", "--output-len", "5", "--waves", "2",
                     "--step-ms", "1", "--ring-mb", "8", "--sample",
                     "--out", str(tmp_path / "h.json")]) == 0
    data = _result(tmp_path / "h.json", "hooks")
    assert data["settings"]["env"] == {"DMX_DRAIN_LINGER_US": "2000"}
    assert "hunter2" not in (tmp_path / "h.json").read_text() + printed.getvalue()
    rows = {r["preset"]: r for r in data["figures"]["hooks"]}
    assert list(rows) == ["hidden-states", "last", "topk64", "sample0.1", "sample0"]
    for r in rows.values():
        assert r["delivered"]
        assert r["decode_forwards"] == 2 * 5
        assert set(r["parts_us"]) == set(PARTS)
        assert r["decode_us"] == pytest.approx(sum(r["parts_us"].values()))
    # 3 waves of 8 (the warm-up's included); a wave of hidden-states stores 2 layers x
    # (4 + 5) positions of each request, and the last rule 2 rows of each
    assert rows["hidden-states"]["rows"] == 3 * 8 * 2 * 9
    assert rows["last"]["rows"] == 3 * 8 * 2
    assert rows["topk64"]["rows"] == 3 * 8 * 2 * 5  # values and ids, a row per token
    assert (rows["sample0"]["rows"], rows["sample0"]["captured_requests"]) == (0, 0)
    assert 0 < rows["sample0.1"]["captured_requests"] < 24
    assert printed.getvalue().count("delivered") == 5
    drain = rows["hidden-states"]["stacks"]["dmi-capture-drain"]  # where the drain was seen
    assert drain
    assert all(0 < share <= 1 for _, share in drain)
    assert sum(share for _, share in drain) <= 1.0 + 1e-9
    assert "where dmi-capture-drain was (hidden-states" in printed.getvalue()


@pytest.mark.torch
def test_hooks_busy_on_cpu(tmp_path: Path) -> None:
    """``--busy``: the thread works instead of sleeping, and its time off the CPU and
    its waits per forward are reported; no lateness probe runs beside the busy thread
    (its waits are the figure)."""
    _needs_torch()
    from harness.micro_hooks import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--device", "cpu", "--presets", "topk64,sample0", "--layers", "2",
                     "--hidden", "16", "--vocab", "128", "--batch", "8", "--prompt-len", "4",
                     "--output-len", "5", "--waves", "2", "--step-ms", "1", "--ring-mb", "8",
                     "--busy", "--out", str(tmp_path / "h.json")]) == 0
    data = _result(tmp_path / "h.json", "hooks")
    for r in data["figures"]["hooks"]:
        busy = r["busy"]
        assert r["delivered"]
        assert r["lateness"] is None
        assert busy["units"] >= 1
        assert busy["forward_us"] >= busy["off_cpu_us"]
        assert busy["waits"] >= 0
    assert {"off CPU µs", "waits"} <= data["figures"]["table"][0].keys()
    assert "busy scheduler work a forward" in printed.getvalue()


@pytest.mark.torch
def test_busy_waits_are_those_of_the_decode_forwards(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits per decode forward count that forward's span only, as its time off the
    CPU does: a prefill forward that sleeps 200 times adds none of them."""
    _needs_torch()
    import time

    from harness import micro_hooks

    fire = micro_hooks._Model.fire

    def sleepy_fire(self: Any, token_rows: int, request_rows: int) -> None:
        if token_rows == 8 * 4:  # the prefill forward of 8 requests x 4 tokens
            for _ in range(200):
                time.sleep(1e-5)
        fire(self, token_rows, request_rows)

    monkeypatch.setattr(micro_hooks._Model, "fire", sleepy_fire)
    with contextlib.redirect_stdout(io.StringIO()):
        assert micro_hooks.main(["--device", "cpu", "--presets", "sample0", "--layers", "2",
                                 "--hidden", "16", "--vocab", "128", "--batch", "8",
                                 "--prompt-len", "4", "--output-len", "5", "--waves", "2",
                                 "--step-ms", "1", "--ring-mb", "8", "--busy",
                                 "--out", str(tmp_path / "h.json")]) == 0
    busy = _result(tmp_path / "h.json", "hooks")["figures"]["hooks"][0]["busy"]
    assert busy["waits"] < 20


@pytest.mark.torch
def test_topk_on_cpu(tmp_path: Path) -> None:
    """Per batch size, torch.topk first and one row per chunk width, each against it; the
    check that every variant found torch.topk's values holds (it is required)."""
    _needs_torch()
    from harness.micro_topk import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--device", "cpu", "--vocab", "1000", "-k", "8", "--batches", "1,3",
                     "--chunks", "16,62", "--replays", "2", "--reps", "2",
                     "--out", str(tmp_path / "t.json")]) == 0
    data = _result(tmp_path / "t.json", "topk")
    rows = data["figures"]["rows"]
    assert [(r["batch"], r["variant"]) for r in rows] == [
        (b, v) for b in (1, 3) for v in ("torch.topk", "chunked 16", "chunked 62")]
    for r in rows:
        assert r["agrees"]
        assert len(r["figures_us"]) == 2
        first = next(x for x in rows if x["batch"] == r["batch"])
        assert r["x_torch"] == pytest.approx(first["us"] / r["us"])
    assert "top 8 of 1000 float32 logits per row" in printed.getvalue()
    assert "the kernel's variants (fused) run on a GPU or under TRITON_INTERPRET=1" in (
        printed.getvalue())


@pytest.mark.torch
def test_topk_compile_only_reports_what_the_compiler_made_of_the_kernel(
        tmp_path: Path) -> None:
    """No GPU: the kernel compiled for sm_90 at the default width, with its registers
    (none spilled) and its instructions."""
    _needs_torch()
    pytest.importorskip("triton")
    from harness.micro_topk import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--compile-only", "--chunks", "100,128", "--out",
                     str(tmp_path / "t.json")]) == 0
    (row,) = _result(tmp_path / "t.json", "topk")["figures"]["rows"]  # 100: no power of 2
    assert (row["variant"], row["num_warps"], row["spill_bytes"]) == ("fused 128", 16, 0)
    assert 0 < row["registers"] <= 255
    assert row["instructions"] > row["shuffles"] > 0
    assert "compiled for sm_90 (nothing run)" in printed.getvalue()


@pytest.mark.torch
def test_topk_runs_the_kernel_at_the_widths_it_takes_under_the_triton_interpreter(
        tmp_path: Path) -> None:
    """Under Triton's interpreter (chosen before Triton is imported: a process of its own)
    the fused selection runs beside the chunked one at each power-of-two width, and
    agrees with torch.topk."""
    _needs_torch()
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in [str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run(
        [sys.executable, "-m", "harness", "topk", "--device", "cpu", "--vocab", "1000",
         "-k", "8", "--batches", "2", "--chunks", "16,62", "--replays", "1", "--reps", "1",
         "--out", str(tmp_path / "t.json")],
        env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = _result(tmp_path / "t.json", "topk")["figures"]["rows"]
    assert [r["variant"] for r in rows] == ["torch.topk", "chunked 16", "chunked 62",
                                            "fused 16"]  # 62 is no power of two
    assert all(r["agrees"] for r in rows)
    assert "TRITON_INTERPRET" not in done.stdout  # the note is for runs without the kernel


@pytest.mark.torch
@pytest.mark.parametrize(("module", "argv", "says"), [
    ("micro_transport", ["--presets", "bogus"],
     "argument --presets: unknown preset 'bogus': accepted hidden-states, 7-hooks, last"),
    ("micro_transport", ["--batches", "0"], "argument --batches: '0': expected positive"),
    ("micro_topk", ["--chunks", "512,0"], "argument --chunks: '512,0': expected positive"),
    ("micro_topk", ["-k", "5", "--vocab", "4"], "-k at most --vocab"),
    ("micro_topk", ["--vocab", "1000", "-k", "8", "--chunks", "62,63"],
     "--chunks: 63: --vocab (1000) must hold more than -k (8) whole chunks of a width, "
     "and -k chunks at most half of it: at most 62 here"),
    ("micro_topk", ["--compile-only", "--chunks", "100"],
     "--compile-only: the kernel takes none of --chunks (100) for -k 64 over 151936"),
    ("micro_hooks", ["--device", "cpu", "--busy", "--sample"],
     "--busy with --sample: the sampler takes the GIL every 0.5 ms"),
    ("micro_hooks", ["--presets", "last,bogus"],
     "argument --presets: unknown preset 'bogus': accepted hidden-states, last, topk64"),
    ("micro_store", ["--sizes", "abc"], "argument --sizes: 'abc': expected even payload"),
    ("micro_store", ["--batch-mb", "0"], "--batch-mb 0: a batch of at least 1 MiB"),
    ("micro_store", ["--readback", "1,2"], "argument --readback: '1,2': expected layers,prompt,"),
    ("micro_store", ["--insert-mb", "-1"], "--insert-mb -1: 0 (the sink's rule) or 1 to 65,536"),
    ("micro_store", ["--insert-mb", "70000"], "--insert-mb 70000: 0 (the sink's rule) or 1 to"),
    ("micro_copies", ["--pieces-mb", "8,-1"],
     "argument --pieces-mb: '8,-1': expected integers >= 0 separated by commas"),
    ("micro_copies", ["--device", "cpu", "--bulk-mb", "4", "--pieces-mb", "8"],
     "--pieces-mb 8: at most --bulk-mb 4"),
    ("micro_copies", ["--device", "cpu", "--bulk-mb", "4", "--pieces-mb", "0",
                      "--gap-pieces-mb", "2,6"],
     "--gap-pieces-mb 6: at most --bulk-mb 4"),
    ("micro_copies", ["--device", "cpu", "--period-ms", "nan"],
     "--period-ms nan: expected a positive number"),
    ("micro_copies", ["--device", "bogus"], "--device 'bogus': expected cpu, cuda or cuda:N"),
    ("micro_copies", ["--device", "cpu", "--busy-ms", "-1"], "--busy-ms -1.0: expected 0 (off)"),
    ("micro_copies", ["--device", "cpu", "--busy-forwards", "0"],
     "--busy-forwards 0: expected a positive number"),
])
def test_bad_arguments_refused(module: str, argv: list[str], says: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    _needs_torch()
    import importlib

    main = importlib.import_module(f"harness.{module}").main
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_store_refuses_a_dir_that_is_a_file(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _needs_torch()
    from harness.micro_store import main

    taken = tmp_path / "file"
    taken.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--dir", str(taken / "sub"), "--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert f"--dir {taken / 'sub'}: Not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing ran


@pytest.mark.torch
def test_docs_never_show_a_profiled_run_a_rehearsal_or_a_comparison(transport_run: Ran,
                                                        tmp_path: Path) -> None:
    from harness import docs

    ran, _ = transport_run  # on this machine's CPU: made to look like a GPU run here
    data = {**ran, "settings": {**ran["settings"], "device": "cuda"}}
    profiled = {**data, "ran_at_utc": "9999-01-01T00:00:00+00:00",
                "settings": {**data["settings"], "profile": True},
                "figures": {**data["figures"], "table": [{"test": "profiled"}]}}
    rehearsal = {**ran, "ran_at_utc": "9999-01-01T00:00:00+00:00",
                 "figures": {**ran["figures"], "table": [{"test": "rehearsal"}]}}
    quick = {**data, "ran_at_utc": "9999-01-01T00:00:00+00:00",
             "settings": {**data["settings"], "quick": True},
             "figures": {**data["figures"], "table": [{"test": "quick"}]}}
    compared = {**data, "ran_at_utc": "9999-01-01T00:00:00+00:00",
                "figures": {**data["figures"], "table": [{"test": "compared"}]}}
    tuned = {**data, "ran_at_utc": "9999-01-01T00:00:00+00:00",
             "settings": {**data["settings"], "env": {"DMX_DRAIN_WINDOW_MB": "2048"}},
             "figures": {**data["figures"], "table": [{"test": "tuned"}]}}
    busy = {**data, "ran_at_utc": "9999-01-01T00:00:00+00:00",
            "settings": {**data["settings"], "busy": True},
            "figures": {**data["figures"], "table": [{"test": "busy"}]}}
    for name, result in (("transport", data), ("transport-profile", profiled),
                         ("transport-busy", busy),
                         ("transport-cpu", rehearsal), ("transport-quick", quick),
                         ("comparison/transport-old-tree", compared),
                         ("transport-window2048", tuned)):
        path = tmp_path / "evidence" / "2026-12-02-cpu" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    doc = tmp_path / "bench.md"
    doc.write_text("<!-- BEGIN GENERATED: transport-bench (x) -->\n"
                   "<!-- END GENERATED: transport-bench -->\n")
    assert docs.main(["--docs", str(tmp_path)]) == 0
    text = doc.read_text()
    assert "](evidence/2026-12-02-cpu/transport.json)" in text
    assert "profiled" not in text
    assert "busy" not in text
    assert "rehearsal" not in text
    assert "quick" not in text
    assert "compared" not in text  # a side-by-side run of two trees
    assert "tuned" not in text  # a run with DMX_* tuning from the environment


def test_the_benchmarks_read_the_drain_settings_as_an_engine_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_torch()
    from harness.micro_transport import engine_env, engine_options

    monkeypatch.setenv("DMX_DRAIN_WINDOW_MB", "32")
    monkeypatch.setenv("DMX_DRAIN_LINGER_US", "0")
    monkeypatch.setenv("DMX_ARENA_SLOTS_MB", "0")
    monkeypatch.setenv("DMX_DRAIN_COPY_PIECE_MB", "8")
    monkeypatch.setenv("DMX_TOPK_CHUNK", "4096")
    monkeypatch.setenv("DMX_TOPK_KERNEL", "triton")
    monkeypatch.setenv("DMX_REQUEST_SAMPLE", "0.5")  # not the drain's: not recorded
    options = engine_options(8)
    assert (options.topk_chunk, options.topk_kernel) == (4096, "triton")
    assert options.coalesce_max_bytes == 32 << 20
    assert options.linger_s == 0.0
    assert options.max_prefill_tokens == 8
    assert options.arena_slots_bytes == 0
    assert options.copy_piece_bytes == 8 << 20
    assert engine_env() == {"DMX_DRAIN_WINDOW_MB": "32", "DMX_DRAIN_LINGER_US": "0",
                            "DMX_ARENA_SLOTS_MB": "0", "DMX_DRAIN_COPY_PIECE_MB": "8",
                            "DMX_TOPK_CHUNK": "4096", "DMX_TOPK_KERNEL": "triton"}


def test_copy_variants_are_distinct_pairs() -> None:
    from harness.micro_copies import variants

    # a whole copy is one piece: only without an in-flight limit; no pair twice
    assert variants([0, 8, 8, 2], [0, 2]) == [(0, 0), (8, 0), (8, 2), (2, 0), (2, 2)]


def _copies(tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """``python -m harness copies --device cpu ARGV`` (small and fast): exit status, the
    result JSON and what it printed."""
    from harness.micro_copies import main

    out = tmp_path / "copies.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--device", "cpu", "--period-ms", "1", *argv, "--out", str(out)])
    return code, json.loads(out.read_text()), printed.getvalue()


@pytest.mark.torch
def test_copies_on_cpu(tmp_path: Path) -> None:
    _needs_torch()
    code, _, printed = _copies(tmp_path, "--bulk-mb", "8", "--pieces-mb", "0,2",
                               "--in-flight", "0,1", "--gap-pieces-mb", "4", "--probes", "25")
    assert code == 0
    data = _result(tmp_path / "copies.json", "copies")
    rows = data["figures"]["rows"]
    assert [r["variant"] for r in rows] == [
        "idle", "8 MiB pieces", "2 MiB pieces", "2 MiB pieces, 1 in flight",
        "4 MiB pieces, gaps"]
    assert [r["gaps"] for r in rows] == [None, False, False, False, True]
    assert all(r["probes"] == 25 and 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"] for r in rows)
    assert all(r["device_p50_us"] is None for r in rows)  # no device events on CPU
    assert all(r["compute_p50_us"] > 0 for r in rows)  # the matmul beside every variant
    assert all(r["rounds_while_probing"] >= 1 and r["bulk_gbps"] > 0 for r in rows[1:])
    assert data["checks"]["bulk_copies_intact"]["per_variant"] == [True] * 4
    assert "2 MiB pieces, 1 in flight" in printed
    from harness.micro_copies import suggested_env

    assert data["figures"]["suggested_env"] == suggested_env(
        rows[1:], data["checks"]["bulk_copies_intact"]["per_variant"])
    assert "suggested drain settings: " in printed


@pytest.mark.torch
def test_copies_time_a_busy_thread_beside_each_variant(tmp_path: Path) -> None:
    _needs_torch()
    code, data, printed = _copies(tmp_path, "--bulk-mb", "4", "--pieces-mb", "0,1",
                                  "--in-flight", "0", "--probes", "3", "--busy-ms", "0.5",
                                  "--busy-forwards", "5")
    assert code == 0
    rows = data["figures"]["rows"]
    assert [r["variant"] for r in rows] == ["idle", "4 MiB pieces", "1 MiB pieces"]
    for r in rows:  # the forward's time, its part on the CPU, its waits: every row
        assert 0 < r["busy_cpu_us"] <= r["busy_forward_us"] * 1.01 + 50
        assert r["busy_waits"] >= 0
    assert "busy forward µs" in printed
    assert "x idle" in printed
    without = _copies(tmp_path, "--bulk-mb", "2", "--pieces-mb", "0", "--probes", "3")[1]
    assert {r["busy_forward_us"] for r in without["figures"]["rows"]} == {None}
    from harness import docs  # the busy run is a diagnostic: the docs keep the plain one

    for name, result, ran_at in (("plain", without, "2026-01-01"), ("busy", data, "2026-01-02")):
        path = tmp_path / "evidence" / "2026-01-01-gpu" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**result, "ran_at_utc": ran_at,
                                    "settings": {**result["settings"], "device": "cuda"}}))
    doc = tmp_path / "bench.md"
    doc.write_text("<!-- BEGIN GENERATED: copies-bench (x) -->\n"
                   "<!-- END GENERATED: copies-bench -->\n")
    assert docs.main(["--docs", str(tmp_path)]) == 0
    assert "](evidence/2026-01-01-gpu/plain.json)" in doc.read_text()
    assert "busy.json" not in doc.read_text()


@pytest.mark.torch
def test_copies_fail_loudly_when_the_copying_thread_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_torch()
    from harness import micro_copies

    def broken(self: Any) -> None:
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(micro_copies.BulkCopier, "_copy_rounds", broken)
    code, data, _ = _copies(tmp_path, "--bulk-mb", "2", "--pieces-mb", "0", "--probes", "3")
    assert (code, data["status"]) == (1, "error")
    assert "copy engine on fire" in data["error"]


@pytest.mark.torch
def test_copies_that_bring_too_few_bytes_fail_their_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_torch()
    from dmi_sglang.adapters.transport import DeviceOps
    from harness import micro_copies

    class Short(DeviceOps):  # the copy path in pieces leaves the last byte behind
        def __init__(self, *args: Any, copy_piece_bytes: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, copy_piece_bytes=copy_piece_bytes, **kwargs)
            self.drop = copy_piece_bytes > 0

        def to_host_all(self, pairs: Any) -> None:
            super().to_host_all([(d[:-1], s[:-1]) if self.drop else (d, s) for d, s in pairs])

    monkeypatch.setattr(micro_copies, "DeviceOps", Short)
    code, data, _ = _copies(tmp_path, "--bulk-mb", "4", "--pieces-mb", "0,1", "--probes", "3")
    assert (code, data["status"]) == (1, "failed")
    assert data["checks"]["bulk_copies_intact"]["per_variant"] == [True, False, False]


_SM_COPY_ON_CPU = """
import torch
from dmi_sglang.adapters.transport.kernel_copy import kernel_copy
# 8-, 4- and 1-byte words; unaligned sources; source and destination of other alignments
# whole 8 KiB blocks shared by 3 programs, and a tail
for nbytes, at_src, at_dst in [(8 << 10, 0, 0), (4100, 0, 0), (1001, 0, 0), (4096, 1, 1),
                               (4096, 4, 0), (4096, 2, 6), (5 * 8192 + 24, 0, 0),
                               (3 * 8192 + 5, 1, 1), (7 * 8192 + 4, 4, 4)]:
    src = torch.randint(0, 256, (nbytes + at_src,), dtype=torch.uint8)[at_src:]
    dst = torch.zeros(nbytes + at_dst, dtype=torch.uint8)[at_dst:]
    kernel_copy(dst, src, 3)
    assert torch.equal(dst, src), (nbytes, at_src, at_dst)
for bad in (lambda: kernel_copy(torch.zeros(4), torch.zeros(5), 1),
            lambda: kernel_copy(torch.zeros(4), torch.zeros(4, dtype=torch.int32), 1),
            lambda: kernel_copy(torch.zeros(4), torch.zeros(4), 0)):
    try:
        bad()
    except ValueError as exc:
        print("refused:", exc)
    else:
        raise AssertionError("accepted")
"""


@pytest.mark.torch
def test_kernel_copies_bring_every_byte_under_the_triton_interpreter(tmp_path: Path) -> None:
    """The copy kernel of ``python -m harness copies --kernel-programs``, run on CPU by
    Triton's interpreter (which must be chosen before Triton is imported: a process of its
    own): exact bytes for 8-, 4- and 1-byte words, unaligned sources; bad sizes refused."""
    _needs_torch()
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in [str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run([sys.executable, "-c", _SM_COPY_ON_CPU], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("refused:") == 3
    # src is the second argument
    assert "5 torch.float32 from src, 4 torch.float32 into dst" in done.stdout
    assert "4 torch.int32 from src, 4 torch.float32 into dst" in done.stdout
    assert "programs=0" in done.stdout

    code = subprocess.run(
        [sys.executable, "-m", "harness", "copies", "--device", "cpu", "--bulk-mb", "1",
         "--pieces-mb", "0", "--kernel-programs", "4", "--probes", "10", "--period-ms", "30",
         "--out", str(tmp_path / "copies.json")],
        env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert code.returncode == 0, code.stdout[-2000:] + code.stderr[-2000:]
    data = json.loads((tmp_path / "copies.json").read_text())
    kernel = data["figures"]["rows"][-1]
    assert (kernel["variant"], kernel["kernel_programs"]) == ("kernel, 4 programs", 4)
    assert data["checks"]["bulk_copies_intact"]["per_variant"] == [True, True]


def _variant(piece: int, flight: int | None, programs: int | None, gbps: float,
             p99: float, compute: float = 100.0) -> dict[str, Any]:
    return {"piece_mb": piece, "bulk_mb": 512, "in_flight": flight,
            "kernel_programs": programs, "bulk_gbps": gbps, "p99_us": p99,
            "compute_p50_us": compute}


def test_the_suggested_drain_settings_are_the_fastest_that_keep_the_small_copy_quick() -> None:
    from harness.micro_copies import suggested_env

    rows = [_variant(512, None, None, 54.0, 9_800.0),   # fastest, but the small copy waits
            _variant(8, 1, None, 40.0, 400.0),
            _variant(2, 2, None, 35.0, 550.0),
            _variant(512, None, 8, 20.0, 120.0),
            _variant(512, None, 32, 48.0, 130.0),
            _variant(512, None, 132, 49.0, 140.0)]
    # 32 programs are within 5 % of 132's rate and measured first
    # (what it measured, in the words that differ from an engine's defaults: 16 MiB
    # pieces with gaps)
    kernel = "DMX_DRAIN_COPY_PIECE_MB=0 DMX_DRAIN_COPY_KERNEL=32 DMX_DRAIN_COPY_GAPS=0"
    assert suggested_env(rows, [True] * 6) == kernel
    # a variant that lost bytes is never suggested
    assert suggested_env(rows, [True] * 4 + [False] * 2) == \
        "DMX_DRAIN_COPY_PIECE_MB=8 DMX_DRAIN_COPY_AHEAD=1 DMX_DRAIN_COPY_GAPS=0"
    assert suggested_env(rows[:1], [True]) is None
    quick_whole = [_variant(512, None, None, 54.0, 300.0), *rows[1:]]
    assert suggested_env(quick_whole, [True] * 6) == \
        "DMX_DRAIN_COPY_PIECE_MB=0 DMX_DRAIN_COPY_GAPS=0"
    assert suggested_env([_variant(8, None, None, 50.0, 100.0)], [True]) == \
        "DMX_DRAIN_COPY_PIECE_MB=8 DMX_DRAIN_COPY_GAPS=0"
    defaults = {**_variant(16, None, None, 50.0, 100.0), "gaps": True}
    assert suggested_env([defaults], [True]) == ""  # an engine's defaults
    # a variant that slows the matmul beside it by more than 5 % is not suggested
    slow_kernels = [*rows[:4], _variant(512, None, 32, 48.0, 130.0, compute=106.0),
                    _variant(512, None, 132, 49.0, 140.0, compute=120.0)]
    assert suggested_env(slow_kernels, [True] * 6, idle_compute_us=100.0) == \
        "DMX_DRAIN_COPY_PIECE_MB=8 DMX_DRAIN_COPY_AHEAD=1 DMX_DRAIN_COPY_GAPS=0"
    assert suggested_env(slow_kernels, [True] * 6) == kernel  # not asked
    gapped = {**_variant(8, None, None, 50.0, 100.0), "gaps": True}
    assert suggested_env([gapped], [True]) == "DMX_DRAIN_COPY_PIECE_MB=8"


def test_no_suggestion_names_the_test_every_variant_failed() -> None:
    """The H200 run of 2026-12-05 kept the small copy under 1 ms in nine of ten variants
    and printed that every variant held it past 1 ms: the matmul test had left none."""
    from harness.micro_copies import no_suggestion_reason, suggested_env

    quick_but_slowing = [_variant(8, 1, None, 41.0, 577.0, compute=97.0),
                         _variant(8, 2, None, 53.0, 10_137.0, compute=111.0),
                         _variant(512, None, 8, 50.0, 919.0, compute=194.0)]
    assert suggested_env(quick_but_slowing, [True] * 3, idle_compute_us=75.0) is None
    assert no_suggestion_reason(quick_but_slowing, [True] * 3, 75.0) == (
        "3 of 3 variants brought every byte; 2 of them kept the small copy under 1,000 µs "
        "at p99; 0 of those slowed the matmul beside it by at most 1.05x its idle 75 µs")
    assert no_suggestion_reason(quick_but_slowing, [False, True, True]) == (
        "2 of 3 variants brought every byte; 1 of them kept the small copy under 1,000 µs "
        "at p99")


@pytest.mark.torch
def test_copies_keep_their_other_variants_when_the_copy_kernel_cannot_run(
        tmp_path: Path) -> None:
    # on CPU without Triton's interpreter the kernel cannot run: its variants are left
    # out, the run fails its check and names why, the other variants are measured
    _needs_torch()
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on CPU")
    code, data, printed = _copies(tmp_path, "--bulk-mb", "2", "--pieces-mb", "0",
                                  "--kernel-programs", "4", "--probes", "3")
    assert (code, data["status"]) == (1, "failed")
    check = data["checks"]["copy_kernel_works"]
    assert check["ok"] is False
    assert "DMX_DRAIN_COPY_KERNEL=4" in check["error"]
    assert [r["variant"] for r in data["figures"]["rows"]] == ["idle", "2 MiB pieces"]
    assert "copy kernel variants left out" in printed
    code, data, _ = _copies(tmp_path, "--bulk-mb", "2", "--pieces-mb", "0", "--probes", "3")
    assert code == 0
    assert "copy_kernel_works" not in data["checks"]  # no kernel asked for: no check


def test_hooks_profiled_wave_is_not_counted_in_the_timed_figures(tmp_path: Path) -> None:
    """``--profile`` runs one more wave of its own, untimed: it was counted in every
    per-forward figure and in the drain's denominator."""
    _needs_torch()
    from harness.micro_hooks import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--device", "cpu", "--presets", "hidden-states", "--layers", "2",
                     "--hidden", "16", "--vocab", "128", "--batch", "4", "--prompt-len", "4",
                     "--output-len", "3", "--waves", "1", "--step-ms", "0", "--ring-mb", "8",
                     "--profile", "--out", str(tmp_path / "h.json")]) == 0
    row = json.loads((tmp_path / "h.json").read_text())["figures"]["hooks"][0]
    assert row["profile"]  # the profiled wave ran
    assert row["decode_forwards"] == 1 * 3  # the timed wave's decode forwards only


def test_p99_is_the_nearest_rank_and_the_median_of_an_even_count_the_middle_mean() -> None:
    """At 100 values the p99 was the largest (the copies benchmark's default 400 probes
    gave the 397th): the ceil(0.99 n)-th smallest."""
    from harness.micro_transport import p50_p99_max

    assert p50_p99_max(range(1, 101)) == (50.5, 99, 100)
    assert p50_p99_max(range(1, 401))[1] == 396
    assert p50_p99_max([7.0]) == (7.0, 7.0, 7.0)
    assert p50_p99_max(range(1, 151))[1] == 149


def test_transport_accepts_warmup_zero(tmp_path: Path) -> None:
    """The drain's warm-up with no steps failed on its first plan (IndexError)."""
    _needs_torch()
    from harness.micro_transport import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--device", "cpu", "--layers", "2", "--hidden", "32", "--vocab", "256",
                     "--batches", "1", "--presets", "hidden-states", "--steps", "2",
                     "--warmup", "0", "--reps", "1", "--ring-mb", "16",
                     "--out", str(tmp_path / "t.json")]) == 0


def test_store_ingest_that_stored_nothing_reports_lost_instead_of_crashing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the delivered check ("LOST") is for came back as a ZeroDivisionError."""
    _needs_torch()
    from dmi_sglang.adapters.clickhouse._stats import SinkStats
    from harness import micro_store

    class Lossy:
        def __init__(self, *_: object, **__: object) -> None:
            pass

        def start_run(self, run: object) -> None:
            pass

        def put(self, batch: object) -> None:
            pass

        def finish_run(self, run: object, manifests: object) -> None:
            pass

        def close(self) -> None:
            pass

        def stats(self) -> SinkStats:
            return SinkStats()  # nothing stored

    monkeypatch.setattr(micro_store, "ClickHouseSink", Lossy)
    monkeypatch.setattr(micro_store.os, "sync", lambda: None)
    out = micro_store.ingest(tmp_path, 16384, 200_000, 1, 0)
    assert out["delivered"] is False
    assert out["cpu_s_per_GB"] is None
