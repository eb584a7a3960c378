"""Every number the GPU harness assumes, in one place.

Estimates only decide what fits before the deadline; nothing measured is taken from here.
"""

from __future__ import annotations

SCHEMA = 2
"""Version of the result JSON (:mod:`harness.results`); bump when a field changes meaning."""
SEED = 20261129
"""Prompt-id and ServerArgs ``random_seed`` seed shared by stock and monitored engines."""
TOKEN_ID_LIMIT = 151643
"""Prompt ids are drawn below Qwen3's first special token."""
MAX_TOTAL_TOKENS = 65536
"""KV pool of every engine (stock and monitored alike): two engines share the GPU while a
benchmark brackets one with the other, so the pool is fixed instead of profiled."""
MEM_FRACTION_STATIC = 0.45
"""SGLang's static memory fraction, the same for both engines of a comparison."""

DEADLINE_ENV = "DMI_HARNESS_DEADLINE_S"
"""The one deadline setting: seconds after the harness command started by which it must be
done (unset or 0: no deadline). Work that would not fit is left for the next invocation,
which resumes from the state directory."""
STATE_ENV = "DMI_HARNESS_STATE"
"""Directory of resumable state (default :data:`STATE_DIR` where writable)."""
STATE_DIR = "/root/dmi-harness-state"
"""The default state directory: it outlives one command on the GPU machine."""
TRITON_CACHE_DIR = "/root/triton-cache"
"""Triton's kernel cache for engine children (kept between commands of one machine)."""
SHUTDOWN_GRACE_S = 120.0
"""How long a shutting-down engine may take before its process group is killed (a grace
for cleanup, not a limit on the work: the work is bounded by the deadline alone)."""

ENGINE_OVERHEAD_S = 20.0
"""Process start, imports and shutdown per engine, beyond SGLang's own startup (estimate)."""
STORE_INGEST_BPS = 300e6
"""Embedded store ingest rate assumed by time estimates."""
READBACK_S_PER_REQUEST = 0.05
"""Completeness read-back per request (estimate)."""
DISK_PROBE_BYTES = 1 << 30
"""Bytes the disk probe writes (and syncs) to measure the store disk's write rate."""
D2H_PROBE_BYTES = 1 << 30
"""Bytes of the pinned device-to-host copy that measures the D2H bound."""

TARGETS: dict[str, tuple[str, float]] = {
    "transport:hidden-states": ("ratio", 0.97),
    "transport:sglang-full": ("ratio", 0.60),
    "store:hidden-states": ("bound_share", 0.85),
    "store:resid_pre:last": ("ratio", 0.97),
    "store:final_logits:topk(64)": ("ratio", 0.95),
    "store:hidden-states [DMX_REQUEST_SAMPLE=0.1]": ("ratio", 0.90),
    "store:hidden-states [DMX_REQUEST_SAMPLE=0]": ("ratio", 0.97),
}
"""The serving targets (ARCHITECTURE.md, "Performance targets"; the selective cells from
the selective-capture issue): cell (mode and ``--env``) -> (summary figure, minimum).
They apply to the reference workload only (:data:`TARGET_WORKLOAD`)."""
TARGET_WORKLOAD = {"model": "0.6b", "batch": 64, "prompt_len": 256, "output_len": 128}
"""The workload the targets are stated for, with at least :data:`TARGET_MIN_SECONDS`."""
TARGET_MIN_SECONDS = 30.0
