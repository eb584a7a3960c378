"""``dmi-sglang plan``: the bandwidth plan on the command line, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmi_sglang.app.cli import main

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
             "torch_dtype": "bfloat16"}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    return tmp_path


def test_hidden_states_at_stock_speed_are_limited_by_the_store(model, capsys) -> None:
    assert main(["plan", "--model", str(model), "--hooks", "hidden-states",
                 "--tok-s", "21000"]) == 0
    out = capsys.readouterr().out
    assert "selection hidden-states on Qwen3ForCausalLM (28 layers, hidden 1024, bfloat16): " \
        "28 tensors" in out
    # 28 layers x (256 + 128) positions x 2 KiB = 22.0 MB; 57.3 kB a prompt token
    assert "a request of 256 prompt + 128 generated tokens: 22 MB; 57.3 kB per prompt" in out
    assert "172 kB per generated token" in out
    assert "limited by store: 3,778 generated tok/s at most" in out
    assert "at 21,000 tok/s the capture needs 3.61 GB/s: it keeps up with 18% of that" in out


def test_capture_only_has_the_d2h_stage_alone(model, capsys) -> None:
    assert main(["plan", "--model", str(model), "--hooks", "sglang-full", "--no-store",
                 "--d2h-gbps", "50"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert [line.split()[0] for line in lines[at : at + 3]] == ["stage", "d2h", "limited"]
    assert "omitted (the model lacks them): " in out  # MoE routing hooks of the preset
    assert "50.00" in out


def test_an_infinite_rate_is_refused(model, capsys) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's own refusal: usage and one line
        main(["plan", "--model", str(model), "--tok-s", "inf"])
    assert done.value.code == 2
    assert "--tok-s: 'inf' is not a positive (finite) number" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--d2h-gbps", "--tok-s"])
def test_a_rate_beyond_the_floats_products_is_refused(model, capsys, flag: str) -> None:
    """1e308 GB/s passed the finite check, and its products printed ``inf``."""
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model", str(model), flag, "1e308"])
    assert done.value.code == 2
    assert f"{flag}: '1e308' is not a positive (finite) number up to 1e+12" in (
        capsys.readouterr().err)


def test_a_negative_zero_sample_is_zero(model, capsys) -> None:
    assert main(["plan", "--model", str(model), "--request-sample", "-0"]) == 0
    out = capsys.readouterr().out
    assert "-0" not in out


def test_a_selection_that_captures_nothing_is_limited_by_nothing(model, capsys) -> None:
    # found in review: it printed "limited by d2h" with no figure
    assert main(["plan", "--model", str(model), "--hooks", "resid_pre:positions(1000-2000)",
                 "--prompt-len", "16", "--output-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "nothing is captured at these lengths: no stage limits the serving" in out
    assert "limited by" not in out


@pytest.mark.parametrize(("args", "words"), [
    (["--hooks", "bogus"], "unknown hook or preset 'bogus'"),
    (["--hooks", "resid_pre@40"], "outside the model's layers 0-27"),
])
def test_bad_selections_are_one_line_errors(model, capsys, args, words) -> None:
    assert main(["plan", "--model", str(model), *args]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert len(err.strip().splitlines()) == 1


def test_a_directory_without_config_is_refused_by_name(tmp_path, capsys) -> None:
    assert main(["plan", "--model", str(tmp_path / "none")]) == 2
    assert "does not exist: give a model directory" in capsys.readouterr().err


def test_an_unsupported_architecture_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_06B,
                                                      "architectures": ["LlamaForCausalLM"]}))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "LlamaForCausalLM has no hooked model" in capsys.readouterr().err


def test_a_float32_checkpoint_is_planned_as_sglang_serves_it(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_06B, "torch_dtype": "float32"}))
    assert main(["plan", "--model", str(tmp_path), "--hooks", "resid_pre@0"]) == 0
    out = capsys.readouterr().out
    assert "hidden 1024, float16)" in out  # SGLang's dtype=auto serves float32 as float16
    assert "2.05 kB per prompt token" in out


@pytest.mark.parametrize(("config", "words"), [
    ({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2},
     "config.json lacks a usable model size"),
    ([1, 2], "holds no JSON object"),
])
def test_a_config_without_sizes_is_one_line_error(tmp_path, capsys, config, words) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert len(err.strip().splitlines()) == 1


def test_a_directory_lacking_config_json_is_refused_by_name(tmp_path, capsys) -> None:
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "has no config.json: give a model directory" in capsys.readouterr().err


def test_a_file_given_as_model_is_refused_by_name(tmp_path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    assert main(["plan", "--model", str(tmp_path / "f")]) == 2
    assert "is not a directory: give a model directory" in capsys.readouterr().err


def test_the_capture_logs_its_plan_and_warns_below_the_asked_rate() -> None:
    import structlog

    from dmi_sglang.app.composition import log_plan
    from dmi_sglang.domain.hooks import CATALOG, ModelHooks, parse_selection
    from dmi_sglang.domain.settings import Settings
    from dmi_sglang.domain.shapes import ModelShape

    shape = ModelShape(28, 1024, 16, 8, 128, 3072, 151936)
    sel = parse_selection("hidden-states").resolve(
        ModelHooks("Qwen3ForCausalLM", frozenset(h.name for h in CATALOG), 28))
    tok_s = Settings.from_env({"DMX_PLAN_TOK_S": "21000"}).plan_tok_s
    with structlog.testing.capture_logs() as logs:
        log_plan(sel, shape, stored=True, tok_s=None)
        log_plan(sel, shape, stored=False, tok_s=tok_s)
        log_plan(sel, shape, stored=True, tok_s=tok_s)
    plans = [e for e in logs if e["event"] == "dmi.plan"]
    assert plans[0]["bytes_per_generated_token"] == 28 * 384 * 2048 // 128
    assert plans[0]["limiting"] == "store"
    assert set(plans[1]["max_tok_s"]) == {"d2h"}
    warned = [e for e in logs if e["event"] == "dmi.plan_cannot_keep_up"]
    assert len(warned) == 1  # only the stored capture at 21,000 tok/s falls short
    assert warned[0]["stage"] == "store"
    assert warned[0]["keeps_up_with"] == pytest.approx(0.18, abs=0.005)
    assert warned[0]["log_level"] == "warning"


def test_the_ring_advice_follows_the_prefill_chunk_and_the_ring(model, capsys,
                                                              monkeypatch) -> None:
    monkeypatch.delenv("DMX_RING_PAYLOAD_MB", raising=False)
    monkeypatch.delenv("DMX_RING_PINNED_MB", raising=False)
    assert main(["plan", "--model", str(model), "--hooks", "hidden-states"]) == 0
    # 28 layers x 8,192 positions x 2 KiB = 470 MB: the default 1 GiB ring holds it
    assert ("a prefill chunk of 8,192 tokens takes 470 MB of the ring (1,024 MiB): it fits"
            in capsys.readouterr().out)
    assert main(["plan", "--model", str(model), "--hooks", "hidden-states",
                 "--prefill-tokens", "32768"]) == 0
    out = capsys.readouterr().out  # 1.88 GB: two chunks need 3.76 GB, in whole GiB 4
    assert "takes 1.88 GB of the ring (1,024 MiB): it commits piecewise, in parts" in out
    assert "DMX_RING_PAYLOAD_MB=4096 DMX_RING_PINNED_MB=4096 hold two chunks" in out
    assert "fall behind" not in out  # no --tok-s: no rate to fall behind
    for tok_s, behind in (("1000", False), ("1000000", True)):  # 55 GB/s, 172 kB a token
        assert main(["plan", "--model", str(model), "--hooks", "hidden-states",
                     "--prefill-tokens", "32768", "--tok-s", tok_s, "--no-store"]) == 0
        out = capsys.readouterr().out
        assert "hold two chunks" in out
        assert ("at this rate the copies fall behind, so a ring of any size" in out) is behind
    monkeypatch.setenv("DMX_RING_PAYLOAD_MB", "4096")
    monkeypatch.setenv("DMX_RING_PINNED_MB", "2048")  # the ring holds the smaller
    assert main(["plan", "--model", str(model), "--hooks", "hidden-states",
                 "--prefill-tokens", "32768"]) == 0
    assert "takes 1.88 GB of the ring (2,048 MiB): it fits" in capsys.readouterr().out


def test_a_chunk_larger_than_the_largest_ring_is_told_to_shrink(model, capsys,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("DMX_RING_PAYLOAD_MB", "131072")
    monkeypatch.setenv("DMX_RING_PINNED_MB", "131072")
    monkeypatch.setenv("DMX_BOGUS_SETTING", "1")  # the plan reads the ring's alone
    assert main(["plan", "--model", str(model), "--hooks", "hidden-states",
                 "--prefill-tokens", "3000000"]) == 0
    out = capsys.readouterr().out  # 172 GB a chunk, 137 GB of ring at most
    assert ("takes 172 GB of the ring (131,072 MiB): it commits piecewise, in parts "
            "waiting for the drain; a smaller --chunked-prefill-size makes it fit") in out


@pytest.mark.parametrize("bad", [
    {"num_attention_heads": 0, "head_dim": None}, {"hidden_size": -5},
    {"num_hidden_layers": 0}, {"vocab_size": 0},
    {"num_hidden_layers": None}, {"num_hidden_layers": "MISSING"},
])
def test_impossible_model_sizes_are_one_line_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: dict[str, object]) -> None:
    """They were tracebacks (a missing layer count, heads of 0) or plans of negative and
    zero bytes with status 0."""
    config = {k: v for k, v in {**QWEN3_06B, **bad}.items() if v != "MISSING"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--hooks", "resid_pre,final_logits"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err
    assert len(err.strip().splitlines()) == 1


def test_the_plan_counts_only_the_sampled_requests(
        model: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenth of the requests captured needs a tenth of the bytes a second: each stage
    follows ten times the tokens."""
    def limit(args: list[str]) -> str:
        assert main(["plan", "--model", str(model), "--hooks", "hidden-states", *args]) == 0
        out = capsys.readouterr().out
        return next(line for line in out.splitlines() if line.startswith("limited by"))

    full = limit([])
    tenth = limit(["--request-sample", "0.1"])
    monkeypatch.setenv("DMX_REQUEST_SAMPLE", "0.1")
    assert limit([]) == tenth != full
    rate = {t: float(t.split(": ")[1].split(" ")[0].replace(",", "")) for t in (full, tenth)}
    assert rate[tenth] == pytest.approx(10 * rate[full], rel=1e-3)
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model", str(model), "--request-sample", "1.5"])
    assert done.value.code == 2
    assert "'1.5' is not a number from 0 to 1" in capsys.readouterr().err
