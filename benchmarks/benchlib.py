"""Shared plumbing for the benchmarks: the real `gpuctl` command as a subprocess
with every output line timestamped, a local cluster that is always torn down
(and checked to be gone), process-table probes, small statistics, tables and
an optional matplotlib plot.

Benchmarks run gpuctl exactly as a user does (`python -m gpuctl ...`, plain
output because stdout is a pipe) in a private GPUCTL_STATE_DIR under a temp
dir. Nothing here imports gpuctl: what is measured is the command.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


def gpuctl_python() -> str:
    """An interpreter that can `import gpuctl`: this one, else the repo's .venv."""
    try:
        import gpuctl  # noqa: F401
        return sys.executable
    except ImportError:
        venv = REPO / ".venv" / "bin" / "python"
        if venv.exists():
            return str(venv)
        raise SystemExit("gpuctl is not importable; run with the repo's venv: .venv/bin/python benchmarks/...")


def preflight() -> None:
    """Local nodes in netns mode need root, iproute2, terraform, sshd, rsync."""
    missing = [t for t in ("terraform", "ssh", "ssh-keygen", "rsync", "ip") if not shutil.which(t)]
    if not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")):
        missing.append("sshd")
    if missing:
        raise SystemExit(f"missing tools for local nodes: {', '.join(missing)}")
    if os.geteuid() != 0:
        print("note: not root: local nodes run in loopback mode (no network namespaces)", file=sys.stderr)


def machine_note() -> str:
    """CPU count, memory and load, to print next to every table (the machine is shared)."""
    la = os.getloadavg()
    mem_gib = os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30
    return f"{os.cpu_count()} CPUs, {mem_gib:.0f} GiB RAM, load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"


# -- running gpuctl -----------------------------------------------------------------

STAGE_START = re.compile(r"^==> (?P<title>.+)$")
STAGE_DONE = re.compile(r"^    (?P<title>.+): done in (?P<secs>[0-9.]+)s$")
JOB_RUNNING = re.compile(r"^Job (?P<id>\d+) running \(")

# Stage titles (cli.py / jobplane/runner.py) -> short names; titles carry node counts.
STAGE_KEYS = (
    ("Provisioning", "provision"),
    ("Preparing", "prepare"),
    ("Copying the", "upload"),
    ("Waiting for", "wait"),
    ("Syncing workdir", "sync"),
    ("Running setup", "setup"),
    ("Writing hostfile", "env"),
    ("Starting job", "run"),
    ("Tearing down", "down"),
)


def stage_key(title: str) -> str:
    for prefix, key in STAGE_KEYS:
        if title.startswith(prefix):
            return key
    return title


@dataclass
class Line:
    t: float  # time.time() when the benchmark read the line
    text: str
    cpu: float | None = None  # gpuctl's CPU seconds so far, reaped descendants included


CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu_so_far(pid: int) -> float | None:
    """utime+stime+cutime+cstime of `pid` (/proc/PID/stat): its own CPU and that of
    every child it has waited for (each of which includes its own reaped children)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    f = stat[stat.rfind(b")") + 2:].split()
    return sum(int(x) for x in f[11:15]) / CLK_TCK


class Gpuctl:
    """One running `gpuctl ARGS` in its own session; stdout/stderr read line by line."""

    def __init__(self, *args: str, env: dict[str, str], cwd: Path | None = None,
                 on_line: Callable[[Line], None] | None = None) -> None:
        self.argv = [gpuctl_python(), "-m", "gpuctl", *args]
        self.on_line = on_line
        self.stdout: list[Line] = []
        self.stderr: list[Line] = []
        self.started = time.time()
        self.ended: float | None = None
        self.cpu: float | None = None  # user+sys seconds of gpuctl and the descendants it reaped
        self._exit_lock = threading.Lock()
        # Own session: signals we send reach only gpuctl (and, for a group
        # signal, its process group), never this benchmark.
        self.proc = subprocess.Popen(self.argv, cwd=cwd or REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     errors="replace", start_new_session=True)
        self._readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True)]
        for t in self._readers:
            t.start()

    def _pump(self, stream, sink: list[Line]) -> None:
        for text in iter(stream.readline, ""):
            line = Line(time.time(), text.rstrip("\n"),
                        tree_cpu_so_far(self.proc.pid) if sink is self.stdout else None)
            sink.append(line)
            if self.on_line is not None and sink is self.stdout:
                self.on_line(line)
        stream.close()

    def poll(self) -> int | None:
        """Exit code or None; reaps gpuctl ourselves to keep its rusage, which
        counts every descendant it waited for (ansible-playbook and its forks)."""
        with self._exit_lock:
            if self.proc.returncode is None:
                try:
                    pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
                except ChildProcessError:
                    return self.proc.poll()
                if pid == 0:
                    return None
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.cpu = usage.ru_utime + usage.ru_stime
            if self.ended is None:
                self.ended = time.time()
            return self.proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; on timeout: Ctrl-C (gpuctl cancels the job), then SIGKILL."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.poll() is None:
                if deadline is not None and time.monotonic() > deadline:
                    self.stop()
                    break
                time.sleep(0.01)
        except BaseException:  # the benchmark is interrupted: cancel the job before teardown
            self.stop()
            raise
        for t in self._readers:
            t.join(timeout=10)
        assert self.proc.returncode is not None
        return self.proc.returncode

    def stop(self) -> None:
        """SIGINT, then SIGKILL to the group if it does not end within 60 s."""
        if self.poll() is not None:
            return
        self.interrupt()
        deadline = time.monotonic() + 60
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.poll() is None:
            self.interrupt(sig=signal.SIGKILL, group=True)
            while self.poll() is None:
                time.sleep(0.02)

    def interrupt(self, *, sig: int = signal.SIGINT, group: bool = False) -> None:
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def first(self, pattern: re.Pattern[str] | str) -> Line | None:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return next((ln for ln in self.stdout if rx.search(ln.text)), None)

    def stages(self, *, cpu: bool = False) -> dict[str, float]:
        """Stage -> seconds, from the `==> X` / `X: done in Ys` lines (our timestamps, ms
        resolution); with cpu=True the CPU seconds of gpuctl's process tree in each stage
        (counted when ansible-playbook and its forks have been reaped, i.e. by the done line)."""
        opened: dict[str, Line] = {}
        out: dict[str, float] = {}
        for ln in self.stdout:
            m = STAGE_START.match(ln.text)
            if m:
                opened[m["title"]] = ln
                continue
            m = STAGE_DONE.match(ln.text)
            if m and m["title"] in opened:
                start = opened.pop(m["title"])
                if not cpu:
                    out[stage_key(m["title"])] = ln.t - start.t
                elif ln.cpu is not None and start.cpu is not None:
                    out[stage_key(m["title"])] = ln.cpu - start.cpu
        return out

    def describe(self) -> str:
        rc = self.proc.returncode
        return (f"$ {' '.join(self.argv[1:])}\nexit {rc}\n--- stdout\n"
                + "".join(ln.text + "\n" for ln in self.stdout)
                + "--- stderr\n" + "".join(ln.text + "\n" for ln in self.stderr))


def run_gpuctl(*args: str, env: dict[str, str], timeout: float = 900, check: bool = True) -> Gpuctl:
    g = Gpuctl(*args, env=env)
    rc = g.wait(timeout=timeout)
    if check and rc != 0:
        raise RuntimeError(f"gpuctl {args[0]} failed:\n{g.describe()}")
    return g


@dataclass
class Timed:
    """One command run to its end: exit code, wall seconds, CPU seconds of its process tree."""

    rc: int
    wall: float
    cpu: float  # user+sys of the command and every descendant that was waited for
    output: str  # stdout and stderr, for a failure's message


def timed_command(argv: Sequence[str], env: dict[str, str], timeout: float = 900) -> Timed:
    """Run `argv` to its end (no other child of this process may end meanwhile).

    CPU is the RUSAGE_CHILDREN delta around the run: the command and every
    descendant reaped below it (ssh, ansible forks, rsync), not daemons it
    leaves behind (an ssh ControlMaster: see ssh_masters).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(argv), env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, errors="replace", timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = 124, f"timed out after {timeout:g}s: {exc.stdout or ''}{exc.stderr or ''}"
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(rc, wall, cpu, output)


# -- a local cluster that is always torn down -----------------------------------------


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def netns_names() -> set[str]:
    if not shutil.which("ip"):
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def proc_alive(pid: int, start: str | None = None) -> bool:
    """A live (non-zombie) process, optionally the one that started at `start` (field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0] != b"Z" and (start is None or fields[19].decode() == start)


@dataclass
class Footprint:
    """What a local cluster put on this machine (from clusters/<name>/nodes/*/node.env)."""

    netns: list[str] = field(default_factory=list)
    sshd: list[tuple[int, str]] = field(default_factory=list)
    node_dirs: list[Path] = field(default_factory=list)

    @classmethod
    def read(cls, cdir: Path) -> "Footprint":
        fp = cls()
        for p in sorted((cdir / "nodes").glob("node*/node.env")):
            e = _env_file(p)
            if e.get("LN_NETNS"):
                fp.netns.append(e["LN_NETNS"])
            fp.node_dirs.append(Path(e["LN_DIR"]))
        for p in sorted((cdir / "nodes").glob("node*/sshd.pid")):
            pid, start = p.read_text().split()
            fp.sshd.append((int(pid), start))
        return fp

    def leftovers(self) -> list[str]:
        left = [f"netns {ns}" for ns in sorted(set(self.netns) & netns_names())]
        left += [f"sshd pid {pid}" for pid, start in self.sshd if proc_alive(pid, start)]
        left += [f"dir {d}" for d in self.node_dirs if d.exists()]
        return left


def read_inventory(cdir: Path) -> list[dict]:
    """The cluster's hosts from clusters/<name>/inventory.yml in rank order: each host's
    variables (ansible_host, ansible_port, ansible_user, ansible_ssh_private_key_file, ...)."""
    import yaml  # a gpuctl dependency, in the venv that runs the benchmarks

    hosts: list[dict] = []

    def walk(group: dict) -> None:
        for name, hv in (group.get("hosts") or {}).items():
            hosts.append({"name": str(name), **(hv or {})})
        for child in (group.get("children") or {}).values():
            walk(child or {})

    data = yaml.safe_load((cdir / "inventory.yml").read_text()) or {}
    for top in data.values():
        walk(top or {})
    return sorted(hosts, key=lambda h: h.get("gpuctl_rank", 0))


def bridge_tx_bytes(cdir: Path) -> int | None:
    """Bytes this machine has sent into the cluster's bridge (netns mode; None otherwise).

    The bridge device's TX counter in the root namespace counts only what the
    host itself transmits through it, i.e. the controller's traffic to the
    nodes; frames the bridge forwards from one node's veth to another's are not
    counted there.
    """
    env_file = cdir / "nodes" / "bridge.env"
    if not env_file.exists():
        return None
    bridge = _env_file(env_file).get("LN_BRIDGE")
    try:
        return int(Path(f"/sys/class/net/{bridge}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


class LocalCluster:
    """`gpuctl apply FILE --provision-only` on enter, `gpuctl down` on exit (always),
    then a check that its namespaces, sshd processes and directories are gone.

    With provision_only=False the whole `gpuctl apply FILE` runs on enter
    (provision, prepare, setup, run): `provision_run` holds it either way."""

    def __init__(self, name: str, num_nodes: int, workdir: Path, env: dict[str, str],
                 run: str = "true", *, setup: str | None = None, provision_only: bool = True,
                 timeout: float = 900, accelerators: str | None = None) -> None:
        self.name = name
        self.num_nodes = num_nodes
        self.state_dir = Path(env["GPUCTL_STATE_DIR"])
        self.env = env
        self.provision_only = provision_only
        self.timeout = timeout
        self.yaml = workdir / f"{name}.yaml"
        self.yaml.write_text(f"name: {name}\nnum_nodes: {num_nodes}\nresources:\n  infra: local\n"
                             + (f"  accelerators: {accelerators}\n" if accelerators else "")
                             + (f"setup: {json.dumps(setup)}\n" if setup is not None else "")
                             + f"run: {json.dumps(run)}\n")
        self.provision_run: Gpuctl | None = None
        self.down_run: Gpuctl | None = None
        self.footprint = Footprint()

    @property
    def cdir(self) -> Path:
        return self.state_dir / "clusters" / self.name

    def __enter__(self) -> "LocalCluster":
        try:
            args = ("apply", str(self.yaml), *(("--provision-only",) if self.provision_only else ()))
            self.provision_run = Gpuctl(*args, env=self.env)  # kept when it fails, for its output
            if self.provision_run.wait(timeout=self.timeout) != 0:
                raise RuntimeError(f"gpuctl apply failed:\n{self.provision_run.describe()}")
        finally:
            if self.cdir.exists():
                self.footprint = Footprint.read(self.cdir)
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def down(self) -> None:
        if self.cdir.exists():
            for attempt in range(2):
                self.down_run = run_gpuctl("down", self.name, env=self.env, check=False)
                if self.down_run.proc.returncode == 0:
                    break
                print(f"warning: gpuctl down {self.name} failed (attempt {attempt + 1}):\n"
                      + self.down_run.describe(), file=sys.stderr)
        left = self.footprint.leftovers()
        if self.cdir.exists():
            left.append(f"dir {self.cdir}")
        if left:
            raise RuntimeError(f"cluster {self.name} left behind after down: {', '.join(left)}")


@contextmanager
def state_dir(prefix: str, *, keep: bool = False) -> Iterator[tuple[Path, dict[str, str]]]:
    """A private GPUCTL_STATE_DIR under a temp dir and the environment for gpuctl.

    On the way out every cluster still in it is torn down (`gpuctl down`), its
    network namespaces, sshd processes and node directories are checked to be
    gone, and the temp dir is removed.
    """
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o755)  # nodes' users (loopback mode) read scripts written here
    env = {**os.environ, "GPUCTL_STATE_DIR": str(root / "state"), "GPUCTL_PLAIN": "1"}
    env.pop("GPUCTL_LOCAL_MODE", None)
    try:
        yield root, env
    finally:
        left: list[str] = []
        clusters = root / "state" / "clusters"
        for cdir in sorted(clusters.iterdir()) if clusters.is_dir() else ():
            fp = Footprint.read(cdir)
            inside = sorted(str(p.relative_to(cdir)) for p in cdir.rglob("*"))[:20]
            print(f"cleanup: gpuctl down {cdir.name} (left: {inside})", file=sys.stderr)
            run_gpuctl("down", cdir.name, env=env, check=False)
            left += fp.leftovers() + ([f"dir {cdir}"] if cdir.exists() else [])
        if left:
            keep = True
            print(f"warning: left behind: {', '.join(left)}", file=sys.stderr)
        if keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def sigterm_as_interrupt() -> None:
    """SIGTERM ends the benchmark like Ctrl-C: every `finally` (gpuctl down) still runs."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


# -- the process table ----------------------------------------------------------------


def _environ(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return None


def find_env_processes(entry: str) -> dict[int, tuple[str, dict[str, str]]]:
    """Live processes whose environment holds `entry` (NAME=VALUE):
    pid -> (start time, {NAME: value} of the GPUCTL_* / BENCH_* variables)."""
    needle = entry.encode()
    found: dict[int, tuple[str, dict[str, str]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        env = _environ(name)
        if env is None or needle not in env:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields[0] == b"Z":
            continue
        kv = {}
        for item in env:
            k, _, v = item.partition(b"=")
            if k.startswith((b"GPUCTL_", b"BENCH_")):
                kv[k.decode()] = v.decode(errors="replace")
        found[int(name)] = (fields[19].decode(), kv)
    return found


def descendants(root: int) -> list[int]:
    """`root` and every process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def control_hash(host: str, port: int, user: str) -> str:
    """OpenSSH's %C for a destination (sha1 of local host name, host, port, user): the
    ControlPath socket name, whatever directory a client keeps its sockets in."""
    return hashlib.sha1(f"{socket.gethostname()}{host}{port}{user}".encode()).hexdigest()


def mux_masters() -> dict[int, Path]:
    """Every live ssh ControlMaster (`ssh: PATH [mux]`): pid -> its socket path."""
    found: dict[int, Path] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().rstrip(b"\0").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ssh: ") and cmd.endswith(" [mux]"):
            found[int(name)] = Path(cmd[5:-6])
    return found


def ssh_masters(hashes: Iterable[str]) -> dict[int, Path]:
    """Live ssh ControlMaster processes whose socket is named by one of `hashes`: pid -> socket
    path. They are daemons: no rusage of ours counts them."""
    wanted = set(hashes)
    found = {pid: path for pid, path in mux_masters().items() if path.name in wanted}
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of each process itself (not its children), summed; 0 for one that is gone.

    From /proc/PID/schedstat (ns on the CPU, of the main thread: ssh has no
    other) where the kernel has it, else utime+stime in clock ticks (10 ms steps).
    """
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat", "rb") as fh:
                total += int(fh.read().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        total += sum(int(x) for x in stat[stat.rfind(b")") + 2:].split()[11:13]) / CLK_TCK
    return total


def memory_of(pid: int) -> int:
    """PSS in bytes (shared pages split between their users), else RSS; 0 when gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * PAGE
    except OSError:
        return 0


class TreeMemorySampler:
    """Peak total PSS and peak process count of a process tree, sampled in a thread."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root = root
        self.interval = interval
        self.peak_bytes = 0
        self.peak_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            pids = descendants(self.root)
            total = sum(memory_of(p) for p in pids)
            self.peak_bytes = max(self.peak_bytes, total)
            self.peak_procs = max(self.peak_procs, len(pids))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- terraform timing ------------------------------------------------------------------

TF_SHIM = """#!/bin/bash
# Benchmark shim: times each terraform command, then behaves exactly like terraform.
cmd=""
for a in "$@"; do case "$a" in -*) ;; *) cmd="$a"; break ;; esac; done
start=$(date +%s.%N)
"{real}" "$@"
rc=$?
echo "$cmd $start $(date +%s.%N) $rc" >> "{log}"
exit $rc
"""


def terraform_shim(where: Path) -> tuple[Path, Path]:
    """A `terraform` that logs `COMMAND START END RC` lines: (bin dir for PATH, log file)."""
    real = shutil.which("terraform")
    if real is None:
        raise SystemExit("terraform is not on PATH")
    bindir = where / "tf-shim"
    bindir.mkdir(parents=True, exist_ok=True)
    log = where / "terraform-times.log"
    shim = bindir / "terraform"
    shim.write_text(TF_SHIM.replace("{real}", real).replace("{log}", str(log)))
    shim.chmod(0o755)
    return bindir, log


def terraform_times(log: Path, since: float = 0.0) -> dict[str, float]:
    """Seconds per terraform command logged by the shim after `since` (summed per command)."""
    out: dict[str, float] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        cmd, start, end = parts[0], float(parts[1]), float(parts[2])
        if start >= since:
            out[cmd] = out.get(cmd, 0.0) + end - start
    return out


# -- statistics, tables, plots ------------------------------------------------------------


def summary(values: Sequence[float]) -> tuple[float, float, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return min(vals), statistics.median(vals), max(vals)


def slope(xs: Sequence[float], ys: Sequence[float | None]) -> float | None:
    """Least-squares slope of ys over xs (pairs with a None left out); None under 2 points."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def fmt_s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_summary(values: Sequence[float]) -> str:
    s = summary(values)
    return "-" if s is None else f"{s[0]:.2f} / {s[1]:.2f} / {s[2]:.2f}"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-markdown table (readable as plain text too)."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def pyplot():
    """matplotlib.pyplot with a non-interactive backend, or None (plots are optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return None


# -- ansible-runner artifacts ------------------------------------------------------------


def _iso(ts: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def artifact_dirs(cdir: Path) -> set[Path]:
    """The cluster's ansible-runner artifact directories (one per playbook run)."""
    base = cdir / "runner" / "artifacts"
    return {p for p in base.iterdir() if p.is_dir()} if base.is_dir() else set()


@dataclass
class PlaybookRun:
    """One playbook run read back from its job_events: where its time went."""

    playbook: str  # stem: wait, sync, env, run, ...
    first: float  # playbook_on_start (time.time() scale)
    last: float  # playbook_on_stats
    # task name -> per-host durations in seconds (runner_on_ok/failed/skipped; loops: the whole task)
    tasks: dict[str, list[float]] = field(default_factory=dict)
    # task name -> per-host start times (runner_on_start): their spread shows hosts taken in turn
    starts: dict[str, list[float]] = field(default_factory=dict)

    @property
    def span(self) -> float:
        return self.last - self.first


def read_playbook_run(artifact_dir: Path) -> PlaybookRun | None:
    events = []
    for p in (artifact_dir / "job_events").glob("*.json"):
        try:
            events.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    events.sort(key=lambda e: e.get("counter", 0))
    start = next((e for e in events if e.get("event") == "playbook_on_start"), None)
    stats = next((e for e in events if e.get("event") == "playbook_on_stats"), None)
    if start is None or stats is None:
        return None
    stem = Path((start.get("event_data") or {}).get("playbook") or "?").stem
    run = PlaybookRun(stem, _iso(start["created"]), _iso(stats["created"]))
    for e in events:
        if e.get("event") == "runner_on_start":
            run.starts.setdefault(str((e.get("event_data") or {}).get("task")), []).append(_iso(e["created"]))
        if e.get("event") in ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_on_unreachable"):
            d = e.get("event_data") or {}
            if d.get("duration") is not None:
                run.tasks.setdefault(str(d.get("task")), []).append(float(d["duration"]))
    return run
