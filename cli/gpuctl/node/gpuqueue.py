"""The head's job queue: a job that asks for GPUs waits until they are free on every node it runs on.

Each job's coordinator (coordinator.py) is its own process on the head; they share one state file,
~/.gpuctl/queue/state.json, changed only under ~/.gpuctl/queue/lock (flock) and replaced atomically
(readers without the lock see a whole file). An entry is a job that asks for GPUs: waiting
(`devices` null) or holding `devices` ({rank: [GPU index, ...]}), with its coordinator's pid and
that process's start time, so that an entry whose coordinator died (SIGKILL, a reboot, a pid used
again) frees its GPUs at the next look: nothing stays held by a job that no longer runs.

First come, first served: a waiting job starts only when no job that came before it still waits,
and when every node it runs on has `per_node` GPUs that no running job holds. A job that asks for
none never enters the queue. A job's end (its coordinator's `gpu_release`) wakes the waiting ones at
once through their wake FIFOs (~/.gpuctl/queue/JOB.wake); a waiting coordinator also looks again
every GPU_QUEUE_LOOK_S, which is how a dead holder is noticed. A holder whose coordinator died keeps
its GPUs GPU_QUEUE_DEAD_HOLD_S more: its ranks are being stopped (each stage's supervisor ends its
stage when its owner's lifeline closes, after a grace; a worker's relay when its ssh ends), and the
next job must not start beside them. Entries carry the boot they were made in (boot_id): after a
reboot none of them runs.
"""

import errno
import fcntl
import json
import os
import select
import time

from gpuctl.node.jobdir import GPUCTL_DIR, remove, write_private
from gpuctl.node.procs import stat_fields

GPU_QUEUE_DIR = os.path.join(GPUCTL_DIR, "queue")
GPU_QUEUE_LOOK_S = 1.0  # a waiting job looks again this often without being woken (dead holders)
GPU_QUEUE_DEAD_HOLD_S = 15.0  # a dead holder's GPUs stay held this long: the grace, and the workers' relays
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def _queue_paths(queue_dir):
    queue_dir = queue_dir or GPU_QUEUE_DIR
    return queue_dir, os.path.join(queue_dir, "state.json"), os.path.join(queue_dir, "lock")


def _wake_path(job, queue_dir=None):
    return os.path.join(_queue_paths(queue_dir)[0], job + ".wake")


def process_start_time(pid):
    """The process's start time (clock ticks since boot), or None when it is gone or a zombie: with
    the pid, it names one process, never a later one given the same pid."""
    fields = stat_fields(pid) if pid else None
    if fields is None or fields[0] == "Z":
        return None
    return fields[19]


def boot_id():
    try:
        with open(BOOT_ID_FILE) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _coordinator_alive(entry):
    return (entry.get("boot") == boot_id()
            and process_start_time(entry.get("pid")) == entry.get("pid_start") is not None)


class LockedQueue(object):
    """The queue's state under its lock; written back (atomically) on leaving, when changed."""

    def __init__(self, queue_dir=None):
        self.dir, self.state_path, self.lock_path = _queue_paths(queue_dir)

    def __enter__(self):
        os.makedirs(self.dir, 0o700, exist_ok=True)  # coordinators of a fresh head make it at once
        self.lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self.state = read_gpu_queue(self.dir)
        self.before = json.dumps(self.state, sort_keys=True)
        return self.state

    def __exit__(self, *exc):
        try:
            if json.dumps(self.state, sort_keys=True) != self.before:
                write_private(self.state_path, json.dumps(self.state))
        finally:
            os.close(self.lock_fd)  # releases the lock
        return False


def read_gpu_queue(queue_dir=None):
    """The state as last written (no lock needed: it is replaced whole)."""
    _, state_path, _ = _queue_paths(queue_dir)
    try:
        with open(state_path) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        state = {}
    if not isinstance(state, dict) or not isinstance(state.get("entries"), list):
        state = {"seq": 0, "entries": []}
    return state


def _drop_dead_entries(state, now=None):
    """Drop the entries whose coordinator is gone: a waiting one at once, a holding one once its
    ranks had GPU_QUEUE_DEAD_HOLD_S to stop (marked dying until then); their names."""
    now = time.time() if now is None else now
    gone = []
    for e in state["entries"]:
        if _coordinator_alive(e):
            continue
        if e.get("devices") and e.get("boot") == boot_id():
            e.setdefault("dead_since", now)
            if now - e["dead_since"] < GPU_QUEUE_DEAD_HOLD_S:
                continue
        gone.append(e["job"])
    state["entries"] = [e for e in state["entries"] if e["job"] not in gone]
    return gone


def gpu_enqueue(job, label, per_node, ranks, capacity, names, pid=None, queue_dir=None):
    """Put the job at the end of the queue (once); its coordinator is `pid` (this process)."""
    pid = pid or os.getpid()
    with LockedQueue(queue_dir) as state:
        _drop_dead_entries(state)  # an earlier try of this job whose coordinator died: this one queues
        if any(e["job"] == job for e in state["entries"]):
            return
        state["seq"] = int(state.get("seq") or 0) + 1
        state["entries"].append({
            "job": job, "label": label, "pid": pid, "pid_start": process_start_time(pid), "boot": boot_id(),
            "seq": state["seq"],
            "per_node": int(per_node), "ranks": [int(r) for r in ranks],
            "capacity": dict((str(r), int(c)) for r, c in capacity.items()),
            "names": dict((str(r), n) for r, n in names.items()), "devices": None,
        })


def _free_gpus(state, rank, capacity):
    held = set()
    for e in state["entries"]:
        if e.get("devices"):
            held.update(e["devices"].get(str(rank)) or [])
    return [i for i in range(capacity) if i not in held]


def _gpu_holders(state, rank):
    return [e for e in state["entries"] if e.get("devices") and e["devices"].get(str(rank))]


def _why_waiting(state, entry):
    """What the entry waits for, in words ("8 GPU(s) on head held by job 3"), or None if it fits."""
    waiting_ahead = [e for e in state["entries"] if e.get("devices") is None and e["seq"] < entry["seq"]]
    if waiting_ahead:
        first = min(waiting_ahead, key=lambda e: e["seq"])
        return "its turn: %s came first and waits too (first come, first served)" % first["label"]
    for rank in entry["ranks"]:
        capacity = int(entry["capacity"].get(str(rank)) or 0)
        if len(_free_gpus(state, rank, capacity)) < entry["per_node"]:
            holders = ", ".join(e["label"] + (" (ended; its ranks are being stopped)" if e.get("dead_since") else "")
                                for e in _gpu_holders(state, rank)) or "nothing"
            return "%d GPU(s) on %s held by %s" % (entry["per_node"], entry["names"].get(str(rank), "rank %d" % rank),
                                                    holders)
    return None


def gpu_try_admit(job, queue_dir=None):
    """Give the job its GPUs if it is its turn and they are free: ({rank: [index, ...]}, None), or
    (None, what it waits for). (None, None): the job is not in the queue (never was, or released)."""
    with LockedQueue(queue_dir) as state:
        _drop_dead_entries(state)
        entry = next((e for e in state["entries"] if e["job"] == job), None)
        if entry is None:
            return None, None
        if entry.get("devices"):
            return dict((int(r), d) for r, d in entry["devices"].items()), None
        why = _why_waiting(state, entry)
        if why is not None:
            return None, why
        devices = {}
        for rank in entry["ranks"]:
            capacity = int(entry["capacity"].get(str(rank)) or 0)
            devices[str(rank)] = _free_gpus(state, rank, capacity)[:entry["per_node"]]
        entry["devices"] = devices
        return dict((int(r), d) for r, d in devices.items()), None


def gpu_release(job, queue_dir=None):
    """The job ended (or was cancelled waiting): its GPUs are free and the waiting jobs look again."""
    with LockedQueue(queue_dir) as state:
        state["entries"] = [e for e in state["entries"] if e["job"] != job]
        waiting = [e["job"] for e in state["entries"] if e.get("devices") is None]
    for other in waiting:
        gpu_wake(other, queue_dir)


def gpu_wake(job, queue_dir=None):
    """One byte to a waiting job's wake FIFO; nothing if it has none (it looks again on its own)."""
    try:
        fd = os.open(_wake_path(job, queue_dir), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody reads it (the waiter is gone); ENOENT: none made
        return
    try:
        os.write(fd, b".")
    except OSError:  # full of wake-ups not read yet: one more changes nothing
        pass
    finally:
        os.close(fd)


class GpuWaker(object):
    """A waiting job's wake FIFO (removed again by `close`), read end and a write end of its own (so
    that select never sees its writers come and go as an end of file)."""

    def __init__(self, job, queue_dir=None):
        self.path = _wake_path(job, queue_dir)
        remove(self.path)
        os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self.keep = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)

    def wait(self, timeout):
        """Until woken (True) or `timeout` s passed (False)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                while os.read(self.fd, 4096):
                    pass
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
        return bool(ready)

    def close(self):
        for fd in (self.fd, self.keep):
            try:
                os.close(fd)
            except OSError:
                pass
        remove(self.path)


def gpu_waiting_reason(job, queue_dir=None):
    """What a waiting job waits for (read without the lock: `job-status`), or None when it is not
    waiting (not queued, or holding its GPUs)."""
    state = read_gpu_queue(queue_dir)
    entry = next((e for e in state["entries"] if e["job"] == job), None)
    if entry is None or entry.get("devices") or not _coordinator_alive(entry):
        return None
    _drop_dead_entries(state)
    return _why_waiting(state, entry) or "its GPUs (being given to it now)"
