"""Reading captures back, whatever the store: :func:`open_store`.

::

    from dmi_sglang import open_store

    store = open_store("chdb:///abs/path/dmi-captures")   # default: ./dmi-captures
    for run in store.runs():
        print(run.run_id, run.status.value)
    handle = store.handle(run.run_id, store.requests(run.run_id)[0].request_id)
    print(handle.available, [h.shape for h in handle.hidden_states])

Nothing is opened until a method reads; each read opens the store and closes it again
(the embedded store admits one process at a time), unless it runs inside
``with store.session():``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
import structlog

from dmi_sglang.app import composition
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.domain.ports import HookTotal, RecordReader, RequestSummary, RunClaims
from dmi_sglang.domain.records import (
    RequestManifest,
    RunInfo,
    RunStatus,
    original_request_id,
    storable_request_id,
)
from dmi_sglang.domain.settings import PREFIX, Settings, StoreUrl, ignored_variables
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

__all__ = ["CaptureStore", "open_store", "store_config"]

log = structlog.get_logger(__name__)


def store_config(url: str | None = None) -> StoreConfig:
    """The resolved store of a URL, as ``DMX_DB_URL`` reads it, with the other ``DMX_*``
    settings of the environment (credentials, table, timeout). ``None``: the store the
    environment names (``DMX_DB_URL`` or ``DMX_DB_HOST``), else ``./dmi-captures``.

    Raises:
        ConfigurationError: the URL is not a store URL.
    """
    env = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    if url is None:
        settings = Settings.from_env(env)
    else:  # a URL given replaces where the environment says, as a keyword does
        StoreUrl.parse(url)  # "" too: an empty variable means unset, an empty URL is none
        settings = Settings.from_kwargs({"dmx_db_url": url}, env=env)
    store = settings.resolve(model_path="reader").store()
    for variable, why in ignored_variables(env):
        log.warning("setting ignored", variable=variable, why=why)
    return store


class CaptureStore:
    """The runs and requests of one store, and each request's capture handle.

    Args:
        config: the store (see :func:`store_config`).

    Raises:
        StoreError: the store is ``none`` (nothing to read).
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._reader: RecordReader = composition.reader_for(config)

    @property
    def url(self) -> str:
        """The store's URL (no credentials)."""
        return self.config.url

    @contextmanager
    def session(self) -> Iterator[CaptureStore]:
        """Keep the store open for the calls inside the block (re-entrant)."""
        with self._reader.session():
            yield self

    def runs(self) -> Sequence[RunInfo]:
        """Every run, newest first."""
        return self._reader.runs()

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None."""
        return self._reader.run(run_id)

    def requests(self, run_id: str) -> Sequence[RequestSummary]:
        """The requests of a run with their stored records and bytes.

        Raises:
            StoreError: no such run.
        """
        with self.session():
            self._require(run_id)
            return [attrs.evolve(r, request_id=original_request_id(r.request_id))
                    for r in self._reader.requests(run_id)]

    def hook_totals(self, run_id: str) -> Sequence[HookTotal]:
        """Per captured hook of a run: layers, records, rows and bytes stored.

        Raises:
            StoreError: no such run.
        """
        with self.session():
            self._require(run_id)
            return self._reader.hook_totals(run_id)

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """A request's manifest (its prompt and completion lengths, whether it is
        committed), or None when the run wrote none for it."""
        return self._reader.manifest(run_id, storable_request_id(request_id))

    def holds(self, run_id: str, request_id: str) -> bool:
        """Whether the run stored anything of the request: a manifest or a record (found
        by the table's key; no payload is read)."""
        stored = storable_request_id(request_id)
        return (self._reader.manifest(run_id, stored) is not None
                or bool(self._reader.ranges(run_id, stored)))

    def require_run(self, run_id: str) -> RunInfo:
        """The run's latest state.

        Raises:
            StoreError: no such run.
        """
        return self._require(run_id)

    def handle(self, run_id: str, request_id: str, *, partial: bool = False) -> CaptureHandle:
        """The lazy capture handle of one request (nothing is read until used).

        ``partial=True`` reads what an interrupted or failed run stored, hook by hook,
        up to its first missing position (see :meth:`CaptureHandle.partial_positions`);
        never by default.
        """
        return CaptureHandle(run_id, storable_request_id(request_id), lambda: self._reader,
                             partial=partial)

    def delete_run(self, run_id: str, *, force: bool = False) -> int:
        """Delete a run and free its id (also an id only claimed by a start that never
        recorded its run); returns the records deleted. A run that reads as running (its
        owner is alive) is deleted only with ``force``.

        Raises:
            StoreError: no such run or claim, or a running run without ``force``.
        """
        claims = composition.run_claims(self.config)
        with self.session():
            self._check_deletable(run_id, force=force, claims=claims)
            deleted = self._reader.delete_run(run_id)
        if claims is not None:
            claims.release(run_id)
        return deleted

    def check_deletable(self, run_id: str, *, force: bool = False) -> None:
        """Raise what :meth:`delete_run` would raise now, deleting nothing (so a command
        asks no question about a run it cannot delete).

        Raises:
            StoreError: no such run or claim, or a running run without ``force``.
        """
        with self.session():
            self._check_deletable(run_id, force=force,
                                  claims=composition.run_claims(self.config))

    def _check_deletable(self, run_id: str, *, force: bool, claims: RunClaims | None) -> None:
        run = self._reader.run(run_id)
        if run is None and not (claims is not None and claims.claimed(run_id)):
            self._require(run_id)
        if run is not None and run.status is RunStatus.RUNNING and not force:
            msg = (f"run {run_id!r} is running (owner {run.owner or 'unknown'}); stop it "
                   "first, or pass --force to delete it anyway")
            raise StoreError(msg)

    def _require(self, run_id: str) -> RunInfo:
        run = self._reader.run(run_id)
        if run is None:
            msg = f"no run {run_id!r} in {self.url}"
            raise StoreError(msg)
        return run


def open_store(url: str | None = None) -> CaptureStore:
    """The store at ``url`` (``chdb:///abs/path`` or ``http(s)://host:port/db``; default
    ``DMX_DB_URL``, else the embedded store ``./dmi-captures``). Opens nothing until a
    method reads.

    Raises:
        ConfigurationError: ``url`` is not a store URL.
        StoreError: ``url`` is ``none`` (nothing to read).
    """
    return CaptureStore(store_config(url))
