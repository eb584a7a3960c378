"""Making an embedded store's new files durable: ``fsync`` of what changed since a time.

ClickHouse writes a part's files and renames its directory into place without syncing
them (``fsync_after_insert`` is off), so after an insert the data may sit in the page
cache only. :func:`sync_tree` syncs every regular file under the store changed since a
given time, then every directory that holds one of them or changed itself (its entries:
new parts, renames), deepest first, so that a power loss after it returned loses none
of them.

Given a :class:`SyncedFiles` record, a sync skips what an earlier sync of the record
made durable and that has not changed since (same inode, size, modification and change
times), and records what it syncs, once it is settled: last modified more than the
record's slack before that sync began (file times come from a coarse clock, and
ClickHouse sets a part directory's modification time to a whole second as it renames
it into place, so a change within the slack could leave the times as they were). A
change after such a sync moves them, so a file or directory that changed is synced
again; one the record never saw (a pass whose walk missed a part renamed into place
meanwhile) is synced like any other.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import attrs

__all__ = ["SyncReport", "SyncedFiles", "sync_tree"]

_Key = tuple[int, int, int, int, int]
"""What identifies a version of a file or directory: device, inode, size, and its
modification and change times (ns; no call sets the change time back)."""


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
    skipped: int = 0
    """Files and directories left out: synced before and unchanged since (a record)."""


class SyncedFiles:
    """What earlier syncs made durable, for :func:`sync_tree` to skip while unchanged.

    Args:
        slack_ns: how long before a sync's start an entry must have been last modified
            for that sync to record it (the file clock's coarseness, with a margin).
    """

    def __init__(self, slack_ns: int) -> None:
        self.slack_ns = slack_ns
        self.keys: dict[str, _Key] = {}
        """Path -> the version a sync made durable."""


def _key(st: os.stat_result) -> _Key:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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


@attrs.define
class _Found:
    """What a walk found: files to sync (with their versions), every directory's
    version, the directories of the files to sync, and what is durable already."""

    files: list[tuple[str, _Key]] = attrs.Factory(list)
    directories: dict[str, _Key] = attrs.Factory(dict)
    holding: set[str] = attrs.Factory(set)
    durable: dict[str, _Key] = attrs.Factory(dict)
    nbytes: int = 0
    skipped: int = 0


def _walk(root: str, since_ns: int, known: dict[str, _Key]) -> _Found:
    """The regular files under ``root`` modified at or after ``since_ns`` and not in
    ``known`` as they are now; those in it are kept as durable."""
    found = _Found()
    for dirpath, _, filenames in os.walk(root, onerror=_unless_vanished):
        try:
            found.directories[dirpath] = _key(os.lstat(dirpath))
        except FileNotFoundError:
            continue
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = _key(st)
            if known.get(path) == key:  # durable already: kept in the record
                found.durable[path] = key
                found.skipped += st.st_mtime_ns >= since_ns
            elif st.st_mtime_ns >= since_ns:
                found.files.append((path, key))
                found.holding.add(dirpath)
                found.nbytes += st.st_size
    return found


def sync_tree(root: str, since_ns: int, synced: SyncedFiles | None = None) -> SyncReport:
    """fsync the regular files under ``root`` modified at or after ``since_ns`` (a
    ``time.time_ns()`` value), then the directories holding them or modified since,
    deepest first. Symbolic links are neither followed nor synced. With ``synced``,
    what it recorded and is unchanged is left out, and the record becomes what this
    sync found durable (see the module docstring; updated only when the sync succeeded).

    Raises:
        OSError: the store's directory is gone, or a file or directory under it could
            not be listed, opened or synced (one that vanished is skipped): its files
            would otherwise stay unsynced unnoticed.
    """
    started, began_ns = time.perf_counter(), time.time_ns()
    known = synced.keys if synced is not None else {}
    settled_before = began_ns - synced.slack_ns if synced is not None else 0
    try:  # the store itself vanished: nothing of it is on disk
        is_dir = stat.S_ISDIR(os.stat(root).st_mode)
    except FileNotFoundError:
        is_dir = False
    if not is_dir:
        raise FileNotFoundError(errno.ENOENT, "the store's directory is gone", root)
    found = _walk(root, since_ns, known)
    durable, skipped = found.durable, found.skipped
    files = 0
    for path, key in found.files:
        if _fsync(path, os.O_RDONLY):
            files += 1
            if key[3] < settled_before:
                durable[path] = key
    dirs = 0
    for d in sorted(found.directories, key=lambda d: d.count(os.sep), reverse=True):
        key, holds = found.directories[d], d in found.holding  # deepest first
        if not holds and known.get(d) == key:
            durable[d] = key
            skipped += key[3] >= since_ns
        elif (holds or key[3] >= since_ns) and _fsync(d, os.O_RDONLY | os.O_DIRECTORY):
            dirs += 1
            if key[3] < settled_before:
                durable[d] = key
    if synced is not None:
        synced.keys = durable
    return SyncReport(files, dirs, found.nbytes, time.perf_counter() - started, skipped)
