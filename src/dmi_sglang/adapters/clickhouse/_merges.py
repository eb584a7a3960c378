"""Holding background merges of the records table while a run captures (embedded store).

Each insert makes a part; MergeTree merges parts in the background, rewriting (and
recompressing) the payload again, which on the embedded engine competes with the capture
for the same cores. :class:`MergeHold` stops merges of the records table when a run
starts (``SYSTEM STOP MERGES``) and starts them again when it finishes, when the sink
closes, or earlier when parts pile up: after ``max_parts`` active parts (counted at the
start, plus one per insert), since ClickHouse slows inserts down from
``parts_to_delay_insert`` (1000) parts on and refuses them at ``parts_to_throw_insert``
(3000, TOO_MANY_PARTS). Merges are held in memory only: a crashed process holds none.

Stopping and starting are best effort: a failure is logged, never raised (the capture
works either way, only its CPU cost differs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

__all__ = ["HELD_PARTS", "MergeHold", "active_parts"]

log = structlog.get_logger(__name__)

HELD_PARTS = 500
"""Most active parts of the records table while merges are held (well below the 1000
from which ClickHouse delays inserts)."""

Control = Callable[[str, Callable[["Client"], object]], None]
"""Runs an action on the sink's control client (serialised), raising StoreError."""


class MergeHold:
    """Stops and starts merges of one table (see the module docstring).

    Args:
        control: runs a statement on the sink's control client.
        database / table: the records table (names unquoted).
        qualified: ``db.table``, quoted.
        max_parts: active parts beyond which merges run again (default
            :data:`HELD_PARTS`, read when the sink opens).
    """

    def __init__(self, control: Control, database: str, table: str, qualified: str,
                 max_parts: int | None = None) -> None:
        self._control = control
        self._database, self._table, self._qualified = database, table, qualified
        self._max_parts = HELD_PARTS if max_parts is None else max_parts
        self._lock = threading.Lock()
        self._held = False
        self._left = 0

    @property
    def held(self) -> bool:
        """Whether merges are held now."""
        return self._held

    def hold(self) -> None:
        """Stop merges, unless the table already has ``max_parts`` active parts."""
        with self._lock:
            if self._held:
                return
            try:
                parts = self._active_parts()
                if parts >= self._max_parts:
                    log.info("store.merges_not_held", table=self._qualified, parts=parts)
                    return
                self._control("stopping merges",
                              lambda c: c.command(f"SYSTEM STOP MERGES {self._qualified}"))
            except Exception as exc:
                log.warning("store.merges_not_held", table=self._qualified, error=str(exc))
                return
            self._held, self._left = True, self._max_parts - parts
            log.info("store.merges_held", table=self._qualified, parts=parts)

    def inserted(self, parts: int = 1) -> None:
        """An insert made ``parts`` parts; merges run again once ``max_parts`` are
        reached."""
        with self._lock:
            if not self._held:
                return
            self._left -= parts
            if self._left > 0:
                return
        self.release("parts")

    def release(self, reason: str) -> None:
        """Start merges again (when held); ``reason`` is logged. A start that failed
        leaves them held, so the next release (the run's finish, the sink's close, the
        next too-many-parts wait) tries again."""
        with self._lock:
            if not self._held:
                return
            try:
                self._control("starting merges",
                              lambda c: c.command(f"SYSTEM START MERGES {self._qualified}"))
            except Exception as exc:
                log.warning("store.merges_not_started", table=self._qualified, reason=reason,
                            error=str(exc))
                return
            self._held = False
            log.info("store.merges_started", table=self._qualified, reason=reason)

    def _active_parts(self) -> int:
        found: list[int] = []
        self._control("counting parts",
                      lambda c: found.append(active_parts(c, self._database, self._table)))
        return found[0]


def active_parts(client: Client, database: str, table: str) -> int:
    """Active parts of ``database.table`` (``system.parts``)."""
    rows = client.query(
        "SELECT count() FROM system.parts WHERE database = {db:String} "
        "AND table = {t:String} AND active",
        parameters={"db": database, "t": table},
    ).result_rows
    return int(rows[0][0]) if rows else 0
