"""One gpuctl at a time changes a cluster: a per-cluster lock around provisioning and teardown.

Two `gpuctl apply` of one cluster at once would run Terraform twice on one
state and write the registry and inventory from both; the second waits here,
saying for whom. Jobs on a cluster do not take it: they may run side by side.
The lock files live in `locks/` of the state dir, outside the cluster's
directory, so `down` can hold the lock until the directory is gone; it then
removes the lock file too (`HeldLock.discard`), still holding it. Whoever
waited on the removed file finds the path no longer names it and locks the
file at the path instead, so two holders never coexist.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpuctl.common.paths import state_root


class HeldLock:
    """The cluster's lock while held; `discard()`: the cluster is gone, so is its lock file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


@contextmanager
def cluster_lock(name: str, on_wait: Callable[[str], None] = lambda _: None) -> Iterator[HeldLock]:
    locks = state_root() / "locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    path = locks / f"{name}.lock"
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                on_wait(f"Waiting for another gpuctl (pid {holder}) that is changing cluster '{name}'")
                waited = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _names(path, fd):
            break
        os.close(fd)  # a `down` removed this file while we waited: lock the one at the path now
    held = HeldLock(path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield held
    finally:
        if held.discarded:
            path.unlink(missing_ok=True)  # still held: a waiter sees the path changed
        os.close(fd)  # releases the lock


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        here, opened = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino)
