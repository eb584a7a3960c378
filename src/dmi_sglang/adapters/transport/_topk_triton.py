"""The Triton kernel of :func:`~dmi_sglang.adapters.transport.topk_kernel.fused_topk`
(imported on its first use: importing this module imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["topk_kernel"]


@triton.jit
def key32(x):  # type: ignore[no-untyped-def]
    # a float's order as a signed 32-bit integer; NaN above every number
    f = x.to(tl.float32)
    bits = f.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(f != f, 0x7FFFFFFF, key)  # noqa: PLR0124 (f != f: f is NaN, of any sign)


@triton.jit
def packed(key, column):  # type: ignore[no-untyped-def]
    # the key above its column: equal keys rank the lower column higher
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - column).to(tl.int64)


@triton.jit(do_not_specialize=["width", "row_stride", "groups", "k"])  # type: ignore[untyped-decorator]
def topk_kernel(logits, maxima, values, ids, width, row_stride, groups, k,  # type: ignore[no-untyped-def] # noqa: PLR0917
                chunk: tl.constexpr, rounded: tl.constexpr, slots: tl.constexpr):
    # unannotated pointers: what every Triton version reads the same way
    row = tl.program_id(0).to(tl.int64)
    line = logits + row * row_stride
    nothing = tl.full((), -0x7FFFFFFFFFFFFFFF - 1, tl.int64)  # below every real key
    # the chunks' maxima, and the columns after the last whole chunk as chunk `groups`
    g = tl.arange(0, slots)
    whole = g < groups
    best = key32(tl.load(maxima + row * groups + g, mask=whole, other=0.0))
    tail = groups.to(tl.int64) * chunk + tl.arange(0, chunk)
    in_tail = tail < width
    tail_best = tl.max(tl.where(in_tail, key32(tl.load(line + tail, mask=in_tail,
                                                       other=0.0)), -0x7FFFFFFF - 1), 0)
    best = tl.where(g == groups, tail_best, best)
    used = whole | ((g == groups) & (groups.to(tl.int64) * chunk < width))
    chosen = tl.topk(tl.where(used, packed(best, g), nothing), rounded)
    picked = (0x7FFFFFFF - (chosen & 0xFFFFFFFF)).to(tl.int64)  # chunk numbers
    # every column of the chosen chunks is a candidate
    cols = picked[:, None] * chunk + tl.arange(0, chunk)[None, :]
    real = cols < width
    keys = tl.where(real, packed(key32(tl.load(line + cols, mask=real, other=0.0)),
                                 cols), nothing)
    top = tl.topk(tl.reshape(keys, [rounded * chunk]), rounded)
    column = (0x7FFFFFFF - (top & 0xFFFFFFFF)).to(tl.int64)
    j = tl.arange(0, rounded)
    wanted = j < k
    out = row * k + j
    tl.store(values + out, tl.load(line + column, mask=wanted), mask=wanted)
    tl.store(ids + out, column, mask=wanted)

