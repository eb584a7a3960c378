"""Threads the capture starts carry their names at the OS level (Linux)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from dmi_sglang.threads import OsNamedThread, name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux names")


def _os_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_a_thread_takes_its_python_name_at_the_os_level() -> None:
    seen: list[str] = []
    thread = OsNamedThread(target=lambda: seen.append(_os_name()), name="dmi-capture-drain",
                           daemon=True)
    thread.start()
    thread.join()
    assert seen == ["dmi-capture-dra"]  # Linux keeps 15 bytes


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 names OS threads itself")
def test_a_plain_python_thread_keeps_the_process_name() -> None:
    """What the class is for: without it the OS name is the process's."""
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(_os_name()), name="dmi-other")
    thread.start()
    thread.join()
    assert seen != ["dmi-other"]


def test_naming_the_calling_thread() -> None:
    def rename() -> None:
        seen.append(name_os_thread("dmi-x"))
        seen.append(_os_name())

    seen: list[object] = []
    thread = threading.Thread(target=rename)
    thread.start()
    thread.join()
    assert seen == [True, "dmi-x"]
