"""Probe: do a decode graph's capture copies cost less on a side stream?

A decoder-shaped stack (Qwen3-0.6B sizes: 28 layers, hidden 1024, q 2048, kv 1024,
intermediate 3072, bf16, batch 64) whose residual is updated in place (as SGLang's fused
add+RMSNorm does) is captured in a CUDA graph four ways and replayed:

* ``base``: no capture copies;
* ``main``: after each layer's first norm, its residual rows are copied into that layer's
  place of an arena on the forward's stream (what the capture points record today);
* ``side``: the same copies on a second stream, forked after the norm and joined before
  the residual is next changed in place (the layer's second add), so they run beside
  the attention's kernels;
* ``side+move``: ``side`` plus one indexed copy of every place into a slot at the end
  (the arena's landing move), on the second stream, joined at the forward's end.

Prints the median replay time (CUDA events, ``--blocks`` blocks of ``--replays``) and
each variant's extra time over ``base``; checks that the side-stream variants' arena
holds what the in-line copies hold after a replay (and the moved slot the same). ``--device cpu`` runs the eager forwards only (a
dry run of the script). A one-off diagnostic: it uses torch alone, not dmi-sglang.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

LAYERS, HIDDEN, Q, KV, INTER = 28, 1024, 2048, 1024, 3072


def weights(dev: torch.device, layers: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(i: int, o: int) -> torch.Tensor:
        return (torch.randn(i, o, generator=g) / i**0.5).to(dev, torch.bfloat16)

    return [{"qkv": w(HIDDEN, Q + 2 * KV), "o": w(Q, HIDDEN), "up": w(HIDDEN, 2 * INTER),
             "down": w(INTER, HIDDEN)} for _ in range(layers)]


def rms(t: torch.Tensor) -> torch.Tensor:
    return (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)


class Copies:
    """Where a variant's capture copies go."""

    def __init__(self, variant: str, arena: torch.Tensor, slots: torch.Tensor,
                 index: torch.Tensor) -> None:
        self.variant, self.arena, self.slots, self.index = variant, arena, slots, index
        cuda = arena.device.type == "cuda"
        self.side = torch.cuda.Stream(arena.device) if cuda and variant.startswith("side") \
            else None
        self.pending = False

    def capture(self, layer: int, resid: torch.Tensor) -> None:
        if self.variant == "base":
            return
        if self.side is None:
            self.arena[layer].copy_(resid)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.arena[layer].copy_(resid)
        self.pending = True

    def join(self) -> None:
        if self.side is not None and self.pending:
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False

    def end(self) -> None:
        if self.variant != "side+move":
            pass
        elif self.side is None:  # a CPU dry run
            self.slots.index_copy_(0, self.index, self.arena.unsqueeze(0))
        else:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.slots.index_copy_(0, self.index, self.arena.unsqueeze(0))
            self.pending = True
        self.join()


def forward(ws: list[dict[str, torch.Tensor]], x: torch.Tensor, resid: torch.Tensor,
            cp: Copies) -> torch.Tensor:
    h = x
    for i, w in enumerate(ws):
        resid.add_(h)  # fused add: the residual changes in place
        h = rms(resid)
        cp.capture(i, resid)
        qkv = h @ w["qkv"]
        a = torch.nn.functional.silu(qkv[:, :Q])  # stands in for attention
        o = a @ w["o"]
        cp.join()  # the residual changes next
        resid.add_(o)
        h = rms(resid)
        gate, up = (h @ w["up"]).chunk(2, dim=-1)
        h = (torch.nn.functional.silu(gate) * up) @ w["down"]
    cp.end()
    return h


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    ws = weights(dev, args.layers)
    x0 = (torch.randn(args.batch, HIDDEN, generator=torch.Generator().manual_seed(1))
          .to(dev, torch.bfloat16))
    results: dict[str, object] = {"device": torch.cuda.get_device_name(dev)
                                  if dev.type == "cuda" else "cpu",
                                  "batch": args.batch, "layers": args.layers}
    times: dict[str, float] = {}
    expected = None
    for variant in ("base", "main", "side", "side+move"):
        arena = torch.zeros(args.layers, args.batch, HIDDEN, dtype=torch.bfloat16, device=dev)
        slots = torch.zeros(3, args.layers, args.batch, HIDDEN, dtype=torch.bfloat16,
                            device=dev)
        index = torch.tensor([1], device=dev)
        cp = Copies(variant, arena, slots, index)
        x, resid = x0.clone(), torch.zeros_like(x0)

        def step() -> None:
            resid.zero_()
            forward(ws, x, resid, cp)

        with torch.no_grad():
            if dev.type != "cuda":
                step()
            else:
                s = torch.cuda.Stream(dev)
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    step()
                    step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                arena.zero_()
                slots.zero_()
                graph.replay()
                torch.cuda.synchronize()
                blocks = []
                for _ in range(args.blocks):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    for _ in range(args.replays):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    blocks.append(start.elapsed_time(end) * 1e3 / args.replays)
                times[variant] = statistics.median(blocks)
                results[f"{variant}_spread_us"] = max(blocks) - min(blocks)
        if variant == "main":
            expected = arena.clone()
        elif variant.startswith("side"):
            assert expected is not None
            same = bool(torch.equal(arena, expected))
            results[f"{variant}_arena_equal"] = same
            if variant == "side+move":
                results["move_equal"] = bool(torch.equal(slots[1], expected))
    for v, t in times.items():
        results[f"{v}_us"] = t
        print(f"{v:>10}  {t:8.1f} us/replay  +{t - times['base']:6.1f} us")
    print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    bad = [k for k, v in results.items() if k.endswith("_equal") and v is not True]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
