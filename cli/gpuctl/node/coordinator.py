"""The head's side of a job (`submit`, `attach`, `events`, `cancel`, `job-status`).

`submit` is the controller's one call: it takes the job from stdin, forks
the detached coordinator (fork_coordinator) and streams JOBDIR/events.log back;
`attach` streams it again from an offset, `events` prints it as it is now. The `Coordinator` drives the
phases (P events: hello, buckets, sync, mounts, setup, run) through the head's
Relay, decides fail-fast (it sees every exit first), and ends with the
outcome (job.json and the D event) whatever happened, the controller attached
or not. `cancel` asks it to stop the job everywhere.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

from gpuctl.node.autostop import ensure_watcher, going
from gpuctl.node.buckets import check_bucket_sources, parse_secrets, rclone_env
from gpuctl.node.follow import OUTPUT_HEADS, Out, Wake, ev, follow_stage
from gpuctl.node.gpuqueue import GPU_QUEUE_LOOK_S, GpuWaker, gpu_enqueue, gpu_release, gpu_try_admit, gpu_waiting_reason
from gpuctl.node.jobdir import (
    Stage, cannot_write, job_dir, prepared_problem, read_int, read_text, take_job_dir, write_atomic,
    write_private,
)
from gpuctl.node.procs import pid_alive
from gpuctl.node.relay import Relay, describe_by_node, read_payload
from gpuctl.node.protocol import (
    EV_BUCKETS, EV_CLAIMS, EV_DONE, EV_EXIT, EV_HELLO, EV_LOST, EV_OUTPUT, EV_PHASE, EV_STARTED,
    EV_SYNCED, EXIT_UNKNOWN, HELLO_OK, HELLO_PROBLEM, HELLO_UNPREPARED, MESSAGE_PREFIX, OFFSET_HEADER,
    PHASE_BUCKETS, PHASE_CANCELLING, PHASE_MOUNTS, PHASE_PENDING, PHASE_PLAN, PHASE_RUN, PHASE_RUNNING, PHASE_SETUP, PHASE_START,
    PHASE_SYNC, RELAY_BUCKETS, RELAY_CLAIM, RELAY_CLEANUP, RELAY_END, RELAY_KILL, RELAY_RELEASE, RELAY_START,
    RELAY_SYNC, SENTINEL, STAGE_AGENT, STAGE_EVENTS, STAGE_RUN, STAGE_SETUP,
)


class Coordinator(object):
    """The head's side of a job: drives the phases, decides fail-fast, writes events.log."""

    def __init__(self, jobdir, payload, secrets, wake_fd=None):
        self.jobdir = jobdir
        self.wake_fd = wake_fd  # a byte per event for `submit`, which follows events.log (follow.Wake)
        self.payload = payload
        self.n = len(payload["peers"])
        self.job_ranks = int(payload.get("job_ranks") or self.n)
        self.grace = float(payload.get("grace") or 3.0)
        self.events = os.open(os.path.join(jobdir, "events.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.cancelled = False
        self.hello = {}
        self.problems = {}  # rank -> why nothing can run there (H RANK problem TEXT)
        self.claims = {}
        self.synced = {}
        self.fetched = {}  # rank -> (code, message) of its bucket fetch (B)
        self.started = {STAGE_SETUP: set(), STAGE_RUN: set()}
        self.exits = {STAGE_SETUP: {}, STAGE_RUN: {}}
        self.lost = {}
        self.first_failed = None
        self.run_started = False
        self.queued = False  # in the head's GPU queue (gpuqueue.py): released at the end, whatever the end
        payload["subtree"] = list(range(self.n))  # the head's subtree is the whole cluster
        self.relay = Relay(payload, secrets, 0, self.on_event)

    def write(self, data):
        view = memoryview(data)
        while view:  # a short write would leave half an event for the next one to complete
            view = view[os.write(self.events, view):]
        if self.wake_fd is not None:
            try:
                os.write(self.wake_fd, b".")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups not read yet: one more changes nothing
            except OSError:  # submit is gone (the controller's session ended): nobody to wake
                os.close(self.wake_fd)
                self.wake_fd = None

    def on_event(self, data):
        self.write(data)
        if data[:2] in OUTPUT_HEADS:  # output (a batch of whole events): nothing to record
            return
        parts = data.decode("utf-8", "replace").rstrip("\n").split(" ", 3)
        kind = parts[0]
        if len(parts) < 2 or not parts[1].lstrip("-").isdigit():
            return
        rank = int(parts[1])
        if kind == EV_HELLO:
            self.hello[rank] = parts[2] if len(parts) > 2 else "?"
            if self.hello[rank] == HELLO_PROBLEM:
                self.problems[rank] = parts[3] if len(parts) > 3 else "not ready"
        elif kind == EV_CLAIMS:
            self.claims[rank] = json.loads(parts[2])
        elif kind == EV_SYNCED:
            # one per destination pushed to the rank: a wave waits for all of them (do_sync)
            self.synced.setdefault(rank, []).append((int(parts[2]), parts[3] if len(parts) > 3 else ""))
        elif kind == EV_BUCKETS:
            self.fetched[rank] = (int(parts[2]), parts[3] if len(parts) > 3 else "")
        elif kind == EV_STARTED and parts[2] in self.started:
            self.started[parts[2]].add(rank)
        elif kind == EV_EXIT and parts[2] in self.exits:
            code = None if parts[3] == EXIT_UNKNOWN else int(parts[3])
            self.exits[parts[2]][rank] = code
            if parts[2] == STAGE_RUN and code != 0 and self.first_failed is None and not self.cancelled:
                self.first_failed = rank
        elif kind == EV_LOST:
            self.lost[rank] = parts[2] + (" " + parts[3] if len(parts) > 3 else "")
            if self.first_failed is None and rank < self.job_ranks and self.started[STAGE_RUN] and not self.cancelled:
                self.first_failed = rank

    def phase(self, name):
        self.write(ev(EV_PHASE, name))

    def check_cancel(self):
        if os.path.exists(os.path.join(self.jobdir, "cancel")):
            self.cancelled = True
        return self.cancelled

    def wait(self, done, timeout=None):
        """Step the tree until `done()`; False when cancelled or timed out."""
        deadline = None if timeout is None else time.time() + timeout
        while not done():
            if self.check_cancel():
                return False
            if deadline is not None and time.time() > deadline:
                return False
            self.relay.step(timeout=0.2)
        return True

    def accounted(self, ranks, table):
        return all(r in table or r in self.lost for r in ranks)

    def run(self):
        try:
            return self._run()
        except Exception as exc:  # noqa: BLE001 - always leave an outcome behind
            self.write(ev(EV_OUTPUT, 0, STAGE_AGENT, "gpuctl-node: coordinator failed: %s" % exc))
            return self.finish("FAILED", "coordinator failed: %s" % exc)
        finally:
            self.release_gpus()

    def wait_for_gpus(self):
        """A job that asks for GPUs waits in the head's queue until they are free on each of its
        nodes (gpuqueue.py), saying what it waits for (P pending WHY); then every node's stages see
        only the job's own (payload["gpu_devices"], stages.stage_env_text). None when it may start,
        else the outcome's (status, detail)."""
        per_node = int(self.payload.get("gpus_per_node") or 0)
        if per_node <= 0:
            return None
        ranks = list(range(self.job_ranks))
        peers = self.payload["peers"]
        capacity = dict((r, int(peers[r].get("gpus") or 0)) for r in ranks)
        short = [r for r in ranks if capacity[r] < per_node]
        if short:  # it would wait for ever: the controller refuses this before it gets here
            return "FAILED", "the job asks for %d GPU(s) per node; %s" % (per_node, "; ".join(
                "%s has %d" % (peers[r]["name"], capacity[r]) for r in short))
        job = self.payload["job"]
        gpu_enqueue(job, "job %s" % job.split("-")[0], per_node, ranks, capacity,
                    dict((r, peers[r]["name"]) for r in ranks))
        self.queued = True
        waker = GpuWaker(job)
        try:
            said = None
            while True:
                devices, why = gpu_try_admit(job)
                if devices is not None:
                    break
                if why is None:  # not in the queue any more: its entry was lost (the state file removed)
                    return "FAILED", "the job's place in the head's queue was lost"
                if why != said:
                    self.write(ev(EV_PHASE, PHASE_PENDING, why))
                    said = why
                looked = time.time()
                while time.time() - looked < GPU_QUEUE_LOOK_S:
                    if self.check_cancel():
                        return "CANCELLED", "cancelled while it waited for GPUs"
                    if waker.wait(0.2):
                        break
        finally:
            waker.close()
        self.payload["gpu_devices"] = dict((str(r), d) for r, d in devices.items())
        return None

    def release_gpus(self):
        if self.queued:
            self.queued = False
            try:
                gpu_release(self.payload["job"])
            except Exception as exc:  # noqa: BLE001 - the outcome is written all the same (and a dead
                # coordinator's entry frees itself: gpuqueue._drop_dead_entries)
                sys.stderr.write("gpuctl-node: releasing the job's GPUs failed: %s\n" % exc)

    def _run(self):
        all_ranks = list(range(self.n))
        waited = self.wait_for_gpus()
        if waited is not None:
            return self.finish(*waited)
        self.phase(PHASE_START)
        self.relay.prepare_local()
        self.relay.spawn_children()
        if not self.wait(lambda: self.accounted(all_ranks, self.hello), timeout=float(self.payload.get("connect_timeout") or 120)):
            return self.finish("CANCELLED" if self.cancelled else "FAILED", "nodes did not answer in time")
        unprepared = [r for r, h in self.hello.items() if h not in (HELLO_OK, HELLO_PROBLEM)]
        if unprepared:
            return self.finish("UNPREPARED", "node(s) need prepare", ranks=unprepared)
        if self.problems:
            return self.finish("FAILED", describe_by_node(self.payload["peers"], self.problems),
                               ranks=sorted(self.problems))
        if self.lost:
            return self.finish("FAILED", "lost before start: " + self.describe_lost())
        kinds = None
        if self.payload.get("buckets"):
            kinds = self.check_buckets()
            if kinds is None:
                return self.finish("CANCELLED" if self.cancelled else "FAILED", self.bucket_failure)
        if self.payload.get("sync"):
            self.phase(PHASE_SYNC)
            if not self.do_sync():
                return self.finish("CANCELLED" if self.cancelled else "FAILED", self.sync_failure or "sync failed")
        if kinds is not None and not self.fetch_buckets(kinds):
            return self.finish("CANCELLED" if self.cancelled else "FAILED", self.bucket_failure)
        stages = self.payload.get("stages") or {}
        if stages.get(STAGE_SETUP):
            self.phase(PHASE_SETUP)
            self.relay.command("%s %s" % (RELAY_START, STAGE_SETUP))
            if not self.wait(lambda: self.accounted(all_ranks, self.exits[STAGE_SETUP])):
                return self.cancel((STAGE_SETUP,))
            failed = [r for r in all_ranks if self.exits[STAGE_SETUP].get(r) != 0]
            if failed:
                return self.finish("FAILED_SETUP", "setup failed", ranks=failed)
        if stages.get(STAGE_RUN):
            job = list(range(self.job_ranks))
            self.phase(PHASE_RUN)
            self.run_started = True
            self.relay.command("%s %s" % (RELAY_START, STAGE_RUN))
            if not self.wait(lambda: self.accounted(job, self.started[STAGE_RUN]) or self.first_failed is not None):
                return self.cancel((STAGE_RUN,))
            self.phase(PHASE_RUNNING)
            killed = False
            while not self.accounted(job, self.exits[STAGE_RUN]):
                if self.check_cancel():
                    return self.cancel((STAGE_RUN,))
                if self.first_failed is not None and not killed:
                    killed = True  # fail fast: the others are stopped at once
                    self.relay.command("%s %g %s" % (RELAY_KILL, self.grace, STAGE_RUN))
                self.relay.step(timeout=0.2)
            failed = [r for r in job if self.exits[STAGE_RUN].get(r) != 0]
            return self.finish("FAILED" if failed else "SUCCEEDED", "", ranks=failed)
        return self.finish("SUCCEEDED", "")

    def do_sync(self):
        """Claims on every node, then copies from the head to the owners in waves (a tree)."""
        self.sync_failure = None
        dests = self.payload["sync"]
        token = "%s-%s" % (self.payload["job"], self.payload.get("nonce") or os.getpid())
        self.relay.command("%s %s" % (RELAY_CLAIM, token))
        all_ranks = list(range(self.n))
        if not self.wait(lambda: self.accounted(all_ranks, self.claims), timeout=300):
            self.sync_failure = "claiming the destinations timed out"
            return False
        if self.lost:
            self.sync_failure = "lost during sync: " + self.describe_lost()
            return False
        # Copies fan out narrower than commands: each push sends the whole tree of bytes
        # over the sender's link, so a node feeds a few others, which then feed theirs.
        branching = int(self.payload.get("copy_branching") or 4)
        edges = {}  # (src, dst) -> [dest index]
        depth_of = {}
        # Setup runs on every node, so every node gets the files; a job without setup only on its
        # own nodes, each through whichever node owns its filesystem's copy (the head: none).
        needed = self.n if (self.payload.get("stages") or {}).get(STAGE_SETUP) else self.job_ranks
        for i in range(len(dests)):
            owning = set(self.claims.get(r, [None] * len(dests))[i] for r in range(1, needed))
            owners = [0] + sorted(r for r in owning if isinstance(r, int) and 0 < r < self.n)
            for pos in range(1, len(owners)):
                parent = (pos - 1) // branching
                depth_of[(owners[parent], owners[pos])] = depth_of.get((owners[parent], owners[pos]), 0)
                edges.setdefault((owners[parent], owners[pos]), []).append(i)
                d, p = 1, parent
                while p > 0:
                    p, d = (p - 1) // branching, d + 1
                depth_of[(owners[parent], owners[pos])] = max(depth_of[(owners[parent], owners[pos])], d)
        copies = [[dests[i]["path"], sorted(dst for (src, dst), idx in edges.items() if i in idx)]
                  for i in range(len(dests))]
        self.write(ev(EV_PHASE, PHASE_PLAN, json.dumps({"copies": copies}, separators=(",", ":"))))
        waves = {}
        for edge, idx in edges.items():
            waves.setdefault(depth_of[edge], []).append([edge[0], edge[1], idx])
        for depth in sorted(waves):
            wave = waves[depth]
            pushes = {}  # target rank -> how many destinations it is sent in this wave
            for _, dst, idx in wave:
                pushes[dst] = pushes.get(dst, 0) + len(idx)
            targets = sorted(pushes)
            for t in targets:
                self.synced.pop(t, None)
            self.relay.command("%s %s" % (RELAY_SYNC, json.dumps(wave, separators=(",", ":"))))
            # every push to a rank ended, not just its first: a rank's run must not start while a copy
            # to it is still going
            if not self.wait(lambda: all(len(self.synced.get(t, ())) >= pushes[t] or t in self.lost
                                         for t in targets)):
                self.sync_failure = "sync cancelled"
                return False
            bad = []
            for t in targets:
                failed = [msg for code, msg in self.synced.get(t, []) if code != 0]
                if failed:  # a rank's first failed push says why
                    bad.append("%s: %s" % (self.payload["peers"][t]["name"], failed[0]))
            if bad or self.lost:
                self.sync_failure = "sync failed: " + "; ".join(bad + ([self.describe_lost()] if self.lost else []))
                return False
        self.relay.command(RELAY_RELEASE)
        return True

    def check_buckets(self):
        """Before the copies, on the head: create the buckets named without a source, check the
        others (see "buckets"); each mount's kind, or None (bucket_failure says why)."""
        self.phase(PHASE_BUCKETS)
        env, extra = rclone_env(self.payload.get("storage"), parse_secrets(self.relay.secrets))
        procs, box = [], []

        def check():
            try:
                box.append(check_bucket_sources(self.payload["buckets"], env, extra, procs=procs))
            except Exception as exc:  # noqa: BLE001 - one line for the user
                box.append((None, "checking the buckets failed: %s" % exc))

        worker = threading.Thread(target=check)
        worker.daemon = True
        worker.start()
        if not self.wait(lambda: not worker.is_alive()):
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            self.bucket_failure = "cancelled"
            return None
        kinds, error = box[0]
        self.bucket_failure = error
        return kinds

    def fetch_buckets(self, kinds):
        """After the copies, on every node: COPY into the destinations, MOUNT the rest; a barrier."""
        self.phase(PHASE_MOUNTS)
        self.fetched = {}
        token = "%s-%s-b" % (self.payload["job"], self.payload.get("nonce") or os.getpid())
        self.relay.command("%s %s %s" % (RELAY_BUCKETS, token, json.dumps(kinds, separators=(",", ":"))))
        all_ranks = list(range(self.n))
        if not self.wait(lambda: self.accounted(all_ranks, self.fetched)):
            self.bucket_failure = "cancelled"
            return False
        self.relay.command(RELAY_RELEASE)
        failed = dict((r, msg) for r, (code, msg) in self.fetched.items() if code != 0)
        if failed or self.lost:
            self.bucket_failure = "; ".join(([describe_by_node(self.payload["peers"], failed)] if failed else [])
                                            + (["lost: " + self.describe_lost()] if self.lost else []))
            return False
        return True

    def describe_lost(self):
        return "; ".join("rank %d (%s): %s" % (r, self.payload["peers"][r]["name"], why)
                         for r, why in sorted(self.lost.items()))

    def cancel(self, stages):
        self.cancelled = True
        self.relay.command("%s %g %s" % (RELAY_KILL, self.grace, " ".join(stages)))
        self.phase(PHASE_CANCELLING)
        deadline = time.time() + self.grace + 15
        for stage in stages:
            started = sorted(self.started[stage])
            while not self.accounted(started, self.exits[stage]) and time.time() < deadline:
                self.relay.step(timeout=0.2)
        return self.finish("CANCELLED", "cancelled")

    def finish(self, status, detail, ranks=()):
        codes = dict((str(r), c) for r, c in self.exits[STAGE_RUN].items())
        if self.run_started:  # a node lost before run started has no run code to report
            for r in self.lost:
                if r < self.job_ranks:
                    codes.setdefault(str(r), None)
        outcome = {
            "status": status, "detail": detail, "ranks": list(ranks),
            "setup": dict((str(r), c) for r, c in self.exits[STAGE_SETUP].items()),
            "run": codes, "first_failed": self.first_failed,
            "lost": dict((str(r), why) for r, why in self.lost.items()),
        }
        self.relay.command(RELAY_CLEANUP)
        self.relay.command(RELAY_END)
        self.relay.close(grace=self.grace)
        deadline = time.time() + 10
        while any(not c.out.eof for c in self.relay.children) and time.time() < deadline:
            self.relay.step(timeout=0.1)
        self.release_gpus()  # every rank stopped: the next job in the queue may have them
        write_atomic(os.path.join(self.jobdir, "job.json"), json.dumps(outcome))
        self.write(ev(EV_DONE, status, json.dumps(outcome, separators=(",", ":"))))
        write_atomic(os.path.join(self.jobdir, "events.exit"), "0")
        return 0


def run_coordinator(jobdir, payload, secrets, wake_fd=None):
    """The head's coordinator of one job: runs it to its end (a fork of `submit`, fork_coordinator)."""
    coordinator = Coordinator(jobdir, payload, secrets, wake_fd)

    def on_term(signum, frame):
        coordinator.cancelled = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, on_term)
    return coordinator.run()


def fork_coordinator(jobdir, payload, secrets):
    """Start the job's coordinator as a fork of this `submit`, in a session of its own and re-parented
    to init (a double fork), so that it outlives the controller's SSH session: a job costs the head one
    Python start and agent import fewer than running the agent again, and its secrets pass through no
    pipe. Its output goes to coordinator.log. (the coordinator's pid or None if it did not start,
    a follow.Wake that has news as the coordinator writes events)."""
    log_path = os.path.join(jobdir, "coordinator.log")
    read_fd, write_fd = os.pipe()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)  # the coordinator never waits on its follower
    os.set_blocking(wake_read, False)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # intermediate: a new session, then fork the coordinator and leave
        code = 1
        try:
            os.close(read_fd)
            os.close(wake_read)
            os.setsid()
            coordinator = os.fork()
            if coordinator == 0:
                rc = 1
                try:
                    rc = _coordinate_detached(jobdir, payload, secrets, log_path, wake_write)
                finally:
                    os._exit(rc if isinstance(rc, int) else 1)
            os.write(write_fd, b"%d\n" % coordinator)
            code = 0
        except BaseException:  # noqa: BLE001 - never return into submit's code
            code = 1
        os._exit(code)
    os.close(write_fd)
    os.close(wake_write)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as pipe:
        line = pipe.readline().strip()
    if not line.isdigit():
        os.close(wake_read)
        return None, None
    return int(line), Wake(wake_read)


def _coordinate_detached(jobdir, payload, secrets, log_path, wake_fd):
    """In the forked coordinator: hold none of the SSH session's pipes or submit's files (but the
    pipe that wakes submit), then run."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, wake_fd)
    os.closerange(wake_fd + 1, max(wake_fd + 1, min(os.sysconf("SC_OPEN_MAX"), 65536)))
    os.chdir(os.path.expanduser("~"))
    try:
        return run_coordinator(jobdir, payload, secrets, wake_fd)
    except BaseException:  # noqa: BLE001 - said in its log, as an uncaught error in its own process was
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def answer_without_job(out, hello, outcome):
    """`submit`'s whole answer when the head takes no job: its H (b"": none), the outcome, the stream's end."""
    out.write(("%s 0\n" % OFFSET_HEADER).encode())
    out.write(hello)
    out.write(ev(EV_DONE, outcome["status"], json.dumps(outcome)))
    out.write(("%s 3\n" % SENTINEL).encode())
    return 0


def cmd_submit(args):
    """The controller's one call: take the job from stdin, start the coordinator, stream its events."""
    out = Out()
    payload, secrets = read_payload(sys.stdin.buffer)
    problem = prepared_problem(payload.get("fingerprint"))
    if problem:
        return answer_without_job(out, ev(EV_HELLO, 0, HELLO_UNPREPARED, problem),
                                  {"status": "UNPREPARED", "ranks": [0], "detail": problem})
    jobdir = job_dir(payload["job"])
    nonce = payload.get("nonce")
    ours = not os.path.lexists(jobdir)  # made here, or an earlier try of this submission (below)
    try:
        problem = take_job_dir(jobdir, nonce, reset=True)
        if problem:  # nothing of the job was started; the directory there stays as it is
            return answer_without_job(out, b"", {"status": "FAILED", "ranks": [], "detail": problem})
        ours = True
        write_private(os.path.join(jobdir, "payload.json"), json.dumps(payload))
        os.close(os.open(os.path.join(jobdir, "events.log"), os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError as exc:  # a full disk: the job fails here and now (it is no unprepared node)
        if ours:
            shutil.rmtree(jobdir, ignore_errors=True)
        problem = cannot_write(exc, jobdir)
        return answer_without_job(out, ev(EV_HELLO, 0, HELLO_PROBLEM, problem), {
            "status": "FAILED", "ranks": [0], "detail": describe_by_node(payload["peers"], {0: problem})})
    phase = going()
    if phase:  # autostop's power-off began: the job would be cut off with the nodes
        shutil.rmtree(jobdir, ignore_errors=True)
        what = "take it down (autodown)" if phase == "down" else "stop it (autostop)"
        return answer_without_job(out, b"", {"status": "FAILED", "ranks": [], "detail": (
            "the cluster is going: autostop began to %s, so the job was not started; `gpuctl apply` "
            "brings the cluster back" % what)})
    ensure_watcher()  # an autostop watcher killed, or gone with a reboot, comes back with the next job
    pid, wake = fork_coordinator(jobdir, payload, secrets)
    if pid is None:  # fork failed (no memory, no pids left): nothing of the job started
        shutil.rmtree(jobdir, ignore_errors=True)
        return answer_without_job(out, b"", {"status": "FAILED", "ranks": [], "detail": (
            "the head could not start the job's coordinator (fork failed: out of memory or processes?)")})
    write_atomic(os.path.join(jobdir, "events.supervisor"), str(pid))
    return follow_stage(Stage(jobdir, STAGE_EVENTS), out, offset=0, print_offset=True, wake=wake)


def cmd_attach(args):
    """Stream a job's events from a byte offset (a controller reconnecting, `gpuctl logs`)."""
    return follow_stage(Stage(job_dir(args.job), STAGE_EVENTS), Out(), offset=args.offset, print_offset=True)


def cmd_events(args):
    """Print a job's events.log as it is now, in one read (`gpuctl logs` of a job, rebuilt on the
    controller); a line still being written is the reader's to drop. Exit 1 with one line when the
    job has no events here."""
    path = Stage(job_dir(args.job), STAGE_EVENTS).log
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the with below, once opening is known to work
    except OSError as exc:
        sys.stderr.write("%sjob %s has no events.log here: %s\n" % (MESSAGE_PREFIX, args.job, exc.strerror))
        return 1
    with fh:
        left = os.fstat(fh.fileno()).st_size  # what is there now: a job still running writes on
        out = getattr(sys.stdout, "buffer", sys.stdout)
        while left > 0:
            chunk = fh.read(min(left, 1 << 20))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
        out.flush()
    return 0


def cmd_cancel(args):
    """Ask the coordinator to stop the job everywhere; wait until it recorded the outcome."""
    jobdir = job_dir(args.job)
    if not os.path.isdir(jobdir):
        print(json.dumps({"status": "UNKNOWN"}))
        return 0
    write_atomic(os.path.join(jobdir, "cancel"), "1")
    events = Stage(jobdir, STAGE_EVENTS)
    pid = read_int(events.supervisor)
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
        deadline = time.time() + args.wait
        while events.exit_code() is None and pid_alive(pid) and time.time() < deadline:
            time.sleep(0.05)
    return cmd_job_status(args)


def cmd_job_status(args):
    jobdir = job_dir(args.job)
    outcome = read_text(os.path.join(jobdir, "job.json"))
    if outcome:
        print(outcome.strip())
        return 0
    events = Stage(jobdir, STAGE_EVENTS)
    alive = pid_alive(read_int(events.supervisor))
    waiting = gpu_waiting_reason(args.job) if alive else None
    if waiting is not None:
        print(json.dumps({"status": "PENDING", "waiting": waiting}))
        return 0
    print(json.dumps({"status": "RUNNING" if alive else ("UNKNOWN" if not os.path.isdir(jobdir) else "LOST")}))
    return 0
