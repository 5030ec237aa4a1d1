#!/usr/bin/env python3
"""gpuctl-node: the node agent gpuctl installs on every node (the job plane).

Standard library only, Python >= 3.6: nodes have nothing but their system
python3. One file, copied to ~/.gpuctl/bin/gpuctl-node by the prepare play.

A job reaches a cluster as ONE ssh call from the controller to the head:
`gpuctl-node submit` reads the job (JSON) and its secrets from stdin, starts a
detached coordinator, and streams the job's events back. The coordinator
fans the job out to the workers over the cluster's internal key as a tree of
`gpuctl-node relay` processes (at most `branching` children per node), so the
controller's cost does not grow with the number of nodes. Every rank's output
lines and exit code flow up the tree into JOBDIR/events.log on the head, which
`submit` (and later `attach`) streams to the controller. Fail-fast is decided
by the coordinator, which sees every exit first: it keeps working when the
controller detaches or goes away. Nothing of a job outlives the process that
answers for it on a node (the coordinator, or a worker's relay): each stage's
supervisor stops the stage's process group and removes the secrets when that
owner dies (see _supervise), and the owner stops a stage whose supervisor died.

Per stage STAGE (setup, run), files in JOBDIR (~/.gpuctl/jobs/<job>, <job> being
the controller's `<id>-<token>`; JOBDIR/submission names the submission that made it):
  STAGE.sh         the user's script (run under bash, in the workdir)
  STAGE.env.sh     exported variables of the stage (env.sh: older layout)
  secrets.sh       exported secrets (0600), there only while a stage of the job runs
  STAGE.log        the script's stdout and stderr, appended as written
  STAGE.pid        process-group id of the stage (bash is the group leader)
  STAGE.supervisor pid of the supervisor that waits for the stage
  STAGE.exit       exit code, written atomically when the stage ended
                   (128+N when a signal N ended it, or when `kill` stopped it)
  STAGE.killed     the last signal `kill` sent, if it was used
  STAGE.cpid       in a container: the stage's process group there
  container.json   image_id docker:IMAGE: the node's container (see "containers")
The coordinator's own files on the head: payload.json (the job, no secrets),
events.log / events.supervisor / events.exit (followed like a stage),
job.json (the outcome), coordinator.log (its own errors).

Events (one line each, up the tree and to the controller):
  H RANK ok | H RANK unprepared REASON   the node is ready / needs `prepare`
  H RANK problem TEXT                    nothing can run there (no container runtime)
  C RANK [OWNER,...]                     owners of the sync destinations
  Y RANK CODE MESSAGE                    a sync push to RANK ended
  B RANK CODE MESSAGE                    RANK's cloud buckets are copied/mounted (0) or not
  S RANK STAGE                           the stage started on RANK
  O RANK STAGE BYTES                     the end of an output line (all of it, or its last piece)
  o RANK STAGE BYTES                     a piece of an output line that goes on in the next o/O
  X RANK STAGE CODE|?                    the stage ended on RANK
  L RANK REASON                          RANK was lost (ssh to it ended)
  P PHASE                                the coordinator's phase
  D STATUS JSON                          the job ended (last event)
A rank's output is cut into pieces of at most OUT_PIECE bytes, each sent as it
is read, so no hop holds or cuts a longer event; BYTES are the rank's own bytes
(anything but a newline, which ends the event), never read as an event. A last
line without a newline is an `o` before the stage's X. Every other event is
one line of text the agent wrote (ev).
Commands down the tree (one line each, on a relay's stdin):
  claim TOKEN | sync JSON | buckets TOKEN KINDS | release | start STAGE | kill GRACE STAGE... | cleanup | end

Other commands: launch/follow/kill/status of one stage on this node (used by
`gpuctl logs` and as a fallback), claim (shared-filesystem detection), cancel,
attach and job-status of a coordinated job, container-stage (a stage in the
node's container, started by the stage's supervisor).
"""

import argparse
import binascii
import errno
import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SENTINEL = "__GPUCTL_EXIT__"
OFFSET_HEADER = "__GPUCTL_OFFSET__"
POLL_S = 0.15
CHUNK = 65536
OUT_PIECE = 65536  # bytes of a rank's output per O/o event (the controller's events.PIECE)

PROTOCOL = 1
GPUCTL_DIR = os.path.expanduser("~/.gpuctl")
PREPARED_FILE = os.path.join(GPUCTL_DIR, "prepared")  # the prepare play's fingerprint
FABRIC_ENV = os.path.join(GPUCTL_DIR, "fabric.env")  # the prepare play's NCCL/fabric defaults
JOBS_DIR = os.path.join(GPUCTL_DIR, "jobs")
CLAIM_PREFIX = ".gpuctl-claim-"
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Sources fabric.env, the stage's env file, then secrets.sh with every
# assignment exported, then replaces itself with `bash STAGE.sh`. The paths
# travel as $1..$4, never in the shell text.
WRAPPER = (
    'set -a; for f in "$1" "$2" "$3"; do if [ -f "$f" ]; then . "$f"; fi; done; set +a; '
    'script="$4"; shift 4; exec bash "$script" "$@"'
)


class Stage(object):
    def __init__(self, jobdir, stage):
        if not stage or "/" in stage or stage.startswith("."):
            raise SystemExit("gpuctl-node: invalid stage name %r" % stage)
        self.jobdir = os.path.abspath(os.path.expanduser(jobdir))
        self.name = stage
        base = os.path.join(self.jobdir, stage)
        self.script = base + ".sh"
        self.log = base + ".log"
        self.pid = base + ".pid"
        self.supervisor = base + ".supervisor"
        self.exit = base + ".exit"
        self.killed = base + ".killed"
        self.cpid = base + ".cpid"  # in a container: the stage's process group there
        self.tag = base + ".tag"  # the value of STAGE_TAG in the environment of the stage's processes
        self.clean = base + ".clean"  # its supervisor left with nothing of the stage below it
        self.env = base + ".env.sh"
        if not os.path.exists(self.env):
            self.env = os.path.join(self.jobdir, "env.sh")  # written by the Ansible env role
        self.secrets = os.path.join(self.jobdir, "secrets.sh")

    def pgid(self):
        return read_int(self.pid)

    def exit_code(self):
        return read_int(self.exit)

    def supervisor_alive(self):
        return pid_alive(read_int(self.supervisor))

    def running(self):
        return self.pgid() is not None and self.exit_code() is None and self.supervisor_alive()


def read_int(path):
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def write_atomic(path, text):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _proc_state(pid):
    """(state letter, pgrp) from /proc, or None when the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def pid_alive(pid):
    if not pid or pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        st = _proc_state(pid)
        return st is not None and st[0] != "Z"  # a zombie has ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid):
    """Whether any live (non-zombie) process is in process group `pgid`."""
    if not pgid or pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)  # no such group: nothing to look for (every job's end asks, on every node)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_state(int(entry))
            if st is not None and st[1] == pgid and st[0] != "Z":
                return True
    return False


def killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Make this process the one a descendant is re-parented to when its parent dies (Linux), so
    what a stage starts in a session of its own (torchrun's workers) stays findable under it."""
    try:
        import ctypes  # only here: a node without it still runs stages, as before

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def process_table():
    """{pid: (state letter, parent pid, process group)} of every process, from /proc."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as fh:
                data = fh.read()
        except OSError:
            continue
        fields = data[data.rfind(")") + 2:].split()
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def stage_processes(pgid, root=None):
    """The live processes of a stage: its process group, everything below a member of it (a
    session of its own does not leave the tree), and everything below `root` (its supervisor,
    a subreaper: where what lost its parent went)."""
    table = process_table()
    children = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = set(pid for pid, (_, _, group) in table.items() if pgid and group == pgid)
    todo = list(found) + ([root] if root else [])
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(pid for pid in found if table[pid][0] != "Z")


STAGE_TAG = "GPUCTL_NODE_STAGE"  # in the environment of every process of a stage: a random value (STAGE.tag)


def stage_tag(st):
    """The stage's tag on this node, or None. Random per stage and node, not derived from the job:
    nodes that share one process table (local nodes) or one home path must not see each other's."""
    text = (read_text(st.tag) or "").strip()
    return text if re.match(r"^[0-9a-f]{32}$", text) else None


def tagged_processes(tag):
    """This user's live processes whose environment carries STAGE_TAG=`tag`: a stage's processes
    that left its group and its supervisor's tree both (a daemon that double-forked to init, or
    a session leader whose supervisor died), found wherever they went."""
    if not tag:
        return []
    want = ("\0%s=%s\0" % (STAGE_TAG, tag)).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as fh:
                environ = fh.read()
        except OSError:  # gone, or another user's
            continue
        if want in b"\0" + environ + b"\0":
            found.append(int(name))
    return found


def descendants(pid):
    """The live (non-zombie) processes below `pid` in the process tree."""
    return stage_processes(None, pid)


def kill_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stage_supervisor(st):
    """The stage's supervisor while it lives (its command line is this agent's), else None."""
    pid = read_int(st.supervisor)
    if pid is None or not pid_alive(pid):
        return None
    if pid == os.getpid():
        return pid
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            ours = os.path.basename(os.path.abspath(__file__)).encode() in fh.read()
    except OSError:
        return None
    return pid if ours else None


def status_of(st):
    return {
        "pid": st.pgid(),
        "running": st.running(),
        "exit": st.exit_code(),
        "killed": os.path.exists(st.killed),
    }


# --------------------------------------------------------------------- launch


def _supervise(st, cwd, notify_fd, lifeline=None, grace=3.0):
    """Runs in the detached grandchild: start the stage, wait, record its exit.

    With `lifeline` (a job-plane stage: the read end of a pipe whose only
    writer is the relay or coordinator that owns the job on this node), the
    owner's death -- SIGKILL included -- closes the pipe, and the supervisor
    then stops the stage's whole process group and removes the job's secrets:
    nothing of a job outlives the process that answers for it.
    """
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    in_container = os.path.exists(os.path.join(st.jobdir, CONTAINER_FILE))  # image_id: docker:IMAGE
    if not in_container:  # (a container runtime's monitors would be re-parented here too)
        become_subreaper()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # hold none of the SSH session's pipes
    log_fd = os.open(st.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    keep = sorted({notify_fd, log_fd, devnull} | ({lifeline} if lifeline is not None else set()))
    low = 3
    for fd in keep:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, min(os.sysconf("SC_OPEN_MAX"), 65536))

    def notify(text):
        try:
            os.write(notify_fd, text.encode())
        except OSError:
            pass  # the launcher is gone (e.g. Ansible's async timeout); carry on

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # live logs from Python ranks
    env[STAGE_TAG] = binascii.hexlify(os.urandom(16)).decode()  # stop_group finds them wherever they went
    write_atomic(st.tag, env[STAGE_TAG])
    if in_container:
        argv = [sys.executable, os.path.abspath(__file__), "container-stage", st.jobdir, st.name]
    else:
        argv = ["bash", "-c", WRAPPER, "gpuctl-" + st.name, FABRIC_ENV, st.env, st.secrets, st.script]
    wake = _child_wakeup() if lifeline is not None else None  # before the child: its exit cannot be missed
    try:
        child = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=devnull, stdout=log_fd, stderr=log_fd,
            start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        os.write(log_fd, ("gpuctl-node: cannot start bash: %s\n" % exc).encode())
        write_atomic(st.supervisor, str(os.getpid()))
        write_atomic(st.exit, "127")
        notify("started 0\nexit 127\n")
        return
    write_atomic(st.supervisor, str(os.getpid()))
    write_atomic(st.pid, str(child.pid))
    notify("started %d\n" % child.pid)
    rc = child.wait() if lifeline is None else _wait_or_owner_gone(st, child, lifeline, wake, grace)
    code = rc if rc >= 0 else 128 - rc
    killed = read_int(st.killed)
    if killed:
        code = 128 + killed
    if lifeline is not None:  # job plane: the secrets live only while one of the job's stages runs here
        remove(st.secrets)
    watch = lifeline is not None and not in_container
    left = watch and _has_children()
    if watch and not left:  # before the exit is seen: the job's end then kills without looking for leftovers
        write_atomic(st.clean, "1")
    write_atomic(st.exit, str(code))
    notify("exit %d\n" % code)
    if left:
        _outlive_leftovers(lifeline, wake, grace)
        write_atomic(st.clean, "1")  # nothing of the stage is left: a later kill need not look for it


def _outlive_leftovers(lifeline, wake, grace):
    """After the stage's exit: what it left running in a session of its own (re-parented here,
    a subreaper) may serve the job's next stage, but not outlive the job: wait for the owner's
    end, then stop it. Returns at once when nothing was left."""
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    poller.register(wake, select.POLLIN)  # a process re-parented here ended
    while True:
        if not _has_children():  # one waitpid, no /proc scan: the common case of a stage that left nothing
            return
        if any(fd == lifeline for fd, _ in poller.poll()):
            break
        _drain(wake)
    kill_all(descendants(os.getpid()), signal.SIGTERM)
    deadline = time.time() + grace
    while descendants(os.getpid()) and time.time() < deadline:
        time.sleep(0.1)
    kill_all(descendants(os.getpid()), signal.SIGKILL)


def _has_children():
    """Whether a live process is still below this one, collecting the ended ones. A subreaper's
    leftovers are all below its children (orphans are re-parented to it), so waitpid tells."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
        return True
    except ChildProcessError:
        return False


def _drain(fd):
    try:
        os.read(fd, 512)
    except OSError:
        pass


def _child_wakeup():
    """A pipe that becomes readable when a child exits (SIGCHLD through the signal wakeup fd)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    return read_fd


def _wait_or_owner_gone(st, child, lifeline, wake, grace):
    """The stage's wait status; if the job's owner on this node dies first, stop the stage's group.

    The owner never writes to the lifeline: it reads as EOF (or hang-up) only
    once every copy of the write end is closed, i.e. when the owner process has
    ended, however it ended. A parent-death signal would not do: this process is
    detached from the owner (its parent is the intermediate that left at once),
    and such a signal would reach only the stage's first process, never its
    grandchildren -- those in its process group, nor those in sessions of their
    own (torchrun's workers), which stop_group finds below this subreaper.
    """
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    poller.register(wake, select.POLLIN)
    while True:
        rc = child.poll()
        if rc is not None:
            return rc
        for fd, _ in poller.poll():
            if fd == wake:
                _drain(wake)
            elif fd == lifeline:
                poller.unregister(lifeline)
                stop_group(st, st.pgid(), grace)  # the leader stays a zombie until child.poll() reaps it


def start_stage(st, workdir, wait=False, lifeline=None, grace=3.0):
    """Start STAGE.sh detached in its own session; (exit status for the caller, error text).

    Without `wait` the status is 0 once the stage's process group exists;
    with it, the stage's exit code. `lifeline`: see _supervise.
    """
    if not os.path.isfile(st.script):
        return 2, "%s does not exist" % st.script
    if st.running():
        return 3, "stage %s is already running (pgid %s)" % (st.name, st.pgid())
    for path in (st.exit, st.killed, st.pid, st.supervisor):
        remove(path)
    os.close(os.open(st.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    workdir = os.path.expanduser(workdir)
    cwd = workdir if os.path.isdir(workdir) else os.path.expanduser("~")

    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # intermediate: new session, then fork the supervisor and leave
        code = 0
        try:
            os.close(read_fd)
            os.setsid()
            if os.fork() == 0:
                try:
                    _supervise(st, cwd, write_fd, lifeline, grace)
                finally:
                    os._exit(0)
        except BaseException:  # noqa: BLE001 - never return into the launcher's code
            code = 1
        os._exit(code)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as pipe:
        first = pipe.readline()
        if not first.startswith(b"started"):
            return 1, "the supervisor of %s did not start" % st.name
        if not wait:
            return 0, ""
        last = pipe.readline()  # "exit N", or EOF if the supervisor died
    if last.startswith(b"exit "):
        return int(last.split()[1]) & 0xFF, ""
    code = st.exit_code()
    return (255 if code is None else code & 0xFF), ""


def cmd_launch(args):
    code, err = start_stage(Stage(args.jobdir, args.stage), args.workdir, wait=args.wait)
    if err:
        sys.stderr.write("gpuctl-node: %s\n" % err)
    return code


# --------------------------------------------------------------------- follow


class Out(object):
    """Writes to stdout (fd 1); notices when the reader went away."""

    def __init__(self):
        self.fd = 1
        self.poller = select.poll()
        self.poller.register(self.fd, 0)  # only error / hang-up conditions

    def write(self, data):
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def idle(self, seconds):
        """Sleep, returning False early if the reader closed the pipe."""
        for _fd, ev in self.poller.poll(int(seconds * 1000)):
            if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return False
        return True


def _tail_offset(fh, size, lines):
    """Byte offset where the last `lines` lines of the file start."""
    if lines <= 0:
        return size
    seen = 0
    end = size
    # A final line without a newline counts as a line too.
    if size:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            end = size - 1
    pos = end
    while pos > 0:
        step = min(CHUNK, pos)
        pos -= step
        fh.seek(pos)
        block = fh.read(step)
        idx = len(block)
        while True:
            idx = block.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == lines:
                return pos + idx + 1
    return 0


def cmd_follow(args):
    return follow_stage(Stage(args.jobdir, args.stage), Out(), offset=args.offset, tail=args.tail,
                        print_offset=args.print_offset)


def follow_stage(st, out, offset=None, tail=None, print_offset=False):
    """Print the stage's log from `offset` (or the last `tail` lines) until it ended, then the sentinel."""
    try:
        while not os.path.exists(st.log):
            if not out.idle(POLL_S):
                return 0
        with open(st.log, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if offset is not None:
                start = min(max(offset, 0), size)
            elif tail is not None:
                start = _tail_offset(fh, size, tail)
            else:
                start = 0
            fh.seek(start)
            if print_offset:
                out.write(("%s %d\n" % (OFFSET_HEADER, start)).encode())
            at_line_start = True
            lost_since = None
            while True:
                chunk = fh.read(CHUNK)
                if chunk:
                    out.write(chunk)
                    at_line_start = chunk.endswith(b"\n")
                    continue
                code = st.exit_code()
                if code is not None:
                    rest = fh.read()  # the stage wrote everything before its exit was recorded
                    if rest:
                        out.write(rest)
                        at_line_start = rest.endswith(b"\n")
                        continue
                    out.write(("%s%s %d\n" % ("" if at_line_start else "\n", SENTINEL, code)).encode())
                    return 0
                if not st.supervisor_alive():
                    # No supervisor and no exit: it died without recording one
                    # (OOM killer, reboot...). Allow a launch a moment to start it.
                    lost_since = lost_since or time.time()
                    if time.time() - lost_since > 3.0 and st.exit_code() is None:
                        out.write(("%s%s unknown\n" % ("" if at_line_start else "\n", SENTINEL)).encode())
                        return 0
                else:
                    lost_since = None
                if not out.idle(POLL_S):
                    return 0
    except (BrokenPipeError, ConnectionResetError):
        return 0


# ----------------------------------------------------------------- kill/status


def cmd_kill(args):
    st = Stage(args.jobdir, args.stage)
    stopped = kill_stage(st, args.grace)
    remove(st.secrets)  # whoever kills a stage ends the job here: its secrets go with it
    print(json.dumps(dict(status_of(st), stopped=stopped)))
    return 0


def kill_stage(st, grace):
    """SIGTERM the stage's process group, SIGKILL after `grace` s; record the exit.

    True when something of the stage was still running (it was stopped)."""
    pgid = st.pgid()
    if pgid is None:
        return False
    box = stage_container(st)
    escaped = not box and not os.path.exists(st.clean)  # its supervisor did not see the end of it all
    if st.exit_code() is None or group_alive(pgid) or (escaped and tagged_processes(stage_tag(st))):
        sig = stop_group(st, pgid, grace)
        deadline = time.time() + 5  # the supervisor records the exit
        while st.exit_code() is None and st.supervisor_alive() and time.time() < deadline:
            time.sleep(0.05)
        if st.exit_code() is None:
            write_atomic(st.exit, str(128 + int(sig)))
        return True
    return False


def stop_group(st, pgid, grace):
    """SIGTERM the stage's process group (in its container, where it runs in one), SIGKILL
    whatever is left after `grace` s; the last signal sent (recorded in STAGE.killed).

    What the stage started in a session of its own (torchrun's workers) is not in
    its group, but stays under its supervisor (a subreaper), and every process of
    the stage carries its tag in its environment (STAGE_TAG, for what escaped both):
    they are signalled too. Not in a container: there the runtime's own monitors
    live under the supervisor."""
    box = stage_container(st)  # in a container the signals go to the stage's group there
    supervisor = None if box else stage_supervisor(st)

    def others():
        if box:
            return []
        return sorted(p for p in set(stage_processes(pgid, supervisor)) | set(tagged_processes(stage_tag(st)))
                      if p != pgid and p != supervisor)

    def alive():
        return group_alive(pgid) or bool(others())

    def send(sig, inside):
        tree = others()  # before its parents die: what they leave goes to init
        if not (inside and box and signal_in_container(box, st, sig)):
            killpg(pgid, sig)
        kill_all(tree, sig)

    sig = signal.SIGTERM
    if st.exit_code() is None:
        write_atomic(st.killed, str(int(sig)))
    send(sig, True)
    deadline = time.time() + max(grace, 0)
    while alive() and time.time() < deadline:
        time.sleep(0.1)
    if alive():
        sig = signal.SIGKILL
        if st.exit_code() is None:
            write_atomic(st.killed, str(int(sig)))
        send(sig, False)
        deadline = time.time() + 5
        while alive() and time.time() < deadline:
            time.sleep(0.1)
    if box:  # whatever of the stage's group is left in the container (`exec` ended with its first process)
        signal_in_container(box, st, signal.SIGKILL)
    return sig


def cmd_status(args):
    print(json.dumps(status_of(Stage(args.jobdir, args.stage))))
    return 0


# ----------------------------------------------------------------- job plane


def shell_quote(value):
    """POSIX single quotes (shlex.quote, which Python 3.6's agent may lack as shlex.quote)."""
    value = str(value)
    if value and re.match(r"^[A-Za-z0-9_@%+=:,./-]+$", value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"


def write_private(path, text, mode=0o600):
    """Write a file only its owner can read, replacing it atomically."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_text(path, default=None):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return default


def job_dir(job_id):
    if not JOB_ID_RE.fullmatch(job_id or ""):
        raise SystemExit("gpuctl-node: invalid job id %r" % job_id)
    return os.path.join(JOBS_DIR, job_id)


SUBMISSION_FILE = "submission"  # in JOBDIR: the payload's nonce, i.e. which submission made the directory


def take_job_dir(jobdir, nonce, reset=False):
    """Make the job's directory on this node; None, or why it cannot be this job's.

    A directory that is already there is taken only when this very submission
    made it (an earlier try of it, or a node sharing the filesystem): the job's
    name (`<id>-<token>`) is the controller's own, but nothing here deletes or
    writes into a directory another submission made. `reset`: the head starts
    the job's event stream again (an earlier try's coordinator must be gone).
    """
    os.makedirs(JOBS_DIR, 0o700, exist_ok=True)
    try:
        os.mkdir(jobdir, 0o700)
    except FileExistsError:
        made_by = (read_text(os.path.join(jobdir, SUBMISSION_FILE)) or "").strip()
        if not nonce or made_by != nonce:
            return ("%s exists and another submission made it (job ids of another gpuctl state on the same "
                    "nodes?); it was left as it is" % jobdir)
        if reset:
            if pid_alive(read_int(os.path.join(jobdir, "events.supervisor"))):
                return "%s: this job is already running here" % jobdir
            shutil.rmtree(jobdir)  # an earlier try of this submission: ours
            os.mkdir(jobdir, 0o700)
        else:
            return None
    if nonce:
        write_private(os.path.join(jobdir, SUBMISSION_FILE), nonce)
    return None


def prepared_problem(expected):
    """Why this node is not in the state gpuctl expects, or None when it is."""
    found = (read_text(PREPARED_FILE) or "").strip()
    if not found:
        return "never prepared"
    if found != expected:
        return "prepared state %s differs from the expected %s" % (found[:12], (expected or "")[:12])
    return None


# ----------------------------------------------------------------- containers
# `image_id: docker:IMAGE` (payload["container"]): setup and run go inside one
# long-lived container per node, as SkyPilot keeps one per cluster, so what
# setup installs is there for run and for later jobs. It is created on first
# use, reused while it has the image and every mount a job needs (the same
# file or directory: device and inode), and re-created when they change:
#   name     gpuctl-<cluster>-<node name> (local nodes share one image store)
#   options  --network=host --ipc=host; all GPUs where the node has NVIDIA
#            devices (docker --gpus=all, podman --device=nvidia.com/gpu=all);
#            the workdir, the file_mounts and bucket destinations and
#            ~/.gpuctl/jobs bound at the node's own paths
#   inside   HOME is the node user's home, so ~/... means what it means on the
#            node; the stage's env, secrets and hostfile are read from the job
#            directory there, never passed on a command line
# The node's check (H) finds a runtime that answers (docker, then podman, or
# GPUCTL_CONTAINER_RUNTIME) and writes JOBDIR/container.json; the stage's
# supervisor starts `gpuctl-node container-stage` in place of bash, which
# creates or reuses the container and becomes `RUNTIME exec ... bash -c
# CONTAINER_WRAPPER`. That wrapper starts the stage in a process group of its
# own and writes its id (in the container's PID namespace) to STAGE.cpid:
# `kill` signals that group through the runtime, as `docker exec` passes no
# signal on. A container is never re-created under another job's running stage:
# each stage holds a shared flock on ~/.gpuctl/containers/NAME.use, and a
# re-creation that cannot take it exclusively is refused (exit code 125).
RUNTIMES = ("docker", "podman")
RUNTIME_ENV = "GPUCTL_CONTAINER_RUNTIME"
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")
CONTAINERS_DIR = os.path.join(GPUCTL_DIR, "containers")
CONTAINER_LABEL = "gpuctl.spec"
CONTAINER_FILE = "container.json"
# PID 1 of the container: sleeps until stopped, and ends at once when it is.
KEEPALIVE = 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done'
# $1 the STAGE.cpid file, $2 STAGE.killed, then WRAPPER's arguments. `set -m` puts
# the stage in its own process group; a kill that came before the group's id was
# written is seen through the killed file.
CONTAINER_WRAPPER = (
    'cpid="$1" killed="$2"; shift 2; set -m; bash -c %s "$0" "$@" & pid=$!; set +m; '
    'echo "$pid" >"$cpid"; if [ -e "$killed" ]; then kill -TERM -- "-$pid"; fi; wait "$pid"' % shell_quote(WRAPPER))


def find_runtime(wanted=None):
    """(path of a container runtime that answers, None), or (None, what is wrong and what to install)."""
    notes = []
    for name in [wanted] if wanted else RUNTIMES:
        if os.path.isabs(name):
            path = name if os.path.isfile(name) and os.access(name, os.X_OK) else None
        else:
            path = shutil.which(name)
        if not path:
            notes.append("%s is not installed%s" % (name, "" if os.path.isabs(name) else " (not on PATH)"))
            continue
        try:
            proc = subprocess.run([path, "version"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            notes.append("`%s version` did not answer: %s" % (name, exc))
            continue
        if proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            why = err[-1] if err else "exit code %d" % proc.returncode
            notes.append("`%s version` failed: %s" % (name, why[:200]))
            continue
        return path, None
    if wanted:
        return None, "%s=%s: %s; install it on the node or unset %s" % (RUNTIME_ENV, wanted, "; ".join(notes),
                                                                        RUNTIME_ENV)
    return None, ("no container runtime to run the job's image in: %s; install Docker (and the NVIDIA Container "
                  "Toolkit where the node has GPUs) or Podman on the node" % "; ".join(notes))


def has_nvidia_gpus():
    try:
        return any(re.match(r"nvidia[0-9]+$", name) for name in os.listdir("/dev"))
    except OSError:
        return False


def container_config(box, node_name, workdir):
    """(this node's container for the job, None) or (None, problem): what JOBDIR/container.json holds."""
    image = box.get("image") or ""
    if not IMAGE_RE.fullmatch(image):
        return None, "%r is not a container image name" % image
    paths = []
    for dest in [workdir] + list(box.get("mounts") or []) + [JOBS_DIR]:
        path = os.path.normpath(dest_paths(dest)[0])
        if not os.path.isabs(path) or path == "/" or ":" in path or "," in path:
            return None, ("%s cannot be bound into a container (an absolute path other than /, without ':' or ',')"
                          % dest)
        paths.append(path)
    mounts = []  # one bind per tree: a destination inside another is there already
    for path in sorted(set(paths), key=len):
        if not any(path.startswith(m.rstrip("/") + "/") for m in mounts):
            mounts.append(path)
    runtime, problem = find_runtime(box.get("runtime"))
    if problem:
        return None, problem
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", "%s-%s" % (box.get("name") or "gpuctl", node_name))
    return {"runtime": runtime, "flavor": "podman" if "podman" in os.path.basename(runtime) else "docker",
            "name": name if name[:1].isalnum() else "gpuctl-" + name, "image": image, "mounts": sorted(mounts),
            "gpus": has_nvidia_gpus(), "fabric": os.path.isdir("/dev/infiniband"), "home": os.path.expanduser("~"),
            "workdir": os.path.normpath(dest_paths(workdir)[0])}, None


def stage_container(st):
    """The job's container.json on this node, or None when the job runs on the node itself."""
    try:
        with open(os.path.join(st.jobdir, CONTAINER_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def wanted_container(cfg):
    """What the job needs of the container: the image, GPUs, and each existing mount's device:inode."""
    mounts = {}
    for path in cfg["mounts"]:
        if not os.path.exists(path):
            if path != cfg["workdir"] and path != JOBS_DIR:
                continue  # a file_mount not copied here (yet): bound once it is there
            os.makedirs(path, exist_ok=True)
        st = os.stat(path)
        mounts[path] = "%d:%d" % (st.st_dev, st.st_ino)
    return {"image": cfg["image"], "gpus": bool(cfg["gpus"]), "mounts": mounts}


def container_fits(have, want):
    """Whether a container made for `have` serves a job that needs `want` (it may bind more)."""
    bound = have.get("mounts") or {}
    return (have.get("image") == want["image"] and have.get("gpus") == want["gpus"]
            and all(bound.get(path) == ident for path, ident in want["mounts"].items()))


def container_run_argv(cfg, want):
    argv = [cfg["runtime"], "run", "--detach", "--name=" + cfg["name"],
            "--label=%s=%s" % (CONTAINER_LABEL, json.dumps(want, sort_keys=True, separators=(",", ":"))),
            "--network=host", "--ipc=host"]
    if want["gpus"]:
        argv.append("--device=nvidia.com/gpu=all" if cfg["flavor"] == "podman" else "--gpus=all")
    if cfg.get("fabric"):  # EFA / InfiniBand: the verbs devices, and the pinned memory RDMA needs
        argv += ["--device=/dev/infiniband", "--ulimit=memlock=-1:-1"]
    argv += ["--volume=%s:%s" % (path, path) for path in sorted(want["mounts"])]
    # Nothing user-given before `--`: the image cannot be read as an option.
    return argv + ["--entrypoint=bash", "--", cfg["image"], "-c", KEEPALIVE]


def container_exec_argv(cfg, st):
    fabric = os.path.join(st.jobdir, "fabric.env")
    return [cfg["runtime"], "exec", "--env=PYTHONUNBUFFERED=1", "--env=HOME=" + cfg["home"],
            "--workdir=" + cfg["workdir"], cfg["name"], "bash", "-c", CONTAINER_WRAPPER, "gpuctl-" + st.name,
            st.cpid, st.killed, fabric, st.env, st.secrets, st.script]


def container_state(cfg):
    """(running, the spec in its label) of the node's container, or None when there is none."""
    try:
        proc = subprocess.run([cfg["runtime"], "inspect", "--type", "container", "--format",
                               '{{.State.Running}}|{{index .Config.Labels "%s"}}' % CONTAINER_LABEL, cfg["name"]],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    running, _, label = proc.stdout.decode("utf-8", "replace").strip().partition("|")
    try:
        have = json.loads(label)
    except ValueError:
        have = {}
    return running == "true", have if isinstance(have, dict) else {}


def say(text):
    sys.stdout.write("gpuctl-node: %s\n" % text)
    sys.stdout.flush()


def ensure_container(cfg):
    """Reuse, start or (re-)create the node's container; (0, fd holding it in use) or (exit code, None)."""
    os.makedirs(CONTAINERS_DIR, 0o700, exist_ok=True)
    base = os.path.join(CONTAINERS_DIR, cfg["name"])
    lock = os.open(base + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    use = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one job at a time decides
        want = wanted_container(cfg)
        state = container_state(cfg)
        if state is not None and container_fits(state[1], want):
            if state[0] or subprocess.call([cfg["runtime"], "start", cfg["name"]], **quiet) == 0:
                fcntl.flock(use, fcntl.LOCK_SH)
                return 0, use
        if state is not None:
            try:
                fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                say("container %s runs another job's stage with another image or other mounts; it can be "
                    "re-created once that job ends" % cfg["name"])
                os.close(use)
                return 125, None
            subprocess.call([cfg["runtime"], "rm", "--force", cfg["name"]], **quiet)
        say("starting container %s from %s" % (cfg["name"], cfg["image"]))
        code = subprocess.call(container_run_argv(cfg, want), **quiet)
        if code != 0:
            say("%s could not start container %s (exit code %d)" % (os.path.basename(cfg["runtime"]), cfg["name"],
                                                                  code))
            os.close(use)
            return 125, None
        fcntl.flock(use, fcntl.LOCK_SH)
        return 0, use
    finally:
        os.close(lock)


def cmd_container_stage(args):
    """A stage in the node's container (its supervisor starts this in place of bash)."""
    st = Stage(args.jobdir, args.stage)
    cfg = stage_container(st)
    if cfg is None:
        say("%s has no readable %s" % (st.jobdir, CONTAINER_FILE))
        return 125
    code, use = ensure_container(cfg)
    if code:
        return code
    if os.path.exists(st.killed):
        return 128 + (read_int(st.killed) or 15)
    os.set_inheritable(use, True)  # held (shared) while the stage runs: no re-creation under it
    sys.stderr.flush()
    try:
        os.execv(cfg["runtime"], container_exec_argv(cfg, st))
    except OSError as exc:
        say("cannot run %s: %s" % (cfg["runtime"], exc))
        return 126


def signal_in_container(cfg, st, sig):
    """Signal the stage's process group inside its container; False when that is not known (yet) or gone."""
    cpid = read_int(st.cpid)
    if not cpid or cpid <= 1:
        return False
    try:
        code = subprocess.call([cfg["runtime"], "exec", cfg["name"], "bash", "-c", 'kill -"$1" -- "-$2" 2>/dev/null',
                                "gpuctl-kill", str(int(sig)), str(cpid)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return code == 0


def stage_env_text(stage, spec, rank, jobdir):
    """The exported variables of one stage on one node (values single-quoted)."""
    lines = ["# Written by gpuctl-node: the %s environment of this job. Values are single-quoted." % stage]
    for name in sorted(spec.get("env") or {}):
        if NAME_RE.fullmatch(name):
            lines.append("export %s=%s" % (name, shell_quote(spec["env"][name])))
    for name in spec.get("rank_vars") or []:
        if NAME_RE.fullmatch(name):
            lines.append("export %s=%s" % (name, rank))
    if spec.get("hostfile") is not None:
        lines.append("export GPUCTL_HOSTFILE=%s" % shell_quote(os.path.join(jobdir, "hostfile")))
    return "\n".join(lines) + "\n"


def dest_paths(dest):
    """(local absolute path, path as rsync's remote side takes it: relative to home for ~/...)."""
    path = dest.rstrip("/") or "/"
    if path == "~":
        return os.path.expanduser("~"), "."
    if path.startswith("~/"):
        return os.path.expanduser(path), path[2:]
    return path, path


def claim_destinations(token, dests, rank):
    """Create every destination, then claim it for this node unless a node sharing its
    filesystem already did; the owner's rank per destination.

    The claim is a marker created with O_EXCL in the destination directory (in
    the parent for a file), which NFS and local filesystems create atomically:
    of the nodes sharing a filesystem exactly one creates it, and the others
    read its rank. Only owners receive a copy, so nodes that share a filesystem
    get the bytes once and never race one another into one directory.
    """
    owners = []
    for dest in dests:
        path, _ = dest_paths(dest["path"])
        where = path if dest.get("dir") else (os.path.dirname(path) or "/")
        marker = os.path.join(where, CLAIM_PREFIX + token + ("" if dest.get("dir") else "-" + os.path.basename(path)))
        os.makedirs(where, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
            owner = None
            deadline = time.time() + 5
            while owner is None and time.time() < deadline:  # the winner writes right after creating
                owner = read_int(marker)
                if owner is None:
                    time.sleep(0.02)
            owners.append(owner if owner is not None else -1)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(str(rank))
        owners.append(rank)
    return owners


def release_claims(token, dests, owners, rank):
    for dest, owner in zip(dests, owners):
        if owner != rank:
            continue
        path, _ = dest_paths(dest["path"])
        where = path if dest.get("dir") else (os.path.dirname(path) or "/")
        remove(os.path.join(where, CLAIM_PREFIX + token + ("" if dest.get("dir") else "-" + os.path.basename(path))))


def cmd_claim(args):
    dests = [{"path": d, "dir": True} for d in args.dir] + [{"path": f, "dir": False} for f in args.file]
    owners = claim_destinations(args.token, dests, args.rank)
    if args.release:
        release_claims(args.token, dests, owners, args.rank)
    print(json.dumps(owners))
    return 0


def ev(*fields):
    """An event of the agent's own (not a rank's output: out_events): one line, whatever its text holds."""
    return (" ".join(str(f) for f in fields).replace("\n", " ") + "\n").encode("utf-8", "replace")


def out_events(head, line, ended):
    """A rank's `line` (bytes, no newline) as O/o events of at most OUT_PIECE bytes: `head` is
    b"RANK STAGE "; the last is O if the line `ended` with its newline, else o (more follows)."""
    frames = []
    while len(line) > OUT_PIECE:
        frames.append(b"o " + head + line[:OUT_PIECE] + b"\n")
        line = line[OUT_PIECE:]
    frames.append((b"O " if ended else b"o ") + head + line + b"\n")
    return b"".join(frames)


def partition(ranks, branching):
    """Split `ranks` into at most `branching` contiguous groups of near-equal size."""
    groups = []
    n = len(ranks)
    k = min(max(branching, 1), n)
    start = 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        groups.append(ranks[start:start + size])
        start += size
    return [g for g in groups if g]


class LineReader(object):
    """Non-blocking line reader over one fd."""

    def __init__(self, fd):
        self.fd = fd
        self.buf = b""
        self.eof = False
        os.set_blocking(fd, False)

    def read_lines(self):
        try:
            data = os.read(self.fd, CHUNK)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            self.eof = True
            rest, self.buf = self.buf, b""
            return [rest] if rest else []
        self.buf += data
        parts = self.buf.split(b"\n")
        self.buf = parts.pop()
        return parts


class Child(object):
    """A child relay: `ssh child gpuctl-node relay`, carrying a subtree of ranks."""

    def __init__(self, relay, subtree):
        self.relay = relay
        self.rank = subtree[0]
        self.subtree = subtree
        self.open_ranks = set(subtree)  # ranks whose end this child still owes
        self.hello = False  # the child answered (H)
        self.err = b""
        peer = relay.peers[self.rank]
        argv = ["ssh"] + list(peer["ssh"]) + ["--", peer["host"], "~/.gpuctl/bin/gpuctl-node relay"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     close_fds=True)
        self.out = LineReader(self.proc.stdout.fileno())
        self.errs = LineReader(self.proc.stderr.fileno())
        payload = dict(relay.payload, subtree=subtree)
        self.send(json.dumps(payload, separators=(",", ":")).encode() + b"\n"
                  + json.dumps(relay.secrets).encode() + b"\n")

    def send(self, data):
        if self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close_stdin(self):
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.stdin = None

    def reason(self):
        text = self.err.decode("utf-8", "replace").strip().splitlines()
        return (text[-1] if text else "ssh exited with code %s" % self.proc.poll())[:300]


class LocalStage(object):
    """A stage started on this node: its log is read as it grows into O/o events (out_events)."""

    def __init__(self, st):
        self.st = st
        self.fh = open(st.log, "rb")
        self.buf = b""  # the start of a line whose newline has not come yet (< OUT_PIECE bytes)
        self.lost_since = None
        self.done = False

    def poll(self, emit, rank):
        head = ("%d %s " % (rank, self.st.name)).encode()
        chunk = self.fh.read(CHUNK)
        while chunk:
            self._lines(chunk, emit, head)
            chunk = self.fh.read(CHUNK)
        code = self.st.exit_code()
        if code is None and not self.st.supervisor_alive():
            self.lost_since = self.lost_since or time.time()
            if time.time() - self.lost_since < 3.0:
                return
            code = "?"
            # Its supervisor died without recording an exit: nobody else would stop what is left.
            pgid = self.st.pgid()
            if pgid is not None:
                tree = [] if stage_container(self.st) else stage_processes(pgid)  # before its parents die
                killpg(pgid, signal.SIGKILL)
                kill_all(tree, signal.SIGKILL)
        elif code is None:
            return
        chunk = self.fh.read(CHUNK)  # written before the exit was recorded
        while chunk:
            self._lines(chunk, emit, head)
            chunk = self.fh.read(CHUNK)
        if self.buf:  # the last line has no newline: it stays without one
            emit(out_events(head, self.buf, False))
            self.buf = b""
        self.fh.close()
        self.done = True
        emit(ev("X", rank, self.st.name, code))

    def _lines(self, data, emit, head):
        parts = (self.buf + data).split(b"\n")
        rest = parts.pop()
        frames = [out_events(head, line, True) for line in parts]
        if len(rest) >= OUT_PIECE:  # a long line goes out in pieces as it comes, never held whole
            cut = len(rest) - len(rest) % OUT_PIECE
            frames.append(out_events(head, rest[:cut], False))
            rest = rest[cut:]
        self.buf = rest
        if frames:
            emit(b"".join(frames))


# -------------------------------------------------------------------- buckets
# Cloud-bucket file_mounts (payload["buckets"], payload["storage"]; buckets.py
# on the controller), with rclone configured through its environment only:
# remote BUCKET_REMOTE is S3 with env_auth, i.e. AWS's own credential chain --
# the AWS_* credentials among the job's secrets (they reach rclone in its
# environment, never in an argv, a file of ours or a log), else the node's
# instance profile. An endpoint of the task's own (AWS_ENDPOINT_URL_S3) makes
# the remote path-style, as S3-compatible stores expect.
#   hello  every node checks it has rclone (and FUSE when something mounts):
#          a node without is a problem (H RANK problem), so nothing runs;
#   check  the head, once: creates the buckets named without a source, lists
#          each source's top (a missing bucket is one line, nothing runs), and
#          tells a single object (COPY to a file) from a prefix;
#   fetch  after the workdir copy, every node (command `buckets TOKEN KINDS`):
#          COPY  `rclone copy` by the node that owns the destination (the claim
#                markers of the copy phase: nodes sharing a filesystem fetch once);
#          MOUNT / MOUNT_CACHED  `rclone mount --daemon`, VFS cache mode writes
#                (a file is uploaded as soon as it is closed) / full (reads
#                cached on the node's disk too, uploads in the background);
#          then B RANK CODE MESSAGE.
# A mount on the node's own credentials outlives its job. MOUNTS_DIR/KEY.json
# (KEY hashes the path) records what gpuctl mounted there; a later job reuses a
# mount that answers and is the same (bucket, prefix, mode, endpoint, region,
# credentials, access), unmounts a dead one (lazily) or a different one (refused
# while something uses it) and mounts again, and never takes over a mount point
# it did not make. A mount with the job's own credentials (secrets) is held by
# the job (a shared flock on KEY.use) and unmounted at its cleanup, after its
# uploads, by the last job holding it (unmount_bucket). KEY.log is the
# mount's rclone log, KEY.cache its VFS cache (kept across remounts, so writes
# not yet uploaded go up once the path is mounted again).
BUCKET_REMOTE = "gpuctls3"
MOUNTS_DIR = os.path.join(GPUCTL_DIR, "mounts")
BUCKET_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# mode -> (--vfs-cache-mode, --vfs-write-back)
BUCKET_CACHE = {"MOUNT": ("writes", "0s"), "MOUNT_CACHED": ("full", "5s")}
RCLONE_NET = ["--contimeout", "15s", "--timeout", "60s", "--low-level-retries", "3"]
BUCKET_CHECK_TIMEOUT = 120  # seconds for one listing or mkdir on the head
MOUNT_READY_S = 60  # seconds a new mount may take to appear
# Who may reach a mount (rclone_mount_argv); part of its identity, so that a mount an
# older agent opened to every user is mounted again, not reused.
MOUNT_ACCESS = "owner-0600"
UPLOAD_WAIT_S = 900  # how long a job's end waits for a mount's uploads before unmounting it
_SECRET_RE = re.compile(r"^export ([A-Za-z_][A-Za-z0-9_]*)='((?:[^']|'\"'\"')*)'$", re.M)
_LOG_STAMP_RE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s+")


def parse_secrets(text):
    """{NAME: value} of the secrets script gpuctl writes (`export NAME='value'`, jobenv.secrets_script)."""
    return dict((m.group(1), m.group(2).replace("'\"'\"'", "'")) for m in _SECRET_RE.finditer(text or ""))


def rclone_env(storage, secrets, base=None):
    """(rclone's environment, options every rclone call takes).

    The node's environment, the remote's settings, and the job's AWS credentials
    when its secrets give them (then no inherited AWS_* credential is mixed in).
    AWS_CA_BUNDLE becomes --ca-cert: rclone's HTTP client refuses the variable.
    """
    env = dict(os.environ if base is None else base)
    extra = []
    bundle = env.pop("AWS_CA_BUNDLE", None)
    if bundle and os.path.isfile(bundle):
        extra += ["--ca-cert", bundle]
    storage = storage or {}
    prefix = "RCLONE_CONFIG_%s_" % BUCKET_REMOTE.upper()
    endpoint = storage.get("endpoint")
    env[prefix + "TYPE"] = "s3"
    env[prefix + "PROVIDER"] = "Other" if endpoint else "AWS"  # Other: path-style requests
    env[prefix + "ENV_AUTH"] = "true"
    if endpoint:
        env[prefix + "ENDPOINT"] = endpoint
    if storage.get("region"):
        env[prefix + "REGION"] = storage["region"]
        if not endpoint and storage["region"] != "us-east-1":  # AWS makes buckets there without it
            env[prefix + "LOCATION_CONSTRAINT"] = storage["region"]
    if any(name in secrets for name in BUCKET_CREDENTIALS):
        for name in BUCKET_CREDENTIALS:
            env.pop(name, None)
            if name in secrets:
                env[name] = secrets[name]
    return env, extra


def rclone_remote(bucket, prefix=""):
    prefix = (prefix or "").strip("/")
    return "%s:%s%s" % (BUCKET_REMOTE, bucket, "/" + prefix if prefix else "")


def rclone_copy_argv(bucket, path, kind, extra=()):
    """Fetch a COPY source: a prefix into the directory `path`, one object (kind "file") to the file `path`."""
    return (["rclone", "copyto" if kind == "file" else "copy", "-q", "--transfers", "16", "--checkers", "16"]
            + RCLONE_NET + list(extra) + [rclone_remote(bucket["bucket"], bucket.get("prefix")), path])


def fuse_allow_other():
    """Whether FUSE lets this user open the mount to others (root, or user_allow_other in
    /etc/fuse.conf); rclone_mount_argv then lets the kernel check the files' modes instead."""
    return os.geteuid() == 0 or bool(re.search(r"^\s*user_allow_other\b", read_text("/etc/fuse.conf") or "", re.M))


def rclone_mount_argv(bucket, path, base, extra=(), allow_other=False, uid=None, gid=None):
    """Mount a bucket (prefix) at `path` as a daemon; `base` is MOUNTS_DIR/KEY (its log and cache).

    Only the job's user reaches the data: every file is theirs, 0600 (directories 0700), and
    the kernel checks those modes (--default-permissions); without it, --allow-other would let
    every local user read, write and delete through the mount whatever the listing shows.
    Where FUSE allows it (`allow_other`), root passes too (a container's root, or the runtime's
    daemon binding the path into one); elsewhere FUSE itself keeps everyone else out.
    """
    cache, write_back = BUCKET_CACHE[bucket["mode"]]
    owner = ["--uid", str(os.getuid() if uid is None else uid), "--gid", str(os.getgid() if gid is None else gid),
             "--umask", "0077"]
    return (["rclone", "mount", rclone_remote(bucket["bucket"], bucket.get("prefix")), path, "--daemon",
             "--vfs-cache-mode", cache, "--vfs-write-back", write_back, "--cache-dir", base + ".cache",
             "--log-file", base + ".log", "--log-level", "NOTICE"] + owner
            + (["--allow-other", "--default-permissions"] if allow_other else []) + RCLONE_NET + list(extra))


def bucket_tools_problem(buckets, which=shutil.which, exists=os.path.exists):
    """What this node lacks for the job's buckets (rclone; FUSE to mount), or None."""
    if not buckets:
        return None
    missing = [] if which("rclone") else ["rclone"]
    if any(b.get("mode") != "COPY" for b in buckets):
        if not (which("fusermount3") or which("fusermount")):
            missing.append("fusermount3 (package fuse3)")
        if not exists("/dev/fuse"):
            missing.append("/dev/fuse (the fuse kernel module)")
    if not missing:
        return None
    return ("%s %s not installed, and the job's cloud-bucket file_mounts need %s; gpuctl installs rclone and fuse3 "
            "when it prepares AWS nodes, elsewhere install them on the node (local nodes: on this machine): "
            "apt-get install rclone fuse3" % (" and ".join(missing), "is" if len(missing) == 1 else "are",
                                              "it" if len(missing) == 1 else "them"))


# Where no copy or bucket may land on this node, its symlinks resolved (nodepaths.py on the
# controller checks every spelling with the same lists; a test keeps them equal):
# anything in RESERVED_TREES, any of RESERVED_DIRS itself; and no mount may hold
# the home, the workdir or a reserved tree, nor be in the workdir.
WORKDIR = "~/gpuctl_workdir"
RESERVED_TREES = (
    "~/.ssh", "~/.gpuctl",
    # the login shell's startup files: sshd runs every command of gpuctl's through them, and one that
    # prints or exits breaks rsync and the agent for every later job (as a bad authorized_keys would)
    "~/.bashrc", "~/.bash_profile", "~/.bash_login", "~/.bash_logout", "~/.profile", "~/.zshenv", "~/.zprofile",
    "~/.zshrc", "~/.cshrc", "~/.tcshrc",
    "/etc/ssh", "/etc/sudoers", "/etc/sudoers.d", "/etc/pam.d", "/etc/passwd", "/etc/shadow", "/etc/group",
    "/etc/gshadow", "/etc/fuse.conf", "/etc/security", "/etc/profile", "/etc/profile.d", "/etc/bash.bashrc",
    "/etc/environment", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/nsswitch.conf",
    "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.cache",
    # the programs and libraries gpuctl runs (python3, rsync, ssh, bash): never replaced by a copy
    "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32",
    "/usr/lib64", "/usr/libx32", "/usr/libexec",
    "/proc", "/sys", "/dev", "/run", "/var/run", "/boot",
)
RESERVED_DIRS = (
    "/", "~", "/etc", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp", "/usr", "/var", "/usr/local",
    "/usr/local/bin", "/usr/share", "/var/lib", "/var/log", "/var/tmp",
)


# Where gpuctl itself copies into a reserved tree (the Python API's call files, gpuctl check's probes; the spec
# refuses these places to file_mounts, so only gpuctl's own JobSpecs name them).
GPUCTL_COPIES = ("~/.gpuctl/calls", "~/.gpuctl/check")


def real_path(path):
    """`path` (absolute or ~/...) with the home expanded and every symlink that exists resolved."""
    return os.path.realpath(dest_paths(path)[0])


def path_within(path, top):
    """Whether real `path` is `top` or below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def dest_problem(dest, mode):
    """Why nothing may be copied (COPY: the workdir, a file_mount, a bucket) or mounted at
    `dest` on this node, once the home is expanded and symlinks resolved (a link to ~/.ssh,
    a workdir that is a link); None when it may."""
    path = real_path(dest)
    if mode == "COPY" and any(path_within(path, real_path(top)) and path != real_path(top) for top in GPUCTL_COPIES):
        return None
    shown = dest if path == os.path.normpath(dest_paths(dest)[0]) else "%s (here %s)" % (dest, path)
    for top in RESERVED_TREES:
        if path_within(path, real_path(top)):
            return ("%s is in %s, which gpuctl or the system needs on every node; choose another destination, "
                    "such as /data or ~/data" % (shown, top))
    for top in RESERVED_DIRS:
        if path == real_path(top):
            return ("%s is %s, which the system or gpuctl needs as it is; give a directory of its own, such as "
                    "/data or ~/data" % (shown, {"~": "the home", "/": "the filesystem root"}.get(top, top)))
    if mode == "COPY":
        return None
    for top in ("~", WORKDIR) + RESERVED_TREES:
        real = real_path(top)
        if path_within(real, path) or (top == WORKDIR and path_within(path, real)):
            return ("a %s at %s would cover %s, which gpuctl %s; mount it elsewhere, such as /data or ~/data"
                    % (mode, shown, top, "rewrites on every job (the workdir copy would delete through the "
                                         "mount into the bucket)" if top == WORKDIR else "or the system needs"))
    return None


def workdir_mount_problem(table=None):
    """Why the workdir copy may not run here: something is mounted at the workdir or in it (a
    bucket an older gpuctl mounted there), and its --delete-after would delete through it."""
    real = real_path(WORKDIR)
    table = mount_table() if table is None else table
    inside = sorted(p for p in table if path_within(p, real))
    if not inside:
        return None
    fstype, source = table[inside[0]]
    return ("%s is a mount point (%s %s), and the workdir copy would delete through it whatever your workdir "
            "lacks; unmount it (fusermount -u %s) or mount it elsewhere" % (inside[0], fstype, source, inside[0]))


def workdir_copy_problem(dest):
    """Why a file_mount or bucket may not be copied to `dest`: it is the workdir itself (here,
    symlinks resolved), whose copy and the file_mount's would delete each other's files."""
    if real_path(dest) != real_path(WORKDIR):
        return None
    return ("%s is %s here, where gpuctl copies the workdir on every job: the two copies would delete each "
            "other's files; copy it into a directory below it, or elsewhere" % (dest, WORKDIR))


def destinations_problem(payload):
    """Why this node cannot take the job's copies or buckets where they go (a place gpuctl or
    the system needs, once the real paths are known), as one line naming the field, or None:
    checked in the hello, before anything is copied to, fetched to or mounted on this node."""
    for dest in payload.get("sync") or ():
        why = dest_problem(dest["path"], "COPY") or (dest["path"] == WORKDIR and workdir_mount_problem()) or (
            dest["path"] != WORKDIR and workdir_copy_problem(dest["path"]))
        if why:
            return "%s: %s" % ("workdir" if dest["path"] == WORKDIR else "file_mounts." + dest["path"], why)
    for b in payload.get("buckets") or ():
        why = dest_problem(b["dest"], b.get("mode")) or (b.get("mode") == "COPY" and workdir_copy_problem(b["dest"]))
        if why:
            return "file_mounts.%s: %s" % (b["dest"], why)
    return None


def cmd_check_dest(args):
    """Before the controller's copy lands here (upload.py runs it ahead of rsync on the head):
    exit 2 with one line when the workdir or a file_mount may not be copied to DEST."""
    why = destinations_problem({"sync": [{"path": args.dest}]})
    if why:
        sys.stderr.write("gpuctl-node: %s\n" % why)
        return 2
    return 0


def rclone_error(text):
    """What failed, from rclone's log lines: the last error, without its timestamp, with a hint."""
    lines = [_LOG_STAMP_RE.sub("", line).strip() for line in (text or "").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("NOTICE:", "For verbose messaging"))]
    failed = [line for line in lines if line.startswith(("Failed to", "ERROR", "CRITICAL", "Fatal error"))]
    msg = (failed or lines or ["rclone gave no reason"])[-1]
    msg = re.sub(r"^Failed to \w+( with \d+ errors: last error was)?: ", "", msg)[:300]
    if "NoCredentialProviders" in msg:
        msg += (" (no AWS credentials on the node: give AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY under "
                "secrets:, or give the nodes an instance profile with config.aws.remote_identity)")
    elif "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg:
        msg += " (the store refused the credentials)"
    return msg


def rclone_lines(argv, env, limit, timeout, procs=None):
    """Up to `limit` lines of an rclone listing, read as they come (a big bucket is never listed
    to its end); (exit code, lines, what it said on stderr)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                close_fds=True, cwd="/")
        if procs is not None:
            procs.append(proc)
        reader = LineReader(proc.stdout.fileno())
        lines = []
        deadline = time.time() + timeout
        try:
            while len(lines) < limit and not reader.eof:
                if time.time() > deadline:
                    proc.kill()
                    proc.wait()
                    return 124, lines, "no answer from the store within %ds" % timeout
                if select.select([reader.fd], [], [], 0.2)[0]:
                    lines += [line.decode("utf-8", "replace") for line in reader.read_lines() if line.strip()]
            if len(lines) >= limit and proc.poll() is None:
                proc.kill()
            code = proc.wait()
        finally:
            proc.stdout.close()
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    return (0 if len(lines) >= limit else code), lines[:limit], text


def rclone_run(argv, env, timeout, procs=None):
    """(exit code, rclone's error text) of one rclone command."""
    code, _, text = rclone_lines(argv, env, 1 << 30, timeout, procs)
    return code, text


def _filter_escape(name):
    return re.sub(r"([*?\[\]{}\\])", r"\\\1", name)


def check_bucket_sources(buckets, env, extra=(), timeout=BUCKET_CHECK_TIMEOUT, procs=None):
    """On the head, once per job: create the buckets named without a source, check every other
    source; (each mount's kind, "dir" or "file", None) or (None, the line that says what is wrong)."""
    extra = list(extra)
    kinds = []
    for b in buckets:
        url = b.get("url") or "s3://%s/%s" % (b["bucket"], b.get("prefix") or "")
        if b.get("create"):
            code, text = rclone_run(["rclone", "mkdir", "-q"] + RCLONE_NET + extra + [rclone_remote(b["bucket"])],
                                    env, timeout, procs)
            if code != 0:
                return None, "%s: cannot create the bucket: %s" % (url, rclone_error(text))
            kinds.append("dir")
            continue
        prefix = (b.get("prefix") or "").strip("/")
        code, lines, text = rclone_lines(["rclone", "lsf", "-q", "--max-depth", "1"] + RCLONE_NET + extra
                                         + [rclone_remote(b["bucket"], prefix)], env, 2, timeout, procs)
        if code == 3:  # rclone: directory not found, which for S3 is the bucket
            return None, "%s: no such bucket (%s); create it, or give name: without source: to have it made" % (
                url, b["bucket"])
        if code != 0:
            return None, "%s: %s" % (url, rclone_error(text))
        kind = "dir"
        base = prefix.rsplit("/", 1)[-1]
        if prefix and lines == [base]:  # a listing of one object names just it: is the prefix that object?
            parent = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            code, found, text = rclone_lines(["rclone", "lsf", "-q", "--max-depth", "1", "--files-only",
                                              "--include", "/" + _filter_escape(base)] + RCLONE_NET + extra
                                             + [rclone_remote(b["bucket"], parent)], env, 1, timeout, procs)
            if code == 0 and found == [base]:
                kind = "file"
        if b.get("mode") == "COPY" and prefix and not lines:
            return None, "%s: nothing in bucket %s under %s/" % (url, b["bucket"], prefix)
        kinds.append(kind)
    return kinds, None


def mount_table(text=None):
    """{mount point: (fstype, source)} from /proc/self/mountinfo (this node's mount namespace)."""
    if text is None:
        text = read_text("/proc/self/mountinfo") or ""
    out = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        rest = right.split()
        out[point] = (rest[0] if rest else "", rest[1] if len(rest) > 1 else "")
    return out


def mount_point(dest):
    """The path a mount at `dest` has in the mount table (the parent's symlinks resolved)."""
    path = os.path.normpath(dest_paths(dest)[0])
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def mount_key(path):
    return hashlib.sha256(path.encode("utf-8", "replace")).hexdigest()[:16]


def mount_ident(bucket, storage, env):
    """What makes two mounts the same; the credentials enter only as a hash."""
    creds = hashlib.sha256("\0".join(env.get(n, "") for n in BUCKET_CREDENTIALS).encode()).hexdigest()
    what = {"bucket": bucket["bucket"], "prefix": (bucket.get("prefix") or "").strip("/"), "mode": bucket["mode"],
            "endpoint": (storage or {}).get("endpoint"), "region": (storage or {}).get("region"), "creds": creds,
            "access": MOUNT_ACCESS}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def answers(path, timeout=10.0):
    """Whether stat() of `path` returns in time (a dead FUSE mount says ENOTCONN; a hung one, nothing)."""
    box = []

    def probe():
        try:
            os.stat(path)
            box.append(True)
        except OSError:
            box.append(False)

    t = threading.Thread(target=probe)
    t.daemon = True
    t.start()
    t.join(timeout)
    return bool(box and box[0])


def mount_state(path, ident, record):
    """None (nothing mounted at `path`), "same", "other" (ours, another bucket or mode),
    "stale" (ours, not answering) or "foreign" (a mount point gpuctl did not make)."""
    entry = mount_table().get(path)
    if entry is None:
        return None
    if not record or record.get("path") != path or not entry[0].startswith("fuse.rclone"):
        return "foreign"
    if not answers(path):
        return "stale"
    return "same" if record.get("ident") == ident else "other"


def unmount(path, lazy=False):
    """Unmount a FUSE mount; None, or why not (a mount in use is not unmounted unless `lazy`)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        argv = [tool, "-u"] + (["-z"] if lazy else []) + [path]
    else:
        argv = ["umount"] + (["-l"] if lazy else []) + [path]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        return proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or ["exit code %d" % proc.returncode]
    return None


def ensure_dir(path):
    """mkdir -p, through `sudo -n` (then owned by this user) where the parent is not writable (/data)."""
    try:
        os.makedirs(path, exist_ok=True)
        return
    except PermissionError:
        if os.geteuid() == 0 or not shutil.which("sudo"):
            raise
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if subprocess.call(["sudo", "-n", "mkdir", "-p", "--", path], **quiet) != 0 or subprocess.call(
            ["sudo", "-n", "chown", "%d:%d" % (os.getuid(), os.getgid()), "--", path], **quiet) != 0:
        raise OSError(errno.EACCES, "cannot create %s (not writable, and sudo -n refused)" % path)


def mount_dirty(cache_dir):
    """Whether rclone's VFS cache still holds a write not uploaded (a vfsMeta item "Dirty": true)."""
    for root, _, files in os.walk(os.path.join(cache_dir, "vfsMeta")):
        for name in files:
            if re.search(r'"Dirty"\s*:\s*true', read_text(os.path.join(root, name)) or ""):
                return True
    return False


def hold_mount(base, cancelled=lambda: False):
    """A shared lock on a mount (MOUNTS_DIR/KEY.use) for as long as a job uses it: the fd, or
    None when cancelled. It waits while a job that ended unmounts it (unmount_bucket)."""
    fd = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except OSError:
            if cancelled():
                os.close(fd)
                return None
            time.sleep(0.2)


def mount_daemons(base):
    """This user's `rclone mount` processes serving MOUNTS_DIR/KEY (`base`): their cache dir names it."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat("/proc/" + name).st_uid != os.getuid():
                continue
            with open("/proc/%s/cmdline" % name, "rb") as fh:
                argv = fh.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == "rclone" and "mount" in argv and any(
                a == "--cache-dir" and b == base + ".cache" for a, b in zip(argv, argv[1:])):
            found.append(int(name))
    return found


def unmount_bucket(path, wait_s=UPLOAD_WAIT_S, settle_s=0.0):
    """Unmount what gpuctl mounted at `path` with a job's own credentials once no job holds it:
    after its uploads (up to `wait_s`), lazily if something outside the jobs still has it open.
    `settle_s`: how long the job that just ended may take to let go of it. Why it stayed, or None."""
    base = os.path.join(MOUNTS_DIR, mount_key(path))
    fd = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        settled = time.time() + settle_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.time() >= settled:
                    return "in use by another job, which unmounts it when it ends"
                time.sleep(0.1)
        deadline = time.time() + wait_s
        while mount_dirty(base + ".cache") and path in mount_table() and answers(path) and time.time() < deadline:
            time.sleep(0.5)  # a dead mount uploads nothing more: it is unmounted at once
        entry = mount_table().get(path)
        if entry is not None and entry[0].startswith("fuse.rclone") and unmount(path) and unmount(path, lazy=True):
            return "could not unmount it"
        remove(base + ".json")
        for pid in mount_daemons(base):  # a container's copy of the mount keeps the daemon up: end it
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        return None
    finally:
        os.close(fd)


def cmd_unmount_bucket(args):
    if args.lifeline_fd is not None:  # started when the mount was taken: wait for the job's owner here to end
        while True:
            try:
                if not os.read(args.lifeline_fd, 1):
                    break
            except InterruptedError:
                continue
        os.close(args.lifeline_fd)
    why = unmount_bucket(args.path, settle_s=5.0 if args.lifeline_fd is not None else 0.0)
    if why:
        sys.stderr.write("gpuctl-node: %s: %s\n" % (args.path, why))
    return 0


class NodeBuckets(object):
    """This node's part of the fetch step: claims at once, the COPYs and MOUNTs in a thread, then B."""

    def __init__(self, relay, token, kinds):
        self.relay = relay
        self.rank = relay.rank
        self.token = token
        self.buckets = relay.payload.get("buckets") or []
        self.kinds = list(kinds) + ["dir"] * (len(self.buckets) - len(kinds))
        self.storage = relay.payload.get("storage") or {}
        secrets = parse_secrets(relay.secrets)
        self.env, self.extra = rclone_env(self.storage, secrets)
        # Mounts made or reused with the job's own credentials, unmounted when it ends: [(fd, path)]
        self.own_credentials = any(name in secrets for name in BUCKET_CREDENTIALS)
        self.held = []
        self.procs = []
        self.claims = []  # COPY destinations claimed here: (index, dest)
        self.owners = []
        self.errors = []
        self.done = {"copied": [], "shared": [], "mounted": [], "reused": []}  # destinations, by what happened
        self.thread = None
        self.sent = False
        self.cancelled = False

    def start(self):
        """Free and claim the COPY destinations (before the nodes below hear of it), start the work."""
        why = destinations_problem({"buckets": self.buckets})  # again: the copies ran since the hello
        if why:
            self.errors.append(why)
            return
        try:
            for i, b in enumerate(self.buckets):
                if b.get("mode") != "COPY":
                    continue
                path = mount_point(b["dest"])
                if path in mount_table():  # a MOUNT of an earlier job there: copy onto the disk, not into it
                    why = self._release_mount(b, path, None)
                    if why:
                        self.errors.append(why)
                        continue
                ensure_dir(path if self.kinds[i] == "dir" else os.path.dirname(path))
                self.claims.append((i, {"path": b["dest"], "dir": self.kinds[i] == "dir"}))
            self.owners = claim_destinations(self.token, [d for _, d in self.claims], self.rank)
        except Exception as exc:  # noqa: BLE001 - reported as this node's result
            self.errors.append("preparing the destinations failed: %s" % exc)
        if not self.errors:
            self.thread = threading.Thread(target=self._work)
            self.thread.daemon = True
            self.thread.start()

    def busy(self):
        return not self.sent

    def poll(self, emit):
        if self.sent or (self.thread is not None and self.thread.is_alive()):
            return
        self.sent = True
        if self.errors:
            text = "; ".join(self.errors).replace("\n", " ")[:600]
            emit(ev("B", self.rank, 1, text))
        else:  # what happened where, for people and tests: {"copied": [DEST], "shared": [...], ...}
            emit(ev("B", self.rank, 0, json.dumps(dict((k, v) for k, v in self.done.items() if v),
                                                   separators=(",", ":"))))

    def release(self):
        if self.owners:
            release_claims(self.token, [d for _, d in self.claims], self.owners, self.rank)
            self.owners = []

    def kill(self):
        self.cancelled = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def end(self):
        """The job ended here: let go of the mounts it held with its own credentials; each one's
        watcher (`_watch`) unmounts it once this process is gone and no other job holds it."""
        for fd, _ in self.held:
            os.close(fd)
        self.held = []

    def _watch(self, path):
        """A detached `unmount-bucket` for a mount held with the job's credentials, started as the
        mount is taken: it waits on this process's lifeline, so the mount and the credentials in
        its rclone daemon go when the job ends here, however its owner ends (kill -9 included),
        after its uploads, unless another job still holds it (that job's watcher then does it)."""
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "unmount-bucket",
                          "--lifeline-fd", str(self.relay.lifeline), "--", path],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         close_fds=True, pass_fds=(self.relay.lifeline,), cwd="/", start_new_session=True)

    def _work(self):
        owned = dict((i, owner == self.rank) for (i, _), owner in zip(self.claims, self.owners))
        for i, b in enumerate(self.buckets):
            if self.cancelled:
                self.errors.append("cancelled")
                return
            try:
                if b.get("mode") != "COPY":
                    why, how = self._mount(b)
                elif owned.get(i):
                    why, how = self._copy(b, self.kinds[i]), "copied"
                else:  # a node sharing this filesystem owns the destination and fetches it
                    why, how = None, "shared"
            except Exception as exc:  # noqa: BLE001
                why, how = "%s: %s" % (b["dest"], exc), None
            if why:
                self.errors.append(why)
            else:
                self.done[how].append(b["dest"])

    def _copy(self, b, kind):
        path = os.path.normpath(dest_paths(b["dest"])[0])
        code, text = rclone_run(rclone_copy_argv(b, path, kind, self.extra), self.env, 1 << 30, self.procs)
        if code != 0:
            return "%s: copying to %s failed: %s" % (b.get("url"), b["dest"], rclone_error(text))
        return None

    def _release_mount(self, b, path, ident):
        """Unmount what gpuctl mounted at `path` (unless it is the same as wanted); why not, or None."""
        base = os.path.join(MOUNTS_DIR, mount_key(path))
        record = None
        try:
            with open(base + ".json") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            pass
        state = mount_state(path, ident, record)
        if state in (None, "same"):
            return None
        if state == "foreign":
            fstype = mount_table().get(path, ("?", ""))[0]
            return ("%s is a mount point (%s) that gpuctl did not make; give the bucket another destination"
                    % (b["dest"], fstype))
        why = unmount(path, lazy=(state == "stale"))
        if why:
            return ("%s is mounted from %s and in use (a running job?): %s; it is mounted again once nothing uses it"
                    % (b["dest"], (record or {}).get("url", "another bucket"), why[0]))
        remove(base + ".json")
        return None

    def _mount(self, b):
        """(why not, None) or (None, "mounted" | "reused")."""
        path = mount_point(b["dest"])
        base = os.path.join(MOUNTS_DIR, mount_key(path))
        ident = mount_ident(b, self.storage, self.env)
        os.makedirs(MOUNTS_DIR, 0o700, exist_ok=True)
        if self.own_credentials:
            fd = hold_mount(base, lambda: self.cancelled)
            if fd is None:
                return "cancelled", None
            self.held.append((fd, path))
            self._watch(path)
        why = self._release_mount(b, path, ident)
        if why:
            return why, None
        if path in mount_table():
            return None, "reused"  # the same mount, and it answers
        ensure_dir(path)
        if os.listdir(path):
            return "%s is not empty; a %s needs an empty (or new) directory" % (b["dest"], b["mode"]), None
        os.makedirs(MOUNTS_DIR, 0o700, exist_ok=True)
        remove(base + ".log")
        argv = rclone_mount_argv(b, path, base, self.extra, allow_other=fuse_allow_other())
        with open(base + ".out", "wb") as out:
            # --daemon: the mount's process leaves this one's session; its cwd holds nothing busy
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    close_fds=True, cwd="/", start_new_session=True)
            self.procs.append(proc)
            code = proc.wait()
        deadline = time.time() + MOUNT_READY_S  # rclone before 1.58 returns before the mount is up
        while code == 0 and path not in mount_table() and time.time() < deadline and not self.cancelled:
            time.sleep(0.1)
        if path not in mount_table():
            text = (read_text(base + ".out") or "") + (read_text(base + ".log") or "")
            return "%s: mounting at %s failed: %s" % (b.get("url"), b["dest"], rclone_error(text)), None
        write_private(base + ".json", json.dumps({"path": path, "dest": b["dest"], "url": b.get("url"),
                                                  "mode": b["mode"], "ident": ident}))
        return None, "mounted"


def cannot_write(exc, path):
    """One line for job files a node could not write: the path and why (No space left on device...)."""
    return "cannot write %s: %s" % (getattr(exc, "filename", None) or path, exc.strerror or exc)


def answer_without_job(out, hello, outcome):
    """`submit`'s whole answer when the head takes no job: its H (b"": none), the outcome, the stream's end."""
    out.write(("%s 0\n" % OFFSET_HEADER).encode())
    out.write(hello)
    out.write(ev("D", outcome["status"], json.dumps(outcome)))
    out.write(("%s 3\n" % SENTINEL).encode())
    return 0


def describe_by_node(peers, messages):
    """One clause per distinct message, naming its nodes: `head, worker1: TEXT`."""
    names = {}
    for r in sorted(messages):
        names.setdefault(messages[r], []).append(peers[r]["name"])
    return "; ".join("%s: %s" % (", ".join(n[:3]) + (" and %d more node(s)" % (len(n) - 3) if len(n) > 3 else ""),
                                 text) for text, n in names.items())


class Relay(object):
    """One node's part of a job: its own rank, and the children it fans out to.

    The head's coordinator and every worker's `relay` command run this; a
    command given to a relay is done here and passed on to its children.
    """

    def __init__(self, payload, secrets, rank, emit):
        self.payload = payload
        self.secrets = secrets
        self.rank = rank
        self.emit = emit
        self.job = payload["job"]
        self.jobdir = job_dir(self.job)
        self.peers = dict((p["rank"], p) for p in payload["peers"])
        self.subtree = payload.get("subtree") or [rank]
        self.children = []
        self.stages = {}
        self.claim_owners = []
        self.pushes = []  # running rsync pushes: (proc, to_rank, reader of stderr, its lines)
        self.ok = False
        self.closing = False  # `end` was sent: children closing now are not lost
        self.node_buckets = None  # this node's part of the bucket fetch (NodeBuckets)
        # Held open (never written) for as long as this process lives: each stage's supervisor
        # stops its stage when it reads EOF here (see _supervise). Not inherited across exec.
        self.lifeline, self._lifeline_w = os.pipe()

    # -- setup ---------------------------------------------------------------
    def prepare_local(self):
        """Check the node's prepared state and write the job's files; emits H."""
        try:
            return self._prepare_local()
        except OSError as exc:  # a full disk, a read-only home: prepare would not help, the job cannot run
            self.emit(ev("H", self.rank, "problem", cannot_write(exc, self.jobdir)))
            return False

    def _prepare_local(self):
        problem = prepared_problem(self.payload.get("fingerprint"))
        if problem:
            self.emit(ev("H", self.rank, "unprepared", problem))
            return False
        if self.rank != 0:  # the head's submit already made its job directory
            problem = take_job_dir(self.jobdir, self.payload.get("nonce"))
            if problem:
                self.emit(ev("H", self.rank, "problem", problem))
                return False
        os.chmod(self.jobdir, 0o700)
        stages = self.payload.get("stages") or {}
        for stage, spec in stages.items():
            if not spec or stage not in ("setup", "run"):
                continue
            if stage == "run" and self.rank >= self.payload.get("job_ranks", len(self.peers)):
                continue
            write_private(os.path.join(self.jobdir, stage + ".sh"), spec["script"], 0o700)
            write_private(os.path.join(self.jobdir, stage + ".env.sh"),
                          stage_env_text(stage, spec, self.rank, self.jobdir), 0o600)
        first = stages.get("setup") or stages.get("run")
        if first and first.get("hostfile") is not None:
            self.write_hostfile(first)
        problem = (self.prepare_container() or bucket_tools_problem(self.payload.get("buckets"))
                   or destinations_problem(self.payload))
        if problem:  # nothing can run here: the job ends before anything runs anywhere
            self.emit(ev("H", self.rank, "problem", problem))
            return False
        self.emit(ev("H", self.rank, "ok"))
        self.ok = True
        return True

    def prepare_container(self):
        """image_id docker:IMAGE: a container runtime that answers, and JOBDIR/container.json; the problem, or None."""
        box = self.payload.get("container")
        if not box:
            return None
        cfg, problem = container_config(box, self.peers[self.rank]["name"],
                                        self.payload.get("workdir") or "~/gpuctl_workdir")
        if problem:
            return problem
        if os.path.isfile(FABRIC_ENV):  # the container sees the job directory, not ~/.gpuctl
            shutil.copyfile(FABRIC_ENV, os.path.join(self.jobdir, "fabric.env"))
        write_private(os.path.join(self.jobdir, CONTAINER_FILE), json.dumps(cfg))
        return None

    def write_hostfile(self, spec):
        """JOBDIR/hostfile: every cluster node during setup, the job's nodes during run (one path:
        GPUCTL_HOSTFILE is the same in both stages)."""
        write_private(os.path.join(self.jobdir, "hostfile"), "".join(line + "\n" for line in spec["hostfile"]),
                      0o644)

    def spawn_children(self):
        for group in partition(self.subtree[1:], int(self.payload.get("branching") or 32)):
            try:
                self.children.append(Child(self, group))
            except OSError as exc:
                for r in group:
                    self.emit(ev("L", r, "cannot start ssh: %s" % exc))

    # -- commands ------------------------------------------------------------
    def command(self, line):
        """Do one command here and pass it to every child.

        A claim is made here before the children hear of it, so a node claims
        ahead of every node below it: the head owns whatever it shares, and
        nothing is copied into the directory the head's copy already is.
        """
        words = line.split(" ", 1)
        claims = words[0] in ("claim", "buckets")
        if not claims:
            self.forward(line)
        try:
            self._do(line)
        finally:
            if claims:
                self.forward(line)

    def forward(self, line):
        for child in self.children:
            child.send(line.encode() + b"\n")

    def _do(self, line):
        words = line.split(" ", 1)
        verb, rest = words[0], (words[1] if len(words) > 1 else "")
        if verb == "end":
            self.closing = True
        if not self.ok and verb not in ("kill", "cleanup", "end"):
            return
        try:
            if verb == "claim":
                self._claim(rest.strip())
            elif verb == "sync":
                self._sync(json.loads(rest))
            elif verb == "buckets":
                token, _, kinds = rest.strip().partition(" ")
                self.node_buckets = NodeBuckets(self, token, json.loads(kinds or "[]"))
                self.node_buckets.start()
            elif verb == "start":
                self._start(rest.strip())
            elif verb == "kill":
                parts = rest.split()
                self.kill_local(float(parts[0]), parts[1:])
            elif verb == "release":
                self.release()
            elif verb == "cleanup":
                self.cleanup()
        except Exception as exc:  # noqa: BLE001 - a failed command is reported, never fatal to the tree
            self.emit(ev("O", self.rank, "gpuctl", "gpuctl-node: %s failed: %s" % (verb, exc)))
            if verb == "start":
                self.emit(ev("X", self.rank, rest.strip(), 127))

    def _claim(self, token):
        dests = self.payload.get("sync") or []
        self.claim_token = token
        self.claim_owners = claim_destinations(token, dests, self.rank)
        self.emit(ev("C", self.rank, json.dumps(self.claim_owners, separators=(",", ":"))))

    def _sync(self, wave):
        """Push the destinations named in this wave to the ranks this node feeds."""
        dests = self.payload.get("sync") or []
        for src, dst, indexes in wave:
            if src != self.rank:
                continue
            peer = self.peers[dst]
            for i in indexes:
                self._push(dests[i], dst, peer)

    def _push(self, dest, to_rank, peer):
        local, remote = dest_paths(dest["path"])
        # --modify-window=-1: mtimes to the nanosecond, as upload.py (same-size edits within a second)
        argv = ["rsync", "--archive", "--modify-window=-1", "--exclude=/" + CLAIM_PREFIX + "*"]
        argv += list(dest.get("rsync_args") or [])
        rsh = " ".join(shell_quote(a) for a in ["ssh"] + list(peer["ssh"]))
        host = peer["host"]
        target = "%s:%s" % ("[%s]" % host if ":" in host else host, remote)
        if dest.get("dir"):
            argv += ["-e", rsh, "--", local.rstrip("/") + "/", target.rstrip("/") + "/"]
        else:
            argv += ["-e", rsh, "--", local, target]
        if shutil.which("rsync") is None:
            self.emit(ev("Y", to_rank, 127, "rsync is not installed on %s" % self.peers[self.rank]["name"]))
            return
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                close_fds=True)
        self.pushes.append((proc, to_rank, LineReader(proc.stderr.fileno()), []))

    def _start(self, stage):
        if stage not in ("setup", "run"):
            return
        if stage == "run" and self.rank >= self.payload.get("job_ranks", len(self.peers)):
            return
        spec = (self.payload.get("stages") or {}).get(stage) or {}
        if spec.get("hostfile") is not None:
            self.write_hostfile(spec)
        st = Stage(self.jobdir, stage)
        if self.secrets:  # written for the stage; its supervisor removes it when the stage ends
            write_private(st.secrets, self.secrets)
        code, err = start_stage(st, self.payload.get("workdir") or "~/gpuctl_workdir", lifeline=self.lifeline,
                                grace=float(self.payload.get("grace") or 3.0))
        if code != 0:
            self.emit(ev("O", self.rank, stage, "gpuctl-node: %s" % err))
            self.emit(ev("X", self.rank, stage, 127))
            return
        self.stages[stage] = LocalStage(st)
        self.emit(ev("S", self.rank, stage))

    def kill_local(self, grace, stages):
        for stage in stages:
            if stage in ("setup", "run"):
                st = Stage(self.jobdir, stage)
                if st.pgid() is not None:
                    kill_stage(st, grace)

    def release(self):
        """Remove this node's claim markers (the copies are done)."""
        if self.claim_owners:
            release_claims(getattr(self, "claim_token", ""), self.payload.get("sync") or [], self.claim_owners,
                           self.rank)
            self.claim_owners = []
        if self.node_buckets is not None:
            self.node_buckets.release()

    def cleanup(self):
        remove(os.path.join(self.jobdir, "secrets.sh"))
        self.release()
        if self.node_buckets is not None:
            self.node_buckets.end()  # mounts holding the job's credentials go too

    # -- the loop ------------------------------------------------------------
    def fds(self):
        out = []
        for child in self.children:
            if not child.out.eof:
                out.append((child.out.fd, ("out", child)))
            if not child.errs.eof:
                out.append((child.errs.fd, ("err", child)))
        for push in self.pushes:
            if not push[2].eof:
                out.append((push[2].fd, ("push", push)))
        return out

    def busy(self):
        return (bool(self.pushes) or any(not s.done for s in self.stages.values())
                or (self.node_buckets is not None and self.node_buckets.busy()))

    def step(self, extra=(), timeout=0.5):
        """One round: read children and pushes, poll local stages; returns the ready `extra` fds."""
        watched = dict(self.fds())
        for fd in extra:
            watched[fd] = ("extra", None)
        wait = 0.05 if self.busy() else timeout
        try:
            ready, _, _ = select.select(list(watched), [], [], wait) if watched else ([], [], [])
        except InterruptedError:
            ready = []
        if not watched:
            time.sleep(wait)
        extra_ready = []
        for fd in ready:
            kind, obj = watched[fd]
            if kind == "extra":
                extra_ready.append(fd)
            elif kind == "out":
                for line in obj.out.read_lines():
                    self._from_child(obj, line)
                if obj.out.eof:
                    self._child_ended(obj)
            elif kind == "err":
                for line in obj.errs.read_lines():
                    obj.err = (obj.err + line + b"\n")[-4096:]
            elif kind == "push":
                for line in obj[2].read_lines():
                    obj[3].append(line.decode("utf-8", "replace"))
        for push in list(self.pushes):
            proc, to_rank, reader, errs = push
            if reader.eof and proc.poll() is not None:
                self.pushes.remove(push)
                msg = (errs[-1] if errs else "") if proc.returncode else "ok"
                self.emit(ev("Y", to_rank, proc.returncode, msg.strip()[:300] or "rsync exit code %d" % proc.returncode))
        for stage in list(self.stages.values()):
            if not stage.done:
                stage.poll(self.emit, self.rank)
        if self.node_buckets is not None:
            self.node_buckets.poll(self.emit)
        return extra_ready

    def _from_child(self, child, line):
        if line[:2] in (b"O ", b"o "):  # a rank's output: passed on as it is
            self.emit(line + b"\n")
            return
        kind, _, rest = line.partition(b" ")
        if kind in (b"X", b"L", b"H"):
            rank_text = rest.split(b" ", 1)[0]
            if rank_text.isdigit():
                rank = int(rank_text)
                if kind == b"H" and rank == child.rank:
                    child.hello = True
                if kind == b"L" or (kind == b"H" and (b" unprepared" in rest or b" problem " in rest)):
                    child.open_ranks.discard(rank)
        self.emit(line + b"\n")

    def _child_ended(self, child):
        """The child's connection closed: every rank it still owed is lost."""
        child.proc.wait()
        while not child.errs.eof:  # ssh has exited: the rest of its stderr (its reason) is there to read
            os.set_blocking(child.errs.fd, True)
            for line in child.errs.read_lines():
                child.err = (child.err + line + b"\n")[-4096:]
        if self.closing:
            child.open_ranks.clear()
            return
        reason = child.reason()
        if not child.hello and child.proc.returncode in (126, 127):
            # ssh reached the node but there is no agent to run: prepare puts it back.
            self.emit(ev("H", child.rank, "unprepared", "no gpuctl agent: %s" % reason))
            child.open_ranks.discard(child.rank)
        for rank in sorted(child.open_ranks):
            self.emit(ev("L", rank, "connection to %s ended: %s" % (self.peers[child.rank]["name"], reason)))
        child.open_ranks.clear()

    def close(self, grace=3.0):
        """End of the job on this node: stop what still runs, drop secrets, close the children.

        Every stage started here is stopped, also one that was seen to end: what
        its script left running in the background, or what a dead supervisor
        left behind, is still in its process group."""
        self.kill_local(grace, list(self.stages))
        remove(os.path.join(self.jobdir, "secrets.sh"))
        for child in self.children:
            child.close_stdin()
        deadline = time.time() + 10
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
        for proc, _, _, _ in self.pushes:
            if proc.poll() is None:
                proc.kill()
        if self.node_buckets is not None:
            self.node_buckets.kill()  # a COPY under way; mounts stay


def read_payload(stream):
    """The job (first line, JSON) and its secrets (second line, a JSON string) from a pipe."""
    payload = json.loads(stream.readline().decode("utf-8"))
    if payload.get("v") != PROTOCOL:
        raise SystemExit("gpuctl-node: job protocol %r, this agent speaks %d" % (payload.get("v"), PROTOCOL))
    secrets_line = stream.readline()
    secrets = json.loads(secrets_line.decode("utf-8")) if secrets_line.strip() else ""
    return payload, secrets


def cmd_relay(args):
    """A worker's part of a job: commands from the parent on stdin, events to stdout."""
    stdin = sys.stdin.buffer
    payload, secrets = read_payload(stdin)
    out = Out()
    out_lost = []

    def emit(data):
        if out_lost:
            return
        try:
            out.write(data)
        except (BrokenPipeError, OSError):
            out_lost.append(True)

    rank = payload["subtree"][0]
    relay = Relay(payload, secrets, rank, emit)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the parent's ssh going away shows as stdin EOF
    relay.spawn_children()
    try:
        if relay.prepare_local():
            # Who fed this node (the parent's address): the fan-out tree, for people and tests.
            with open(os.path.join(relay.jobdir, "relay.from"), "w") as fh:
                fh.write(os.environ.get("SSH_CONNECTION", "") + "\n")
    except Exception as exc:  # noqa: BLE001
        emit(ev("H", rank, "unprepared", "cannot write the job: %s" % exc))
    commands = LineReader(stdin.fileno())
    try:
        while not commands.eof and not out_lost:
            for fd in relay.step(extra=[commands.fd]):
                for line in commands.read_lines():
                    text = line.decode("utf-8", "replace").strip()
                    if text == "end":
                        relay.command(text)  # passed on: the children close too, and are not lost
                        commands.eof = True
                        break
                    if text:
                        relay.command(text)
    finally:
        # Parent gone or job over: nothing of the job may outlive it here.
        relay.close(grace=float(payload.get("grace") or 3.0))
        while relay.children and any(not c.out.eof for c in relay.children):
            relay.step(timeout=0.1)
            if all(c.proc.poll() is not None for c in relay.children):
                for c in relay.children:
                    for line in c.out.read_lines():
                        relay._from_child(c, line)
                break
    return 0


class Coordinator(object):
    """The head's side of a job: drives the phases, decides fail-fast, writes events.log."""

    def __init__(self, jobdir, payload, secrets):
        self.jobdir = jobdir
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
        self.started = {"setup": set(), "run": set()}
        self.exits = {"setup": {}, "run": {}}
        self.lost = {}
        self.first_failed = None
        self.run_started = False
        payload["subtree"] = list(range(self.n))  # the head's subtree is the whole cluster
        self.relay = Relay(payload, secrets, 0, self.on_event)

    def write(self, data):
        view = memoryview(data)
        while view:  # a short write would leave half an event for the next one to complete
            view = view[os.write(self.events, view):]

    def on_event(self, data):
        self.write(data)
        if data[:2] in (b"O ", b"o "):  # output (a batch of whole events): nothing to record
            return
        parts = data.decode("utf-8", "replace").rstrip("\n").split(" ", 3)
        kind = parts[0]
        if len(parts) < 2 or not parts[1].lstrip("-").isdigit():
            return
        rank = int(parts[1])
        if kind == "H":
            self.hello[rank] = parts[2] if len(parts) > 2 else "?"
            if self.hello[rank] == "problem":
                self.problems[rank] = parts[3] if len(parts) > 3 else "not ready"
        elif kind == "C":
            self.claims[rank] = json.loads(parts[2])
        elif kind == "Y":
            self.synced[rank] = (int(parts[2]), parts[3] if len(parts) > 3 else "")
        elif kind == "B":
            self.fetched[rank] = (int(parts[2]), parts[3] if len(parts) > 3 else "")
        elif kind == "S" and parts[2] in self.started:
            self.started[parts[2]].add(rank)
        elif kind == "X" and parts[2] in self.exits:
            code = None if parts[3] == "?" else int(parts[3])
            self.exits[parts[2]][rank] = code
            if parts[2] == "run" and code != 0 and self.first_failed is None and not self.cancelled:
                self.first_failed = rank
        elif kind == "L":
            self.lost[rank] = parts[2] + (" " + parts[3] if len(parts) > 3 else "")
            if self.first_failed is None and rank < self.job_ranks and self.started["run"] and not self.cancelled:
                self.first_failed = rank

    def phase(self, name):
        self.write(ev("P", name))

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
            self.write(ev("O", 0, "gpuctl", "gpuctl-node: coordinator failed: %s" % exc))
            return self.finish("FAILED", "coordinator failed: %s" % exc)

    def _run(self):
        all_ranks = list(range(self.n))
        self.phase("start")
        self.relay.prepare_local()
        self.relay.spawn_children()
        if not self.wait(lambda: self.accounted(all_ranks, self.hello), timeout=float(self.payload.get("connect_timeout") or 120)):
            return self.finish("CANCELLED" if self.cancelled else "FAILED", "nodes did not answer in time")
        unprepared = [r for r, h in self.hello.items() if h not in ("ok", "problem")]
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
            self.phase("sync")
            if not self.do_sync():
                return self.finish("CANCELLED" if self.cancelled else "FAILED", self.sync_failure or "sync failed")
        if kinds is not None and not self.fetch_buckets(kinds):
            return self.finish("CANCELLED" if self.cancelled else "FAILED", self.bucket_failure)
        stages = self.payload.get("stages") or {}
        if stages.get("setup"):
            self.phase("setup")
            self.relay.command("start setup")
            if not self.wait(lambda: self.accounted(all_ranks, self.exits["setup"])):
                return self.cancel(("setup",))
            failed = [r for r in all_ranks if self.exits["setup"].get(r) != 0]
            if failed:
                return self.finish("FAILED_SETUP", "setup failed", ranks=failed)
        if stages.get("run"):
            job = list(range(self.job_ranks))
            self.phase("run")
            self.run_started = True
            self.relay.command("start run")
            if not self.wait(lambda: self.accounted(job, self.started["run"]) or self.first_failed is not None):
                return self.cancel(("run",))
            self.phase("running")
            killed = False
            while not self.accounted(job, self.exits["run"]):
                if self.check_cancel():
                    return self.cancel(("run",))
                if self.first_failed is not None and not killed:
                    killed = True  # fail fast: the others are stopped at once
                    self.relay.command("kill %g run" % self.grace)
                self.relay.step(timeout=0.2)
            failed = [r for r in job if self.exits["run"].get(r) != 0]
            return self.finish("FAILED" if failed else "SUCCEEDED", "", ranks=failed)
        return self.finish("SUCCEEDED", "")

    def do_sync(self):
        """Claims on every node, then copies from the head to the owners in waves (a tree)."""
        self.sync_failure = None
        dests = self.payload["sync"]
        token = "%s-%s" % (self.payload["job"], self.payload.get("nonce") or os.getpid())
        self.relay.command("claim " + token)
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
        for i in range(len(dests)):
            owners = [0] + [r for r in range(1, self.n) if self.claims.get(r, [None] * len(dests))[i] == r]
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
        self.write(ev("P", "plan", json.dumps({"copies": copies}, separators=(",", ":"))))
        waves = {}
        for edge, idx in edges.items():
            waves.setdefault(depth_of[edge], []).append([edge[0], edge[1], idx])
        for depth in sorted(waves):
            wave = waves[depth]
            targets = [w[1] for w in wave]
            for t in targets:
                self.synced.pop(t, None)
            self.relay.command("sync " + json.dumps(wave, separators=(",", ":")))
            if not self.wait(lambda: self.accounted(targets, self.synced)):
                self.sync_failure = "sync cancelled"
                return False
            bad = ["%s: %s" % (self.payload["peers"][t]["name"], self.synced[t][1]) for t in targets
                   if t in self.synced and self.synced[t][0] != 0]
            if bad or self.lost:
                self.sync_failure = "sync failed: " + "; ".join(bad + ([self.describe_lost()] if self.lost else []))
                return False
        self.relay.command("release")
        return True

    def check_buckets(self):
        """Before the copies, on the head: create the buckets named without a source, check the
        others (see "buckets"); each mount's kind, or None (bucket_failure says why)."""
        self.phase("buckets")
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
        self.phase("mounts")
        self.fetched = {}
        token = "%s-%s-b" % (self.payload["job"], self.payload.get("nonce") or os.getpid())
        self.relay.command("buckets %s %s" % (token, json.dumps(kinds, separators=(",", ":"))))
        all_ranks = list(range(self.n))
        if not self.wait(lambda: self.accounted(all_ranks, self.fetched)):
            self.bucket_failure = "cancelled"
            return False
        self.relay.command("release")
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
        self.relay.command("kill %g %s" % (self.grace, " ".join(stages)))
        self.phase("cancelling")
        deadline = time.time() + self.grace + 15
        for stage in stages:
            started = sorted(self.started[stage])
            while not self.accounted(started, self.exits[stage]) and time.time() < deadline:
                self.relay.step(timeout=0.2)
        return self.finish("CANCELLED", "cancelled")

    def finish(self, status, detail, ranks=()):
        codes = dict((str(r), c) for r, c in self.exits["run"].items())
        if self.run_started:  # a node lost before run started has no run code to report
            for r in self.lost:
                if r < self.job_ranks:
                    codes.setdefault(str(r), None)
        outcome = {
            "status": status, "detail": detail, "ranks": list(ranks),
            "setup": dict((str(r), c) for r, c in self.exits["setup"].items()),
            "run": codes, "first_failed": self.first_failed,
            "lost": dict((str(r), why) for r, why in self.lost.items()),
        }
        self.relay.command("cleanup")
        self.relay.command("end")
        self.relay.close(grace=self.grace)
        deadline = time.time() + 10
        while any(not c.out.eof for c in self.relay.children) and time.time() < deadline:
            self.relay.step(timeout=0.1)
        write_atomic(os.path.join(self.jobdir, "job.json"), json.dumps(outcome))
        self.write(ev("D", status, json.dumps(outcome, separators=(",", ":"))))
        write_atomic(os.path.join(self.jobdir, "events.exit"), "0")
        return 0


def cmd_coordinate(args):
    """Detached, started by `submit`: the secrets arrive on stdin, then it runs the job."""
    jobdir = job_dir(args.job)
    with open(os.path.join(jobdir, "payload.json")) as fh:
        payload = json.load(fh)
    secrets = json.loads(sys.stdin.buffer.read().decode("utf-8") or '""')
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    coordinator = Coordinator(jobdir, payload, secrets)

    def on_term(signum, frame):
        coordinator.cancelled = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, on_term)
    return coordinator.run()


def cmd_submit(args):
    """The controller's one call: take the job from stdin, start the coordinator, stream its events."""
    out = Out()
    payload, secrets = read_payload(sys.stdin.buffer)
    problem = prepared_problem(payload.get("fingerprint"))
    if problem:
        return answer_without_job(out, ev("H", 0, "unprepared", problem),
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
        return answer_without_job(out, ev("H", 0, "problem", problem), {
            "status": "FAILED", "ranks": [0], "detail": describe_by_node(payload["peers"], {0: problem})})
    with open(os.path.join(jobdir, "coordinator.log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "coordinate", payload["job"]],
                                stdin=subprocess.PIPE, stdout=log, stderr=log, close_fds=True,
                                start_new_session=True, cwd=os.path.expanduser("~"))
    write_atomic(os.path.join(jobdir, "events.supervisor"), str(proc.pid))
    proc.stdin.write(json.dumps(secrets).encode())
    proc.stdin.close()
    return follow_stage(Stage(jobdir, "events"), out, offset=0, print_offset=True)


def cmd_attach(args):
    """Stream a job's events from a byte offset (a controller reconnecting, `gpuctl logs`)."""
    return follow_stage(Stage(job_dir(args.job), "events"), Out(), offset=args.offset, print_offset=True)


def cmd_cancel(args):
    """Ask the coordinator to stop the job everywhere; wait until it recorded the outcome."""
    jobdir = job_dir(args.job)
    if not os.path.isdir(jobdir):
        print(json.dumps({"status": "UNKNOWN"}))
        return 0
    write_atomic(os.path.join(jobdir, "cancel"), "1")
    events = Stage(jobdir, "events")
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
    events = Stage(jobdir, "events")
    alive = pid_alive(read_int(events.supervisor))
    print(json.dumps({"status": "RUNNING" if alive else ("UNKNOWN" if not os.path.isdir(jobdir) else "LOST")}))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpuctl-node", description="gpuctl node agent")
    sub = parser.add_subparsers(dest="cmd")
    sub.required = True

    p = sub.add_parser("launch", help="start STAGE.sh detached, in its own session")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.add_argument("--wait", action="store_true", help="wait and exit with the stage's exit code")
    p.add_argument("--workdir", default="~/gpuctl_workdir",
                   help="directory to run in (default ~/gpuctl_workdir; $HOME if missing)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("follow", help="print STAGE.log as it grows, then the exit sentinel")
    p.add_argument("jobdir")
    p.add_argument("stage")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--from-start", action="store_true", help="print the whole log (default)")
    where.add_argument("--tail", type=int, metavar="N", help="start with the last N lines")
    where.add_argument("--offset", type=int, metavar="BYTES", help="start at this byte offset")
    p.add_argument("--print-offset", action="store_true",
                   help="first print '%s <byte offset>' (used to resume)" % OFFSET_HEADER)
    p.set_defaults(func=cmd_follow)

    p = sub.add_parser("kill", help="SIGTERM the stage's process group, SIGKILL after --grace")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.add_argument("--grace", type=float, default=10.0)
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("status", help="print {pid, running, exit, killed} as JSON")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("claim", help="create and claim destinations; print each one's owner rank (JSON)")
    p.add_argument("token")
    p.add_argument("rank", type=int)
    p.add_argument("--dir", action="append", default=[], help="a destination directory")
    p.add_argument("--file", action="append", default=[], help="a destination file")
    p.add_argument("--release", action="store_true", help="remove this node's markers again")
    p.set_defaults(func=cmd_claim)

    p = sub.add_parser("unmount-bucket", help="unmount a job's bucket mount at PATH once unused and uploaded")
    p.add_argument("path")
    p.add_argument("--lifeline-fd", type=int, help="first wait for EOF on this inherited descriptor")
    p.set_defaults(func=cmd_unmount_bucket)
    p = sub.add_parser("check-dest", help="exit 2 with one line if nothing may be copied to DEST here")
    p.add_argument("dest")
    p.set_defaults(func=cmd_check_dest)

    p = sub.add_parser("submit", help="run a job from stdin on the cluster, streaming its events")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("relay", help="a worker's part of a job (started by its parent node)")
    p.set_defaults(func=cmd_relay)
    p = sub.add_parser("container-stage", help="a stage in the node's container (started by its supervisor)")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.set_defaults(func=cmd_container_stage)
    p = sub.add_parser("coordinate", help="the head's coordinator of a job (started by submit)")
    p.add_argument("job")
    p.set_defaults(func=cmd_coordinate)
    p = sub.add_parser("attach", help="stream a job's events from a byte offset")
    p.add_argument("job")
    p.add_argument("--offset", type=int, default=0)
    p.set_defaults(func=cmd_attach)
    p = sub.add_parser("cancel", help="stop a job on every node and wait for its outcome")
    p.add_argument("job")
    p.add_argument("--wait", type=float, default=30.0)
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("job-status", help="a job's outcome (job.json), or RUNNING / LOST")
    p.add_argument("job")
    p.set_defaults(func=cmd_job_status)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
