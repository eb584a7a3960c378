"""``dmi-sglang reference-capture``: a real CPU capture (transformers, 2-layer demo
checkpoint) into a real embedded store, read back by ls, show, export and the handle."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from dmi_sglang.app.cli import main
from dmi_sglang.app.reference import forward_records
from dmi_sglang.domain.hooks import ModelHooks, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import make_plan
from dmi_sglang.domain.records import expected_coverage
from dmi_sglang.domain.shapes import DType, ModelShape
from dmi_sglang.errors import CaptureError

RUN = "reference-test-1"
PROMPTS = ("w1 w2 w3", "w5 w6 w7 w8 w9 w10")
NEW_TOKENS = 4


def _needs_torch() -> None:
    if os.environ.get("CI", "").lower() != "true":  # under CI=true a missing package fails
        pytest.importorskip("torch")
        pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One default-model reference capture (the demo checkpoint it generates, 2 layers)."""
    _needs_torch()
    base = tmp_path_factory.mktemp("reference")
    url = f"chdb://{base / 'captures'}"
    args = ["reference-capture", "--db", url, "--layers", "2", "--run-id", RUN,
            "--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return {"url": url, "base": base, "out": out.getvalue()}


def _store(url: str) -> Any:
    from dmi_sglang import open_store

    return open_store(url)


@pytest.mark.torch
def test_the_run_is_committed_and_labelled_cpu_reference(captured: dict[str, Any]) -> None:
    run = _store(captured["url"]).require_run(RUN)
    settings = dict(run.settings)
    assert run.status.value == "committed"
    assert run.source == "cpu-reference" == settings["dmi.source"]
    assert settings["dmi.reference.engine"].startswith("transformers ")
    assert "--layers 2" in settings["dmi.reference.model"]
    assert run.model_path == "qwen3-demo"
    selection = parse_selection("sglang-full")
    from dmi_sglang.app.composition import reference_hooks

    expected = selection.resolve(reference_hooks(None, layers=2)).captures()
    assert run.captures == tuple((h.act_name, layer) for h, layer in expected)
    assert len(run.captures) == 12 * 2 + 5


@pytest.mark.torch
def test_every_request_is_complete_and_stores_exactly_its_coverage(
        captured: dict[str, Any]) -> None:
    from dmi_sglang.app.assemble import hook_for
    from dmi_sglang.app.composition import reader_for
    from dmi_sglang.app.reading import store_config

    store = _store(captured["url"])
    reader = reader_for(store_config(captured["url"]))
    run = store.require_run(RUN)
    with store.session(), reader.session():
        requests = [r.request_id for r in store.requests(RUN)]
        assert requests == ["req-0", "req-1"]
        for rid, prompt in zip(requests, PROMPTS, strict=True):
            assert store.handle(RUN, rid).missing == ()
            manifest = store.manifest(RUN, rid)
            assert manifest is not None
            assert manifest.committed
            assert manifest.prompt_tokens == len(prompt.split())
            assert 1 <= manifest.completion_tokens <= NEW_TOKENS
            assert not manifest.overlap_extra_forward
            stored: dict[tuple[str, int], list[int]] = {}
            for act, layer, _shard, start, end in reader.ranges(RUN, rid):
                stored.setdefault((act, layer), []).extend(range(start, end))
            assert set(stored) == set(run.captures)
            for (act, layer), positions in stored.items():
                cov = expected_coverage(hook_for(act), prompt_tokens=manifest.prompt_tokens,
                                        completion_tokens=manifest.completion_tokens,
                                        overlap_extra_forward=False)
                assert sorted(positions) == list(range(cov.start, cov.end)), (act, layer)


@pytest.mark.torch
def test_captures_equal_a_direct_transformers_forward(captured: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dmi_sglang.app.composition import write_demo_checkpoint

    model_dir = write_demo_checkpoint(captured["base"] / "again", layers=2)  # same seed
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    store = _store(captured["url"])
    with store.session():
        for i, prompt in enumerate(PROMPTS):
            handle = store.handle(RUN, f"req-{i}")
            prompt_ids = tokenizer(prompt)["input_ids"]
            ids = handle.token_ids
            n_prompt = len(prompt_ids)
            assert ids[:n_prompt].tolist() == prompt_ids
            with torch.no_grad():
                ref = hf(ids[None], output_hidden_states=True)
            for layer, got in enumerate(handle.hidden_states):
                torch.testing.assert_close(got, ref.hidden_states[layer][0], rtol=1e-5,
                                           atol=1e-5, msg=f"resid_pre layer {layer}")
            torch.testing.assert_close(handle.get("final_ln"), ref.hidden_states[-1][0],
                                       rtol=1e-5, atol=1e-5)
            logits = handle.logits
            torch.testing.assert_close(logits, ref.logits[0, n_prompt - 1:], rtol=1e-5,
                                       atol=1e-5)
            # greedy: each generated token that was fed back is its logits row's argmax
            assert ids[n_prompt:].tolist() == logits[:-1].argmax(-1).tolist()


@pytest.mark.torch
def test_the_summary_says_what_ran_and_how_to_read_it(captured: dict[str, Any]) -> None:
    out = captured["out"]
    assert "a CPU reference capture (transformers on CPU, not SGLang), labelled cpu-reference" \
        in out
    assert f"run id       {RUN}\n" in out
    assert "requests     2  (prompt tokens 9, generated " in out
    assert f"dmi-sglang show {RUN} req-0 --db {captured['url']}" in out
    assert "blocks.hook_resid_pre" in out


@pytest.mark.torch
def test_ls_show_and_export_read_it_like_any_run(captured: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    url = captured["url"]
    assert main(["ls", "--db", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "source"
    row = next(line for line in lines if line.startswith(RUN))
    assert row.split()[1] == "committed"
    assert row.split()[-1] == "cpu-reference"
    assert main(["ls", RUN, "--db", url]) == 0
    out = capsys.readouterr().out
    assert "CPU reference capture (transformers" in out
    assert "req-1" in out
    assert "NO:" not in out
    assert main(["show", RUN, "req-0", "--db", url]) == 0
    assert "blocks.hook_resid_pre.1" in capsys.readouterr().out
    target = tmp_path / "req-0.safetensors"
    assert main(["export", RUN, "req-0", "--out", str(target), "--db", url]) == 0
    tensors = load_file(str(target))
    assert tensors["blocks.hook_resid_pre.0"].dtype.is_floating_point
    assert len(tensors) == 12 * 2 + 5


@pytest.mark.torch
def test_a_given_model_and_selection(captured: dict[str, Any], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from dmi_sglang.app.composition import write_demo_checkpoint

    model_dir = write_demo_checkpoint(tmp_path / "mine", layers=2)
    url = captured["url"]
    assert main(["reference-capture", "--db", url, "--model", str(model_dir), "--hooks",
                 "resid_pre@1,final_logits", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    run_id = next(ln.split()[-1] for ln in out.splitlines() if ln.startswith("run id"))
    assert run_id.startswith("mine-")
    store = _store(url)
    run = store.require_run(run_id)
    assert run.captures == (("blocks.hook_resid_pre", 1), ("final_logits", -1))
    assert run.model_path == str(model_dir)
    handle = store.handle(run_id, "req-0")
    assert handle.missing == ()
    assert handle.logits.shape[0] == store.manifest(run_id, "req-0").completion_tokens
    # the run id names one run: a second capture under it is refused before any work
    assert main(["reference-capture", "--db", url, "--run-id", RUN]) != 0
    err = capsys.readouterr().err.strip()
    assert "already exists" in err
    assert err.count("\n") == 0


def test_a_selection_with_position_rules_is_captured_and_read_as_it_says(
        captured: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dmi_sglang.app.composition import write_demo_checkpoint

    model_dir = write_demo_checkpoint(tmp_path / "ruled", layers=2)
    url = captured["url"]
    hooks = ("resid_pre@0:last_prompt,final_ln:positions(1-3),final_logits:last_prompt,"
             "mlp_out@1:every(2)")
    assert main(["reference-capture", "--db", url, "--model", str(model_dir), "--hooks",
                 hooks, "--max-new-tokens", "4", "--prompt", "w1 w2 w3"]) == 0
    out = capsys.readouterr().out
    run_id = next(ln.split()[-1] for ln in out.splitlines() if ln.startswith("run id"))
    store = _store(url)
    handle = store.handle(run_id, "req-0")
    prompt = store.manifest(run_id, "req-0").prompt_tokens
    assert handle.missing == ()
    assert handle.positions("resid_pre", 0) == range(prompt - 1, prompt)
    assert handle.positions("final_ln") == range(1, 4)
    assert handle.get("resid_pre", 0).shape[0] == 1
    assert handle.get("final_ln").shape[0] == 3
    assert handle.logits.shape[0] == 1  # the row that decided the first token
    total = prompt + store.manifest(run_id, "req-0").completion_tokens - 1
    assert handle.positions("mlp_out", 1) == range(0, total, 2)
    assert handle.get("mlp_out", 1).shape[0] == len(range(0, total, 2))
    assert main(["show", run_id, "req-0", "--db", url]) == 0
    shown = capsys.readouterr().out
    assert f"{'blocks.hook_mlp_out.1':<36} [0, {total}) every 2 " in shown
    assert f"blocks.hook_resid_pre.0              [{prompt - 1}, {prompt}) " in shown
    assert "hook_final_ln                        [1, 4) " in shown


def _config_dir(tmp_path: Path, architecture: str) -> Path:
    where = tmp_path / architecture
    where.mkdir()
    (where / "config.json").write_text(json.dumps(
        {"architectures": [architecture], "num_hidden_layers": 2}))
    return where


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--model", "/nonexistent"], "--model /nonexistent does not exist"),
     (["--model", "QWEN", "--layers", "3"], "--layers 3 sets the layers of the generated"),
     (["--model", "LLAMA"], "architecture LlamaForCausalLM has no reference capture"),
     (["--hooks", "resid_pree"], "--hooks 'resid_pree': unknown hook or preset"),
     (["--hooks", "resid_pre@2"], "outside the model's layers 0-1"),
     (["--run-id", "no spaces"], "--run-id 'no spaces' is not a run id"),
     (["--db", "bogus://x"], "--db 'bogus://x' is not a store URL"),
     (["--db", "none"], "the store is 'none'"),
     (["--prompt", "  "], "is blank; give a prompt with words"),
     (["--prompts", "/nonexistent/prompts.txt"], "No such file"),
     (["--max-new-tokens", "0"], "is not a positive integer"),
     (["--layers", "0"], "is not a positive integer")],
    ids=["model", "model-and-layers", "architecture", "hooks", "layer-range", "run-id", "db",
         "db-none", "prompt", "prompts", "max-new-tokens", "layers"],
)
def test_bad_arguments_are_refused_before_any_work(
        args: list[str], words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from dmi_sglang.app import composition

    def no_work(*_a: object, **_k: object) -> None:
        raise AssertionError("the capture began")

    monkeypatch.setattr(composition, "run_reference_capture", no_work)
    monkeypatch.setattr(composition, "write_demo_checkpoint", no_work)
    names = {"QWEN": "Qwen3ForCausalLM", "LLAMA": "LlamaForCausalLM"}
    args = [str(_config_dir(tmp_path, names[a])) if a in names else a for a in args]
    store = tmp_path / "captures"
    db = [] if "--db" in args else ["--db", f"chdb://{store}"]
    with contextlib.suppress(SystemExit):  # argparse's own refusals exit 2
        assert main(["reference-capture", *db, *args]) != 0
    err = capsys.readouterr().err.strip()
    assert words in err
    assert err.count("\n") == 0 or "usage:" in err
    assert not store.exists()


def test_a_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    store = tmp_path / "captures"
    assert main(["reference-capture", "--db", f"chdb://{store}"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("dmi-sglang reference-capture: needs the ")
    assert err.endswith(" package: pip install 'dmi-sglang[demo]'")
    assert err.count("\n") == 0
    assert not store.exists()


def test_records_are_cut_by_the_domain_plan() -> None:
    """An intermediate prompt chunk of one request beside the last chunk of another: token
    rows for both, a logits row only for the request whose chunk decides a token."""
    shape = ModelShape(num_layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2,
                       intermediate=4, vocab=3, activation_dtype=DType.FLOAT32)
    selection = parse_selection("resid_pre,final_logits").resolve(
        ModelHooks("Qwen3ForCausalLM", frozenset({"resid_pre", "final_logits"}), 1))
    layout = BatchLayout.extend(["a", "b"], [0, 4], [3, 2], seq_lens=[8, 6])
    plan = make_plan(layout, selection, shape, padded=False)
    resid = bytes(range(5 * 8))  # 5 token rows of 2 float32
    logits = bytes(range(100, 100 + 2 * 12))  # one row per request of 3 float32
    records = forward_records(plan, {("resid_pre", 0): resid, ("final_logits", -1): logits},
                              run_id="r", seq=7)
    got = {(r.act_name, r.request_id): (r.start_token_idx, r.end_token_idx, r.shape,
                                        bytes(r.payload)) for r in records}
    assert got == {
        ("blocks.hook_resid_pre", "a"): (0, 3, (3, 2), resid[:24]),
        ("blocks.hook_resid_pre", "b"): (4, 6, (2, 2), resid[24:]),
        ("final_logits", "b"): (5, 6, (1, 3), logits[12:]),
    }
    assert {r.seq for r in records} == {7}
    with pytest.raises(CaptureError, match="expects 5 rows"):
        forward_records(plan, {("resid_pre", 0): resid[:8], ("final_logits", -1): logits},
                        run_id="r", seq=8)
    with pytest.raises(CaptureError, match="does not hold"):
        forward_records(plan, {("resid_pre", 0): resid, ("final_logits", -1): logits,
                               ("ln1", 0): b""}, run_id="r", seq=8)


def test_the_reference_offers_the_hooked_sglang_models_hooks() -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import QWEN3_HOOKS
    from dmi_sglang.adapters.transformers_ref import REFERENCE_HOOKS

    assert REFERENCE_HOOKS == QWEN3_HOOKS


def test_a_run_without_the_source_key_is_an_sglang_run() -> None:
    from dmi_sglang.domain.records import SOURCE_KEY, RunInfo, RunSource

    plain = RunInfo("r", "/m", (("DMX_HOOK_SELECTION", "resid_pre"),), (), "t")
    assert plain.source == RunSource.SGLANG.value == "sglang"
    labelled = RunInfo("r", "/m", ((SOURCE_KEY, "cpu-reference"),), (), "t")
    assert labelled.source == RunSource.CPU_REFERENCE.value


@pytest.mark.torch
def test_payload_modifiers_store_the_cast_rows_and_the_top_logits(
        captured: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    url = captured["url"]
    assert main(["reference-capture", "--db", url, "--layers", "2", "--hooks",
                 "resid_pre@1:fp16,final_logits:topk(5)", "--max-new-tokens",
                 str(NEW_TOKENS), "--prompt", PROMPTS[0]]) == 0
    out = capsys.readouterr().out
    run_id = next(ln.split()[-1] for ln in out.splitlines() if ln.startswith("run id"))
    store = _store(url)
    with store.session():
        full, some = store.handle(RUN, "req-0"), store.handle(run_id, "req-0")
        assert some.missing == ()
        assert store.require_run(run_id).captures == (
            ("blocks.hook_resid_pre", 1), ("logits_topk_values", -1), ("logits_topk_ids", -1))
        resid = some.get("resid_pre", 1)
        assert resid.dtype == torch.float16
        assert torch.equal(resid, full.get("resid_pre", 1).to(torch.float16))
        values, ids = some.logits_topk
        want = torch.topk(full.logits, 5)
        assert ids.dtype == torch.int32
        assert torch.equal(values, want.values)
        assert torch.equal(ids, want.indices.to(torch.int32))
    assert main(["show", run_id, "req-0", "--db", url]) == 0
    shown = capsys.readouterr().out
    assert "logits_topk_ids" in shown
    assert "torch.float16" in shown


@pytest.mark.torch
def test_the_last_rule_stores_the_row_that_decided_the_last_token(
        captured: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    url = captured["url"]
    assert main(["reference-capture", "--db", url, "--layers", "2", "--hooks",
                 "resid_pre@1:last,final_logits:last", "--max-new-tokens", str(NEW_TOKENS),
                 "--prompt", PROMPTS[0]]) == 0
    out = capsys.readouterr().out
    run_id = next(ln.split()[-1] for ln in out.splitlines() if ln.startswith("run id"))
    store = _store(url)
    with store.session():
        full, some = store.handle(RUN, "req-0"), store.handle(run_id, "req-0")
        manifest = store.manifest(run_id, "req-0")
        last = manifest.prompt_tokens + manifest.completion_tokens - 2
        assert some.missing == ()
        assert some.positions("resid_pre", 1) == range(last, last + 1)
        assert torch.equal(some.get("resid_pre", 1), full.get("resid_pre", 1)[last:last + 1])
        assert torch.equal(some.logits, full.logits[-1:])


# -- found in review: what is refused before any work, what a failure records ----------
def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.app import composition

    def no_work(*_a: object, **_k: object) -> None:
        raise AssertionError("the capture began")

    monkeypatch.setattr(composition, "run_reference_capture", no_work)
    monkeypatch.setattr(composition, "write_demo_checkpoint", no_work)


@pytest.mark.parametrize(("argv", "env", "words"), [
    (["--hooks", "final_logits:topk(5000)"], {}, "--hooks 'final_logits:topk(5000)'"),
    ([], {"DMX_HOOK_SELECTION": "final_logits:topk(5000)"}, "DMX_HOOK_SELECTION="),
    (["--max-new-tokens", "5000"], {}, "--max-new-tokens 5000"),
    ([], {"DMX_REQUEST_SAMPLE": "0"}, "DMX_REQUEST_SAMPLE=0")])
def test_what_the_reference_cannot_do_is_refused_before_any_work(
        argv: list[str], env: dict[str, str], words: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = tmp_path / "captures"
    assert main(["reference-capture", "--db", f"chdb://{store}", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert words in err
    assert not store.exists()


def test_a_row_the_model_cannot_have_fails_before_the_run_starts() -> None:
    from dmi_sglang.app.reference import ReferenceRequest, capture_reference
    from dmi_sglang.domain.records import RunInfo
    from dmi_sglang.errors import ConfigurationError
    from dmi_sglang.testing import MemorySink

    class Model:
        shape = ModelShape(num_layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2,
                           intermediate=4, vocab=3, activation_dtype=DType.FLOAT32)

        def generate(self, *_a: object, **_k: object) -> object:
            raise AssertionError("not reached")

    selection = parse_selection("final_logits:topk(5):last").resolve(
        ModelHooks("Qwen3ForCausalLM", frozenset({"final_logits"}), 1))
    sink = MemorySink()
    with pytest.raises(ConfigurationError, match="topk"):
        capture_reference(Model(), sink, RunInfo("r", "/m", (), (), "t"),  # type: ignore[arg-type]
                          selection, [ReferenceRequest("a", (1, 2))], max_new_tokens=2)
    assert not sink.runs  # no run left "running"


def _one_layer(url: str, run_id: str, hooks: str, *, new_tokens: int) -> int:
    """``reference-capture`` of a one-layer demo checkpoint, the prompt ``w1 w2 w3``."""
    return main(["reference-capture", "--db", url, "--layers", "1", "--run-id", run_id,
                 "--hooks", hooks, "--max-new-tokens", str(new_tokens),
                 "--prompt", "w1 w2 w3"])


@pytest.mark.torch
def test_the_last_rule_counts_no_extra_forward(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from dmi_sglang import open_store

    url = f"chdb://{tmp_path / 'captures'}"
    assert _one_layer(url, "fw-1", "resid_pre@0:last", new_tokens=3) == 0
    out = capsys.readouterr().out
    completion = open_store(url).manifest("fw-1", "req-0").completion_tokens
    assert f"generated {completion}; {completion} forwards in " in out, out


@pytest.mark.torch
def test_a_prompt_and_its_new_tokens_beyond_the_context_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from dmi_sglang import open_store

    url = f"chdb://{tmp_path / 'captures'}"
    assert _one_layer(url, "ctx-1", "token_ids", new_tokens=4095) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 4095" in err
    assert "at most 4093" in err
    assert _one_layer(url, "ctx-1", "token_ids", new_tokens=2) == 0  # the id is free
    assert open_store(url).manifest("ctx-1", "req-0") is not None
