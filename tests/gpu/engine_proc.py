"""Shared by the GPU qualification runner and the serving benchmark (no GPU needed here).

* Real model shapes (Qwen3-0.6B, Qwen3-8B) written as a ``config.json`` for
  ``load_format="dummy"`` engines.
* Workloads: named batches of random prompt ids (fixed seed), one ``generate`` call each,
  optionally repeated in waves; turned into ``run_engine.py`` specs.
* Expected capture sizes, from the domain's hook catalog and row shapes (pure Python).
* :func:`launch`: one engine in its own process group (``run_engine.py``), its log kept,
  the scheduler's ``dmi.stopped`` / ``store.closed`` statistics parsed from it, leftover
  processes killed.
* The device call's deadline (each lent-machine command is limited to 10 minutes).

Nothing here imports torch or SGLang.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN_ENGINE = HERE / "run_engine.py"

try:  # installed (the GPU kit installs the project wheel); else this checkout's sources
    import dmi_sglang  # noqa: F401
except ImportError:  # a dry run on a machine without the project installed
    sys.path.insert(0, str(REPO / "src"))

SEED = 20261129
"""Prompt-id and server ``random_seed`` seed shared by every run (stock and monitored)."""
TOKEN_ID_LIMIT = 151643
"""Prompt ids are drawn below Qwen3's first special token."""
D2H_CEILING_BPS = 55e9
"""Pinned device-to-host copy measured on the H200 (ARCHITECTURE.md)."""
CALL_LIMIT_S = 600.0
"""Wall-clock limit of one device command."""


# -- models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A real Qwen3 shape (dummy weights) and how long its engines take to start."""

    key: str
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    startup_eager_s: float
    startup_graph_s: float
    decode_tok_s_graph: float
    decode_tok_s_eager: float
    prefill_tok_s: float

    def startup_s(self, graphs: bool) -> float:
        """Estimated engine start (first start of a lease; Triton cache cold)."""
        return self.startup_graph_s if graphs else self.startup_eager_s

    def tok_s(self, graphs: bool) -> float:
        """Assumed stock output tokens/s at batch 64 (for time estimates only)."""
        return self.decode_tok_s_graph if graphs else self.decode_tok_s_eager

    def generate_s(self, workload: Workload, graphs: bool) -> float:
        """Rough seconds one wave of ``workload`` takes (time estimates only): its
        longest output at the batch-64 step time, plus its prefill."""
        step = 64.0 / self.tok_s(graphs)
        return max(workload.output_lens) * step + workload.prompt_tokens / self.prefill_tok_s


MODELS: dict[str, ModelSpec] = {
    # GPU kit README: real shapes; throughput: ARCHITECTURE.md "Performance targets".
    "0.6b": ModelSpec("0.6b", "qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, True,
                      45.0, 120.0, 19000.0, 2100.0, 60000.0),
    "8b": ModelSpec("8b", "qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, False,
                    90.0, 200.0, 5000.0, 1200.0, 15000.0),
}


def qwen3_config(model: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of a real Qwen3 model shape (as on the Hugging Face hub)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": model.hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.intermediate,
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.tied,
        "max_position_embeddings": 40960,
        "max_window_layers": model.layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def write_model_dir(root: Path, model: ModelSpec) -> Path:
    """``root/<name>/config.json`` for ``load_format="dummy"`` (idempotent)."""
    path = root / model.name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(qwen3_config(model), indent=1) + "\n")
    return path


def base_engine_kwargs(
    model_dir: Path | str,
    *,
    graphs: bool,
    overlap: bool = True,
    max_bs: int = 64,
    mem_fraction_static: float = 0.45,
    chunked_prefill_size: int | None = 4096,
    seed: int = SEED,
) -> dict[str, Any]:
    """ServerArgs keywords shared by stock and monitored runs of one configuration.

    The two settings a monitored engine forces (prefill CUDA graphs off, radix cache off)
    are passed explicitly, so the stock run matches. ``chunked_prefill_size`` None or 0
    leaves SGLang's default.
    """
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "mem_fraction_static": mem_fraction_static,
        "disable_prefill_cuda_graph": True,
        "disable_radix_cache": True,
        "random_seed": seed,
        "log_level": "error",
    }
    if chunked_prefill_size:
        kwargs["chunked_prefill_size"] = chunked_prefill_size
    if graphs:
        kwargs["cuda_graph_max_bs_decode"] = max_bs
    else:
        kwargs["disable_cuda_graph"] = True
    if not overlap:
        kwargs["disable_overlap_schedule"] = True
    return kwargs


# -- workloads ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One ``generate`` call of ``len(prompt_lens)`` requests (greedy, ignore_eos).

    With ``min_seconds`` > 0 or ``max_waves`` > 1 the call is repeated in waves (request
    ids get a ``.wN`` suffix) until ``min_seconds`` of generation or ``max_waves``.
    """

    name: str
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    timed: bool = True
    min_seconds: float = 0.0
    max_waves: int = 1
    return_hidden_states: bool = False
    keep_outputs: bool = True
    ids_from: str = ""
    """Draw the prompt ids of this workload name instead (repeats of a workload)."""

    def __post_init__(self) -> None:
        if len(self.prompt_lens) != len(self.output_lens) or not self.prompt_lens:
            msg = f"workload {self.name}: {len(self.prompt_lens)} prompts, " \
                  f"{len(self.output_lens)} output lengths"
            raise ValueError(msg)
        if min(self.output_lens) < 2 or min(self.prompt_lens) < 1:
            msg = f"workload {self.name}: prompts need >= 1 token and outputs >= 2"
            raise ValueError(msg)

    @property
    def requests(self) -> int:
        """Requests per wave."""
        return len(self.prompt_lens)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens per wave."""
        return sum(self.prompt_lens)

    @property
    def output_tokens(self) -> int:
        """Output tokens per wave (ignore_eos: exactly max_new_tokens)."""
        return sum(self.output_lens)

    def rids(self) -> list[str]:
        """Request ids of one wave (unique within an engine)."""
        return [f"{self.name}-{i}" for i in range(self.requests)]

    def input_ids(self, seed: int = SEED) -> list[list[int]]:
        """Random prompt ids, a pure function of (seed, name, lengths)."""
        return random_ids(seed, self.ids_from or self.name, self.prompt_lens)

    def spec(self, seed: int = SEED) -> dict[str, Any]:
        """This workload as a ``run_engine.py`` workload entry."""
        return {
            "name": self.name,
            "input_ids": self.input_ids(seed),
            "rids": self.rids(),
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                for n in self.output_lens
            ],
            "timed": self.timed,
            "min_seconds": self.min_seconds,
            "max_waves": self.max_waves,
            "return_hidden_states": self.return_hidden_states,
            "keep_outputs": self.keep_outputs,
        }

    def again(self, prefix: str = "again-") -> Workload:
        """The same prompts under other request ids (a determinism repeat)."""
        return Workload(prefix + self.name, self.prompt_lens, self.output_lens,
                        timed=self.timed, ids_from=self.ids_from or self.name)


def random_ids(seed: int, name: str, lens: Sequence[int]) -> list[list[int]]:
    """Prompt ids below :data:`TOKEN_ID_LIMIT` from ``random.Random(seed ^ crc32(name))``."""
    rng = random.Random(seed ^ zlib.crc32(name.encode()))
    return [[rng.randrange(TOKEN_ID_LIMIT) for _ in range(n)] for n in lens]


def spread(n: int, lo: int, hi: int) -> tuple[int, ...]:
    """``n`` integers evenly spread over ``[lo, hi]`` (deterministic, varied lengths)."""
    if n == 1:
        return (lo,)
    return tuple(lo + (hi - lo) * i // (n - 1) for i in range(n))


# -- expected capture sizes (domain code: pure Python) -------------------------------------
def captures_of(preset: str, model: ModelSpec) -> tuple[tuple[Any, int], ...]:
    """Every ``(Hook, layer_no)`` a forward captures for ``preset`` on the hooked Qwen3."""
    from dmi_sglang.adapters.sglang_v0519.facts import QWEN3_HOOKS
    from dmi_sglang.domain.hooks import ModelHooks, parse_selection

    hooks = ModelHooks("Qwen3ForCausalLM", QWEN3_HOOKS, model.layers)
    return parse_selection(preset).resolve(hooks).captures()


def model_shape(model: ModelSpec) -> Any:
    """The domain :class:`~dmi_sglang.domain.shapes.ModelShape` (bf16 activations)."""
    from dmi_sglang.domain.shapes import ModelShape

    return ModelShape(model.layers, model.hidden, model.heads, model.kv_heads,
                      model.head_dim, model.intermediate, model.vocab)


@dataclass
class Expected:
    """Rows and payload bytes a complete capture holds, per act_name and in total."""

    rows: int = 0
    bytes: int = 0
    by_act: dict[str, list[int]] = field(default_factory=dict)
    """act_name -> [rows, bytes]."""

    def add(self, act: str, rows: int, nbytes: int) -> None:
        """Count ``rows`` rows of ``nbytes`` bytes in total for ``act``."""
        self.rows += rows
        self.bytes += nbytes
        entry = self.by_act.setdefault(act, [0, 0])
        entry[0] += rows
        entry[1] += nbytes


def expected_capture(
    preset: str,
    model: ModelSpec,
    requests: Iterable[tuple[int, int, bool]],
) -> Expected:
    """What the store must hold for requests ``(prompt, completion, extra_forward)``.

    ``extra_forward``: the overlap scheduler forwarded the last token once more (its
    token rows are stored). Row coverage follows
    :func:`dmi_sglang.domain.records.expected_coverage`.
    """
    from dmi_sglang.domain.records import expected_coverage

    caps = captures_of(preset, model)
    shape = model_shape(model)
    out = Expected()
    for prompt, completion, extra in requests:
        for hook, _layer in caps:
            rows = expected_coverage(hook, prompt_tokens=prompt, completion_tokens=completion,
                                     overlap_extra_forward=extra).rows
            out.add(hook.act_name, rows, rows * shape.row(hook).nbytes)
    return out


def check_transport_rows(
    stats: Mapping[str, Any],
    preset: str,
    model: ModelSpec,
    requests: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    """Transport-only runs: do the stop statistics account for every expected row?

    Each request may or may not have had the overlap scheduler's extra forward, so the
    rows handed to the sink must be ``base + k * extra`` for one whole ``k`` in
    ``[0, len(requests)]``, and the bytes must agree with the same ``k``.
    """
    base = expected_capture(preset, model, ((p, c, False) for p, c in requests))
    with_extra = expected_capture(preset, model, ((p, c, True) for p, c in requests))
    n = len(requests)
    per_rows = (with_extra.rows - base.rows) // n if n else 0
    per_bytes = (with_extra.bytes - base.bytes) // n if n else 0
    rows, nbytes = int(stats.get("rows", -1)), int(stats.get("bytes", -1))
    if per_rows:
        k = (rows - base.rows) // per_rows
        ok = (rows - base.rows) % per_rows == 0 and 0 <= k <= n
    else:  # no token-row hook (e.g. logits only): no extra rows at all
        k, ok = 0, rows == base.rows
    ok = ok and n > 0 and nbytes == base.bytes + k * per_bytes
    return {
        "ok": ok,
        "rows": rows,
        "bytes": nbytes,
        "expected_rows_without_extra": base.rows,
        "expected_rows_all_extra": with_extra.rows,
        "expected_bytes_without_extra": base.bytes,
        "expected_bytes_all_extra": with_extra.bytes,
        "requests_with_extra_forward": k if ok else None,
    }


# -- running one engine ------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KEY = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=")
_CLOSE = {"[": "]", "{": "}", "(": ")"}


def _value_end(text: str, i: int) -> int:
    """End index of the value starting at ``text[i]`` (quotes and brackets balanced)."""
    if i >= len(text):
        return i
    ch = text[i]
    if ch in "'\"":
        j = i + 1
        while j < len(text) and text[j] != ch:
            j += 2 if text[j] == "\\" else 1
        return min(j + 1, len(text))
    if ch in _CLOSE:
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c in "'\"":
                j = _value_end(text, j)
                continue
            if c in _CLOSE:
                depth += 1
            elif c in _CLOSE.values():
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return j
    j = i
    while j < len(text) and not text[j].isspace():
        j += 1
    return j


def _convert(raw: str) -> Any:
    if raw[:1] in "'\"" and raw[-1:] == raw[:1] and len(raw) >= 2:
        return raw[1:-1]
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw in ("True", "False"):
        return raw == "True"
    return raw


def parse_kv(text: str) -> dict[str, Any]:
    """``key=value`` pairs of a structlog console line (numbers converted)."""
    out: dict[str, Any] = {}
    pos = 0
    while True:
        m = _KEY.search(text, pos)
        if m is None:
            return out
        start = m.end()
        end = _value_end(text, start)
        out[m.group(1)] = _convert(text[start:end])
        pos = max(end, start + 1)


def parse_log_events(text: str, events: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The last occurrence of each structlog event in a log (console or JSON lines)."""
    wanted = set(events)
    found: dict[str, dict[str, Any]] = {}
    for line in _ANSI.sub("", text).splitlines():
        stripped = line.strip()
        if stripped.startswith("{"):
            with contextlib.suppress(ValueError):
                data = json.loads(stripped)
                if isinstance(data, dict) and data.get("event") in wanted:
                    found[str(data["event"])] = data
            continue
        for event in wanted:
            m = re.search(rf"\]\s+{re.escape(event)}(\s|$)", line)
            if m:
                found[event] = parse_kv(line[m.end():])
    return found


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment without any ``DMX_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMX_")}
    env.setdefault("TRITON_CACHE_DIR", "/root/triton-cache")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _reap_group(pgid: int, grace_s: float = 10.0) -> bool:
    """Kill what is left of the engine's process group; True when something was left."""
    if not _group_alive(pgid):
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.5)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(min(2.0, grace_s))  # let the driver release the GPU memory
        return True
    return False


def gpu_memory_used_mib() -> int | None:
    """Used GPU memory (first GPU) from nvidia-smi, None where unavailable."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


STAT_EVENTS = ("dmi.stopped", "dmi.timing", "store.closed", "dmi.prepared",
               "capture transport ready")

_TRACK: list[Path] = []
"""The file listing the process groups of engines this invocation started (if set)."""


def _group_members(pgid: int) -> list[str]:
    """Command lines of the processes in group ``pgid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                out.append(cmd.decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def track_engines(path: Path, settle_s: float = 3.0) -> list[int]:
    """Remember engine process groups in ``path``; kill those an earlier invocation left.

    A device call cut off at its time limit can leave an engine (and its GPU memory)
    behind. Only groups recorded in ``path`` by :func:`launch` whose processes still look
    like engines (``run_engine.py`` or multiprocessing children) are killed.
    """
    killed = []
    try:
        recorded = [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        recorded = []
    for pgid in recorded:
        members = _group_members(pgid)
        if members and any("run_engine.py" in m or "multiprocessing" in m or "sglang" in m
                           for m in members):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    _TRACK[:] = [path]
    if killed:
        time.sleep(settle_s)  # let the driver release the GPU memory
    return killed


def _tracked(pgid: int, add: bool) -> None:
    if not _TRACK:
        return
    path = _TRACK[0]
    with contextlib.suppress(OSError, ValueError):
        pids = [int(x) for x in path.read_text().split()] if path.exists() else []
        pids = [*pids, pgid] if add else [p for p in pids if p != pgid]
        path.write_text("".join(f"{p}\n" for p in pids))


def launch(spec: Mapping[str, Any], workdir: Path, name: str, timeout_s: float, *,
           reap_grace_s: float = 10.0) -> dict[str, Any]:
    """Run one engine (``run_engine.py``) in its own process group; its result as a dict.

    Adds ``log`` (path), ``wall_s``, ``timed_out``, ``leftover_processes`` (something of
    the group had to be killed), ``gpu_mib_before`` and ``events`` (the scheduler's
    ``dmi.stopped`` / ``store.closed`` statistics, parsed from the log).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = child_env(spec.get("env", {}))
    before = gpu_memory_used_mib()
    started = time.perf_counter()
    timed_out = False
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(RUN_ENGINE), str(spec_path), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _tracked(proc.pid, add=True)
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    leftover = _reap_group(proc.pid, reap_grace_s)
    _tracked(proc.pid, add=False)
    wall = time.perf_counter() - started
    text = log_path.read_text(errors="replace")
    if out_path.exists():
        result: dict[str, Any] = json.loads(out_path.read_text())
    else:
        why = f"timed out after {timeout_s:.0f} s" if timed_out else \
            f"exit status {proc.returncode}, no result file"
        result = {"ok": False, "error": f"engine process {why}"}
    result.update(
        log=str(log_path), wall_s=wall, timed_out=timed_out, returncode=proc.returncode,
        leftover_processes=leftover, gpu_mib_before=before,
        events=parse_log_events(text, STAT_EVENTS),
    )
    if not result.get("ok"):
        result["log_tail"] = text[-4000:]
    return result


# -- bookkeeping -------------------------------------------------------------------------
def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def git_info(repo: Path = REPO, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"commit", "dirty", "code"}`` of the checkout and its :func:`code_fingerprint`.

    ``DMI_COMMIT`` names the commit where it is set: the device's copy of the checkout
    may have no ``.git``, or one whose HEAD lags the working tree that was sent (seen in
    lease 4 of 2026-11-29); git's own HEAD is then kept as ``git_head`` and ``dirty`` is
    unknown. The code fingerprint identifies the code either way.
    """
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                 text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    named = (os.environ if env is None else env).get("DMI_COMMIT", "").strip()
    head = git("rev-parse", "HEAD")
    code = code_fingerprint(repo)
    if named:
        return {"commit": named, "dirty": None, "code": code, "git_head": head}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head or "unknown", "dirty": bool(status) if status is not None else None,
            "code": code}


def code_fingerprint(repo: Path = REPO) -> str:
    """12 hex digits over the code that decides results (``src/``, ``tests/gpu/``,
    ``bench/``): state saved by an earlier call is reused only for identical code, also
    where the device copy of the checkout has no ``.git``."""
    digest = hashlib.sha256()
    for sub in ("src", "tests/gpu", "bench"):
        for path in sorted((repo / sub).rglob("*.py")):
            digest.update(str(path.relative_to(repo)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def stable_hash(data: Any) -> str:
    """12 hex digits of the sha256 of ``data`` as canonical JSON."""
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _parent_elapsed_s() -> float | None:
    """Seconds since the parent process started (Linux /proc), or None."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        start = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start / ticks


def call_deadline(
    budget_s: float | None,
    *,
    limit_s: float = CALL_LIMIT_S,
    margin_s: float = 45.0,
    now: float | None = None,
    env: Mapping[str, str] | None = None,
    parent_elapsed_s: float | None = None,
) -> float | None:
    """``time.time()`` by which this invocation must be done, or None (no limit).

    ``budget_s``: explicit seconds from now (0 or negative: no limit). Without it the
    device call is assumed to have started at ``DMI_CALL_STARTED_EPOCH`` (set by
    tests/run_v0519_smoke.sh) or when the parent process started (``scripts/gpu-run.sh``
    runs the benchmark directly), provided that is less than ``limit_s`` ago; otherwise
    now. The deadline is that start + ``limit_s`` - ``margin_s``.
    """
    now = time.time() if now is None else now
    if budget_s is not None:
        return None if budget_s <= 0 else now + budget_s
    source = os.environ if env is None else env
    started = now
    text = source.get("DMI_CALL_STARTED_EPOCH", "")
    if text:
        with contextlib.suppress(ValueError):
            started = min(now, float(text))
    else:
        elapsed = _parent_elapsed_s() if parent_elapsed_s is None else parent_elapsed_s
        if elapsed is not None and 0 <= elapsed < limit_s:
            started = now - elapsed
    if now - started >= limit_s:
        started = now
    return started + limit_s - margin_s


def default_state_dir(name: str, fallback: Path) -> Path:
    """``/root/<name>`` where writable (it survives between calls of one lease), else
    ``fallback``."""
    root = Path(os.environ.get("DMI_STATE_ROOT", "/root"))
    try:
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".probe"
        probe.write_text("")
        probe.unlink()
    except OSError:
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback
    return path


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically (a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def as_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a plain dict."""
    return asdict(obj)
