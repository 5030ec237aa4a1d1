"""Autostop on the head: the cluster stops or removes itself once idle, with no controller running.

`gpuctl-node autostop set|cancel|renew|release|show|sessions` keep ~/.gpuctl/autostop.json; `set`
starts the watcher (`autostop-watch`: detached, one per node by its lock), which reads that file
every few seconds, so a new setting takes effect without restarting it.

Idle means: no job (a job directory without job.json whose coordinator runs), no controller lease
(`apply` holds one while it works and renews it; a controller that died stops renewing), and,
under wait_for jobs_and_ssh, no login with a terminal on any node (workers are asked only when
the head's countdown has run out). A running job is never idle, whatever the lease says.

When the cluster has been idle for idle_minutes, the watcher runs the hook (bounded by
hook_timeout), then every worker's power-off command (over the cluster's own ssh), then the
head's own commands, itself last. The provider chose those commands: on AWS, `shutdown`, which
stops or terminates as the instance's shutdown behaviour says; on local nodes, the node's own
teardown script, run in this machine's namespaces.
"""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

from gpuctl.node.jobdir import GPUCTL_DIR, JOBS_DIR, agent_file, read_int, shell_quote, write_private
from gpuctl.node.peerssh import peer_ssh_argv, run_peer_ssh
from gpuctl.node.procs import pid_alive, stat_fields
from gpuctl.node.protocol import AGENT, AUTOSTOP_WAIT_FOR, CMD_AUTOSTOP, CMD_AUTOSTOP_WATCH

AUTOSTOP_CONFIG = os.path.join(GPUCTL_DIR, "autostop.json")
AUTOSTOP_STATE = os.path.join(GPUCTL_DIR, "autostop.state")  # what the watcher saw last (show)
AUTOSTOP_LOG = os.path.join(GPUCTL_DIR, "autostop.log")
AUTOSTOP_LOCK = os.path.join(GPUCTL_DIR, "autostop.lock")  # held by the one watcher
SUBMIT_GRACE_S = 30.0  # a job directory whose coordinator is not yet recorded: being submitted
POWER_OFF_TIMEOUT_S = 120.0


def read_json(path):
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def log(message):
    try:
        with open(AUTOSTOP_LOG, "a") as fh:
            fh.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message))
    except OSError:
        pass


def active_jobs(jobs_dir=None, now=None):
    """Names of the jobs that run here: no job.json yet, and a live coordinator or a fresh directory."""
    jobs_dir = jobs_dir or JOBS_DIR
    now = time.time() if now is None else now
    try:
        names = os.listdir(jobs_dir)
    except OSError:
        return []
    active = []
    for name in names:
        path = os.path.join(jobs_dir, name)
        if os.path.exists(os.path.join(path, "job.json")):
            continue
        supervisor = read_int(os.path.join(path, "events.supervisor"))
        try:
            fresh = supervisor is None and now - os.stat(path).st_mtime < SUBMIT_GRACE_S
        except OSError:
            continue
        if fresh or pid_alive(supervisor):
            active.append(name)
    return sorted(active)


def last_job_end(jobs_dir=None):
    """When the last job here ended (its job.json), or 0."""
    jobs_dir = jobs_dir or JOBS_DIR
    latest = 0.0
    try:
        names = os.listdir(jobs_dir)
    except OSError:
        return latest
    for name in names:
        try:
            latest = max(latest, os.stat(os.path.join(jobs_dir, name, "job.json")).st_mtime)
        except OSError:
            pass
    return latest


def _stat(proc_root, pid):
    """(ppid, tty_nr) of a process, readable for every process; None if gone."""
    fields = stat_fields(pid, proc_root)
    try:
        return None if fields is None else (int(fields[1]), int(fields[4]))
    except (IndexError, ValueError):
        return None


def _local_addresses(proc_root, pid):
    """The IPv4 addresses local to PID's network namespace (PROC/PID/net/fib_trie, which anyone may
    read, unlike PROC/PID/ns/net of another user's process); None when unreadable."""
    found = set()
    previous = None
    try:
        with open(os.path.join(proc_root, pid, "net", "fib_trie")) as fh:
            for line in fh:
                text = line.strip()
                if text.startswith("|-- "):
                    previous = text[4:]
                elif text.startswith("/32 host LOCAL") and previous:
                    found.add(previous)
    except OSError:
        return None
    return frozenset(found)


def _same_network(proc_root, pid, own_ns, own_addresses):
    """Whether PID shares this node's network namespace: by the namespace itself where it may be
    read, else by the namespace's local addresses (every local node has its own); True when neither
    can be read (better kept up than cut off)."""
    try:
        if own_ns is not None:
            return os.readlink(os.path.join(proc_root, pid, "ns", "net")) == own_ns
    except OSError:
        pass
    theirs = _local_addresses(proc_root, pid)
    return theirs is None or own_addresses is None or theirs == own_addresses


def terminal_sessions(proc_root="/proc"):
    """Logins with a terminal on this node: a process with a terminal whose parent is an sshd session
    (`sshd: USER@pts/N`). Counted in this node's network namespace only, since local nodes share one
    machine's processes; the session process itself cannot be asked (sshd makes it non-dumpable),
    so its shell is (`_same_network`)."""
    try:
        own = os.readlink(os.path.join(proc_root, "self", "ns", "net"))
    except OSError:
        own = None
    own_addresses = _local_addresses(proc_root, "self")
    titles = {}
    sessions = set()
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        stat = _stat(proc_root, entry)
        if stat is None or stat[1] == 0:  # no controlling terminal
            continue
        parent = str(stat[0])
        if parent not in titles:
            try:
                with open(os.path.join(proc_root, parent, "cmdline"), "rb") as fh:
                    titles[parent] = fh.read().split(b"\0")[0].decode("utf-8", "replace")
            except OSError:
                titles[parent] = ""
        if not (titles[parent].startswith("sshd: ") and "@pts/" in titles[parent]):
            continue
        if not _same_network(proc_root, entry, own, own_addresses):
            continue
        sessions.add(parent)
    return len(sessions)


def validate(config):
    """The setting as `set` takes it; ValueError naming what is wrong."""
    if not isinstance(config, dict):
        raise ValueError("the autostop setting must be a JSON object")
    idle = config.get("idle_minutes")
    if not isinstance(idle, int) or isinstance(idle, bool) or idle < 0:
        raise ValueError("idle_minutes must be a whole number >= 0")
    if config.get("wait_for", "jobs_and_ssh") not in AUTOSTOP_WAIT_FOR:
        raise ValueError("wait_for must be one of %s" % ", ".join(AUTOSTOP_WAIT_FOR))
    def argv(value):
        return isinstance(value, list) and value and all(isinstance(a, str) for a in value)

    if not all(argv(c) for c in config.get("head_off") or []):
        raise ValueError("head_off must be a list of argument lists")
    for worker in config.get("workers") or []:
        if not (isinstance(worker, dict) and isinstance(worker.get("host"), str)
                and (worker.get("off") is None or argv(worker["off"]))):
            raise ValueError("each worker needs host and ssh, and off as an argument list or null")
    return config


def shown(config, state, now=None):
    """What `show` prints: the setting (without the nodes' commands) and what the watcher saw."""
    now = time.time() if now is None else now
    if config is None:
        return {"set": False}
    state = state or {}
    idle_since = state.get("idle_since")
    return {
        "set": True, "idle_minutes": config.get("idle_minutes"), "down": bool(config.get("down")),
        "wait_for": config.get("wait_for", "jobs_and_ssh"), "hook": bool(config.get("hook")),
        "lease_left_s": max(0.0, round(float(config.get("lease_until") or 0) - now, 1)),
        "idle_s": None if idle_since is None else max(0.0, round(now - float(idle_since), 1)),
        "busy": state.get("busy"), "phase": state.get("phase"),
        "watcher": watcher_running(),
    }


def watcher_running():
    """Whether a watcher holds the lock (one nobody holds: none runs)."""
    try:
        fd = os.open(AUTOSTOP_LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if this took it
    return False


def ensure_watcher():
    """Start the watcher again where a setting exists and none runs: it was killed, or the node
    rebooted (an AWS stop and start). `status`, a lease renewal and every job submission ask."""
    if os.path.exists(AUTOSTOP_CONFIG) and not watcher_running():
        log("the watcher was not running: started again")
        _start_watcher()


def _start_watcher():
    with open(AUTOSTOP_LOG, "a") as out:
        subprocess.Popen([sys.executable, agent_file(), CMD_AUTOSTOP_WATCH], stdin=subprocess.DEVNULL,
                         stdout=out, stderr=out, close_fds=True, start_new_session=True,
                         cwd=os.path.expanduser("~"))


def cmd_autostop(args):
    """`gpuctl-node autostop ACTION`: set (the setting on stdin), cancel, renew, release, show, sessions."""
    now = time.time()
    if args.action == "sessions":
        print(json.dumps({"sessions": terminal_sessions()}))
        return 0
    config = read_json(AUTOSTOP_CONFIG)
    if args.action == "set":
        try:
            config = validate(json.loads(sys.stdin.read() or "null"))
        except ValueError as exc:
            sys.stderr.write("gpuctl-node autostop: %s\n" % exc)
            return 2
        lease_s = float(config.pop("lease_s", 0) or 0)
        config.update(set_at=now, lease_until=now + lease_s if lease_s > 0 else 0)
        write_private(AUTOSTOP_CONFIG, json.dumps(config))
        _write_state(phase="watching", idle_since=now, busy=None)  # not what an earlier watcher saw
        log("set: idle %s min, down %s, wait_for %s, lease %g s" % (
            config["idle_minutes"], bool(config.get("down")), config.get("wait_for", "jobs_and_ssh"), lease_s))
    elif args.action == "cancel":
        try:
            os.unlink(AUTOSTOP_CONFIG)
            log("cancelled")
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        late = too_late()
        if late:
            print(json.dumps({"set": False, "too_late": True, "phase": late}))
            return 0
        config = None
    elif args.action in ("renew", "release") and config is not None:
        config["lease_until"] = now + args.lease if args.action == "renew" else 0
        write_private(AUTOSTOP_CONFIG, json.dumps(config))
    if args.action != "cancel":
        ensure_watcher()
    print(json.dumps(shown(config, read_json(AUTOSTOP_STATE), now), sort_keys=True))
    return 0


def too_late(settle_s=2.0):
    """The power-off a cancel came too late for ("down" or "stop"), or None.

    The watcher records its phase before it reads the setting a last time, and a cancel removes
    the setting before it reads the phase: one of the two sees the other. A watcher that saw the
    cancel leaves the phase within moments; one that did not is powering the cluster off."""
    deadline = time.time() + settle_s
    while True:
        phase = (read_json(AUTOSTOP_STATE) or {}).get("phase")
        if phase not in ("down", "stop") or not watcher_running():
            return None
        if time.time() >= deadline:
            return phase
        time.sleep(0.1)


def going():
    """The power-off under way ("down" or "stop"), or None: a job submitted now is refused. The
    submission's directory exists before this is read, and the watcher writes the phase before it
    looks for jobs a last time: one of the two sees the other."""
    phase = (read_json(AUTOSTOP_STATE) or {}).get("phase")
    return phase if phase in ("down", "stop") and watcher_running() else None


def busy_reason(config, now):
    """Why the cluster is not idle now, from the head alone; None when it is."""
    jobs = active_jobs(now=now)
    if jobs:
        return "job %s" % jobs[0]
    if float(config.get("lease_until") or 0) > now:
        return "controller lease"
    if config.get("wait_for", "jobs_and_ssh") == "jobs_and_ssh" and terminal_sessions():
        return "ssh session on the head"
    return None


def worker_sessions(config):
    """Workers with a terminal login, asked all at once; an unreachable worker counts as none."""
    found = []

    def ask(worker):
        argv = peer_ssh_argv(worker.get("ssh") or []) + ["--", worker["host"], "%s %s sessions" % (AGENT, CMD_AUTOSTOP)]
        try:
            _, out, _ = run_peer_ssh(argv, 30)
            count = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])["sessions"]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
            log("could not ask %s for its ssh sessions" % worker.get("name"))
            return
        if count:
            found.append(worker.get("name"))

    threads = [threading.Thread(target=ask, args=(w,)) for w in config.get("workers") or []]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


def run_hook(config):
    """The user's hook on the head, bounded by hook_timeout; its output goes to the log."""
    hook = config.get("hook")
    if not hook:
        return
    timeout = float(config.get("hook_timeout") or 3600)
    log("hook: running (at most %g s)" % timeout)
    with open(AUTOSTOP_LOG, "a") as out:
        proc = subprocess.Popen(["bash", "-c", hook], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, cwd=os.path.expanduser("~"))
        try:
            code = proc.wait(timeout=timeout)
            log("hook: exit code %d" % code)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log("hook: stopped after %g s (hook_timeout)" % timeout)


def power_off(config):
    """Every worker's power-off command at once, then the head's own commands, in order."""
    def off(worker):
        remote = " ".join(shell_quote(a) for a in worker["off"])
        argv = peer_ssh_argv(worker.get("ssh") or []) + ["--", worker["host"], remote]
        try:
            code, _, err = run_peer_ssh(argv, POWER_OFF_TIMEOUT_S)
            log("%s: power-off exit code %d %s" % (worker.get("name"), code,
                                                   err.decode("utf-8", "replace").strip()[-300:]))
        except (OSError, subprocess.SubprocessError) as exc:
            log("%s: power-off failed: %s" % (worker.get("name"), exc))

    threads = [threading.Thread(target=off, args=(w,)) for w in config.get("workers") or [] if w.get("off")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for argv in config.get("head_off") or []:
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  timeout=POWER_OFF_TIMEOUT_S, cwd="/")
            log("head: %s: exit code %d %s" % (argv[0], proc.returncode,
                                               proc.stderr.decode("utf-8", "replace").strip()[-300:]))
        except (OSError, subprocess.SubprocessError) as exc:
            log("head: %s failed: %s" % (argv[0], exc))


def _write_state(**state):
    try:
        write_private(AUTOSTOP_STATE, json.dumps(state))
    except OSError:
        pass


def _take_lock(tries=5):
    """The watcher's lock, or None when another watcher holds it. A few tries: `watcher_running`
    holds it for an instant when it looks."""
    fd = os.open(AUTOSTOP_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if attempt + 1 < tries:
                time.sleep(0.1)
    os.close(fd)
    return None


def cmd_autostop_watch(args):
    """The watcher: wait until the cluster is idle for long enough, then take it down."""
    lock = _take_lock()
    if lock is None:
        return 0  # another watcher reads the same setting
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    idle_since = None
    seen_set_at = None
    while True:
        config = read_json(AUTOSTOP_CONFIG)
        if config is None:
            os.close(lock)  # a `set` from now on starts a watcher that can take the lock
            if read_json(AUTOSTOP_CONFIG) is None:
                _write_state(phase="off")
                return 0
            lock = _take_lock()  # set again meanwhile, and its watcher found the lock still taken
            if lock is None:
                return 0
            continue
        now = time.time()
        minute = float(config.get("minute_s") or 60)
        if config.get("set_at") != seen_set_at:  # a new setting: the countdown starts again
            seen_set_at = config.get("set_at")
            idle_since = max(float(config.get("set_at") or now), last_job_end())
        busy = busy_reason(config, now)
        if busy:
            idle_since = now
        _write_state(phase="watching", idle_since=idle_since, busy=busy, pid=os.getpid())
        if not busy and now - idle_since >= int(config.get("idle_minutes") or 0) * minute:
            waiting = (config.get("wait_for", "jobs_and_ssh") == "jobs_and_ssh" and worker_sessions(config))
            if waiting:
                log("idle on the head, but %s has an ssh session: waiting" % ", ".join(waiting))
                idle_since = time.time()
                _write_state(phase="watching", idle_since=idle_since, busy="ssh session on " + waiting[0],
                             pid=os.getpid())
            else:
                action = "down" if config.get("down") else "stop"
                log("idle for %.0f s: %s" % (now - idle_since, action))
                _write_state(phase="hook", idle_since=idle_since, busy=None, pid=os.getpid())
                run_hook(config)
                if read_json(AUTOSTOP_CONFIG) is None:  # cancelled during the hook
                    log("cancelled during the hook: nothing stopped")
                    continue
                _write_state(phase=action, idle_since=idle_since, busy=None, pid=os.getpid())
                if read_json(AUTOSTOP_CONFIG) is None:  # the commit point: see too_late
                    log("cancelled before the power-off: nothing stopped")
                    continue
                # The phase is written, so a job submitted from now on is refused (going); one that came
                # during the hook, or just before, and an ssh session opened meanwhile, hold the cluster.
                busy = busy_reason(config, time.time())
                if not busy and config.get("wait_for", "jobs_and_ssh") == "jobs_and_ssh":
                    busy = next(("ssh session on " + w for w in worker_sessions(config)), None)
                if busy:
                    log("busy again after the hook (%s): waiting" % busy)
                    idle_since = time.time()
                    _write_state(phase="watching", idle_since=idle_since, busy=busy, pid=os.getpid())
                    continue
                power_off(config)
                return 0
        time.sleep(max(0.2, min(10.0, minute / 6.0)))
