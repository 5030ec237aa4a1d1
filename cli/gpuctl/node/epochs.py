"""Epoch fencing of a managed job's attempts: never two copies of a rank (admission, `fence`).

A managed job's attempts share one task id; each has a larger epoch (its
attempt number), in the payload as {"epoch": {"task", "value"}}. Every node
keeps the newest epoch it has seen per task (~/.gpuctl/epochs/<task's file>),
under one flock (~/.gpuctl/epochs.lock). A stage of an epoch older than that is
refused (`job_admission`); `fence TASK EPOCH` raises the record and stops
every stage of the task's older epochs here. An admitted job leaves its epoch
in JOBDIR/epoch.json on every node (a worker has no payload.json), which is
how `fence` finds it.

The race that matters: a relay that read an old payload but had not started
its stage when `fence` ran must not start it afterwards. The relay holds the
lock from the check to the moment the stage's process group exists
(`job_admission` wraps start_stage), and `fence` raises the record under the
same lock before it looks for stages: either the start came first, and the
stage's files are there for `fence` to find and stop, or the raise did, and
the check refuses. (Re-checking after the start and killing would let an old
rank run, however briefly, beside a new one: holding the lock costs only the
start's few milliseconds.)
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time

from gpuctl.node.jobdir import (
    GPUCTL_DIR, JOBS_DIR, Stage, read_int, read_text, remove, stage_supervisor, stage_tag, write_atomic,
    write_private,
)
from gpuctl.node.procs import group_alive, kill_all, tagged_processes
from gpuctl.node.spotnotice import doomed_record
from gpuctl.node.stages import kill_stage
from gpuctl.node.protocol import STAGES

EPOCHS_DIR = os.path.join(GPUCTL_DIR, "epochs")  # one file per task: the newest epoch seen, an integer
EPOCHS_LOCK = os.path.join(GPUCTL_DIR, "epochs.lock")
JOB_EPOCH_FILE = "epoch.json"  # in JOBDIR, once a stage of the job was admitted here: {"task", "value"}
FENCE_GRACE = 3.0  # seconds between TERM and KILL, as a job's own grace


def epoch_file(task):
    """The task's record: its id made safe for a file name, plus a digest, so two ids never share one."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", task)[:64].lstrip(".-") or "task"
    return os.path.join(EPOCHS_DIR, "%s.%s" % (safe, hashlib.sha256(task.encode("utf-8")).hexdigest()[:16]))


def epoch_problem(task, value):
    """Why (task, value) is no epoch, or None."""
    if not isinstance(task, str) or not task:
        return "epoch task %r is not a task id" % (task,)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return "epoch value %r of task %s is not a whole number >= 0" % (value, task)
    return None


def job_epoch(payload):
    """((task, value), None) of a job with an epoch, (None, None) without one, (None, problem)."""
    spec = payload.get("epoch")
    if spec is None:
        return None, None
    if not isinstance(spec, dict):
        return None, "epoch must be an object {task, value}, not %r" % (spec,)
    problem = epoch_problem(spec.get("task"), spec.get("value"))
    return (None, problem) if problem else ((spec["task"], spec["value"]), None)


@contextlib.contextmanager
def epochs_locked():
    """The node's epoch lock (flock, exclusive), for the body's duration."""
    os.makedirs(EPOCHS_DIR, 0o700, exist_ok=True)
    fd = os.open(EPOCHS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # Unlocked explicitly: a stage started in the body inherited the descriptor for a moment.
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def newest(task):
    """The newest epoch this node has seen for `task`, or None (written atomically: no lock to read)."""
    return read_int(epoch_file(task))


def raise_to(task, value):
    """Record `value` for `task` unless a newer one is recorded (never lowers); the newest after."""
    with epochs_locked():
        seen = newest(task)
        if seen is None or value > seen:
            write_atomic(epoch_file(task), str(value))
            return value
        return seen


def refusal(task, value, seen):
    return ("epoch %d of task %s refused: a newer attempt (epoch %d) owns this task's ranks"
            % (value, task, seen))


@contextlib.contextmanager
def admission(task, value):
    """Yields None when epoch `value` of `task` may run here (recorded, if newer), else why not;
    the lock is held until the body ends, so a stage started in it starts while admitted."""
    with epochs_locked():
        seen = newest(task)
        if seen is not None and value < seen:
            yield refusal(task, value, seen)
            return
        if seen != value:
            write_atomic(epoch_file(task), str(value))
        yield None


def admit(task, value):
    """None when epoch `value` of `task` may run here (recorded, if newer), else why not."""
    with admission(task, value) as problem:
        return problem


@contextlib.contextmanager
def job_admission(payload, jobdir):
    """Around the start of a job's stage on this node: yields None (admitted, or no epoch), or the
    problem that must fail the start. An admitted job's epoch is left in JOBDIR/epoch.json."""
    epoch, problem = job_epoch(payload)
    if epoch is None:
        yield problem
        return
    with admission(epoch[0], epoch[1]) as problem:
        if problem is None:
            write_private(os.path.join(jobdir, JOB_EPOCH_FILE), json.dumps({"task": epoch[0], "value": epoch[1]}))
        yield problem


def jobdir_epoch(jobdir):
    """(task, value) of the job in `jobdir`: epoch.json (any node), else payload.json (the head's
    copy of the job, before its first stage); None when it has none."""
    for name, key in ((JOB_EPOCH_FILE, None), ("payload.json", "epoch")):
        text = read_text(os.path.join(jobdir, name))
        if text is None:
            continue
        try:
            data = json.loads(text)
        except ValueError:
            continue
        epoch, _ = job_epoch({"epoch": data.get(key) if key else data} if isinstance(data, dict) else {})
        if epoch is not None:
            return epoch
    return None


def stage_lives(st):
    """Whether something of the stage may still run here, judged without trusting its recorded
    group id, which the node may have given to another process since (a reboot, a job of long
    ago): its supervisor lives (the agent's command line), or a process carries its tag."""
    return stage_supervisor(st) is not None or bool(tagged_processes(stage_tag(st)))


def stop_stage(st, grace):
    """Stop what lives of the stage: through its supervisor's records (kill_stage) while that
    lives, else only the processes carrying its tag (TERM, KILL after `grace` s). True when
    something was stopped."""
    if stage_supervisor(st) is not None:
        return kill_stage(st, grace)
    tag = stage_tag(st)
    if not tagged_processes(tag):
        return False
    kill_all(tagged_processes(tag), signal.SIGTERM)
    deadline = time.time() + grace
    while tagged_processes(tag) and time.time() < deadline:
        time.sleep(0.1)
    kill_all(tagged_processes(tag), signal.SIGKILL)
    deadline = time.time() + 5  # a SIGKILL is not instant on a loaded node: wait until they are gone
    while tagged_processes(tag) and time.time() < deadline:
        time.sleep(0.05)
    return True


def fence(task, value, grace=FENCE_GRACE):
    """Raise `task`'s epoch here to `value`, then stop every stage of its older epochs (TERM,
    KILL after `grace` s, all at once); the answer `fence` prints. Idempotent."""
    raise_to(task, value)
    stages = []  # (job, Stage) of the older attempts that may still run
    names = sorted(os.listdir(JOBS_DIR)) if os.path.isdir(JOBS_DIR) else []
    for name in names:
        jobdir = os.path.join(JOBS_DIR, name)
        epoch = jobdir_epoch(jobdir)
        if epoch is not None and epoch[0] == task and epoch[1] < value:
            stages += [(name, st) for st in (Stage(jobdir, stage) for stage in STAGES) if stage_lives(st)]
    stopped = set()

    def stop(name, st):
        if stop_stage(st, grace):
            stopped.add(name)
        remove(st.secrets)  # the job is over here: its secrets go with it

    threads = [threading.Thread(target=stop, args=pair) for pair in stages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    running = ["%s/%s" % (name, st.name) for name, st in stages
               if (stage_supervisor(st) is not None and group_alive(st.pgid())) or tagged_processes(stage_tag(st))]
    return {"fenced": True, "epoch": value, "stopped": sorted(stopped), "running": running,
            "doomed": doomed_record()}


def cmd_fence(args):
    """`fence TASK EPOCH [--grace S]`: one JSON line (see fence)."""
    problem = epoch_problem(args.task, args.epoch)
    if problem:
        sys.stderr.write("gpuctl-node: %s\n" % problem)
        return 2
    print(json.dumps(fence(args.task, args.epoch, max(float(args.grace), 0.0))))
    return 0
