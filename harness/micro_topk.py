"""``python -m harness topk``: the GPU time of ``final_logits:topk(K)``'s selection.

A capture of ``final_logits:topk(64)`` selects the 64 largest logits of every row of each
decode step inside SGLang's decode graph: on Qwen3-0.6B at batch 64 ``torch.topk`` alone
took 164-173 µs of an H100 a call (two hosts), where a stock decode step is about 3 ms.
This measures the selection alone, recorded in a CUDA graph as in serving and replayed
``--replays`` times between CUDA events (median of ``--reps`` blocks, µs per replay), for
``torch.topk``, for :func:`~dmi_sglang.adapters.transport.topk.chunked_topk` at each
chunk width of ``--chunks`` and, at each width it takes, for
:func:`~dmi_sglang.adapters.transport.topk_kernel.fused_topk` (``DMX_TOPK_KERNEL``: the
same selection after the chunk maxima in one Triton kernel) and, where FlashInfer is
installed (with SGLang, on the GPU machine), for ``flashinfer_topk``
(``DMX_TOPK_KERNEL=flashinfer``: FlashInfer's radix top-k), per batch size of
``--batches``, on random logits of the model's vocabulary and logits dtype. What every
variant's last timed replay selected must equal ``torch.topk``'s values, and its indices
must name them (a required check). A row must hold more than ``-k`` whole chunks of each
width, and ``-k`` chunks less than half of it (``chunked_topk`` calls ``torch.topk``
itself otherwise). ``--device cpu`` is a dry run (eager, CPU timings: compare nothing
there); it runs the kernel's variants only under Triton's interpreter
(``TRITON_INTERPRET=1``).

``--compile-only`` runs nothing: it compiles the kernel for the H100/H200 (``sm_90``) at
each width of ``--chunks`` it takes, on any machine, and prints what the compiler made of
it: registers a thread and bytes spilled (``ptxas -v``), and the instructions each warp
runs (the kernel is straight-line code), the shuffles and barriers among them (Triton's
own ``ptxas`` and ``nvdisasm``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dmi_sglang.adapters.transport.topk import chunked_topk, widest_chunk
from dmi_sglang.adapters.transport.topk_flashinfer import flashinfer_topk, warm_up
from dmi_sglang.adapters.transport.topk_kernel import (
    compile_for,
    fits,
    fused_topk,
    launch_constants,
)
from harness.docs import table_lines
from harness.micro_transport import Q06, positive_ints
from harness.results import Json, run_benchmark

Select = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def variants(k: int, chunks: tuple[int, ...], width: int,
             kernel: bool, flashinfer: bool = False) -> dict[str, Select]:
    """``torch.topk`` (``chunked_topk`` with no chunks calls it directly), one chunked
    selection per chunk width, with ``kernel`` the fused one at each width it fits over
    rows of ``width``, and with ``flashinfer`` FlashInfer's, by name."""
    out: dict[str, Select] = {"torch.topk": functools.partial(chunked_topk, k=k, chunk=0)}
    for chunk in chunks:
        out[f"chunked {chunk}"] = functools.partial(chunked_topk, k=k, chunk=chunk)
    for chunk in chunks:
        if kernel and fits(width, k, chunk):
            out[f"fused {chunk}"] = functools.partial(fused_topk, k=k, chunk=chunk)
    if flashinfer:
        out["flashinfer"] = functools.partial(flashinfer_topk, k=k)
    return out


def _timed_us(select: Select, logits: torch.Tensor, replays: int, reps: int,
              ) -> tuple[list[float], tuple[torch.Tensor, torch.Tensor]]:
    """µs per call of ``select`` over ``logits``: replays of a CUDA graph of it (eager
    calls on the CPU), one figure per block of ``replays``; and what the last replay (or
    call) selected."""
    if logits.is_cuda:
        select(logits)  # warm-up outside the recording (kernels loaded)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            selected = select(logits)
        figures = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            figures.append(start.elapsed_time(end) * 1e3 / replays)
        return figures, selected
    figures = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(replays):
            selected = select(logits)
        figures.append((time.perf_counter() - t0) * 1e6 / replays)
    return figures, selected


def _agrees(selected: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, k: int) -> bool:
    """The ``selected`` values are ``torch.topk``'s and their indices name them."""
    values, ids = selected
    expected, _ = torch.topk(logits, k, dim=-1)
    return bool(torch.equal(values, expected)
                and torch.equal(torch.gather(logits, 1, ids), values))


def run(args: argparse.Namespace, data: Json) -> None:
    """Every batch size and variant into ``data``; prints the table."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[Json] = []
    kernel = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    flashinfer_failed = ("runs on a GPU where it is installed" if device.type != "cuda"
                         or importlib.util.find_spec("flashinfer") is None
                         else warm_up(device, args.vocab, args.k, dtype=dtype,
                                     batches=tuple(args.batches)))
    flashinfer = flashinfer_failed is None
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, generator=gen, device=device).to(dtype)
        base: float | None = None
        for name, select in variants(args.k, args.chunks, args.vocab, kernel,
                                     flashinfer).items():
            figures, selected = _timed_us(select, logits, args.replays, args.reps)
            us = statistics.median(figures)
            base = us if base is None else base
            rows.append({"batch": batch, "variant": name, "us": us, "figures_us": figures,
                         "x_torch": base / us, "agrees": _agrees(selected, logits, args.k)})
    table = [{"batch": r["batch"], "variant": r["variant"], "µs per call": r["us"],
              "x torch.topk": r["x_torch"], "values": "equal" if r["agrees"] else "DIFFER"}
             for r in rows]
    note = (f"top {args.k} of {args.vocab} {args.dtype} logits per row; µs per call "
            f"({'CUDA graph replays' if device.type == 'cuda' else 'eager CPU calls'}, "
            f"median of {args.reps} blocks of {args.replays}); x torch.topk: its time over "
            "the variant's" + ("" if kernel else "; the kernel's variants (fused) run on "
                                "a GPU or under TRITON_INTERPRET=1")
            + ("" if flashinfer else f"; flashinfer not run: {flashinfer_failed}"))
    print("\n".join(table_lines(table)) + f"\n{note}")
    data["figures"] = {"rows": rows, "table": table, "note": note}
    data["checks"]["values_equal"] = {"ok": all(r["agrees"] for r in rows), "required": True}


def _tool(name: str) -> str:
    """Triton's own ``ptxas`` or ``nvdisasm`` (``TRITON_PTXAS_PATH`` /
    ``TRITON_NVDISASM_PATH`` name another)."""
    from triton import knobs

    path = str(getattr(knobs.nvidia, name).path)
    if not Path(path).is_file():
        msg = f"--compile-only: Triton's {name} is not at {path} (set TRITON_{name.upper()}_PATH)"
        raise RuntimeError(msg)
    return path


def _ran(argv: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        msg = f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}"
        raise RuntimeError(msg)
    return done


def compiled_figures(width: int, k: int, chunk: int, dtype: torch.dtype) -> Json:
    """What the compiler made of the kernel for ``sm_90`` (see the module docstring)."""
    compiled = compile_for(width, k, chunk, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        cubin.write_bytes(compiled.asm["cubin"])
        used = _ran([_tool("ptxas"), "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull]).stderr
        sass = _ran([_tool("nvdisasm"), "-c", str(cubin)]).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass))
    registers = re.search(r"Used (\d+) registers", used)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", used)]
    return {"variant": f"fused {chunk}", **launch_constants(width, k, chunk),
            "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": sum(spills), "instructions": sum(ops.values()),
            "shuffles": ops["SHFL"], "barriers": ops["BAR"]}


def compile_only(args: argparse.Namespace, data: Json) -> None:
    """The compiler's figures of each width the kernel takes into ``data``; prints them."""
    dtype = getattr(torch, args.dtype)
    rows = [compiled_figures(args.vocab, args.k, chunk, dtype)
            for chunk in args.chunks if fits(args.vocab, args.k, chunk)]
    table = [{"variant": r["variant"], "warps": r["num_warps"], "registers": r["registers"],
              "spilled bytes": r["spill_bytes"], "instructions a warp": r["instructions"],
              "shuffles": r["shuffles"], "barriers": r["barriers"]} for r in rows]
    note = (f"top {args.k} of {args.vocab} {args.dtype} logits per row, the kernel compiled "
            "for sm_90 (nothing run); a warp's instructions are straight-line code")
    print("\n".join(table_lines(table)) + f"\n{note}")
    data["figures"] = {"rows": rows, "table": table, "note": note}
    data["checks"]["compiled"] = {  # each compiled, its registers and instructions read
        "ok": bool(rows) and all(r["registers"] and r["instructions"] for r in rows),
        "required": True}


def main(argv: list[str] | None = None) -> int:
    """Run the top-k benchmark; 0 when every variant agreed with ``torch.topk``."""
    p = argparse.ArgumentParser(prog="python -m harness topk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=Q06.vocab)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the logits' dtype (SGLang's: float32)")
    p.add_argument("-k", type=int, default=64)
    p.add_argument("--batches", type=positive_ints, default="1,8,64", help="positive, e.g. 1,8,64")
    p.add_argument("--chunks", type=positive_ints, default="16,32,64,128,256,512",
                   help="chunk widths, positive (128 divides Qwen3's 151936)")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compile-only", action="store_true",
                   help="compile the kernel for sm_90 at each width it takes and print the "
                        "compiler's figures; runs nothing (any machine)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $OUT/topk.json, else ./topk.json)")
    args = p.parse_args(argv)
    if min(args.vocab, args.k, args.replays, args.reps) <= 0 or args.k > args.vocab:
        p.error("--vocab, -k, --replays and --reps must be positive, -k at most --vocab")
    widest = widest_chunk(args.vocab, args.k)
    for chunk in args.chunks:  # chunked_topk takes torch.topk itself for these
        if chunk > widest:
            p.error(f"--chunks: {chunk}: --vocab ({args.vocab}) must hold more than -k "
                    f"({args.k}) whole chunks of a width, and -k chunks at most half of it: "
                    f"at most {widest} here; chunked_topk calls torch.topk otherwise")
    if args.compile_only:
        if not any(fits(args.vocab, args.k, chunk) for chunk in args.chunks):
            p.error(f"--compile-only: the kernel takes none of --chunks "
                    f"({','.join(map(str, args.chunks))}) for -k {args.k} over {args.vocab} "
                    "columns (a power of two it fits)")
        settings = {**vars(args), "out": str(args.out), "device_name": "none (compiled for "
                    "sm_90)", "torch": torch.__version__, "python": sys.version.split()[0]}
        return run_benchmark("topk", settings, lambda data: compile_only(args, data), args.out)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run")
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    settings = {**vars(args), "out": str(args.out), "device_name": name,
                "torch": torch.__version__, "python": sys.version.split()[0]}
    return run_benchmark("topk", settings, lambda data: run(args, data), args.out)
