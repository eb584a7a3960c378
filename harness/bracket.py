"""Bracketed comparisons: a stock engine kept running while measured engines take turns.

A :class:`Bracket` starts the stock engine once (warm-ups run untimed, then its garbage
collector is frozen: ``freeze_gc`` in :mod:`harness.engine`), probes the D2H rate on it,
and then, for each :meth:`Bracket.measure` call: runs the timed workloads on stock,
starts the measured engine (monitored, or another configuration), runs its warm-ups,
freezes its garbage collector as stock's, runs its timed workloads, stops monitoring
(the run is durable), shuts it down, and runs the stock workloads again. So every
measured run sits between two stock runs of the same workloads on the same engine
(``stock, measured, stock, ...``); the stock run after one measured engine is the one
before the next when their workloads match. The two engines share the GPU with the same
fixed KV pool (:func:`harness.models.engine_kwargs`); the measured one runs alone (stock
idles), and is shut down before stock runs again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.constants import SHUTDOWN_GRACE_S
from harness.engine import EngineError, EngineProcess
from harness.results import Deadline, Json
from harness.workloads import Workload


class Bracket:
    """One stock engine and the measured engines bracketed by it (module docstring)."""

    def __init__(self, key: str, stock_spec: Json, warm_ups: Sequence[Workload], *,
                 workdir: Path, deadline: Deadline, pgid_file: Path | None = None) -> None:
        self.key = key
        self.stock_spec = stock_spec
        self.warm_ups = list(warm_ups)
        self.workdir = workdir
        self.deadline = deadline
        self.pgid_file = pgid_file
        self.stock: EngineProcess | None = None
        self.stock_ready: Json = {}
        self.d2h_bps: float | None = None
        self.blocks = 0
        self._last: tuple[tuple[str, ...], list[Json]] | None = None

    def _timeout(self) -> float | None:
        return self.deadline.timeout()

    def _grace(self) -> float:
        """How long an engine may take to shut down politely: what is left before the
        deadline (none once it passed: the engine is killed at once, so the invocation
        ends when it should), at most :data:`~harness.constants.SHUTDOWN_GRACE_S`."""
        return min(SHUTDOWN_GRACE_S, max(0.0, self.deadline.left()))

    def start(self) -> Json:
        """Start the stock engine, run its warm-ups, probe D2H; its ``ready`` reply."""
        self.stock = EngineProcess(f"stock-{self.key}", self.stock_spec, self.workdir,
                                   self.pgid_file)
        try:
            self.stock_ready = self.stock.start(self._timeout())
            for wl in self.warm_ups:
                self.stock.request("run", self._timeout(), workload=wl.spec("s0-"))
            self.stock.request("freeze_gc", self._timeout())
            self.d2h_bps = self.stock.request("d2h", self._timeout())["d2h_bps"]
        except EngineError:
            self.close()  # the next measurement starts a new stock engine
            raise
        return self.stock_ready

    def stock_block(self, workloads: Sequence[Workload]) -> list[Json]:
        """The timed ``workloads`` on stock (reused when the last block ran the same)."""
        names = tuple(w.name for w in workloads)
        if self._last is not None and self._last[0] == names:
            return self._last[1]
        return self._run_stock(workloads)

    def _run_stock(self, workloads: Sequence[Workload]) -> list[Json]:
        if self.stock is None:
            self.start()
        assert self.stock is not None
        self.blocks += 1
        prefix = f"s{self.blocks}-"
        try:
            out = [_keyed(self.stock.request("run", self._timeout(), workload=w.spec(prefix)),
                          prefix) for w in workloads]
        except EngineError:
            self.close()
            raise
        self._last = (tuple(w.name for w in workloads), out)
        return out

    def measure(self, name: str, spec: Json, warm_ups: Sequence[Workload],
                timed: Sequence[Workload], *, monitored: bool,
                stock_timed: Sequence[Workload] | None = None) -> Json:
        """``stock, measured, stock`` for ``timed`` (stock runs ``stock_timed`` when given:
        the same requests without what only the measured engine asks for); the three runs
        and the measured engine's startup, stop and log statistics. Raises
        :class:`EngineError`."""
        stock_timed = timed if stock_timed is None else stock_timed
        before = self.stock_block(stock_timed)
        engine = EngineProcess(name, spec, self.workdir, self.pgid_file)
        measured: Json = {"workloads": []}
        try:
            measured["ready"] = engine.start(self._timeout())

            def run(wl: Workload) -> None:
                measured["workloads"].append(
                    _keyed(engine.request("run", self._timeout(), workload=wl.spec()), ""))

            for wl in warm_ups:
                run(wl)
            measured["freeze"] = engine.request("freeze_gc", self._timeout())
            for wl in timed:
                run(wl)
            if monitored:
                measured["stop"] = engine.request("stop", self._timeout())
        finally:
            measured.update(engine.close(self._grace()))
        after = self._run_stock(stock_timed)
        return {"stock_before": before, "measured": measured, "stock_after": after}

    def close(self) -> None:
        """Shut the stock engine down."""
        if self.stock is not None:
            self.stock.close(self._grace())
            self.stock = None
            self._last = None


def _keyed(result: Json, prefix: str) -> Json:
    """Outputs keyed by request id without the block prefix (comparable across engines)."""
    for out in result.get("outputs", []):
        out["key"] = str(out["id"]).removeprefix(prefix)
    return result
