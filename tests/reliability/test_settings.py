"""Bad settings and secrets: each refused with the variable, the value (never a password)
and what is accepted, before anything starts.

Each test's docstring is one row of docs/reliability.md.
"""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import structlog.testing

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import ConfigurationError, StoreError

from ._faults import within

SECRET = "s3cret-pw"


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("DMX_CH_WRITERS", "1000000", "an integer from 1 to 64"),
        ("DMX_CH_QUEUE_MB", "100000000", "an integer from 1 to 65,536"),
        ("DMX_DRAIN_FLUSH_TIMEOUT_US", "10000000000000", "an integer from 1 to 60,000,000"),
        ("DMX_DRAIN_LINGER_US", "-1", "an integer from 0 to 1,000,000"),
        ("DMX_DRAIN_GIL_SLICE_US", "fast", "an integer from 0 to 1,000,000"),
        ("DMX_DRAIN_WINDOW_MB", "8", "an integer from 16 to 16,384"),
        ("DMX_ARENA_SLOTS_MB", "-1", "an integer from 0 to 16,384"),
        ("DMX_DRAIN_COPY_PIECE_MB", "1.5", "an integer from 0 to 16,384"),
        ("DMX_DRAIN_COPY_AHEAD", "2000", "an integer from 0 to 1,024"),
        ("DMX_DRAIN_COPY_KERNEL", "-3", "an integer from 0 to 1,024"),
        ("DMX_DRAIN_COPY_GAPS", "maybe", "1/0"),
        ("DMX_TOPK_CHUNK", "-64", "an integer from 0 to 16,777,216"),
        ("DMX_TOPK_KERNEL", "1", "auto, none, triton, flashinfer"),
        ("DMX_PLAN_TOK_S", "0", "an integer from 1 to 100,000,000"),
        ("DMX_CH_TIMEOUT_S", "0", "an integer from 1 to 3,600"),
        ("DMX_RING_PAYLOAD_MB", "-5", "an integer from 1 to 131,072"),
        ("DMX_DB_URL", "chdb:///", "names /: give the store a directory"),
        ("DMX_DB_URL", "chdb:///data/run#1", "has a query or a fragment"),
        ("DMX_DB_URL", "chdb:///data/a?b", "has a query or a fragment"),
        ("DMX_DB_URL", "http://h/db?secure=1", "has a query or a fragment"),
        ("DMX_DB_URL", "http://h:0/db", "bad port 0"),
        ("DMX_DB_HOST", "a b", "a host name or IP address"),
        ("DMX_DB_HOST", "h:1", "the port goes in DMX_DB_PORT"),
    ],
    ids=["writers", "queue-mb", "flush-timeout", "linger", "gil-slice", "window", "arena",
         "copy-piece", "copy-ahead", "copy-kernel", "copy-gaps", "topk-chunk", "topk-kernel",
         "plan-tok-s", "timeout", "ring", "chdb-root", "chdb-fragment", "chdb-query",
         "server-query", "port-zero", "host-space", "host-port"],
)
def test_bad_input_unbounded_or_malformed_settings(variable: str, value: str,
                                                   words: str) -> None:
    """Out-of-range or malformed DMX_* values -> refused at parse time, naming the
    variable, the value and what is accepted."""
    with pytest.raises(ConfigurationError) as info:
        Settings.from_env({variable: value}).resolve(model_path="m").store()
    text = str(info.value)
    assert variable in text
    assert words in text


@pytest.mark.parametrize(("env", "least"), [
    ({"DMX_OWNER_RING_MB": "255"}, 256),
    ({"DMX_OWNER_RING_MB": "31", "DMX_CH_INSERT_MB": "16"}, 32),
    ({"DMX_OWNER_RING_MB": "49", "DMX_CH_QUEUE_MB": "200",
      "DMX_DB_URL": "chdb:///tmp/captures"}, 50),
], ids=["default-insert", "insert-mb", "queue-mb"])
def test_bad_input_a_shared_ring_smaller_than_two_inserts(env: dict[str, str],
                                                          least: int) -> None:
    """A shared owner ring (DMX_OWNER_RING_MB) smaller than two inserts, which would wait
    for an insert's linger at every fill -> refused at parse time with the least size
    accepted; 0 and that size are accepted."""
    with pytest.raises(ConfigurationError) as info:
        Settings.from_env(env)
    text = str(info.value)
    assert f"DMX_OWNER_RING_MB={env['DMX_OWNER_RING_MB']}" in text
    assert f"accepted: 0 (no shared ring) or at least {least}," in text
    assert Settings.from_env({**env, "DMX_OWNER_RING_MB": str(least)}).owner_ring_mb == least
    assert Settings.from_env({**env, "DMX_OWNER_RING_MB": "0"}).owner_ring_mb == 0
    for server in ({"DMX_DB_URL": "http://ch:8123/db"}, {"DMX_DB_URL": "none"},
                   {"DMX_DB_HOST": "ch"}):  # no owner, no ring
        elsewhere = {k: v for k, v in env.items() if k != "DMX_DB_URL"} | server
        assert Settings.from_env(elsewhere).owner_ring_mb == int(env["DMX_OWNER_RING_MB"])


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def _answer(self) -> None:
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        body = b"Code: 516. DB::Exception: nope. (AUTHENTICATION_FAILED)"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer  # noqa: N815 -- http.server's method names

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def recorder() -> Iterator[int]:
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    worker = threading.Thread(target=server.serve_forever, daemon=True)
    worker.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _sent_credentials(headers: dict[str, str]) -> tuple[str, str] | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        return user, password
    if "x-clickhouse-user" in headers:
        return headers["x-clickhouse-user"], headers.get("x-clickhouse-key", "")
    return None


def test_bad_input_credentials_in_the_store_url(recorder: int) -> None:
    """A password inside DMX_DB_URL (http://user:pw@host) -> the credentials are sent to
    the server, and no printed, logged or stored form shows the password."""
    url = f"http://alice:{SECRET}@127.0.0.1:{recorder}/db"
    settings = Settings.from_env({"DMX_DB_URL": url, "DMX_CH_TIMEOUT_S": "2"}).resolve(
        model_path="m")
    store = settings.store()
    assert (store.user, store.password) == ("alice", SECRET)
    with structlog.testing.capture_logs() as logs:
        failure = within(lambda: ClickHouseSink(store))
    assert isinstance(failure, StoreError)
    assert _Recorder.seen, "the stub saw no request"
    assert _sent_credentials(_Recorder.seen[0]) == ("alice", SECRET)
    shown = [str(failure), repr(settings), repr(store), store.url, str(logs),
             str(settings.to_env(include_secrets=False))]
    assert all(SECRET not in text for text in shown), shown
    assert "alice:***@" in settings.to_env(include_secrets=False)["DMX_DB_URL"]
    for hostile in (f"http://alice:{SECRET}@bad host/db", f"http://alice:{SECRET}/x@h:1:2/db",
                    f"http://alice:{SECRET}@[::1/db", f"alice:{SECRET}@h:8123",
                    f"http:/alice:{SECRET}@h:8123", f"http:alice:{SECRET}@h",
                    f"http://h:8123/db?user=alice&password={SECRET}",
                    f"http://h:8123/db#password={SECRET}"):
        with pytest.raises(ConfigurationError) as bad:
            Settings.from_env({"DMX_DB_URL": hostile})
        assert SECRET not in str(bad.value)
    with pytest.raises(ConfigurationError) as bad:  # '://' inside the password
        Settings.from_env({"DMX_DB_URL": "alice:pa://ss-word@h"})
    assert "pa://" not in str(bad.value)
    assert "ss-word" not in str(bad.value)


@pytest.mark.parametrize(
    ("url", "user", "password"),
    [("http://bob:p%40ss%2Fw@h:8123/db", "bob", "p@ss/w"),
     ("http://bob:p/ss#x?@h:8123/db", "bob", "p/ss#x?")],
    ids=["percent-encoded", "unencoded-specials"],
)
def test_bad_input_special_characters_in_a_url_password(url: str, user: str,
                                                        password: str) -> None:
    """Passwords with @ / # ? in the store URL, percent-encoded or not -> the password is
    taken whole (percent-escapes decoded) and every shown form still hides it."""
    settings = Settings.from_env({"DMX_DB_URL": url}).resolve(model_path="m")
    store = settings.store()
    assert (store.user, store.password, store.host, store.port) == (user, password, "h", 8123)
    shown = settings.to_env(include_secrets=False)["DMX_DB_URL"]
    assert shown.startswith(f"http://{user}:***@h:8123")
    assert "p%40" not in shown
    assert password not in repr(settings)
    raw_password = url.split("@", maxsplit=1)[0].rsplit(":", maxsplit=1)[-1]
    assert raw_password not in repr(settings)  # nor the raw form


def test_bad_input_credentials_in_the_store_host_or_an_empty_store_url() -> None:
    """DMX_DB_HOST holding user:password@ -> refused, saying where credentials go, without
    the password; open_store("") -> refused, not read as "the default store" (both found
    in review)."""
    from dmi_sglang.app.reading import open_store

    with pytest.raises(ConfigurationError) as bad:
        Settings.from_env({"DMX_DB_HOST": f"alice:{SECRET}@db.example"})
    assert SECRET not in str(bad.value)
    assert "credentials go in DMX_CH_USER / DMX_CH_PASSWORD" in str(bad.value)
    with pytest.raises(ConfigurationError, match="unsupported store URL ''"):
        open_store("")
