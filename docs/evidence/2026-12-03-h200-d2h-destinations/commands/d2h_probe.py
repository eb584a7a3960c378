"""How long a queued device-to-host copy's ``copy_`` call takes, per kind of destination.

The drain's copies go into page-locked memory in two forms: slices of a torch page-locked
tensor (the staging buffer) and ``torch.from_numpy`` views of the numpy view of such a
tensor (the payload pool's slabs). This times ``dst.copy_(src, non_blocking=True)`` on a
side stream (the call) and the wait after it, for each form and for pageable memory, with
the device idle and with a long kernel queued on the default stream.

    python d2h_probe.py OUT.json [--mib 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch


def destinations(nbytes: int) -> dict[str, torch.Tensor]:
    pinned = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=True)
    numpy_view = torch.from_numpy(pinned.numpy().view(np.ndarray))
    return {"pinned tensor slice": pinned[nbytes:],
            "from_numpy view of pinned": numpy_view[:nbytes],
            "pageable": torch.empty(nbytes, dtype=torch.uint8)}


def probe(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, repeats: int,
          busy: torch.Tensor | None) -> dict[str, float]:
    calls, waits = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy is not None:  # a kernel of several ms on the default stream
            for _ in range(4):
                busy @ busy
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        waits.append(t2 - t1)
    call, wait = statistics.median(calls), statistics.median(waits)
    return {"call_ms": call * 1e3, "wait_ms": wait * 1e3,
            "gb_s": dst.numel() / (call + wait) / 1e9}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2
    nbytes = args.mib << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    busy = torch.randn(8192, 8192, device="cuda")
    rows = []
    for name, dst in destinations(nbytes).items():
        for load, b in (("idle", None), ("busy", busy)):
            r = probe(dst, src, stream, args.repeats, b)
            rows.append({"destination": name, "is_pinned": bool(dst.is_pinned()),
                         "device": load, **r})
            print(f"{name:28s} pinned={rows[-1]['is_pinned']!s:5s} {load:4s} "
                  f"call {r['call_ms']:8.3f} ms  wait {r['wait_ms']:8.3f} ms  "
                  f"{r['gb_s']:6.1f} GB/s")
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                   "mib": args.mib, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
