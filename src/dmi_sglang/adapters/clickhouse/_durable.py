"""Making an embedded store's new files durable: ``fsync`` of what changed since a time.

ClickHouse writes a part's files and renames its directory into place without syncing
them (``fsync_after_insert`` is off), so after an insert the data may sit in the page
cache only. :func:`sync_tree` syncs every regular file under the store changed since a
given time, then every directory that holds one of them or changed itself (its entries:
new parts, renames), deepest first, so that a power loss after it returned loses none
of them.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import attrs

__all__ = ["SyncReport", "sync_tree"]


@attrs.frozen
class SyncReport:
    """What :func:`sync_tree` synced.

    Attributes:
        files / directories: how many of each were synced.
        nbytes: size of the synced files.
        seconds: how long it took (walk included).
    """

    files: int
    directories: int
    nbytes: int
    seconds: float


def _fsync(path: str, flags: int) -> bool:
    """fsync ``path``; False when it vanished meanwhile (the engine removed a temporary
    part or an outdated one)."""
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return False
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _unless_vanished(error: OSError) -> None:
    """``os.walk``'s error handler: a directory that vanished is skipped (the engine
    removed a temporary or outdated part), any other error raised."""
    if not isinstance(error, FileNotFoundError):
        raise error


def sync_tree(root: str, since_ns: int) -> SyncReport:
    """fsync the regular files under ``root`` modified at or after ``since_ns`` (a
    ``time.time_ns()`` value), then the directories holding them or modified since,
    deepest first. Symbolic links are neither followed nor synced.

    Raises:
        OSError: the store's directory is gone, or a file or directory under it could
            not be listed, opened or synced (one that vanished is skipped): its files
            would otherwise stay unsynced unnoticed.
    """
    started = time.perf_counter()
    try:  # the store itself vanished: nothing of it is on disk
        found = stat.S_ISDIR(os.stat(root).st_mode)
    except FileNotFoundError:
        found = False
    if not found:
        raise FileNotFoundError(errno.ENOENT, "the store's directory is gone", root)
    files: list[str] = []
    directories: set[str] = set()
    nbytes = 0
    for dirpath, _, filenames in os.walk(root, onerror=_unless_vanished):
        try:
            if os.lstat(dirpath).st_mtime_ns >= since_ns:
                directories.add(dirpath)
        except FileNotFoundError:
            continue
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if st.st_mtime_ns >= since_ns and stat.S_ISREG(st.st_mode):
                files.append(path)
                directories.add(dirpath)
                nbytes += st.st_size
    synced = sum(_fsync(path, os.O_RDONLY) for path in files)
    deepest_first = sorted(directories, key=lambda d: d.count(os.sep), reverse=True)
    dirs = sum(_fsync(d, os.O_RDONLY | os.O_DIRECTORY) for d in deepest_first)
    return SyncReport(synced, dirs, nbytes, time.perf_counter() - started)
