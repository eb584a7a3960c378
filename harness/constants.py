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
STACK_DUMP_GRACE_S = 5.0
"""How long an engine that did not reply in time has to write its Python stacks to its
log (Python's ``faulthandler``, on ``SIGABRT``) before its process group is killed."""
STACK_DUMP_LINES = 400
"""The lines of an engine's log, from the first stack dump on, that the error of an engine
which did not reply in time quotes (its processes' stacks, each thread's)."""

GPU_BUSY_PERIOD_S = 0.1
"""How often a timed run reads the GPU's utilization (``figures.gpu_busy`` of a serving
unit)."""

THREADS_REPORTED = 8
"""Threads of an engine's processes reported per timed run, the busiest first
(``figures.threads`` of a serving unit: how the CPU time was spent, stock against
monitored)."""

ENGINE_OVERHEAD_S = 20.0
"""Process start, imports and shutdown per engine, beyond SGLang's own startup (estimate)."""
STORE_INGEST_BPS = 300e6
"""Embedded store ingest rate assumed by time estimates."""
STORED_CELL_CAPTURE_BYTES = 20e9
"""A stored serving cell's timed waves stop once they captured this much (or ran
``--min-seconds``, whichever comes first): the targets' measuring rule (">= 30 s of
steady decoding or >= 20 GB captured"), and what keeps a store of every position within
the GPU host's disk."""
MAX_WAVES = 10_000
"""Timed waves of a serving engine at most (``--min-seconds`` ends them first)."""
READBACK_S_PER_REQUEST = 0.05
"""Completeness read-back per request (estimate)."""
DISK_PROBE_BYTES = 1 << 30
"""Bytes the disk probe writes (and syncs) to measure the store disk's write rate."""
D2H_PROBE_BYTES = 1 << 30
"""Bytes of the pinned device-to-host copy that measures the D2H bound."""

TARGETS: dict[tuple[str, str], tuple[str, float]] = {
    ("0.6b", "transport:hidden-states"): ("ratio", 0.97),
    ("0.6b", "transport:sglang-full"): ("ratio", 0.60),
    ("0.6b", "store:hidden-states"): ("bound_share", 0.85),
    ("0.6b", "store:resid_pre:last"): ("ratio", 0.97),
    ("0.6b", "store:final_logits:topk(64)"): ("ratio", 0.95),
    ("0.6b", "store:hidden-states [DMX_REQUEST_SAMPLE=0.1]"): ("ratio", 0.90),
    ("0.6b", "store:hidden-states [DMX_REQUEST_SAMPLE=0]"): ("ratio", 0.97),
    ("8b", "transport:hidden-states"): ("ratio", 0.97),
}
"""The project's serving targets (``docs/benchmarks.md``, "Targets"): (``--model``, cell
(mode and its settings)) -> (summary figure, minimum). They apply to the reference workload
only (:data:`TARGET_WORKLOAD` on that model)."""
REFERENCE_MODEL = "0.6b"
"""The model whose target a cell shows when its own model has none."""
TARGET_WORKLOAD = {"batch": 64, "prompt_len": 256, "output_len": 128}
"""The workload the targets are stated for, with at least :data:`TARGET_MIN_SECONDS`."""
TARGET_MIN_SECONDS = 30.0

# -- serve-load (python -m harness serve-load) -----------------------------------------------
DEFAULT_MODES = ("resid_pre:last", "hidden-states")
"""Hook selections measured unless ``--modes`` says otherwise."""
NUM_PROMPTS = 320
"""bench_serving requests per server."""
INPUT_LEN = 256
"""bench_serving's ``--random-input-len`` (the longest prompt)."""
OUTPUT_LEN = 128
"""bench_serving's ``--random-output-len`` (the longest output)."""
RANGE_RATIO = 0.5
"""bench_serving's ``--random-range-ratio``: lengths drawn from [ratio x len, len]."""
MAX_CONCURRENCY = 64
"""bench_serving's concurrent clients."""
CANCEL_SHARE = 0.1
"""Cancelled requests, as a share of ``--num-prompts``."""
CANCEL_WORKERS = 4
"""Concurrent clients of the cancelling client."""
CANCEL_EVENTS = 3
"""Streamed events a cancelled request reads before its client closes the connection."""
CANCEL_NEW_TOKENS = 1024
"""``max_new_tokens`` of a cancelled request (it must still be running when closed)."""
CANCEL_INTERVAL_S = 0.2
"""Pause of each cancelling client between its requests."""
SUBSET_PROMPTS = 8
"""Requests of the deterministic subset, sent one at a time."""
SUBSET_NEW_TOKENS = 32
"""``max_new_tokens`` of each subset request (greedy, ``ignore_eos``)."""
SUBSET_MIN_LEN = 16
"""Prompt length of the first subset request; each next one is :data:`SUBSET_LEN_STEP`
longer."""
SUBSET_LEN_STEP = 8
WARMUP_REQUESTS = 16
"""Concurrent warm-up requests before the bench (Triton compiles, CUDA graphs touched)."""
WARMUP_NEW_TOKENS = 16
MEM_FRACTION = 0.3
"""``--mem-fraction-static`` of every server (one server at a time on the GPU)."""
SERVER_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--mem-fraction-static", str(MEM_FRACTION), "--disable-radix-cache",
                "--disable-prefill-cuda-graph", "--log-level", "info")
"""SGLang flags of every server. The two settings monitoring forces for selections that
keep every position (radix cache and prefill CUDA graphs off) are given to all, so that
stock and monitored servers run the same configuration whatever the mode. ``info`` logs
the scheduler's batches, which serve-load summarises (``scheduler_activity``)."""
START_S = 300.0
"""Longest server start (a cold Triton cache took ~150 s on the H200, a warm one ~35 s)."""
EXIT_S = 90.0
"""Longest wait for a server's exit after SIGINT before its process group is killed."""
HTTP_S = 120.0
"""Timeout of one HTTP call."""
STOP_WAIT_S = 180.0
"""Longest wait for ``POST /dmi/stop`` to reach ``stopped``."""
BENCH_S = 400.0
"""Longest bench_serving run (the deadline bounds it further)."""
BENCH_MAIN_WAIT_S = 120.0
"""Longest wait for bench_serving's main run before the cancelling client starts anyway."""
BENCH_READY_S = 60
"""bench_serving's ``--ready-check-timeout-sec``."""
START_WARM_EST_S = 45.0
"""Estimated start of a server once the Triton cache is warm (deadline planning)."""
MODE_TAIL_EST_S = 40.0
"""Estimated stop, readback, exit and direct read of one monitored server."""
RESERVE_S = 20.0
"""Seconds kept free before the deadline for stopping servers and writing the JSON."""
COMMIT_WAIT_S = 10.0
"""Longest serve-load waits for a finished request to read complete over HTTP."""

# -- the store owner's write channel (python -m harness store) ------------------------------
CHANNEL_WAIT_S = 120.0
"""Longest wait for the channel benchmark's owner process to start or to end."""
