"""Shared fixtures for tests against the real sglang==0.5.19 on a CPU-only machine.

Every test here runs :func:`require_sglang` first (an autouse fixture; the test modules
import SGLang lazily): it skips when SGLang cannot be imported, except under ``CI=true``,
where it fails (a broken install must not silently turn these tests off).

What works on CPU (found while writing the adapter):

* ``ServerArgs(...)`` plus ``resolve_once()`` and ``check_server_args()`` run once
  ``device="cuda"`` is given; without it resolution raises "No accelerator ... is
  available" (``handle_missing_default_values`` calls ``get_device()``).
* After ``publish(server_args, role="scheduler")``, a gloo world of one and
  ``initialize_model_parallel``, the upstream ``Qwen3ForCausalLM`` builds and runs a full
  extend forward on CPU. Two shims are needed, both test-only: RotaryEmbedding's
  constructor imports a fallback kernel from ``vllm._custom_ops`` off-CUDA (never called
  on the pure-torch path CPU dispatch takes), so a stub module is present only while the
  model is built; and attention goes through a fake backend (SGLang's backends need CUDA)
  installed with ``set_forward_context``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
}

MOE_CONFIG: dict[str, Any] = {
    **QWEN3_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def require_sglang() -> None:
    """Skip the calling module without SGLang; fail instead under ``CI=true``."""
    try:
        import sglang.srt.server_args  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"sglang==0.5.19 is required under CI=true: {exc!r}", pytrace=False)
        pytest.skip(f"sglang is not importable: {exc!r}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _sglang_required() -> None:
    """Every test here needs SGLang (test modules import it lazily, inside tests)."""
    require_sglang()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only a tiny Qwen3 ``config.json``."""
    path = tmp_path_factory.mktemp("qwen3")
    (path / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return path


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only a tiny Qwen3-MoE ``config.json``."""
    path = tmp_path_factory.mktemp("qwen3moe")
    (path / "config.json").write_text(json.dumps(MOE_CONFIG))
    return path


@pytest.fixture(scope="session")
def resolved_args(qwen3_dir: Path) -> Callable[..., Any]:
    """``make(**kw)``: a resolved real ServerArgs (device="cuda" so resolution runs)."""
    from sglang.srt.server_args import ServerArgs

    def make(**kw: Any) -> Any:
        kw.setdefault("model_path", str(qwen3_dir))
        server_args = ServerArgs(device="cuda", **kw)
        server_args.resolve_once()
        return server_args

    return make


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint (bf16 weights, 4 layers), written once per session."""
    from dmi_sglang.adapters.demo_model import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def sglang_runtime(demo_checkpoint: Path) -> Iterator[None]:
    """Publish a scheduler config and a one-process gloo world, as a scheduler has."""
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(demo_checkpoint), device="cuda",
                             disable_cuda_graph=True)
    runtime_context.publish(server_args, role="scheduler")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    parallel_state.initialize_model_parallel(1, 1, 1, backend="gloo")
    yield
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


@contextlib.contextmanager
def _vllm_stub() -> Iterator[None]:
    names = ("vllm", "vllm._custom_ops")
    saved = {n: sys.modules.get(n) for n in names}
    ops = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args: Any, **kwargs: Any) -> None:
        msg = "test stub: the CUDA fallback RoPE kernel must not run on CPU"
        raise AssertionError(msg)

    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    root = types.ModuleType("vllm")
    root._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.update({"vllm": root, "vllm._custom_ops": ops})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture(scope="session")
def build_qwen3(sglang_runtime: None, demo_checkpoint: Path) -> Callable[..., Any]:
    """``build(dtype, cls=upstream)``: an SGLang Qwen3 with the demo weights loaded."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(demo_checkpoint)
    weights = load_file(str(demo_checkpoint / "model.safetensors"))

    def build(dtype: torch.dtype, cls: type = Qwen3ForCausalLM) -> Any:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with _vllm_stub():
                model = cls(config)
        finally:
            torch.set_default_dtype(previous)
        model.load_weights((k, v.to(dtype)) for k, v in weights.items())
        return model.eval()

    return build


class FakeAttentionBackend:
    """Causal self-attention per request, for extend batches without a prefix (CPU)."""

    def forward(self, q: Any, k: Any, v: Any, layer: Any, fb: Any, *_: Any, **__: Any) -> Any:
        import torch
        import torch.nn.functional as F  # noqa: N812

        out = []
        start = 0
        rep = layer.tp_q_head_num // layer.tp_k_head_num
        for n in fb.extend_seq_lens_cpu:
            sl = slice(start, start + n)
            qh = q[sl].reshape(n, layer.tp_q_head_num, layer.head_dim).transpose(0, 1)
            kh = k[sl].reshape(n, layer.tp_k_head_num, layer.head_dim)
            vh = v[sl].reshape(n, layer.tp_v_head_num, layer.head_dim)
            kh = kh.repeat_interleave(rep, 1).transpose(0, 1)
            vh = vh.repeat_interleave(rep, 1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=layer.scaling)
            out.append(o.transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out)


@pytest.fixture(scope="session")
def fake_attention(sglang_runtime: None) -> Iterator[None]:
    """Install :class:`FakeAttentionBackend` as the forward context's backend."""
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

    previous = set_forward_context(ForwardContext(attn_backend=FakeAttentionBackend()))
    yield
    set_forward_context(previous)


@pytest.fixture(scope="session")
def extend_batch() -> Callable[..., Any]:
    """``make(prompts, rids=None)``: a real EXTEND ForwardBatch of prompts without prefix."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    def make(prompts: list[list[int]], rids: list[str] | None = None) -> Any:
        lens = [len(p) for p in prompts]
        total = sum(lens)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(prompts),
            input_ids=torch.tensor([t for p in prompts for t in p]),
            req_pool_indices=torch.arange(len(prompts)),
            seq_lens=torch.tensor(lens),
            seq_lens_cpu=torch.tensor(lens),
            out_cache_loc=torch.arange(total),
            seq_lens_sum=total,
            positions=torch.cat([torch.arange(n) for n in lens]),
            extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
            extend_prefix_lens=torch.zeros(len(lens), dtype=torch.int32),
            extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(lens),
            rids=rids or [f"r{i}" for i in range(len(prompts))],
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )

    return make
