"""Group the drain thread's py-spy samples (``--format raw``) by what they were doing.

    python docs/evidence/2026-11-29-cpu-drain-copy-threads/split_profile.py drain-profile.raw.gz

A sample counts when its stack is inside ``Drain._process`` or a window flush; it goes to
the first of these frames found from the thread's root: the device-to-host (staging or
direct) copy, the window append (the copy of a step's rows into the window), a window
flush (its records and held request rows), ``build_records`` (records of steps that are
not coalesced), else "other".
"""

import collections
import gzip
import sys

GROUPS = (("to_host", "d2h (staging / direct copies)"),
          ("DecodeWindow.append", "window append copy"),
          ("DecodeWindow.flush", "window flush: records"),
          ("_flush_window", "window flush: records"),
          ("build_records", "build_records"))

counts: collections.Counter[str] = collections.Counter()
with gzip.open(sys.argv[1], "rt") as f:
    for line in f:
        stack, _, n = line.rstrip().rpartition(" ")
        if "Drain._process" not in stack and "flush" not in stack:
            continue
        frames = stack.split(";")
        key = next((label for fr in frames for mark, label in GROUPS if mark in fr), "other")
        counts[key] += int(n)
total = sum(counts.values())
for key, n in counts.most_common():
    print(f"{n:6d} {100 * n / total:5.1f}% {key}")
