"""Torch calls the drain thread makes per forward of ``python -m harness hooks``.

Every call into torch's C code releases the GIL and takes it back; the count is what the
one-call copies (``torch._foreach_copy_``) are meant to shrink. The drain thread counts
its own calls with a profile function (``threading.setprofile``, set before the
transport starts its threads; other threads uninstall it at their first event), so the
timing figures of this run are not figures: only the counts are.

    PYTHONPATH=src:. python docs/evidence/2026-12-07-drain-diagnostics/commands/drain_calls.py \
        --device cpu --presets sglang-full --waves 1 --hidden 64 --vocab 512

(all arguments go to ``harness hooks``; small hidden and vocabulary sizes keep the CPU's
copies short, and the drain's calls do not depend on them).
"""

from __future__ import annotations

import collections
import sys
import threading
import types
from typing import Any

from harness import micro_hooks

calls: collections.Counter[str] = collections.Counter()
timed_forwards = [0]
timed_waves = [0]


def _count(_frame: types.FrameType, event: str, arg: Any) -> None:
    if event != "c_call":
        return
    owner = getattr(arg, "__self__", None)
    module = getattr(arg, "__module__", None) or type(owner).__module__ or ""
    if module.startswith("torch"):
        calls[getattr(arg, "__qualname__", getattr(arg, "__name__", "?"))] += 1


def _install(_frame: types.FrameType, _event: str, _arg: Any) -> None:
    """First event of a new thread: count on the drain thread, nothing elsewhere."""
    sys.setprofile(_count if threading.current_thread().name == "dmi-capture-drain" else None)


def main() -> int:
    real_measure = micro_hooks.measure

    def measure(args: Any, preset: str) -> Any:
        threading.setprofile(_install)
        try:
            row = real_measure(args, preset)
        finally:
            threading.setprofile(None)
        timed_forwards[0] += row["decode_forwards"]
        timed_waves[0] = args.waves
        return row

    micro_hooks.measure = measure
    code = micro_hooks.main(sys.argv[1:])
    total = sum(calls.values())
    # the drain ran through the warm-up wave too, whose forwards the rows do not count
    timed = timed_waves[0]
    per_wave = timed_forwards[0] / timed
    print(f"drain torch calls: {total} in {timed + 1} waves of {per_wave:.0f} decode "
          f"forwards: {total / (per_wave * (timed + 1)):.1f} per decode forward")
    for name, n in calls.most_common(12):
        print(f"  {n:8d}  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
