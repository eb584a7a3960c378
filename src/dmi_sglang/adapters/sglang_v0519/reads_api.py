"""The server's read-back endpoints: runs, requests and one request's captures over HTTP.

Mounted on SGLang's FastAPI app by the server's main process (``server.around_http_server``)
before SGLang adds its API-key middleware, which covers them as admin endpoints (they
serve every user's prompts and activations): with ``--admin-api-key`` they need that key,
else ``--api-key``'s. Every answer comes from a :class:`~dmi_sglang.domain.ports.CaptureReads`
(the composition root's: the embedded store is read through its owner, the scheduler).

* ``GET /dmi/runs``: every run of the store;
* ``GET /dmi/runs/{run_id}/requests``: the requests a run stored (rows, bytes, committed);
* ``GET /dmi/runs/{run_id}/requests/{request_id}``: one request's listing (complete or
  why not, lengths, and per tensor its name, hook, layer, dtype, shape and positions);
* ``GET /dmi/runs/{run_id}/requests/{request_id}/safetensors``: a complete request's
  captures as one safetensors file, streamed piece by piece.

Ids must be well formed (:func:`bad_id`): 400 otherwise; an id holding ``/`` cannot be
named in a path (read such a request with ``dmi-sglang show`` or ``open_store``): a path
holding ``%2F`` is refused (400), since it is decoded before the route is matched and
could name another endpoint of another id. A
run or request the store does not hold: 404; an incomplete capture's file: 409 with the
listing's reasons; a store that cannot be read (or an owner that does not answer): 503.
The endpoints take no query parameters: a path with a query string is refused (400,
naming them), so a filter the server does not know is never silently ignored. An
export reads its header and its first rows before it answers, so a store that cannot be
read answers 503, not a 200 cut short. Reads run on worker threads of their own
(:data:`READ_WORKERS`), never on the server's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qsl

import structlog

from dmi_sglang.domain.ports import CaptureReads
from dmi_sglang.errors import IncompleteCaptureError, NotInStoreError, StoreError

__all__ = ["MAX_ID_CHARS", "RUNS_PATH", "bad_id", "mount_reads", "unexpected_query"]

log = structlog.get_logger(__name__)

RUNS_PATH = "/dmi/runs"
"""The root of the read-back endpoints."""
MAX_ID_CHARS = 256
"""Longest run or request id the endpoints accept."""
READ_WORKERS = 4
"""Reads in flight at once; more wait (the store's owner answers one at a time anyway)."""


def bad_id(kind: str, value: str) -> str | None:
    """Why ``value`` is not a well-formed run or request id (None: it is): 1 to
    :data:`MAX_ID_CHARS` printable characters, no surrounding blanks."""
    if not value or len(value) > MAX_ID_CHARS:
        return f"{kind} must have 1 to {MAX_ID_CHARS} characters, got {len(value)}"
    if not value.isprintable() or value != value.strip():
        return (f"{kind} {value!r} is not well formed: printable characters only, no "
                "leading or trailing blanks")
    return None


def unexpected_query(scope: Mapping[str, Any]) -> str | None:
    """Why a request to an endpoint that takes no query parameters is refused (None:
    it has none): the parameters' names, and that none is accepted."""
    raw = bytes(scope.get("query_string") or b"").decode("latin-1")
    if not raw:
        return None
    names = sorted({name for name, _ in parse_qsl(raw, keep_blank_values=True)}) or [raw]
    return (f"query parameters {', '.join(repr(n) for n in names)} are not accepted by "
            f"{scope.get('path', '')}: it takes none")


def mount_reads(app: Any, reads: CaptureReads | None) -> None:
    """Add the read-back endpoints to SGLang's FastAPI ``app``; with ``reads`` None
    (the run stores nothing) each answers 404 saying so."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    def problem(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def answer(work: Callable[[], Any], *ids: tuple[str, str]) -> Any:
        for kind, value in ids:
            why = bad_id(kind, value)
            if why:
                return problem(400, why)
        if reads is None:
            return problem(404, "this server's run stores nothing (--db none), or its "
                                "capture is not set up: there is nothing to read")
        try:
            return await asyncio.get_running_loop().run_in_executor(_pool(), work)
        except IncompleteCaptureError as exc:
            return problem(409, str(exc))
        except NotInStoreError as exc:
            return problem(404, str(exc))
        except StoreError as exc:
            log.warning("dmi.read_failed", error=str(exc))
            return problem(503, str(exc))

    def store() -> CaptureReads:
        assert reads is not None  # answer() returned 404 before any work otherwise
        return reads

    def refused_path(request: Request) -> JSONResponse | None:
        """A 400 for a path whose id held an encoded ``/`` (it was decoded before the
        route was matched, so the path may name another endpoint of another id), or for
        a query string (no endpoint takes one)."""
        if b"%2f" in bytes(request.scope.get("raw_path") or b"").lower():
            return problem(400, "an id holding '/' (%2F) cannot be named in the path; "
                                "read it with dmi-sglang or open_store()")
        why = unexpected_query(request.scope)
        return problem(400, why) if why else None

    async def runs(request: Request) -> Any:
        return refused_path(request) or await answer(
            lambda: JSONResponse({"runs": store().runs()}))

    async def requests(request: Request, run_id: str) -> Any:
        return refused_path(request) or await answer(
            lambda: JSONResponse({"run_id": run_id, "requests": store().requests(run_id)}),
            ("run id", run_id))

    async def listing(request: Request, run_id: str, request_id: str) -> Any:
        return refused_path(request) or await answer(
            lambda: JSONResponse(store().listing(run_id, request_id)),
            ("run id", run_id), ("request id", request_id))

    async def safetensors(request: Request, run_id: str, request_id: str) -> Any:
        refused = refused_path(request)
        if refused is not None:
            return refused
        result = await answer(lambda: _first_read(store().safetensors(run_id, request_id)),
                              ("run id", run_id), ("request id", request_id))
        if not isinstance(result, tuple):
            return result
        length, pieces = result
        name = "".join(c if c.isascii() and (c.isalnum() or c in "-._") else "_"
                       for c in f"{run_id}-{request_id}") + ".safetensors"
        return StreamingResponse(
            _off_the_loop(pieces), media_type="application/octet-stream",
            headers={"Content-Length": str(length),
                     "Content-Disposition": f'attachment; filename="{name}"'})

    async def elsewhere(request: Request, rest: str) -> Any:
        """Any other path under the root: an id that held ``/``, or no endpoint."""
        return refused_path(request) or problem(404, f"no read-back endpoint at {rest!r} under "
                                                f"{RUNS_PATH}")

    for endpoint in (runs, requests, listing, safetensors, elsewhere):  # FastAPI resolves
        endpoint.__annotations__["request"] = Request  # string annotations in globals
    from sglang.srt.utils.auth import AuthLevel, auth_level

    admin = auth_level(AuthLevel.ADMIN_OPTIONAL)  # every user's prompts: admin endpoints
    for guarded in (runs, requests, listing, safetensors, elsewhere):
        admin(guarded)
    base = RUNS_PATH
    app.add_api_route(base, runs, methods=["GET"])
    app.add_api_route(base + "/{run_id}/requests", requests, methods=["GET"])
    app.add_api_route(base + "/{run_id}/requests/{request_id}", listing, methods=["GET"])
    app.add_api_route(base + "/{run_id}/requests/{request_id}/safetensors", safetensors,
                      methods=["GET"])
    app.add_api_route(base + "/{rest:path}", elsewhere, methods=["GET"])  # matched last


def _first_read(export: tuple[int, Iterator[bytes | memoryview]],
                ) -> tuple[int, Iterator[bytes | memoryview]]:
    """An export with its header and first rows read already (on the read thread, before
    the answer starts): a store that fails there answers 503 or 409, not a 200 cut after
    its header. A failure after the first rows still cuts the stream short of its
    ``Content-Length``, which a client sees as a broken download."""
    length, pieces = export
    first = list(itertools.islice(pieces, 2))
    return length, itertools.chain(first, pieces)


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The read-back's own threads: a slow or silent store never takes the threads of
    the server's default executor (which SGLang and the status and stop endpoints use)."""
    return concurrent.futures.ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="dmi-read")


async def _off_the_loop(
        pieces: Iterator[bytes | memoryview]) -> AsyncIterator[bytes | memoryview]:
    """Take each piece on a worker thread (each is a read of the store), so a large
    export never blocks the server's event loop; a client that goes away stops it."""
    done = object()
    while True:
        try:
            piece = await asyncio.get_running_loop().run_in_executor(
                _pool(), next, pieces, done)
        except Exception as exc:  # the response has started: the client sees it cut short
            log.warning("dmi.export_failed", error=repr(exc))
            raise
        if piece is done:
            return
        yield piece  # type: ignore[misc]
