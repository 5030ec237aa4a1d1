"""A stage on this node: its detached supervisor, which starts, waits for and records it; stopping it.

`start_stage` forks a supervisor in a session of its own (it outlives the
ssh call that started it) that runs STAGE.sh under bash through WRAPPER (or
in the node's container), records STAGE.pid and STAGE.exit, and, given a
lifeline, stops the stage when the job's owner on this node dies.
`kill_stage` / `stop_group` end a stage wherever its processes went. The
commands launch, kill and status act on one stage (`gpuctl logs`, fallbacks).
"""

import binascii
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

from gpuctl.node.containers import CONTAINER_FILE, signal_in_container, stage_container
from gpuctl.node.jobdir import (
    FABRIC_ENV, Stage, WRAPPER, agent_file, read_int, remove, shell_quote, stage_supervisor, stage_tag,
    status_of, write_atomic,
)
from gpuctl.node.procs import (
    STAGE_TAG, become_subreaper, descendants, group_alive, kill_all, killpg, stage_processes, tagged_processes,
)
from gpuctl.node.protocol import CMD_CONTAINER_STAGE


NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def stage_env_text(stage, spec, rank, jobdir, gpu_devices=None):
    """The exported variables of one stage on one node (values single-quoted). `gpu_devices`: the
    GPUs the head's queue gave the job on this node (gpuqueue.py), the only ones its stage sees."""
    lines = ["# Written by gpuctl-node: the %s environment of this job. Values are single-quoted." % stage]
    for name in sorted(spec.get("env") or {}):
        if NAME_RE.fullmatch(name):
            lines.append("export %s=%s" % (name, shell_quote(spec["env"][name])))
    for name in spec.get("rank_vars") or []:
        if NAME_RE.fullmatch(name):
            lines.append("export %s=%s" % (name, rank))
    if spec.get("hostfile") is not None:
        lines.append("export GPUCTL_HOSTFILE=%s" % shell_quote(os.path.join(jobdir, "hostfile")))
    if gpu_devices is not None:
        lines.append("export CUDA_VISIBLE_DEVICES=%s" % shell_quote(",".join(str(int(i)) for i in gpu_devices)))
    return "\n".join(lines) + "\n"


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
        argv = [sys.executable, agent_file(), CMD_CONTAINER_STAGE, st.jobdir, st.name]
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
    code, err, fd = start_stage_watched(st, workdir, lifeline, grace)
    if fd is None:
        return code, err
    if not wait:
        os.close(fd)
        return 0, ""
    with os.fdopen(fd, "rb") as pipe:
        last = pipe.readline()  # "exit N", or EOF if the supervisor died
    if last.startswith(b"exit "):
        return int(last.split()[1]) & 0xFF, ""
    code = st.exit_code()
    return (255 if code is None else code & 0xFF), ""


def start_stage_watched(st, workdir, lifeline=None, grace=3.0):
    """start_stage without waiting: (0, "", fd) once the stage's process group exists, where `fd` is
    the read end of the supervisor's notice pipe, which becomes readable the moment the stage's exit
    is recorded (a reader can select on it instead of polling); (code, error, None) when it did not start."""
    if not os.path.isfile(st.script):
        return 2, "%s does not exist" % st.script, None
    if st.running():
        return 3, "stage %s is already running (pgid %s)" % (st.name, st.pgid()), None
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
    first = _read_line(read_fd)  # byte by byte: the exit's line stays in the pipe for the caller's select
    if not first.startswith(b"started"):
        os.close(read_fd)
        return 1, "the supervisor of %s did not start" % st.name, None
    return 0, "", read_fd


def _read_line(fd):
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line


def cmd_launch(args):
    code, err = start_stage(Stage(args.jobdir, args.stage), args.workdir, wait=args.wait)
    if err:
        sys.stderr.write("gpuctl-node: %s\n" % err)
    return code


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

    def alive():
        return group_alive(pgid) or bool(_stage_others(st, pgid, box))

    def send(sig, inside):
        signal_stage(st, pgid, sig, inside, box)

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


def _stage_others(st, pgid, box):
    """The stage's processes outside its group (not in a container: there the runtime's own
    monitors live under the supervisor): below its supervisor, or carrying its tag."""
    if box:
        return []
    supervisor = stage_supervisor(st)
    return sorted(p for p in set(stage_processes(pgid, supervisor)) | set(tagged_processes(stage_tag(st)))
                  if p != pgid and p != supervisor)


def signal_stage(st, pgid, sig, inside=True, box=None):
    """Send `sig` to every process of the stage once: its process group (in its container where it
    runs in one and `inside`), and what left the group (stop_group's one step; the spot notice's
    SIGTERM, which must reach torchrun's workers in their own sessions as a stop would)."""
    box = box or stage_container(st)
    tree = _stage_others(st, pgid, box)  # before its parents die: what they leave goes to init
    if not (inside and box and signal_in_container(box, st, sig)):
        killpg(pgid, sig)
    kill_all(tree, sig)


def cmd_status(args):
    print(json.dumps(status_of(Stage(args.jobdir, args.stage))))
    return 0
