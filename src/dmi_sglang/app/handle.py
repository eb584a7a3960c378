"""A lazy per-request view of a capture: :class:`CaptureHandle` (any store backend).

Free until used: the constructor does no I/O. Each access opens the store through the
reader factory, reads and closes it; the run and the request's completeness are cached
once read (a "not complete" verdict is not, so a handle made before the run stopped sees
the committed data later), tensors never: each read returns tensors of its own.

Incomplete captures: ``available`` is False and every data access raises
:class:`~dmi_sglang.errors.IncompleteCaptureError` listing what is missing (``missing``
has the same reasons). Partial data is never returned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from dmi_sglang.app.assemble import (
    covered_prefix,
    hook_for,
    missing,
    narrowed,
    selected_positions,
)
from dmi_sglang.app.shards import combined_rows, empty_rows
from dmi_sglang.domain.hooks import Hook
from dmi_sglang.domain.ports import RecordReader
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import RequestManifest, RunInfo
from dmi_sglang.domain.tensor_parallel import ShardPlan
from dmi_sglang.errors import IncompleteCaptureError

if TYPE_CHECKING:
    import torch

__all__ = ["DMI_GLOBAL_FIELDS", "DMI_LAYER_FIELDS", "CaptureHandle", "NoStoreHandle"]

DMI_LAYER_FIELDS: dict[str, str] = {
    "attention_output": "attn_out",
    "attention_values": "z",
    "q": "q",
    "k": "k",
    "v": "v",
    "ln1": "ln1",
    "ln2": "ln2",
    "middle_residual": "resid_mid",
    "mlp_input": "mlp_in",
    "mlp_output": "mlp_out",
    "mlp_activation": "mlp_post",
}
"""DMI's per-layer readback fields -> our hook names (a tuple by layer, per request)."""
DMI_GLOBAL_FIELDS: dict[str, str] = {
    "embeddings": "embed",
    "final_hidden": "final_ln",
    "final_residual": "resid_final",
}
"""DMI's global readback fields -> our hook names."""

_Key = tuple[str, int, range]


class CaptureHandle:
    """The captured internals of one request of one run, read on first use.

    Args:
        run_id: the run (``model_id`` of its records).
        request_id: the request (SGLang's ``meta_info["id"]``).
        reader_factory: makes a :class:`~dmi_sglang.domain.ports.RecordReader` (the
            composition root's ``reader_for(store)``); called on each access.

    Positions are absolute token positions of the request. ``get(..., start=, end=)``
    selects the half-open range ``[start, end)`` within the hook's coverage.
    """

    __slots__ = ("_factory", "_lock", "_partial", "_state", "request_id", "run_id")

    def __init__(
        self, run_id: str, request_id: str, reader_factory: Callable[[], RecordReader], *,
        partial: bool = False,
    ) -> None:
        self.run_id = run_id
        self.request_id = request_id
        self._factory = reader_factory
        self._partial = partial
        self._lock = threading.RLock()
        self._state: tuple[RunInfo, RequestManifest] | None = None

    def __repr__(self) -> str:
        return f"CaptureHandle(run_id={self.run_id!r}, request_id={self.request_id!r})"

    # -- completeness ----------------------------------------------------------------

    @property
    def missing(self) -> tuple[str, ...]:
        """Why the capture is not complete (empty when it is).

        Raises:
            StoreError: the store cannot be read, or the run's row is damaged.
        """
        with self._reader() as reader:
            return self._missing(reader)

    @property
    def available(self) -> bool:
        """True only when the run and the request's manifest are committed and every
        expected row of every captured (hook, layer) is stored (every part of it, under
        tensor parallelism). Raises as :attr:`missing`."""
        return not self.missing

    def _missing(self, reader: RecordReader) -> tuple[str, ...]:
        with self._lock:
            if self._state is not None:
                return ()
            run = reader.run(self.run_id)
            manifest = reader.manifest(self.run_id, self.request_id)
            extents = reader.extents(self.run_id, self.request_id) if manifest else None
            reasons = missing(self.run_id, self.request_id, run, manifest,
                              extents.ranges if extents else (),
                              mixed=extents.mixed if extents else ())
            if not reasons and run is not None and manifest is not None:
                self._state = (run, manifest)
            return reasons

    def _complete(self, reader: RecordReader | None = None) -> tuple[RunInfo, RequestManifest]:
        if self._state is None:
            with contextlib.nullcontext(reader) if reader is not None else self._reader() as r:
                reasons = self._missing(r)
            if reasons or self._state is None:
                msg = f"capture of request {self.request_id!r} is incomplete: " + "; ".join(
                    reasons
                )
                raise IncompleteCaptureError(msg)
        return self._state

    @property
    def manifest(self) -> RequestManifest:
        """The request's manifest (raises IncompleteCaptureError when incomplete)."""
        return self._complete()[1]

    @property
    def captures(self) -> tuple[tuple[str, int], ...]:
        """Every captured ``(act_name, layer_no)`` of the run."""
        if self._partial:
            with self._reader() as reader:
                run = reader.run(self.run_id)
            if run is None:
                msg = f"run {self.run_id!r} is not in the store"
                raise IncompleteCaptureError(msg)
            return run.captures
        return self._complete()[0].captures

    # -- data ------------------------------------------------------------------------

    def positions(self, hook: str, layer: int | None = None) -> range:
        """The positions :meth:`get` returns by default for one hook (a range: the
        request's coverage, narrowed by the run's position rule for that capture).

        Raises:
            IncompleteCaptureError: as :meth:`get`.
            ValueError: a layer missing for a per-layer hook.
        """
        return self._key(hook, layer, None, None)[2]

    def get(
        self,
        hook: str,
        layer: int | None = None,
        *,
        start: int | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """One hook's rows, concatenated in position order (deduped by ``seq``).

        Args:
            hook: short name (``resid_pre``) or stored act_name.
            layer: the layer of a per-layer hook (None for global hooks).
            start / end: absolute positions ``[start, end)``; default every position
                the capture holds (:meth:`positions`; a partial handle: what was stored,
                :meth:`partial_positions`). An empty range reads as no rows, shaped
                ``[0, *row shape]`` in the stored dtype (``[0]``, float32, when the
                request stored no row of that capture: nothing says its shape).
                Each call returns a tensor of its own.

        Raises:
            IncompleteCaptureError: the capture is incomplete, or the hook / layer was
                not captured in this run.
            ValueError: a layer missing for a per-layer hook (or given for a global
                one), or a range outside the captured positions.
        """
        if self._partial:
            return self._partial_get(hook, layer, start, end)
        with self._lock, self._reader() as reader:
            act, layer_no, kept = self._key(hook, layer, start, end, reader)
            if not kept:  # no rows: their shape only
                return self._no_rows(reader, act, layer_no, self._plan(act))
            recs = reader.records(
                self.run_id,
                self.request_id,
                act_name=act,
                layer_no=layer_no,
                start=kept.start,
                end=kept.stop,
            )
            return combined_rows(recs, kept, self._plan(act), act, layer_no)

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...]:
        """``resid_pre`` of every layer: entry i = layer i's input = Hugging Face
        ``hidden_states[i]``; each ``[positions, hidden]``. Needs layers 0..L-1."""
        with self._lock, self._reader() as reader:
            self._complete(reader)
            keys = self._resid_keys()
            recs = reader.records(
                self.run_id,
                self.request_id,
                act_name="blocks.hook_resid_pre",
                start=min(k[2].start for k in keys),
                end=max(k[2].stop for k in keys),
            )
            plan = self._plan("blocks.hook_resid_pre")
            return tuple(  # a layer that keeps no position: no rows, of its row shape
                combined_rows([r for r in recs if r.layer_no == layer_no], kept, plan,
                              act, layer_no)
                if kept else self._no_rows(reader, act, layer_no, plan)
                for act, layer_no, kept in keys)

    def by_layer(self, hook: str) -> tuple[torch.Tensor, ...]:
        """A per-layer hook of every layer, as a tuple indexed by layer (DMI's shape of a
        per-layer field, per request: no left padding). Needs layers 0..L-1.

        Raises:
            IncompleteCaptureError: the capture is incomplete, or not every layer from 0
                was captured (use :meth:`get` with ``layer=``).
        """
        h = hook_for(hook)
        run, _ = self._complete()
        layers = sorted(n for a, n in run.captures if a == h.act_name)
        if not h.per_layer or not layers or layers != list(range(len(layers))):
            msg = (f"{h.name} by layer needs a per-layer hook captured at layers 0..L-1; "
                   f"captured: {layers}; use get({h.name!r}, layer=N)")
            raise IncompleteCaptureError(msg)
        return tuple(self.get(h.name, n) for n in layers)

    def __getattr__(self, name: str) -> object:
        """DMI's readback field names: ``attention_output``, ``middle_residual``, ``q``...
        (tuples by layer) and ``embeddings``, ``final_hidden``, ``final_residual``."""
        if name in DMI_LAYER_FIELDS:
            return self.by_layer(DMI_LAYER_FIELDS[name])
        if name in DMI_GLOBAL_FIELDS:
            return self.get(DMI_GLOBAL_FIELDS[name])
        msg = f"{type(self).__name__!r} object has no attribute {name!r}"
        raise AttributeError(msg)

    def _resid_keys(self) -> list[_Key]:
        run, _ = self._complete()
        layers = sorted(n for a, n in run.captures if a == "blocks.hook_resid_pre")
        if layers != list(range(len(layers))) or not layers:
            msg = f"hidden_states needs resid_pre of layers 0..L-1; captured: {layers}"
            raise IncompleteCaptureError(msg)
        return [self._key("resid_pre", n, None, None) for n in layers]

    @property
    def token_ids(self) -> torch.Tensor:
        """The forwarded token ids, one per position."""
        return self.get("token_ids")

    @property
    def logits(self) -> torch.Tensor:
        """``final_logits``: one row per generated token."""
        return self.get("final_logits")

    @property
    def logits_topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``final_logits:topk(K)``: per generated token the K largest logits, highest
        first, and their token ids (int32), each ``[tokens, K]``."""
        return self.get("logits_topk_values"), self.get("logits_topk_ids")

    def partial_positions(self, hook: str, layer: int | None = None) -> range:
        """For a handle made with ``partial=True``: the positions :meth:`get` returns for
        a hook, from the first stored position up to the first one missing (what an
        interrupted or failed run stored before it stopped); a range with step K under
        ``every(K)``.

        Raises:
            IncompleteCaptureError: no such run, the hook was not captured, or nothing
                of it was stored.
            ValueError: no ``layer`` for a per-layer hook, or one for a global hook.
        """
        with self._reader() as reader:
            return self._partial_key(reader, hook, layer)[0][2]

    def _partial_key(self, reader: RecordReader, hook: str,
                     layer: int | None) -> tuple[_Key, ShardPlan]:
        run = reader.run(self.run_id)
        if run is None:
            msg = f"run {self.run_id!r} is not in the store"
            raise IncompleteCaptureError(msg)
        h = hook_for(hook)
        layer_no = _layer_no(h, layer)
        if (h.act_name, layer_no) not in run.captures:
            msg = f"{h.act_name} layer {layer_no} was not captured in run {self.run_id!r}"
            raise IncompleteCaptureError(msg)
        plan = run.tensor_parallel.plan_for_act(h.act_name)
        spans: list[list[tuple[int, int]]] = [[] for _ in range(plan.parts)]
        for a, n, shard, s, e in reader.ranges(self.run_id, self.request_id):
            if a == h.act_name and n == layer_no and 0 <= shard < plan.parts:
                spans[shard].append((s, e))
        if not all(spans):
            shards = f" (shard_rank {[k for k, sp in enumerate(spans) if not sp]})" \
                if plan.parts > 1 else ""
            msg = (f"nothing of {h.act_name} layer {layer_no}{shards} was stored for request "
                   f"{self.request_id!r}")
            raise IncompleteCaptureError(msg)
        manifest = reader.manifest(self.run_id, self.request_id)
        rule = run.position_rules().get((h.act_name, layer_no))
        step = rule.k if rule is not None and rule.rule is PositionRule.EVERY else 1
        first = max(min(sp)[0] for sp in spans)  # every part holds the rows read
        prefixes = [covered_prefix(sorted(sp), first, step) for sp in spans]
        kept = min(prefixes, key=len)
        if not kept:
            msg = (f"the parts of {h.act_name} layer {layer_no} stored for request "
                   f"{self.request_id!r} share no position from {first}")
            raise IncompleteCaptureError(msg)
        if manifest is not None and rule is not None:  # what the rule keeps, no more
            selected = selected_positions(manifest, h.act_name, rule)
            kept = narrowed(selected, kept.start, kept.stop)
            if not kept:
                msg = (f"nothing of {h.act_name} layer {layer_no} that its rule {rule} keeps "
                       f"was stored for request {self.request_id!r}")
                raise IncompleteCaptureError(msg)
        return (h.act_name, layer_no, kept), plan

    def _partial_get(self, hook: str, layer: int | None, start: int | None,
                     end: int | None) -> torch.Tensor:
        with self._lock, self._reader() as reader:
            (act, layer_no, kept), plan = self._partial_key(reader, hook, layer)
            lo = kept.start if start is None else start
            hi = kept.stop if end is None else end
            if lo < kept.start or hi > kept.stop or hi < lo:
                msg = (f"positions [{lo}, {hi}) are outside {act} layer {layer_no}'s stored "
                       f"[{kept.start}, {kept.stop})")
                raise ValueError(msg)
            kept = narrowed(kept, lo, hi)
            if not kept:
                return self._no_rows(reader, act, layer_no, plan)
            recs = reader.records(self.run_id, self.request_id, act_name=act,
                                  layer_no=layer_no, start=kept.start, end=kept.stop)
            return combined_rows(recs, kept, plan, act, layer_no)

    def _no_rows(self, reader: RecordReader, act: str, layer_no: int,
                 plan: ShardPlan) -> torch.Tensor:
        """No rows of one capture, shaped as its stored rows (:func:`empty_rows`)."""
        layout = next((lay for lay in reader.extents(self.run_id, self.request_id).layouts
                       if (lay.act_name, lay.layer_no) == (act, layer_no)), None)
        return empty_rows(layout, plan, f"{act} layer {layer_no}")

    # -- internals -------------------------------------------------------------------

    def _key(
        self,
        hook: str,
        layer: int | None,
        start: int | None,
        end: int | None,
        reader: RecordReader | None = None,
    ) -> _Key:
        run, manifest = self._complete(reader)
        h = hook_for(hook)
        layer_no = _layer_no(h, layer)
        if (h.act_name, layer_no) not in run.captures:
            msg = (
                f"{h.act_name} layer {layer_no} was not captured in run {self.run_id!r}; "
                f"captured: {', '.join(f'{a}@{n}' for a, n in run.captures)}"
            )
            raise IncompleteCaptureError(msg)
        rule = run.position_rules().get((h.act_name, layer_no))
        kept = selected_positions(manifest, h.act_name, rule)
        first, stop = kept.start, kept.stop
        if rule is not None and rule.rule is PositionRule.EVERY:  # any bounds inside
            cov = manifest.coverage(h)
            first, stop = cov.start, max(cov.start, cov.end)
        lo = first if start is None else start
        hi = stop if end is None else end
        if lo < first or hi > stop or hi < lo:
            msg = f"positions [{lo}, {hi}) are outside {h.name}'s captured [{first}, {stop})"
            raise ValueError(msg)
        return (h.act_name, layer_no, narrowed(kept, lo, hi))

    def _plan(self, act_name: str) -> ShardPlan:
        """How the run stored ``act_name``'s parts (one part at TP=1)."""
        return self._complete()[0].tensor_parallel.plan_for_act(act_name)

    @contextlib.contextmanager
    def _reader(self) -> Iterator[RecordReader]:
        reader = self._factory()
        with reader.session():
            yield reader


def _layer_no(h: Hook, layer: int | None) -> int:
    """The stored ``layer_no`` of ``h`` at ``layer``.

    Raises:
        ValueError: no layer for a per-layer hook, or a layer for a global one.
    """
    if h.per_layer:
        if layer is None:
            msg = f"hook {h.name!r} is per layer: pass layer="
            raise ValueError(msg)
        return layer
    if layer is not None and layer != -1:
        msg = f"hook {h.name!r} is global: pass no layer (got layer={layer!r})"
        raise ValueError(msg)
    return -1


class NoStoreHandle:
    """The handle of a run without persistence (``DMX_DB_URL=none``): nothing to read."""

    __slots__ = ("request_id", "run_id")

    def __init__(self, run_id: str, request_id: str) -> None:
        self.run_id = run_id
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"NoStoreHandle(run_id={self.run_id!r}, request_id={self.request_id!r})"

    @property
    def available(self) -> bool:
        """Always False: the run stored nothing."""
        return False

    @property
    def missing(self) -> tuple[str, ...]:
        """Why nothing can be read."""
        return ("the run was captured without persistence (DMX_DB_URL=none)",)

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):  # Python's own probes (copy, pickle, hasattr, IPython)
            msg = f"{type(self).__name__!r} object has no attribute {name!r}"
            raise AttributeError(msg)
        msg = f"run {self.run_id!r} stored nothing (DMX_DB_URL=none); cannot read {name!r}"
        raise IncompleteCaptureError(msg)
