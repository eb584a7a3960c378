"""One result schema, resumable state and the deadline, shared by every harness command.

Every file the harness writes is a JSON object made by :func:`result`::

    {"schema", "kind", "name", "status", "commit", "code", "library", "command",
     "environment", "ran_at_utc", "finished_at_utc", "settings", "checks", "figures",
     "bound", "error"}

``code`` fingerprints the imported ``dmi_sglang`` and ``harness/``; ``library`` is where
that ``dmi_sglang`` was imported from (``PYTHONPATH`` may put another tree's first).

``status`` is ``passed`` (every required check ok), ``failed``, ``error`` (it could not be
measured) or ``skipped`` (it did not fit before the deadline; run the command again).
A check is ``{"ok": bool, "required": bool, ...}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from dmi_sglang.domain.settings import redact_url
from harness.constants import DEADLINE_ENV, SCHEMA, STATE_DIR, STATE_ENV

REPO = Path(__file__).resolve().parents[1]
STATUSES = ("passed", "failed", "error", "skipped")
Json = dict[str, Any]


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def compact_utc() -> str:
    """Now, UTC, as ``20261201T142625`` (for run ids)."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S")


def stable_hash(data: Any) -> str:
    """12 hex digits of the sha256 of ``data`` as canonical JSON."""
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def library_dir() -> Path:
    """The ``dmi_sglang`` package this process imported (``PYTHONPATH`` may put another
    tree's first)."""
    import dmi_sglang

    return Path(dmi_sglang.__file__).resolve().parent


def code_fingerprint(repo: Path = REPO) -> str:
    """12 hex digits over the code that decides results (the imported ``dmi_sglang`` and
    ``harness/``), so that saved state is reused only for identical code, also where a
    copy has no ``.git``."""
    digest = hashlib.sha256()
    for root, name in ((library_dir(), "src/dmi_sglang"), (repo / "harness", "harness")):
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(root)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit(repo: Path = REPO, env: Mapping[str, str] | None = None) -> str:
    """``DMI_COMMIT`` where set (a device copy may lack ``.git``), else git's HEAD, with
    ``+dirty`` when tracked files differ from it."""
    named = (os.environ if env is None else env).get("DMI_COMMIT", "").strip()
    if named:
        return named

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                 text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


SECRET_FLAGS = ("--api-key", "--admin-api-key")
"""Command-line flags whose value is a secret (SGLang's server keys)."""


def masked(argv: Sequence[str]) -> list[str]:
    """``argv`` as a result may record it: the value of each :data:`SECRET_FLAGS` flag
    (``--api-key KEY`` or ``--api-key=KEY``, also inside one argument of several words
    such as ``--server-flags "--api-key KEY --tp 1"``) hidden, and a password in a URL
    argument."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if i and argv[i - 1] in SECRET_FLAGS:
            out.append("***")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=***")
        elif arg not in SECRET_FLAGS and any(s in arg for s in SECRET_FLAGS):  # passed on
            out.append(f"{flag}={_masked_words(value)}" if eq and flag.startswith("-")
                       else _masked_words(arg))
        else:  # not hook selections such as resid_pre@0-3: URLs only
            out.append(redact_url(arg) if "://" in arg else arg)
    return out


def _masked_words(text: str) -> str:
    """``text``, a command line of its own, with :func:`masked` applied to its words; one
    word naming a secret flag hides its value, and all of it is hidden when it does not
    split."""
    try:
        words = shlex.split(text)
    except ValueError:
        return "***"
    if len(words) > 1:
        return shlex.join(masked(words))
    flag, eq, _ = (words or [""])[0].partition("=")
    return f"{flag}=***" if eq and flag in SECRET_FLAGS else "***"


def command_line() -> str:
    """This process's command line, shell-quoted (``python -m harness ...`` as typed),
    secrets hidden (:func:`masked`)."""
    args = list(sys.argv)
    if args and args[0].endswith(("harness/__main__.py", "harness\\__main__.py")):
        args[0:1] = ["-m", "harness"]
    return " ".join(shlex.quote(a) for a in masked([sys.executable, *args]))


def result(kind: str, name: str, settings: Mapping[str, Any]) -> Json:
    """A fresh result object of the one schema (status unset until the checks ran)."""
    return {
        "schema": SCHEMA, "kind": kind, "name": name, "status": None,
        "commit": git_commit(), "code": code_fingerprint(), "library": str(library_dir()),
        "command": command_line(),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("DMI_HARNESS_", "DMI_COMMIT"))},
        "ran_at_utc": utc_now(), "finished_at_utc": None, "settings": dict(settings),
        "checks": {}, "figures": {}, "bound": {}, "error": None,
    }


def status_of(checks: Mapping[str, Mapping[str, Any]]) -> str:
    """``passed`` when every required check is ok (and there is one), else ``failed``."""
    required = [c for c in checks.values() if c.get("required", True)]
    return "passed" if required and all(c.get("ok") for c in required) else "failed"


def finish(data: Json, status: str | None = None, error: str | None = None) -> Json:
    """Stamp ``data`` finished: the status from its checks unless given."""
    data["status"] = status or status_of(data["checks"])
    data["error"] = error
    data["finished_at_utc"] = utc_now()
    return data


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically (a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def load_json(path: Path) -> Json | None:
    """A JSON object from ``path``; None when missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Deadline:
    """When this invocation must be done: :data:`~harness.constants.DEADLINE_ENV` seconds
    after it started (``budget_s`` overrides; 0 or unset: never)."""

    def __init__(self, budget_s: float | None = None, *, clock: Any = time.time,
                 env: Mapping[str, str] | None = None) -> None:
        if budget_s is None:
            text = (os.environ if env is None else env).get(DEADLINE_ENV, "").strip()
            try:
                budget_s = float(text) if text else 0.0
            except ValueError:
                budget_s = -1.0
            if not budget_s >= 0:  # nan or a negative were read as "no deadline"
                msg = f"{DEADLINE_ENV}={text!r}: expected seconds (a number; 0: no deadline)"
                raise SystemExit(msg) from None
        self.clock = clock
        self.at: float | None = clock() + budget_s if budget_s > 0 else None

    def left(self) -> float:
        """Seconds left (infinite without a deadline)."""
        return float("inf") if self.at is None else self.at - self.clock()

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` of work fit before the deadline."""
        return seconds <= self.left()

    def timeout(self) -> float | None:
        """How long a child may take: what is left, or None (no deadline: wait for it)."""
        return None if self.at is None else max(self.left(), 0.001)


def state_dir(fallback: Path, env: Mapping[str, str] | None = None) -> Path:
    """The state directory: :data:`~harness.constants.STATE_ENV`, else
    :data:`~harness.constants.STATE_DIR` where writable, else ``fallback``."""
    source = os.environ if env is None else env
    for candidate in (source.get(STATE_ENV), STATE_DIR):
        if not candidate:
            continue
        path = Path(candidate)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".probe"
            probe.write_text("")
            probe.unlink()
        except OSError:
            continue
        return path
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


class Resumable:
    """Finished results kept across invocations, keyed by an identity hash: a result is
    reused only for the same code (:func:`code_fingerprint`), the same settings and a
    final status."""

    def __init__(self, root: Path, *, fresh: bool = False) -> None:
        self.root = root
        self.fresh = fresh
        self.code = code_fingerprint()

    def get(self, key: str, identity: str) -> Json | None:
        """The saved result of ``key`` when its identity matches and it is final."""
        if self.fresh:
            return None
        data = load_json(self.root / f"{key}.json")
        if data and data.get("identity") == identity and data.get("status") in \
                ("passed", "failed") and data.get("code") == self.code:
            return data
        return None

    def put(self, key: str, identity: str, data: Json) -> None:
        """Save ``data`` (skipped and error results are not kept: they run again)."""
        if data.get("status") in ("passed", "failed"):
            write_json(self.root / f"{key}.json", {**data, "identity": identity})


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Library logs below WARNING off while a benchmark measures, restored afterwards."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**saved)


def run_benchmark(kind: str, settings: Mapping[str, Any], measure: Callable[[Json], None],
                  out: Path | None) -> int:
    """A component benchmark's frame: a fresh result, ``measure`` filling it with library
    logs quieted, ``passed`` / ``failed`` from its checks or ``error`` with what raised,
    the JSON written (``out``, else ``$OUT/<kind>.json``, else ``./<kind>.json``); the exit
    status (0 passed)."""
    data = result(kind, kind, settings)
    try:
        with quiet_logs():
            measure(data)
        finish(data)
    except Exception as exc:  # a failed measurement is a result with its error
        traceback.print_exc()
        finish(data, "error", f"{type(exc).__name__}: {exc}")
    path = out or Path(os.environ.get("OUT") or ".") / f"{kind}.json"
    write_json(path, data)
    print(f"{data['status']}; wrote {path}")
    return 0 if data["status"] == "passed" else 1
