"""End to end on the GPU: stock vs monitored SGLang 0.5.19 on a generated Qwen3 checkpoint.

Run on the H200 machine with the GPU kit::

    python -m pytest tests/gpu/test_e2e_qwen3.py -m gpu -q -s

Stock and monitored engines run in separate processes (``harness.engine``). Checks:
tokens identical to stock with the same forced settings; captured resid_pre, q, k and v (every
layer), final_ln and final_logits against a transformers forward (relative error <= 3 %
per request and layer); exact row coverage for every selected hook, a prompt longer than
2,000 tokens included (committed piecewise through a 16 MiB ring); unsupported
configurations refused at startup with every reason. A JSON summary goes to
``$DMI_EVIDENCE_DIR`` (default: the test's tmp dir).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.engine import EngineError, EngineProcess

from .conftest import Evidence  # type: ignore[import-not-found]

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REL_TOL = 0.03
LONG_PROMPT_WORDS = 2100


def _engine_kwargs(model: Path) -> dict[str, Any]:
    return {
        "model_path": str(model),
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "mem_fraction_static": 0.3,
        "cuda_graph_max_bs_decode": 16,
        "disable_prefill_cuda_graph": True,
        "disable_radix_cache": True,
        "log_level": "error",
    }


def _prompts() -> list[str]:
    lengths = [3, 7, 12, 20, 33, 50, 81, 130, LONG_PROMPT_WORDS]
    return [" ".join(f"w{(i * 37 + j * 11) % 1000}" for j in range(n))
            for i, n in enumerate(lengths)]


def _run(tmp: Path, name: str, spec: dict[str, Any], prompts: list[str],
         sampling_params: dict[str, Any], *, monitored: bool = False) -> dict[str, Any]:
    """One engine child: the prompts in one call, then the stop RPC when monitored;
    ``{"ok", "outputs", "error", "log_tail"}``."""
    engine = EngineProcess(name, spec, tmp)
    workload = {"name": name, "prompts": prompts, "sampling_params": sampling_params,
                "rids": [f"req-{i}" for i in range(len(prompts))]}
    result: dict[str, Any] = {"ok": False, "outputs": [], "error": None}
    try:
        engine.start(900)
        result["outputs"] = engine.request("run", 900, workload=workload)["outputs"]
        if monitored:
            result["run_id"] = engine.request("stop", 900)["run_id"]
        result["ok"] = True
    except EngineError as exc:
        result["error"] = str(exc)
    finally:
        result.update(engine.close())
    result["log_tail"] = engine.log.read_text(errors="replace")[-3000:]
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def runs(workdir: Path, checkpoint: Path) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    store = workdir / "store"
    stock = _run(workdir, "stock", {"engine": _engine_kwargs(checkpoint),
                                    "env": {"DMX_SGLANG_ENABLE": "0"}}, _prompts(), params)
    monitored = _run(workdir, "monitored", {
        "engine": _engine_kwargs(checkpoint),
        "env": {
            "DMX_HOOK_SELECTION": "sglang-full",
            "DMX_MODEL_ID": "e2e-qwen3",
            "DMX_DB_URL": f"chdb://{store}",
            "DMX_RING_PAYLOAD_MB": "16",
            "DMX_RING_PINNED_MB": "16",
        },
    }, _prompts(), params, monitored=True)
    assert stock["ok"], stock
    assert monitored["ok"], monitored
    return {"stock": stock, "monitored": monitored, "store": store}


def test_tokens_identical_to_stock(runs: dict[str, Any], evidence: Evidence) -> None:
    stock = {o["id"]: o["output_ids"] for o in runs["stock"]["outputs"]}
    mon = {o["id"]: o["output_ids"] for o in runs["monitored"]["outputs"]}
    diverged = {rid: (stock[rid], mon[rid]) for rid in stock if stock[rid] != mon[rid]}
    evidence("e2e-tokens", {"requests": len(stock), "diverged": diverged})
    assert not diverged


def _reader(store: Path) -> Any:
    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.domain.store_config import StoreConfig, StoreKind

    return ClickHouseReader(StoreConfig(kind=StoreKind.EMBEDDED, path=str(store)))


def test_rows_complete_for_every_hook(runs: dict[str, Any], evidence: Evidence) -> None:
    from dmi_sglang.app.handle import CaptureHandle

    run_id = runs["monitored"]["run_id"]
    reader = _reader(runs["store"])
    problems: dict[str, Any] = {}
    summary = {}
    with reader.session():
        run = next(r for r in reader.runs() if r.run_id == run_id)
        for out in runs["monitored"]["outputs"]:
            handle = CaptureHandle(run_id, out["id"], lambda: reader)
            missing = handle.missing
            manifest = reader.manifest(run_id, out["id"])
            summary[out["id"]] = {
                "prompt": out["prompt_tokens"], "completion": out["completion_tokens"],
                "manifest": str(manifest), "missing": list(missing),
            }
            if missing:
                problems[out["id"]] = list(missing)
            assert manifest is not None
            extra = _rows_outside_coverage(reader, run, manifest)
            if extra:
                problems.setdefault(out["id"], []).append(f"rows outside coverage: {extra}")
            summary[out["id"]]["stored_positions"] = _stored_extent(reader, run_id, out["id"])
            assert manifest.prompt_tokens == out["prompt_tokens"]
            assert manifest.completion_tokens == out["completion_tokens"]
    evidence("e2e-rows", {"run": str(run), "requests": summary, "problems": problems})
    assert len(run.captures) == 4 * 12 + 5  # 12 per-layer hooks x 4 layers + 5 global
    assert not problems


def _stored_extent(reader: Any, run_id: str, request_id: str) -> dict[str, list[int]]:
    extent: dict[str, list[int]] = {}
    for act, layer, _shard, start, end in reader.ranges(run_id, request_id):
        key = act if layer < 0 else f"{act}.{layer}"
        lo, hi = extent.get(key, [start, end])
        extent[key] = [min(lo, start), max(hi, end)]
    return extent


def _rows_outside_coverage(reader: Any, run: Any, manifest: Any) -> list[str]:
    """Stored rows beyond the manifest's coverage (e.g. an unused final_logits decision)."""
    from dmi_sglang.domain.hooks import CATALOG

    by_act = {h.act_name: h for h in CATALOG}
    extent = _stored_extent(reader, run.run_id, manifest.request_id)
    bad = []
    for act, layer in run.captures:
        key = act if layer < 0 else f"{act}.{layer}"
        cov = manifest.coverage(by_act[act])
        lo, hi = extent.get(key, [cov.start, cov.end])
        if lo < cov.start or hi > cov.end:
            bad.append(f"{key} stored [{lo}, {hi}) expected [{cov.start}, {cov.end})")
    return bad


def test_captures_match_transformers(runs: dict[str, Any], checkpoint: Path,
                                     evidence: Evidence) -> None:
    from transformers import AutoModelForCausalLM

    from dmi_sglang.app.handle import CaptureHandle

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    # q and k as RoPE receives them (after q/k-norm; SGLang rotates them in place right
    # after their capture), v as attention receives it: per layer, from transformers' modules
    seen: dict[tuple[str, int], Any] = {}
    taps = [(name, i, module) for i, layer in enumerate(hf.model.layers)
            for name, module in (("q", layer.self_attn.q_norm), ("k", layer.self_attn.k_norm),
                                 ("v", layer.self_attn.v_proj))]
    for name, i, module in taps:  # on this test's own model: never removed
        module.register_forward_hook(_keep(seen, (name, i)))
    run_id = runs["monitored"]["run_id"]
    reader = _reader(runs["store"])
    worst: dict[str, float] = {}
    with reader.session():
        for out, prompt_ids in _prompt_ids(runs, checkpoint):
            handle = CaptureHandle(run_id, out["id"], lambda: reader)
            ids = prompt_ids + out["output_ids"]
            hs = handle.hidden_states
            n = hs[0].shape[0]
            seen.clear()
            with torch.no_grad():
                ref = hf(torch.tensor([ids[:n]], device="cuda"), output_hidden_states=True)
            for layer, got in enumerate(hs):
                _cmp(worst, f"resid_pre.{layer}", got, ref.hidden_states[layer][0])
            for (name, layer), expected in seen.items():
                _cmp(worst, f"{name}.{layer}", handle.get(name, layer).reshape(n, -1),
                     expected.reshape(n, -1))
            final_ln = handle.get("final_ln")
            _cmp(worst, "final_ln", final_ln, ref.hidden_states[-1][0][: final_ln.shape[0]])
            logits = handle.logits
            start = out["prompt_tokens"] - 1
            _cmp(worst, "final_logits", logits,
                 ref.logits[0][start: start + logits.shape[0]].float())
    evidence("e2e-parity", {"max_rel_err": worst, "tolerance": REL_TOL})
    assert {k.split(".")[0] for k in worst} >= {"resid_pre", "q", "k", "v", "final_ln",
                                                 "final_logits"}, sorted(worst)
    assert max(worst.values()) <= REL_TOL, worst


def _keep(seen: dict[tuple[str, int], Any], key: tuple[str, int]) -> Any:
    """A forward hook keeping a module's output (batch dimension dropped) under ``key``."""
    def hook(_module: Any, _args: Any, out: Any) -> None:
        seen[key] = out[0]

    return hook


def _prompt_ids(runs: dict[str, Any], checkpoint: Path) -> list[tuple[dict[str, Any],
                                                                       list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    pairs = []
    for out, prompt in zip(runs["monitored"]["outputs"], _prompts(), strict=True):
        ids = tok(prompt)["input_ids"]
        assert len(ids) == out["prompt_tokens"]
        pairs.append((out, ids))
    return pairs


def _cmp(worst: dict[str, float], name: str, got: Any, ref: Any) -> None:
    got = got.to("cuda").float()
    ref = ref.float()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    worst[name] = max(worst.get(name, 0.0), err)


def test_unsupported_configurations_fail_at_startup(workdir: Path, checkpoint: Path,
                                                     evidence: Evidence) -> None:
    moe = workdir / "qwen3-moe"
    moe.mkdir(exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    (moe / "config.json").write_text(json.dumps(config))
    env = {"DMX_HOOK_SELECTION": "hidden-states", "DMX_DB_URL": "none"}
    params = {"max_new_tokens": 2}
    moe_run = _run(workdir, "moe", {"env": env, "engine": {**_engine_kwargs(moe),
                                                           "load_format": "dummy"}},
                   ["w1"], params)
    compile_run = _run(workdir, "compile", {"env": env, "engine": {
        **_engine_kwargs(checkpoint), "enable_torch_compile": True,
        "num_continuous_decode_steps": 2}}, ["w1"], params)
    evidence("e2e-rejections", {"moe": moe_run, "compile": compile_run})
    assert not moe_run["ok"]
    assert "Qwen3MoeForCausalLM is not supported" in moe_run["error"]
    assert not compile_run["ok"]
    assert "enable_torch_compile=True" in compile_run["error"]
    assert "num_continuous_decode_steps=2" in compile_run["error"]
    for run in (moe_run, compile_run):
        assert "capture transport ready" not in run["log_tail"]
