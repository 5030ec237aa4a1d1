"""Helpers for end-to-end tests: the real `gpuctl` command as a subprocess
against real local nodes, and ways to look at those nodes from the outside
(over ssh with the cluster's key, /proc, `ip`), without importing gpuctl.

    cluster = Cluster("e2e-two", state_dir)
    res = cluster.gpuctl("apply", "cluster.yaml", "-c", cluster.name)
    res.check()                      # exit 0, or fail showing the output
    node = cluster.nodes()[1]        # from inventory.yml: host, port, rank, address
    cluster.ssh(node, "cat ~/x")     # as the node's user, with the cluster key
    before = cluster.footprint()     # sshd pids, namespaces, links, dirs on this machine
    cluster.gpuctl("down", cluster.name)
    before.assert_gone()
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import gpuctlfork
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

HAVE_TOOLS = all(shutil.which(t) for t in ("terraform", "ssh", "ssh-keygen", "rsync")) and (
    shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"))
needs_local_nodes = pytest.mark.skipif(
    not HAVE_TOOLS or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="end-to-end tests need root, iproute2, terraform, rsync, ssh and sshd (netns local nodes)")


# -- running gpuctl ----------------------------------------------------------------


@dataclass
class Result:
    """One finished `gpuctl` run; every output line carries the time.time() it was read at."""

    argv: list[str]
    returncode: int
    stdout_lines: list[tuple[float, str]]
    stderr_lines: list[tuple[float, str]]
    started: float
    ended: float

    @property
    def stdout(self) -> str:
        return "".join(line + "\n" for _, line in self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "".join(line + "\n" for _, line in self.stderr_lines)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def describe(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.duration:.1f}s\n"
                f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}")

    def check(self) -> "Result":
        assert self.returncode == 0, self.describe()
        return self

    def first_time(self, predicate: Callable[[str], bool]) -> float | None:
        """When the first stdout line matching `predicate` was read (time.time(): nodes share this machine's clock)."""
        return next((t for t, line in self.stdout_lines if predicate(line)), None)


def gpuctl_env(state_dir: Path) -> dict[str, str]:
    env = {**os.environ, "GPUCTL_STATE_DIR": str(state_dir)}
    env.pop("GPUCTL_LOCAL_MODE", None)  # netns nodes: own address, hostname and home each
    env.pop("GPUCTL_PLAIN", None)
    return env


def run_gpuctl(*args: str, state_dir: Path, cwd: Path | None = None, timeout: float = 300) -> Result:
    """`python -m gpuctl ARGS` (forked: tests/gpuctlfork.py) with stdout and stderr read line by line as they come."""
    argv = [sys.executable, "-m", "gpuctl", *args]
    started = time.time()
    proc, stdout, stderr = gpuctlfork.popen_text(args, env=gpuctl_env(state_dir), cwd=cwd or REPO)
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []

    def pump(stream, sink: list[tuple[float, str]]) -> None:
        for line in iter(stream.readline, ""):
            sink.append((time.time(), line.rstrip("\n")))
        stream.close()

    readers = [threading.Thread(target=pump, args=(stdout, out), daemon=True),
               threading.Thread(target=pump, args=(stderr, err), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(2)  # Ctrl-C: gpuctl cancels the job on the nodes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=5)
        res = Result(argv, proc.returncode, out, err, started, time.time())
        pytest.fail(f"gpuctl ran past {timeout}s\n" + res.describe())
    for t in readers:
        t.join(timeout=10)
    return Result(argv, proc.returncode, out, err, started, time.time())


# Operations that have no command yet (issue 26 adds `gpuctl replace`), for gpuctl_python.
LOST_NODES_PY = """import json, sys
from gpuctl.common.paths import cluster_dir
from gpuctl.providers import get_provider
from gpuctl.provision import provisioner
request, inv = provisioner.load_cluster(sys.argv[1])
print(json.dumps(get_provider(inv.cloud).lost_nodes(cluster_dir(sys.argv[1]), inv, request)))
"""
REPLACE_NODES_PY = """import sys
from gpuctl.common.console import Reporter
from gpuctl.provision import lifecycle
from gpuctl.state.registry import Registry
lifecycle.replace_nodes(sys.argv[1], [int(r) for r in sys.argv[2:]], reporter=Reporter(plain=True),
                        registry=Registry())
"""


def gpuctl_python(code: str, *args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` that imports gpuctl, in its own process with `env` as the CLI would run."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


class ManagedJobs:
    """A state dir's managed jobs as a test sees them: gpuctl run against it, its store, a job's
    supervisor log (tests/integration/test_managed_local.py, test_pipelines_local.py)."""

    def __init__(self, root: Path) -> None:
        from gpuctl.managed.store import Store

        self.root = root
        self.state = root / "state"
        self.store = Store(self.state / "managed.db")

    def gpuctl(self, *args: str, timeout: float = 300) -> Result:
        return run_gpuctl(*args, state_dir=self.state, timeout=timeout)

    def job(self, job_id: int):  # noqa: ANN201 - a ManagedJob
        return self.store.get(job_id)

    def wait_status(self, job_id: int, statuses: tuple[str, ...], timeout: float = 180):  # noqa: ANN201
        return wait_for(f"managed job {job_id} in {statuses}",
                        lambda: (j := self.job(job_id)) is not None and j.status in statuses and j, timeout,
                        interval=0.1)

    def supervisor_log(self, job_id: int) -> str:
        path = self.state / "managed" / str(job_id) / "supervisor.log"
        return path.read_text() if path.exists() else "(no supervisor log)"


class Watched:
    """gpuctl started in its own process group (signalled as a whole, as a terminal's Ctrl-C
    does), its stdout and stderr read line by line; `seen` is set once a stdout line
    satisfies `trigger`."""

    def __init__(self, argv: list[str], env: dict[str, str], trigger: Callable[[str], bool]) -> None:
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.started = time.time()
        self.out: list[str] = []
        self.err: list[str] = []
        self.stamps: list[tuple[float, str]] = []  # every stdout line with the time.time() it was read at
        self.seen = threading.Event()
        self.readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.out, trigger), daemon=True),
                        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err, None), daemon=True)]
        for t in self.readers:
            t.start()

    def _pump(self, stream, sink: list[str], trigger: Callable[[str], bool] | None) -> None:
        for line in iter(stream.readline, ""):
            sink.append(line.rstrip("\n"))
            if sink is self.out:
                self.stamps.append((time.time(), line.rstrip("\n")))
            if trigger is not None and trigger(line):
                self.seen.set()

    def result(self, timeout: float) -> Result:
        """Wait for gpuctl to end; what it printed, as run_gpuctl gives it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gpuctl still runs after {timeout:.0f} s\n" + self.text)
        for t in self.readers:
            t.join(timeout=10)
        return Result(list(map(str, self.proc.args)), self.proc.returncode, list(self.stamps),
                      [(0.0, line) for line in self.err], self.started, time.time())

    def interrupt(self, timeout: float) -> float:
        """SIGINT to the group; seconds until gpuctl exited (fails the test past `timeout`)."""
        sent = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gpuctl still runs {timeout:.0f} s after Ctrl-C\n" + self.text)
        return time.monotonic() - sent

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for t in self.readers:
            t.join(timeout=10)

    @property
    def text(self) -> str:
        return "\n".join(self.out) + "\n--- stderr\n" + "\n".join(self.err)


# -- looking at nodes --------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    """One host of the cluster's inventory.yml (inventories/README.md)."""

    name: str
    rank: int
    address: str
    host: str
    port: int
    user: str
    key: str
    gpus: int


def wait_for(what: str, predicate: Callable[[], object], timeout: float, interval: float = 0.25):
    """Poll until `predicate()` is truthy; its value, or a failure naming `what`. The pause between
    looks grows from `interval` to 0.75 s (or `interval`, if longer): most predicates run a gpuctl
    command or scan /proc, and the suite is CPU-bound, so a long wait looks less often."""
    deadline = time.monotonic() + timeout
    pause, longest = interval, max(interval, 0.75)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f}s (last: {value!r})")
        time.sleep(pause)
        pause = min(pause * 1.5, longest)


def queue_rows(text: str) -> list[list[str]]:
    """`gpuctl queue`'s rows as [ID, NAME, STATUS, ...the other columns]: NAME is a fixed-width column
    that may hold spaces (an exec job is named by its command), so it is cut where the header puts it."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    start, end = lines[0].index("NAME"), lines[0].index("STATUS")
    return [[line[:start].strip(), line[start:end].strip(), *line[end:].split()] for line in lines[1:]]


def queue_row_once_ended(queue: Callable[[], Result], job: int | None = None, timeout: float = 60) -> list[str]:
    """The job's `gpuctl queue` row (the newest job's without `job`), once its
    status is final. Its ranks can be gone while the head still collects their
    exits and writes the record: until then the job is rightly RUNNING."""
    final = ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED")  # gpuctl.state.registry's, not imported here

    def ended() -> list[str] | None:
        rows = queue_rows(queue().check().stdout)
        row = next((r for r in rows if r[0] == str(job)), []) if job is not None else (rows[-1] if rows else [])
        return row if len(row) > 2 and row[2] in final else None

    return wait_for(f"job {job or 'newest'} to end", ended, timeout, interval=1.0)


def running(pid: int, start: str | None = None) -> bool:
    """A live process (not a zombie), optionally the one that started at `start`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and (start is None or fields[19] == start)


def kill_dead(pid: int, timeout: float = 10) -> None:
    """SIGKILL `pid` and return once it has ended (gone, or a zombie): a command run right after it,
    which starts in milliseconds (tests/gpuctlfork.py), must find it dead, as a user's would."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_for(f"process {pid} to end after SIGKILL", lambda: not running(pid), timeout, interval=0.01)


def pids_with_env(entry: str) -> list[int]:
    """Live processes whose environment holds exactly `entry` (NAME=VALUE)."""
    needle = entry.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0") and running(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def pids_matching(text: str) -> list[int]:
    """Live processes whose command line contains `text` (like `pgrep -f`), except ours."""
    found = []
    needle = text.encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "cmdline").read_bytes() and running(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def cluster_netns(name: str) -> set[str]:
    """The namespaces of local cluster `name` (terraform/modules/local-nodes: "gn" + the first three
    characters of the name without dashes + a hash), not those of clusters other tests run meanwhile."""
    prefix = "gn" + name.replace("-", "")[:3]
    return {ns for ns in netns_names() if ns.startswith(prefix)}


def link_names() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.strip()}


def _by_rank(path: Path) -> int:
    """nodes/node<rank>/...: in rank order (node10 after node9, not after node1)."""
    return int(path.parent.name.removeprefix("node"))


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def control_dir_candidates(cdir: Path) -> list[Path]:
    """Where gpuctl may keep the cluster's ssh ControlMaster sockets: clusters/<name>/cm,
    or, when that path is too long for a unix socket, a per-cluster directory under
    the temp dir (docs: ssh.py)."""
    preferred = (cdir / "cm").absolute()
    digest = hashlib.sha1(str(preferred).encode()).hexdigest()[:12]
    return [preferred, Path(tempfile.gettempdir()) / f"gpuctl-{os.getuid()}-{digest}",
            Path("/tmp") / f"gpuctl-{os.getuid()}-{digest}"]


@dataclass
class Footprint:
    """Everything a local cluster has on this machine, recorded while it is up."""

    cluster_dir: Path
    sshd: list[tuple[int, str]]
    tags: list[str]
    netns: list[str]
    veths: list[str]
    bridge: str
    node_dirs: list[Path]
    pids: list[int] = field(default_factory=list)  # every process of the nodes at the time

    def assert_present(self, num_nodes: int) -> None:
        assert len(self.sshd) == len(self.netns) == len(self.veths) == len(self.node_dirs) == num_nodes, self
        assert all(running(pid, start) for pid, start in self.sshd), self.sshd
        assert set(self.netns) <= netns_names()
        assert {self.bridge, *self.veths} <= link_names()
        assert all(d.is_dir() for d in self.node_dirs)
        assert self.pids

    def nodes_left(self) -> list[str]:
        """What of the nodes is still on this machine: processes, namespaces, links, node directories."""
        leftovers = [f"sshd {pid}" for pid, start in self.sshd if running(pid, start)]
        leftovers += [f"pid {pid}" for pid in self.pids if running(pid)]
        leftovers += [f"pid {pid} (tag {tag})" for tag in self.tags for pid in pids_with_env(f"GPUCTL_NODE_TAG={tag}")]
        leftovers += [f"netns {ns}" for ns in sorted(set(self.netns) & netns_names())]
        leftovers += [f"link {ln}" for ln in sorted({self.bridge, *self.veths} & link_names())]
        leftovers += [f"dir {d}" for d in self.node_dirs if d.exists()]
        return leftovers

    def assert_gone(self) -> None:
        leftovers = self.nodes_left()
        if self.cluster_dir.exists():
            leftovers.append(f"dir {self.cluster_dir}")
        for cm in control_dir_candidates(self.cluster_dir):
            if cm.exists():
                leftovers.append(f"dir {cm} (ssh control sockets: {sorted(p.name for p in cm.iterdir())})")
            leftovers += [f"ssh master {pid} ({cm})" for pid in pids_matching(f"{cm}/")]
        assert not leftovers, "left behind after down: " + ", ".join(leftovers)


class Cluster:
    """A local cluster named `name` in its own gpuctl state directory."""

    def __init__(self, name: str, state_dir: Path) -> None:
        self.name = name
        self.state_dir = state_dir
        self.outputs: list[Result] = []  # every gpuctl run against this cluster

    @property
    def cdir(self) -> Path:
        return self.state_dir / "clusters" / self.name

    def gpuctl(self, *args: str, cwd: Path | None = None, timeout: float = 300) -> Result:
        res = run_gpuctl(*args, state_dir=self.state_dir, cwd=cwd, timeout=timeout)
        self.outputs.append(res)
        return res

    def node_job(self, job: int | str) -> str:
        """Job `job`'s name on the nodes, `<id>-<token>` (its directory ~/.gpuctl/jobs/NAME there),
        from the state database: the token is random per job, so no other gpuctl state names it."""
        with sqlite3.connect(self.state_dir / "state.db") as db:
            row = db.execute("SELECT token FROM jobs WHERE cluster=? AND job_id=?", (self.name, int(job))).fetchone()
        assert row is not None and row[0], f"job {job} of {self.name} has no token in {self.state_dir}"
        return f"{job}-{row[0]}"

    def logs_dir(self, job: int | str) -> Path:
        """Where gpuctl keeps job `job`'s logs on this machine (outside the cluster directory: they
        outlive the cluster): `logs/<cluster>/<id>-<token>` in the state dir."""
        return self.state_dir / "logs" / self.name / self.node_job(job)

    def nodes(self) -> list[NodeInfo]:
        data = yaml.safe_load((self.cdir / "inventory.yml").read_text())
        hosts = data["all"]["children"]["gpuctl_nodes"]["hosts"]
        nodes = [NodeInfo(name=name, rank=int(h["gpuctl_rank"]), address=h["gpuctl_address"],
                          host=h["ansible_host"], port=int(h.get("ansible_port", 22)), user=h["ansible_user"],
                          key=h["ansible_ssh_private_key_file"], gpus=int(h.get("gpuctl_gpus", 0)))
                 for name, h in hosts.items()]
        return sorted(nodes, key=lambda n: n.rank)

    def ssh(self, node: NodeInfo, command: str, *, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """Run `command` on the node over plain ssh with the cluster key (the path users have)."""
        key = self.cdir / "ssh" / "id_ed25519"
        assert Path(node.key) == key, (node.key, key)
        argv = ["ssh", "-i", str(key), "-p", str(node.port), "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-o", "ControlMaster=no",
                "-o", "ControlPath=none", f"{node.user}@{node.host}", command]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert proc.returncode == 0, f"ssh {node.name}: {command!r} -> {proc.returncode}: {proc.stderr}"
        return proc

    def read(self, node: NodeInfo, path: str) -> str:
        """A file's text on the node (`~/...` is the node's home)."""
        return self.ssh(node, f"cat {path}").stdout

    def exists_on(self, node: NodeInfo, path: str) -> bool:
        proc = self.ssh(node, f"if test -e {path}; then echo yes; else echo no; fi")
        return proc.stdout.strip() == "yes"

    def footprint(self) -> Footprint:
        """Read where the local-nodes module put the nodes (each node.env / sshd.pid /
        bridge.env under clusters/<name>/nodes, terraform/modules/local-nodes/scripts)."""
        nodes_dir = self.cdir / "nodes"
        envs = [_env_file(p) for p in sorted(nodes_dir.glob("node*/node.env"), key=_by_rank)]
        sshd = []
        for p in sorted(nodes_dir.glob("node*/sshd.pid"), key=_by_rank):
            pid, start = p.read_text().split()
            sshd.append((int(pid), start))
        tags = [e["LN_TAG"] for e in envs]
        pids = sorted({pid for tag in tags for pid in pids_with_env(f"GPUCTL_NODE_TAG={tag}")}
                      | {pid for pid, _ in sshd})
        return Footprint(cluster_dir=self.cdir, sshd=sshd, tags=tags,
                         netns=[e["LN_NETNS"] for e in envs], veths=[e["LN_VETH"] for e in envs],
                         bridge=_env_file(nodes_dir / "bridge.env")["LN_BRIDGE"],
                         node_dirs=[Path(e["LN_DIR"]) for e in envs], pids=pids)

    def node_env(self, node: NodeInfo) -> dict[str, str]:
        """The local-nodes module's node.env (LN_DIR, LN_NETNS, ...) of `node`, matched by the
        address inside each node's network namespace."""
        for path in sorted((self.cdir / "nodes").glob("node*/node.env")):
            env = _env_file(path)
            addrs = subprocess.run(["ip", "-n", env["LN_NETNS"], "-o", "-4", "addr", "show"], capture_output=True,
                                   text=True).stdout
            if f"inet {node.address}/" in addrs:
                return env
        raise AssertionError(f"no local node has {node.address} ({node.name})")

    def down_quietly(self) -> None:
        """Teardown for fixtures: `gpuctl down` if the cluster is still there."""
        if self.cdir.exists():
            res = self.gpuctl("down", self.name, timeout=300)
            if res.returncode != 0:
                sys.stderr.write("gpuctl down failed in teardown:\n" + res.describe())


def files_containing(root: Path, needle: str, *, skip: Iterable[Path] = ()) -> list[Path]:
    """Every regular file under `root` (outside `skip`) whose bytes contain `needle`."""
    data = needle.encode()
    skipped = [p.resolve() for p in skip]
    hits = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath).resolve()
        dirnames[:] = [d for d in dirnames if (here / d) not in skipped]
        for fname in filenames:
            path = here / fname
            try:
                if path.is_file() and not path.is_symlink() and data in path.read_bytes():
                    hits.append(path)
            except OSError:
                continue
    return hits
