"""What the dashboard learns in the background, so that no page waits on a node or a bucket.

- An armed cluster's idle time is known only to its head (`autostop.show`, one SSH call); the
  pages show the last answer and when it came, and ask again in the background when it is older
  than REFRESH_S. The same pass records a cluster that took itself down (autostop.reconcile), as
  `gpuctl status` does.
- With shared state, the bucket's clusters, jobs and managed jobs are brought into the working
  copy every REFRESH_S (Registry.adopt_all, Store.pull), so the pages are the team's view.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuctl.jobplane import autostop
from gpuctl.provision.provisioner import load_inventory_of
from gpuctl.state.registry import Registry

REFRESH_S = 30.0


class HeadWatch:
    """The last idle time each armed cluster's head reported, asked again in the background."""

    def __init__(self, refresh_s: float = REFRESH_S, workers: int = 4) -> None:
        self.refresh_s = refresh_s
        self._seen: dict[str, dict[str, Any]] = {}
        self._asking: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="headwatch")

    def idle(self, name: str) -> dict[str, Any] | None:
        """{"idle_s", "at"} as the head last said (None before it answered); asks again when stale."""
        with self._lock:
            seen = self._seen.get(name)
            stale = seen is None or time.time() - seen["at"] > self.refresh_s
            if stale and name not in self._asking:
                self._asking.add(name)
                self._pool.submit(self._ask, name)
        return seen

    def _ask(self, name: str) -> None:
        try:
            registry = Registry()
            record = registry.cluster(name)
            if record is None:
                return
            what, _ = autostop.reconcile(name, record.status, registry)
            inv = load_inventory_of(name) if what is None else None
            answer = autostop.show(inv) if inv is not None else {}
            with self._lock:
                self._seen[name] = {"idle_s": answer.get("idle_s") if answer.get("set") else None,
                                    "busy": answer.get("busy"), "at": time.time()}
        except Exception:  # noqa: BLE001 - a head that does not answer leaves the last answer shown
            with self._lock:
                old = self._seen.get(name)
                self._seen[name] = {**(old or {"idle_s": None, "busy": None}), "at": time.time()}
        finally:
            with self._lock:
                self._asking.discard(name)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SharedStateSync(threading.Thread):
    """Shared state only: the bucket's rows brought into this working copy every `every` seconds."""

    def __init__(self, every: float = REFRESH_S) -> None:
        super().__init__(name="shared-state-sync", daemon=True)
        self.every = every
        self.stopped = threading.Event()
        self.last_error: str | None = None

    def run(self) -> None:
        while not self.stopped.is_set():
            self.once()
            self.stopped.wait(self.every)

    def once(self) -> None:
        """One pass: the bucket's clusters (with their jobs) and managed jobs into the working copy."""
        from gpuctl.managed.store import Store  # only with shared state

        try:
            Registry().adopt_all()
            Store().pull()
            self.last_error = None
        except Exception as exc:  # noqa: BLE001 - shown on the pages; the next pass tries again
            self.last_error = f"the state bucket could not be read: {exc}"
