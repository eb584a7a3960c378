"""Workloads (named ``generate`` calls of random prompt ids) and what they must capture."""

from __future__ import annotations

import collections
import random
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from harness.constants import SEED, TOKEN_ID_LIMIT
from harness.models import ModelSpec


@dataclass(frozen=True)
class Workload:
    """One ``generate`` call of ``len(prompt_lens)`` greedy, ignore_eos requests.

    With ``min_seconds`` > 0 the call is repeated in waves (request ids suffixed ``.wN``,
    as with ``named_waves`` or ``max_waves`` > 1) until it generated for that long or ran
    ``max_waves`` waves.
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
    """Draw the prompt ids of this workload name instead (a warm-up of the same shapes)."""
    named_waves: bool = False
    """Suffix the request ids with their wave (``.w0``) even when one wave runs."""

    def __post_init__(self) -> None:
        if len(self.prompt_lens) != len(self.output_lens) or not self.prompt_lens:
            msg = (f"workload {self.name}: {len(self.prompt_lens)} prompts, "
                   f"{len(self.output_lens)} output lengths")
            raise ValueError(msg)
        if min(self.output_lens) < 2 or min(self.prompt_lens) < 1:
            msg = f"workload {self.name}: prompts need >= 1 token and outputs >= 2"
            raise ValueError(msg)

    @property
    def requests(self) -> int:
        """Requests per wave."""
        return len(self.prompt_lens)

    @property
    def output_tokens(self) -> int:
        """Output tokens per wave (ignore_eos: exactly max_new_tokens)."""
        return sum(self.output_lens)

    def warm_up(self) -> Workload:
        """An untimed call of the same prompt shapes with 2 output tokens each."""
        return replace(self, name="warm-" + self.name, output_lens=self.requests * (2,),
                       timed=False, min_seconds=0.0, max_waves=1)

    def spec(self, prefix: str = "", seed: int = SEED) -> dict[str, Any]:
        """This workload as an engine child's ``run`` command (request ids get ``prefix``)."""
        rng = random.Random(seed ^ zlib.crc32((self.ids_from or self.name).encode()))
        return {
            "name": self.name,
            "input_ids": [[rng.randrange(TOKEN_ID_LIMIT) for _ in range(n)]
                          for n in self.prompt_lens],
            "rids": [f"{prefix}{self.name}-{i}" for i in range(self.requests)],
            "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                for n in self.output_lens],
            "timed": self.timed, "min_seconds": self.min_seconds,
            "max_waves": self.max_waves, "return_hidden_states": self.return_hidden_states,
            "keep_outputs": self.keep_outputs, "named_waves": self.named_waves,
        }


def _extra_forwards(preset: str, model: ModelSpec, requests: Sequence[tuple[int, int]],
                    rows: int, nbytes: int) -> int | None:
    """How many requests' extra forwards add up to exactly ``rows`` rows and ``nbytes``
    bytes; None when no whole number of each kind does. Requests are grouped by what
    their extra forward adds (usually one kind; a position range can keep a short
    warm-up request's extra forward and not a long one's): the sums reachable with whole
    requests of each kind are walked, kind by kind, never past the target."""
    kinds: collections.Counter[tuple[int, int]] = collections.Counter()
    for (p, c), n in collections.Counter(requests).items():
        without = expected_capture(preset, model, [(p, c, False)])
        with_it = expected_capture(preset, model, [(p, c, True)])
        kinds[(with_it.rows - without.rows, with_it.bytes - without.bytes)] += n
    reach: dict[tuple[int, int], int] = {(0, 0): 0}  # (rows, bytes) -> requests
    for (dr, db), n in kinds.items():
        if (dr, db) == (0, 0):
            continue
        reach = {(r + k * dr, b + k * db): m + k
                 for (r, b), m in reach.items() for k in range(n + 1)
                 if r + k * dr <= rows and b + k * db <= nbytes}
    return reach.get((rows, nbytes))


def spread(n: int, lo: int, hi: int) -> tuple[int, ...]:
    """``n`` integers evenly spread over ``[lo, hi]``."""
    return (lo,) if n == 1 else tuple(lo + (hi - lo) * i // (n - 1) for i in range(n))


@dataclass
class Expected:
    """Rows and payload bytes a complete capture holds, in total and per act_name."""

    rows: int = 0
    bytes: int = 0
    by_act: dict[str, list[int]] = field(default_factory=dict)
    """act_name -> [rows, bytes]."""


def expected_capture(preset: str, model: ModelSpec,
                     requests: Iterable[tuple[int, int, bool]]) -> Expected:
    """What the store must hold for requests ``(prompt, completion, extra_forward)``
    (``extra_forward``: the overlap scheduler forwarded the last token once more), from
    the domain's own arithmetic (:func:`~dmi_sglang.domain.bandwidth.capture_bytes`)."""
    from dmi_sglang.adapters.sglang_v0519.facts import QWEN3_HOOKS
    from dmi_sglang.domain.bandwidth import capture_bytes
    from dmi_sglang.domain.hooks import ModelHooks, parse_selection
    from dmi_sglang.domain.shapes import ModelShape

    hooks = ModelHooks("Qwen3ForCausalLM", QWEN3_HOOKS, model.layers)
    selection = parse_selection(preset).resolve(hooks)
    shape = ModelShape(model.layers, model.hidden, model.heads, model.kv_heads,
                       model.head_dim, model.intermediate, model.vocab)
    got = capture_bytes(selection, shape, requests)
    return Expected(got.rows, got.bytes, {k: list(v) for k, v in got.by_act.items()})


def check_transport_rows(stats: Mapping[str, Any], preset: str, model: ModelSpec,
                         requests: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Capture without storage: do the transport's stop statistics account for every row?

    Each request may or may not have had the overlap scheduler's extra forward, so rows
    and bytes handed to the sink must be the requests' without it plus the extra forwards
    of a whole number of requests of each shape (one count for rows and bytes alike);
    ``requests_with_extra_forward`` is that number (of the requests whose extra forward
    adds rows at all).
    """
    base = expected_capture(preset, model, ((p, c, False) for p, c in requests))
    full = expected_capture(preset, model, ((p, c, True) for p, c in requests))
    rows, nbytes = int(stats.get("rows", -1)), int(stats.get("bytes", -1))
    k = _extra_forwards(preset, model, requests, rows - base.rows, nbytes - base.bytes)
    ok = k is not None  # no request captured: 0 rows, 0 bytes
    return {"ok": ok, "rows": rows, "bytes": nbytes, "expected_rows_range": [base.rows,
            full.rows], "expected_bytes_range": [base.bytes, full.bytes],
            "requests_with_extra_forward": k if ok else None}
