"""One gpuctl at a time changes a cluster: a per-cluster lock around provisioning and teardown.

Two `gpuctl apply` of one cluster at once would run Terraform twice on one
state and write the registry and inventory from both; the second waits here,
saying for whom. Jobs on a cluster do not take it: they may run side by side.
The lock files live in `locks/` of the state dir, outside the cluster's
directory, so they outlive `down`.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from typing import Callable, Iterator

from gpuctl.common.paths import state_root


@contextmanager
def cluster_lock(name: str, on_wait: Callable[[str], None] = lambda _: None) -> Iterator[None]:
    locks = state_root() / "locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            on_wait(f"Waiting for another gpuctl (pid {holder}) that is changing cluster '{name}'")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
