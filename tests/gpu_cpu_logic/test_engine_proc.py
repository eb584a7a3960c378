"""engine_proc: model configs, workloads, expected capture sizes, log parsing, deadlines."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest


def test_real_model_shapes(ep: Any) -> None:
    small, big = ep.qwen3_config(ep.MODELS["0.6b"]), ep.qwen3_config(ep.MODELS["8b"])
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"],
            small["num_key_value_heads"], small["head_dim"], small["intermediate_size"],
            small["vocab_size"], small["tie_word_embeddings"]) == (
        1024, 28, 16, 8, 128, 3072, 151936, True)
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_attention_heads"],
            big["num_key_value_heads"], big["head_dim"], big["intermediate_size"],
            big["vocab_size"], big["tie_word_embeddings"]) == (
        4096, 36, 32, 8, 128, 12288, 151936, False)
    assert small["architectures"] == ["Qwen3ForCausalLM"]


def test_write_model_dir(ep: Any, tmp_path: Path) -> None:
    path = ep.write_model_dir(tmp_path, ep.MODELS["0.6b"])
    assert path.name == "qwen3-0.6b"
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 1024
    assert ep.write_model_dir(tmp_path, ep.MODELS["0.6b"]) == path  # idempotent


def test_engine_kwargs_force_what_monitoring_forces(ep: Any) -> None:
    graph = ep.base_engine_kwargs("/m", graphs=True)
    eager = ep.base_engine_kwargs("/m", graphs=False, overlap=False)
    for kw in (graph, eager):
        assert kw["disable_prefill_cuda_graph"] is True
        assert kw["disable_radix_cache"] is True
        assert kw["load_format"] == "dummy"
        assert kw["skip_tokenizer_init"] is True
        assert kw["attention_backend"] == "triton"
        assert kw["sampling_backend"] == "pytorch"
        assert kw["random_seed"] == ep.SEED
    assert graph["cuda_graph_max_bs_decode"] == 64
    assert "disable_cuda_graph" not in graph
    assert "disable_overlap_schedule" not in graph
    assert eager["disable_cuda_graph"] is True
    assert eager["disable_overlap_schedule"] is True


def test_workloads_are_deterministic_and_valid(ep: Any) -> None:
    w = ep.Workload("bs8", ep.spread(8, 10, 120), ep.spread(8, 16, 40))
    ids = w.input_ids()
    assert ids == w.input_ids()
    assert [len(x) for x in ids] == list(w.prompt_lens)
    assert all(0 <= t < ep.TOKEN_ID_LIMIT for x in ids for t in x)
    assert ep.Workload("other", w.prompt_lens, w.output_lens).input_ids() != ids
    again = w.again()
    assert again.input_ids() == ids
    assert set(again.rids()).isdisjoint(w.rids())
    spec = w.spec()
    assert spec["rids"] == [f"bs8-{i}" for i in range(8)]
    assert [p["max_new_tokens"] for p in spec["sampling_params"]] == list(w.output_lens)
    assert all(p["temperature"] == 0 and p["ignore_eos"] for p in spec["sampling_params"])
    assert w.prompt_tokens == sum(w.prompt_lens)
    assert ep.spread(8, 10, 120)[0] == 10
    assert ep.spread(8, 10, 120)[-1] == 120
    with pytest.raises(ValueError, match="prompts"):
        ep.Workload("bad", (1, 2), (3,))
    with pytest.raises(ValueError, match="outputs >= 2"):
        ep.Workload("bad", (1,), (1,))


def test_expected_capture_hidden_states(ep: Any) -> None:
    model = ep.MODELS["0.6b"]
    exp = ep.expected_capture("hidden-states", model, [(10, 5, True), (10, 5, False)])
    rows = 28 * (15 + 14)
    assert exp.rows == rows
    assert exp.bytes == rows * 1024 * 2
    assert exp.by_act == {"blocks.hook_resid_pre": [rows, rows * 2048]}


def test_expected_capture_full_counts_logits_per_generated_token(ep: Any) -> None:
    model = ep.MODELS["0.6b"]
    exp = ep.expected_capture("sglang-full", model, [(10, 5, True)])
    assert exp.by_act["final_logits"] == [5, 5 * 151936 * 4]
    assert exp.by_act["token_ids"] == [15, 15 * 8]
    assert exp.by_act["blocks.attn.hook_q"] == [28 * 15, 28 * 15 * 16 * 128 * 2]
    assert "blocks.attn.hook_pattern" not in exp.by_act


def test_transport_rows_check(ep: Any) -> None:
    model = ep.MODELS["0.6b"]
    reqs = [(10, 5), (20, 3)]
    full = ep.expected_capture("hf-only", model, [(p, c, True) for p, c in reqs])
    none = ep.expected_capture("hf-only", model, [(p, c, False) for p, c in reqs])
    one = ep.expected_capture("hf-only", model, [(10, 5, True), (20, 3, False)])
    ok = ep.check_transport_rows({"rows": full.rows, "bytes": full.bytes}, "hf-only",
                                 model, reqs)
    assert ok["ok"]
    assert ok["requests_with_extra_forward"] == 2
    assert ep.check_transport_rows({"rows": none.rows, "bytes": none.bytes}, "hf-only",
                                   model, reqs)["requests_with_extra_forward"] == 0
    assert ep.check_transport_rows({"rows": one.rows, "bytes": one.bytes}, "hf-only",
                                   model, reqs)["ok"]
    assert not ep.check_transport_rows({"rows": full.rows - 1, "bytes": full.bytes},
                                       "hf-only", model, reqs)["ok"]
    assert not ep.check_transport_rows({"rows": full.rows, "bytes": full.bytes + 2},
                                       "hf-only", model, reqs)["ok"]
    assert not ep.check_transport_rows({}, "hf-only", model, reqs)["ok"]
    logits = ep.expected_capture("logits", model, [(p, c, True) for p, c in reqs])
    assert ep.check_transport_rows({"rows": logits.rows, "bytes": logits.bytes}, "logits",
                                   model, reqs)["ok"]


LOG = "\n".join([
    "2026-11-29 16:33:42 [info     ] dmi.prepared                   captures=53 "
    "hooks=['token_ids', 'embed'] run_id=r1",
    "\x1b[2m2026-11-29 16:33:45\x1b[0m [info     ] dmi.stopped                    "
    "bytes=66928512 forced_eager=0 piecewise_steps=1 ring_high_water=4982784 rows=132405 "
    "run_id=qwen3-demo-20261129T163314-f29496 stall_seconds=0.0 stalls=0 steps=14 tensors=742",
    "2026-11-29 16:33:45 [info     ] store.closed                   bytes_put=66928512 "
    "bytes_stored=66928512 insert_seconds=0.2597930190000852 inserts=2 "
    "url=chdb:///tmp/e2e/store note='two words=3' writer_cpu_seconds=0.06",
    "[16:33:44] unrelated SGLang line dmi.stopped=not-an-event",
    '{"event": "dmi.stopped", "bytes": 5, "rows": 1}',
    "",
])


def test_parse_log_events(ep: Any) -> None:
    events = ep.parse_log_events(LOG, ep.STAT_EVENTS)
    assert events["dmi.stopped"] == {"event": "dmi.stopped", "bytes": 5, "rows": 1}
    closed = events["store.closed"]
    assert closed["bytes_stored"] == 66928512
    assert closed["insert_seconds"] == pytest.approx(0.2598, rel=1e-3)
    assert closed["url"] == "chdb:///tmp/e2e/store"
    assert closed["note"] == "two words=3"
    assert events["dmi.prepared"]["hooks"] == "['token_ids', 'embed']"
    console_only = ep.parse_log_events(LOG.replace('{"event"', "{'x"), ["dmi.stopped"])
    stopped = console_only["dmi.stopped"]
    assert stopped["rows"] == 132405
    assert stopped["stall_seconds"] == 0.0
    assert stopped["run_id"] == "qwen3-demo-20261129T163314-f29496"


def test_call_deadline(ep: Any) -> None:
    now = 10_000.0
    assert ep.call_deadline(0, now=now) is None
    assert ep.call_deadline(100, now=now) == now + 100
    env = {"DMI_CALL_STARTED_EPOCH": str(now - 200)}
    assert ep.call_deadline(None, now=now, env=env) == now - 200 + 600 - 45
    assert ep.call_deadline(None, now=now, env={}, parent_elapsed_s=100) == now - 100 + 555
    # A parent older than one call is an interactive shell: start counting now.
    assert ep.call_deadline(None, now=now, env={}, parent_elapsed_s=5000) == now + 555
    stale = {"DMI_CALL_STARTED_EPOCH": str(now - 5000)}
    assert ep.call_deadline(None, now=now, env=stale) == now + 555


def _fake_engine_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_run_engine.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_launch_parses_stats_and_kills_leftovers(ep: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    script = _fake_engine_script(tmp_path, """\
        import json, subprocess, sys
        spec = json.load(open(sys.argv[1]))
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("2026-01-01 00:00:00 [info     ] dmi.stopped   bytes=7 rows=3", flush=True)
        json.dump({"ok": True, "env_seen": spec["env"]}, open(sys.argv[2], "w"))
        """)
    monkeypatch.setattr(ep, "RUN_ENGINE", script)
    monkeypatch.setenv("DMX_HOOK_SELECTION", "sglang-full")  # must not leak into stock runs
    res = ep.launch({"env": {"DMX_SGLANG_ENABLE": "0"}}, tmp_path / "w", "stock", 60,
                    reap_grace_s=0.5)
    assert res["ok"]
    assert res["env_seen"] == {"DMX_SGLANG_ENABLE": "0"}
    assert res["events"]["dmi.stopped"] == {"bytes": 7, "rows": 3}
    assert res["leftover_processes"] is True
    assert not res["timed_out"]
    assert Path(res["log"]).exists()


def test_launch_times_out_and_reports(ep: Any, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    script = _fake_engine_script(tmp_path, "import time; time.sleep(60)\n")
    monkeypatch.setattr(ep, "RUN_ENGINE", script)
    res = ep.launch({"env": {}}, tmp_path / "w", "slow", 1.0, reap_grace_s=0.5)
    assert not res["ok"]
    assert res["timed_out"]
    assert "timed out" in res["error"]


def test_child_env_drops_dmx(ep: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMX_DB_URL", "none")
    env = ep.child_env({"DMX_SGLANG_ENABLE": "0"})
    assert "DMX_DB_URL" not in env
    assert env["DMX_SGLANG_ENABLE"] == "0"
    assert env["PATH"] == os.environ["PATH"]


def test_git_info_and_hash(ep: Any) -> None:
    info = ep.git_info(env={})
    assert len(info["commit"]) >= 7
    assert "git_head" not in info
    named = ep.git_info(env={"DMI_COMMIT": "124c490"})
    assert named["commit"] == "124c490"
    assert named["git_head"] == info["commit"]
    assert named["dirty"] is None
    assert named["code"] == info["code"]
    assert info["code"] == ep.code_fingerprint()
    assert len(info["code"]) == 12
    assert ep.stable_hash({"a": 1, "b": [2]}) == ep.stable_hash({"b": [2], "a": 1})
    assert sys.executable


def test_track_engines_kills_only_recorded_engine_groups(ep: Any, tmp_path: Path) -> None:
    import subprocess

    engine = tmp_path / "run_engine.py"
    engine.write_text("import time\ntime.sleep(60)\n")
    other = tmp_path / "unrelated.py"
    other.write_text("import time\ntime.sleep(60)\n")
    a = subprocess.Popen([sys.executable, str(engine)], start_new_session=True)
    b = subprocess.Popen([sys.executable, str(other)], start_new_session=True)
    try:
        pids = tmp_path / "state" / "engines.pgids"
        pids.parent.mkdir()
        pids.write_text(f"{a.pid}\n{b.pid}\n")
        assert ep.track_engines(pids, settle_s=0.1) == [a.pid]
        assert a.wait(timeout=10) != 0
        assert b.poll() is None  # not an engine: left alone
        assert pids.read_text() == ""
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ep._TRACK.clear()
