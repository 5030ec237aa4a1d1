#!/usr/bin/env python3
"""The job plane on local nodes: warm job latency against pdsh and Ansible, workdir
copy cost, cold apply, and kill-after-failure, in one run on the same nodes.

`gpuctl exec NAME -- CMD` is one ssh call to the head (over the cluster's
ControlMaster), whose agent fans the job out as a tree (GPUCTL_FANOUT
children per node, default 32) and streams every rank's events back. For
each cluster size N (`--nodes`, default 1,8,32,64), one cluster at a time
(at most max(N) nodes up; the cold apply comes last, alone):

  1. latency  `gpuctl apply --provision-only`, one unmeasured
              `gpuctl exec NAME -- true` (prepare, ControlMaster), one
              unmeasured run of each other tool; then R repeats
              (`--repeats`, default 5), round-robin (the order rotated each
              repeat), of three commands doing the same on every node:
                gpuctl   gpuctl exec NAME -- true
                pdsh     pdsh -R ssh -S -f N -w <every node address> true
                         (the cluster's access key; ssh options through
                         PDSH_SSH_ARGS_APPEND; no ControlMaster)
                ansible  ansible all -i clusters/NAME/inventory.yml -m command
                         -a true -f N (gpuctl's ansible.cfg, its own
                         ControlPersist sockets, warmed by the unmeasured run)
              Wall time and controller CPU: user+sys of the command's
              process tree, the RUSAGE_CHILDREN delta around subprocess.run
              (every descendant that was waited for: python, ssh, ansible's
              forks). ssh ControlMaster daemons are not in that tree: their
              CPU (utime+stime deltas of the cluster's `ssh: ... [mux]`
              processes, gpuctl's and Ansible's apart) is shown beside it.
  2. copy     for N in `--copy-nodes` (default 1,32): a `--copy-mb`
              (default 100) MB workdir of random bytes (4 files) in a temp
              dir; `gpuctl exec NAME --workdir DIR -- true`, the first time
              (cold: nothing on the nodes yet) and once more unchanged. Wall
              time, gpuctl's controller -> head stage ("Copying the workdir
              to the head"), and bytes out of the controller: the delta of
              the TX counter of the cluster's bridge in the root namespace
              (frames the bridge forwards between nodes do not count there).
  3. cold     `gpuctl apply task.yaml` of `--cold-nodes` (default 64) new
              nodes with `setup: echo ready` and `run: true`: wall time from
              start to exit, and per phase from gpuctl's output lines
              (`==> Provisioning`, `==> Preparing`, `Running setup`,
              `Job N running`, `Job N succeeded`), CPU per phase as far as
              gpuctl has reaped its children (terraform, ansible-playbook).
  4. kill     benchmarks/kill_after_failure.py's scenarios, as that script
              runs them, on the `--kill-nodes` cluster (default 8).

Sizes that only --copy-nodes or --kill-nodes name get a cluster of their
own. Wall times depend on load from other work on this machine, and clusters
of different N are measured one after the other: compare ratios at the same
N (interleaved), and prefer the CPU columns across N.

    .venv/bin/python benchmarks/jobplane.py [--quick] [--nodes 1,8,32,64] [--repeats 5]
        [--copy-nodes 1,32] [--copy-mb 100] [--cold-nodes 64] [--kill-nodes 8]
        [--plot jobplane.png] [--json jobplane.json]

Needs what the local nodes need (root for netns mode, terraform, sshd,
rsync) and pdsh (`apt-get install -y pdsh`). Everything lives in a temp
GPUCTL_STATE_DIR; every cluster is torn down (`gpuctl down`) and checked to
be gone, also when the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import kill_after_failure as kaf  # noqa: E402

TOOLS = ("gpuctl", "pdsh", "ansible")
SSH_OPTIONS = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes", "LogLevel=ERROR")
PREPARING = "==> Preparing"  # gpuctl's stage line when a job finds the nodes not as prepared
PHASES = ("startup", "provision", "prepare", "submit", "setup", "run", "exit", "total")

# Goals
GOAL_WARM_1 = 1.0  # s: warm exec on 1 node
GOAL_SCALE = 2.0  # gpuctl(max N) / gpuctl(1)
GOAL_VS_PDSH = 3.0  # gpuctl / pdsh at max N
GOAL_CPU_PER_NODE = 10.0  # ms of controller CPU per added node
GOAL_COPY_SCALE = 3.0  # copy to max copy N / copy to 1 node
GOAL_BYTES_OUT = 1.2  # bytes out of the controller / workdir size ("~1x")


# -- samples -------------------------------------------------------------------------


@dataclass
class Run:
    tool: str
    n: int
    rep: int
    rc: int
    wall: float
    cpu: float  # s, the command's process tree
    mux_cpu: float | None = None  # s, the tool's ssh ControlMaster daemons (gpuctl, ansible)
    prepared: bool = False  # gpuctl ran prepare again (the agent or the cluster changed): not warm
    error: str | None = None


@dataclass
class LatencyPoint:
    n: int
    runs: list[Run] = field(default_factory=list)

    def median(self, tool: str, what: str = "wall") -> float | None:
        """Median over the warm runs that succeeded."""
        vals = [getattr(r, what) for r in self.runs if r.tool == tool and r.error is None and not r.prepared]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None


@dataclass
class CopySample:
    n: int
    size_bytes: int
    rc: int | None = None
    wall: float | None = None  # cold: first exec with this workdir
    upload: float | None = None  # gpuctl's controller -> head stage
    cpu: float | None = None  # gpuctl's process tree
    tx_bytes: int | None = None  # out of the controller, into the cluster's bridge
    again_wall: float | None = None  # the same workdir once more (nothing changed)
    again_tx_bytes: int | None = None
    prepared: list[str] = field(default_factory=list)  # which exec ran prepare again ("cold", "again")
    error: str | None = None

    @property
    def rest(self) -> float | None:
        """Cold wall time outside the controller -> head copy: head -> workers, the job."""
        return None if self.wall is None or self.upload is None else self.wall - self.upload

    @property
    def out_ratio(self) -> float | None:
        return None if self.tx_bytes is None else self.tx_bytes / self.size_bytes


@dataclass
class ColdApply:
    n: int
    rc: int | None = None
    wall: dict[str, float] = field(default_factory=dict)  # phase -> s
    cpu: dict[str, float] = field(default_factory=dict)  # phase -> s (reaped children only)
    total_cpu: float | None = None
    error: str | None = None


@dataclass
class Results:
    machine_before: str
    args: dict
    machine_after: str = ""
    latency: list[LatencyPoint] = field(default_factory=list)
    copies: list[CopySample] = field(default_factory=list)
    cold: ColdApply | None = None
    kill: list[kaf.Sample] = field(default_factory=list)
    kill_nodes: int | None = None
    kill_skipped: str | None = None
    notes: list[str] = field(default_factory=list)


# -- the three tools -------------------------------------------------------------------


@dataclass
class Tool:
    argv: list[str]
    env: dict[str, str]
    masters: Callable[[], dict[int, Path]] | None = None  # its ssh ControlMaster daemons


def tool_commands(cluster: bl.LocalCluster, env: dict[str, str], root: Path) -> dict[str, Tool]:
    """How each tool runs `true` on every node of `cluster` (pdsh left out in loopback mode)."""
    hosts = bl.read_inventory(cluster.cdir)
    n = len(hosts)
    hashes = [bl.control_hash(h["ansible_host"], int(h.get("ansible_port", 22)), h["ansible_user"]) for h in hosts]
    ansible_cp = root / f"cp{n}"  # short: the socket path must stay under 108 bytes
    ansible_cp.mkdir(mode=0o700, exist_ok=True)

    def masters(ansibles: bool) -> Callable[[], dict[int, Path]]:
        """The cluster's ControlMasters with sockets in Ansible's directory, or elsewhere (gpuctl's)."""
        return lambda: {pid: p for pid, p in bl.ssh_masters(hashes).items() if (p.parent == ansible_cp) == ansibles}

    tools = {"gpuctl": Tool([bl.gpuctl_python(), "-m", "gpuctl", "exec", cluster.name, "--", "true"], env,
                            masters(False))}
    ports = {int(h.get("ansible_port", 22)) for h in hosts}
    if len(ports) == 1:
        key = hosts[0]["ansible_ssh_private_key_file"]
        ssh_args = [f"-i {key}", *(f"-o {o}" for o in SSH_OPTIONS), f"-p {ports.pop()}"]
        tools["pdsh"] = Tool(["pdsh", "-R", "ssh", "-S", "-f", str(max(n, 1)), "-l", hosts[0]["ansible_user"],
                              "-w", ",".join(h["ansible_host"] for h in hosts), "true"],
                             {**env, "PDSH_SSH_ARGS_APPEND": " ".join(ssh_args)})
    venv_bin = Path(bl.gpuctl_python()).parent
    tools["ansible"] = Tool(
        [str(venv_bin / "ansible"), "all", "-i", str(cluster.cdir / "inventory.yml"), "-m", "command",
         "-a", "true", "-f", str(max(n, 1))],
        {**env, "ANSIBLE_CONFIG": str(bl.REPO / "ansible" / "ansible.cfg"),
         "ANSIBLE_SSH_CONTROL_PATH_DIR": str(ansible_cp),
         "PATH": os.pathsep.join([str(venv_bin), env.get("PATH", os.defpath)])},
        masters(True))
    return tools


def master_cpu(tool: Tool) -> dict[int, float]:
    return {pid: bl.cpu_seconds([pid]) for pid in tool.masters()} if tool.masters else {}


def run_tool(name: str, tool: Tool, n: int, rep: int, timeout: float) -> Run:
    before = master_cpu(tool)
    t = bl.timed_command(tool.argv, tool.env, timeout=timeout)
    # A master the run started counts from 0; one that ended meanwhile is missed (rare when warm).
    mux = sum(c - before.get(pid, 0.0) for pid, c in master_cpu(tool).items()) if tool.masters else None
    run = Run(name, n, rep, t.rc, t.wall, t.cpu, mux, prepared=PREPARING in t.output)
    if t.rc != 0:
        run.error = f"exit code {t.rc}: " + " | ".join(t.output.strip().splitlines()[-3:])
    return run


def measure_latency(cluster: bl.LocalCluster, tools: dict[str, Tool], repeats: int, timeout: float) -> LatencyPoint:
    point = LatencyPoint(cluster.num_nodes)
    names = list(tools)
    for name in names[1:]:  # unmeasured: the first run of each (Ansible opens its ControlMaster sockets)
        warm = run_tool(name, tools[name], cluster.num_nodes, -1, timeout)
        if warm.error:
            print(f"  warning: warm-up {name}: {warm.error}", file=sys.stderr)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            run = run_tool(name, tools[name], cluster.num_nodes, rep, timeout)
            point.runs.append(run)
            print(f"  N={cluster.num_nodes:<3} rep {rep} {name:<8} {run.wall:6.2f} s  cpu {run.cpu * 1000:7.0f} ms"
                  + (f"  mux {run.mux_cpu * 1000:5.1f} ms" if run.mux_cpu is not None else "")
                  + ("  PREPARED AGAIN (left out)" if run.prepared else "")
                  + (f"  ERROR {run.error}" if run.error else ""), flush=True)
    return point


# -- workdir copy --------------------------------------------------------------------


def make_workdir(where: Path, megabytes: float, files: int = 4) -> tuple[Path, int]:
    """A directory of `files` files of random bytes, `megabytes` MB (10^6) in all."""
    wd = where / "workdir"
    wd.mkdir()
    per_file = int(megabytes * 1_000_000) // files
    chunk = 1 << 20
    for i in range(files):
        with open(wd / f"blob{i}.bin", "wb") as fh:
            left = per_file
            while left:
                fh.write(os.urandom(min(chunk, left)))
                left -= min(chunk, left)
    return wd, per_file * files


def exec_with_workdir(cluster: bl.LocalCluster, workdir: Path, env: dict[str, str],
                      timeout: float) -> tuple[bl.Gpuctl, int | None]:
    """`gpuctl exec NAME --workdir DIR -- true`: the run and the bytes it sent into the bridge."""
    tx0 = bl.bridge_tx_bytes(cluster.cdir)
    g = bl.Gpuctl("exec", cluster.name, "--workdir", str(workdir), "--", "true", env=env)
    g.wait(timeout=timeout)
    tx1 = bl.bridge_tx_bytes(cluster.cdir)
    return g, (None if tx0 is None or tx1 is None else tx1 - tx0)


def measure_copy(cluster: bl.LocalCluster, workdir: Path, size: int, env: dict[str, str],
                 timeout: float) -> CopySample:
    s = CopySample(cluster.num_nodes, size)
    g, s.tx_bytes = exec_with_workdir(cluster, workdir, env, timeout)
    s.rc, s.cpu = g.proc.returncode, g.cpu
    assert g.ended is not None
    s.wall = g.ended - g.started
    s.upload = g.stages().get("upload")
    if g.first(PREPARING):
        s.prepared.append("cold")
    if s.rc != 0:
        s.error = f"exit code {s.rc}"
        print(g.describe(), file=sys.stderr)
        return s
    again, s.again_tx_bytes = exec_with_workdir(cluster, workdir, env, timeout)
    assert again.ended is not None
    s.again_wall = again.ended - again.started
    if again.first(PREPARING):
        s.prepared.append("again")
    if again.proc.returncode != 0:
        s.error = f"second exec: exit code {again.proc.returncode}"
        print(again.describe(), file=sys.stderr)
    print(f"  copy {size / 1e6:.0f} MB to N={s.n}: cold {bl.fmt_s(s.wall)} s (controller -> head "
          f"{bl.fmt_s(s.upload)} s), again {bl.fmt_s(s.again_wall)} s, out "
          f"{'-' if s.tx_bytes is None else f'{s.tx_bytes / 1e6:.1f} MB'}", flush=True)
    return s


# -- cold apply ------------------------------------------------------------------------

# Points of a cold `gpuctl apply` in its output, besides the process's start and exit.
COLD_POINTS = {
    "provision": r"^==> Provisioning",
    "provisioned": r"^    Provisioning .*: done in",
    "prepared": r"^    Preparing .*: done in",
    "setup": r"^Running setup on",
    "running": r"^Job \d+ running \(",
    "succeeded": r"^Job \d+ succeeded",
}


def cold_phases(g: bl.Gpuctl) -> tuple[dict[str, float], dict[str, float]]:
    """Wall and CPU seconds per phase, between consecutive points that were printed."""
    assert g.ended is not None
    points: dict[str, tuple[float, float | None]] = {"start": (g.started, 0.0), "exit": (g.ended, g.cpu)}
    for key, pattern in COLD_POINTS.items():
        if (line := g.first(pattern)) is not None:
            points[key] = (line.t, line.cpu)
    spans = {"startup": ("start", "provision"), "provision": ("provision", "provisioned"),
             "prepare": ("provisioned", "prepared"), "submit": ("prepared", "setup"),
             "setup": ("setup", "running"), "run": ("running", "succeeded"), "exit": ("succeeded", "exit"),
             "total": ("start", "exit")}
    wall, cpu = {}, {}
    for phase, (a, b) in spans.items():
        if a in points and b in points:
            wall[phase] = points[b][0] - points[a][0]
            ca, cb = points[a][1], points[b][1]
            if ca is not None and cb is not None:
                cpu[phase] = cb - ca
    return wall, cpu


def measure_cold(n: int, name: str, root: Path, env: dict[str, str], timeout: float) -> ColdApply:
    res = ColdApply(n)
    cluster = bl.LocalCluster(name, n, root, env, run="true", setup="echo ready", provision_only=False,
                              timeout=timeout)
    print(f"cold apply of {n} node(s) ({bl.machine_note()})", flush=True)
    try:
        with cluster:
            pass
    except RuntimeError as exc:
        res.error = str(exc).splitlines()[0]
        print(str(exc), file=sys.stderr)
        cluster.down()
    g = cluster.provision_run
    if g is not None and g.ended is not None:
        res.rc, res.total_cpu = g.proc.returncode, g.cpu
        res.wall, res.cpu = cold_phases(g)
    print("  " + "  ".join(f"{p} {bl.fmt_s(res.wall.get(p))}" for p in PHASES), flush=True)
    return res


# -- kill-after-failure ----------------------------------------------------------------


def measure_kill(cluster: bl.LocalCluster, root: Path, env: dict[str, str], repeats: int,
                 timeout: float) -> list[kaf.Sample]:
    ts_dir = root / "kill-ts"
    ts_dir.mkdir(exist_ok=True)
    os.chmod(ts_dir, 0o1777)  # ranks write here (loopback nodes may run as another user)
    samples = []
    for rep in range(repeats):
        for sc in kaf.DEFAULT_SCENARIOS:
            s = kaf.one_job(sc, rep, cluster=cluster.name, nodes=cluster.num_nodes, root=root, ts_dir=ts_dir,
                            env=env, settle=1.0, timeout=timeout)
            samples.append(s)
            print(f"  kill {sc:<17} rep {rep}: detect {bl.fmt_s(s.detect)}  killed {bl.fmt_s(s.killed)}  "
                  f"exit {bl.fmt_s(s.exit)}  rc {s.rc}" + (f"  ERROR {s.error}" if s.error else ""), flush=True)
    return samples


# -- one cluster size --------------------------------------------------------------------


def warm_exec(cluster: bl.LocalCluster, env: dict[str, str], timeout: float) -> None:
    """The unmeasured first job: prepare (Ansible, once) and the head's ControlMaster."""
    g = bl.run_gpuctl("exec", cluster.name, "--", "true", env=env, timeout=timeout)
    assert g.ended is not None
    print(f"  first exec (prepare): {g.ended - g.started:.1f} s", flush=True)


def leftover_masters(root: Path, hashes: list[str]) -> list[str]:
    """ssh ControlMasters to a cluster's nodes that outlived it (they end with the nodes'
    sshd as a rule): Ansible's, under `root`, are stopped (SIGTERM by pid); gpuctl's named."""
    left = []
    time.sleep(0.5)
    for pid, path in bl.ssh_masters(hashes).items():
        if root in path.parents:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                continue
            left.append(f"{pid} (ansible's, stopped)")
        else:
            left.append(f"{pid} ({path})")
    return left


def one_size(n: int, args: argparse.Namespace, root: Path, env: dict[str, str], res: Results,
             workdir: tuple[Path, int] | None) -> None:
    name = f"bjp{os.getpid() % 100000}n{n}"
    print(f"N={n}: bringing up {n} local node(s) ({bl.machine_note()})", flush=True)
    hashes: list[str] = []
    with bl.LocalCluster(name, n, root, env) as cluster:
        hashes = [bl.control_hash(h["ansible_host"], int(h.get("ansible_port", 22)), h["ansible_user"])
                  for h in bl.read_inventory(cluster.cdir)]
        warm_exec(cluster, env, args.timeout)
        if n in args.nodes:
            tools = tool_commands(cluster, env, root)
            tools = {t: tools[t] for t in args.tools if t in tools}
            res.latency.append(measure_latency(cluster, tools, args.repeats, args.timeout))
        if n in args.copy_nodes and workdir is not None:
            res.copies.append(measure_copy(cluster, workdir[0], workdir[1], env, args.timeout))
        if n == args.kill_nodes:
            res.kill = measure_kill(cluster, root, env, args.repeats, args.kill_timeout)
            res.kill_nodes = n
    left = leftover_masters(root, hashes)
    if left:
        res.notes.append(f"N={n}: ssh ControlMaster(s) outlived the cluster: {', '.join(left)}")


# -- report ------------------------------------------------------------------------------


def ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v * 1000:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def latency_table(points: list[LatencyPoint], tools: list[str]) -> str:
    base = points[0].median("gpuctl") if points else None
    headers = ["N"] + [f"{t} {w}" for t in tools for w in ("s", "cpu ms")]
    headers += [f"gpuctl(N)/gpuctl({points[0].n})" if points else "gpuctl(N)/gpuctl(1)", "gpuctl/pdsh"]
    rows = []
    for p in points:
        row = [str(p.n)]
        for t in tools:
            row += [bl.fmt_s(p.median(t)), ms(p.median(t, "cpu"))]
        row += [fmt_x(ratio(p.median("gpuctl"), base)), fmt_x(ratio(p.median("gpuctl"), p.median("pdsh")))]
        rows.append(row)
    ns = [p.n for p in points]
    row = ["per node"]
    for t in tools:
        w = bl.slope(ns, [p.median(t) for p in points])
        c = bl.slope(ns, [p.median(t, "cpu") for p in points])
        row += [ms(w) + " ms", ms(c)]
    rows.append(row + ["", ""])
    return bl.table(headers, rows)


def mux_table(points: list[LatencyPoint], tools: list[str]) -> str:
    with_mux = [t for t in tools if t != "pdsh"]
    rows = [[str(p.n)] + [ms(p.median(t, "mux_cpu"), 1) for t in with_mux] for p in points]
    return bl.table(["N"] + [f"{t} ControlMaster cpu ms" for t in with_mux], rows)


def copy_table(copies: list[CopySample]) -> str:
    rows = [[str(c.n), f"{c.size_bytes / 1e6:.0f}", bl.fmt_s(c.wall), bl.fmt_s(c.upload), bl.fmt_s(c.rest),
             bl.fmt_s(c.cpu), bl.fmt_s(c.again_wall),
             "-" if c.tx_bytes is None else f"{c.tx_bytes / 1e6:.1f}", fmt_x(c.out_ratio),
             "-" if c.again_tx_bytes is None else f"{c.again_tx_bytes / 1e6:.2f}", copy_note(c)] for c in copies]
    return bl.table(["N", "MB", "cold exec s", "controller->head s", "rest s", "gpuctl cpu s",
                     "unchanged again s", "MB out", "out/workdir", "MB out again", "note"], rows)


def copy_note(c: CopySample) -> str:
    notes = [c.error] if c.error else []
    if c.prepared:
        notes.append(f"prepared again in: {', '.join(c.prepared)} (includes a prepare)")
    return "; ".join(notes)


def cold_table(cold: ColdApply) -> str:
    rows = [["wall s"] + [bl.fmt_s(cold.wall.get(p)) for p in PHASES],
            ["cpu s"] + [bl.fmt_s(cold.cpu.get(p)) for p in PHASES[:-1]] + [bl.fmt_s(cold.total_cpu)]]
    return bl.table([f"N={cold.n}"] + list(PHASES), rows)


def goals(res: Results) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met) for each goal that this run's data can judge."""
    out: list[tuple[str, str, bool | None]] = []
    pts = {p.n: p for p in res.latency}
    if 1 in pts and (w := pts[1].median("gpuctl")) is not None:
        out.append((f"warm exec on 1 node <= {GOAL_WARM_1:g} s", f"{w:.2f} s", w <= GOAL_WARM_1))
    if len(pts) >= 2:
        lo, hi = pts[min(pts)], pts[max(pts)]
        r = ratio(hi.median("gpuctl"), lo.median("gpuctl"))
        out.append((f"warm exec at N={hi.n} <= {GOAL_SCALE:g}x N={lo.n}", fmt_x(r), None if r is None else r <= GOAL_SCALE))
        cpu = bl.slope([p.n for p in res.latency], [p.median("gpuctl", "cpu") for p in res.latency])
        out.append((f"controller CPU per added node <= {GOAL_CPU_PER_NODE:g} ms",
                    f"{ms(cpu)} ms/node", None if cpu is None else cpu * 1000 <= GOAL_CPU_PER_NODE))
    if pts:
        hi = pts[max(pts)]
        r = ratio(hi.median("gpuctl"), hi.median("pdsh"))
        out.append((f"warm exec at N={hi.n} <= {GOAL_VS_PDSH:g}x pdsh", fmt_x(r),
                    None if r is None else r <= GOAL_VS_PDSH))
    ok = [c for c in res.copies if c.error is None and c.wall is not None and "cold" not in c.prepared]
    if len(ok) >= 2:
        lo, hi = min(ok, key=lambda c: c.n), max(ok, key=lambda c: c.n)
        r = ratio(hi.wall, lo.wall)
        out.append((f"workdir copy to {hi.n} nodes <= {GOAL_COPY_SCALE:g}x to {lo.n}", fmt_x(r),
                    None if r is None else r <= GOAL_COPY_SCALE))
    for c in ok:
        r = c.out_ratio
        out.append((f"bytes out / workdir, N={c.n}: ~1x (<= {GOAL_BYTES_OUT:g}x)", fmt_x(r),
                    None if r is None else r <= GOAL_BYTES_OUT))
    return out


def report(res: Results, tools: list[str]) -> str:
    out = ["gpuctl job plane on local nodes", f"machine before: {res.machine_before}",
           f"machine after:  {res.machine_after}", ""]
    if res.latency:
        out += ["1. warm `true` on every node: medians; cpu = the command's process tree on the controller",
                latency_table(res.latency, tools), "",
                "ssh ControlMaster daemons (not in the process tree above), medians:",
                mux_table(res.latency, tools), ""]
    if res.copies:
        out += ["2. workdir copy: `gpuctl exec NAME --workdir DIR -- true`, first time (cold) and unchanged again",
                copy_table(res.copies), ""]
    if res.cold is not None:
        out += ["3. cold `gpuctl apply` (setup: echo ready, run: true), phases from gpuctl's output"
                + (f"; ERROR {res.cold.error}" if res.cold.error else ""), cold_table(res.cold), ""]
    if res.kill:
        out += [f"4. kill_after_failure.py scenarios, {res.kill_nodes} nodes",
                kaf.report(res.kill, nodes=res.kill_nodes or 0, note_before="(above)", note_after="(above)"), ""]
    elif res.kill_skipped:
        out += [f"4. kill-after-failure: skipped: {res.kill_skipped}", ""]
    prepared = [f"N={r.n} {r.tool} rep {r.rep}" for p in res.latency for r in p.runs if r.prepared]
    if prepared:
        out += [(f"note: gpuctl prepared the nodes again in {', '.join(prepared)} (the agent or the prepare "
                 "roles changed during the run?): left out of the medians"), ""]
    g = goals(res)
    if g:
        out += ["goals:", bl.table(["goal", "measured", ""], [[a, b, verdict(c)] for a, b, c in g])]
    out += [f"note: {n}" for n in res.notes]
    return "\n".join(out)


def plot(res: Results, path: Path, tools: list[str]) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ns = [p.n for p in res.latency]
    for t in tools:
        axes[0][0].plot(ns, [p.median(t) for p in res.latency], marker="o", label=t)
        axes[0][1].plot(ns, [(p.median(t, "cpu") or 0) * 1000 for p in res.latency], marker="o", label=t)
    axes[0][0].set(title="warm `true` on every node", xlabel="nodes", ylabel="wall s (median)")
    axes[0][1].set(title="controller CPU (process tree)", xlabel="nodes", ylabel="CPU ms (median)")
    for ax in axes[0]:
        if len(ns) > 1 and max(ns) / min(ns) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[1][0]
    labels = [f"N={c.n}" for c in res.copies]
    ax.bar(labels, [c.upload or 0 for c in res.copies], label="controller -> head")
    ax.bar(labels, [c.rest or 0 for c in res.copies], bottom=[c.upload or 0 for c in res.copies],
           label="head -> workers, job")
    ax.set(title="workdir copy (cold exec)", ylabel="wall s")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    if res.cold is not None:
        left = 0.0
        for phase in PHASES[:-1]:
            w = res.cold.wall.get(phase, 0.0)
            ax.barh([f"N={res.cold.n}"], [w], left=left, height=0.4, label=phase)
            left += w
        ax.legend(fontsize=7, ncol=4, loc="upper center")
    ax.set(title="cold apply phases", xlabel="wall s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# -- main --------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int_list, default=[1, 8, 32, 64], help="cluster sizes N; default 1,8,32,64")
    ap.add_argument("--repeats", "-r", type=int, default=5, help="repeats per tool and N (and kill scenario)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"of {','.join(TOOLS)} (gpuctl always runs)")
    ap.add_argument("--copy-nodes", type=int_list, default=[1, 32], help="cluster sizes for the copy; default 1,32")
    ap.add_argument("--copy-mb", type=float, default=100, help="workdir size in MB; default 100")
    ap.add_argument("--cold-nodes", type=int, default=64, help="nodes of the cold apply (0: skip); default 64")
    ap.add_argument("--kill-nodes", type=int, default=8, help="cluster size for kill-after-failure (0: skip)")
    ap.add_argument("--kill-timeout", type=float, default=120, help="per-job limit of a kill scenario, s")
    ap.add_argument("--timeout", type=float, default=1800, help="per-command limit in seconds")
    ap.add_argument("--quick", action="store_true",
                    help="N in 1,2; copy 10 MB to 1,2 nodes; cold apply of 2; kill on 2; 2 repeats")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir (logs) after teardown")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.copy_nodes, args.copy_mb = [1, 2], [1, 2], 10.0
        args.cold_nodes, args.kill_nodes, args.repeats = 2, 2, 2
    args.tools = ["gpuctl"] + [t for t in TOOLS[1:] if t in args.tools.split(",")]
    if args.kill_nodes == 1:
        ap.error("--kill-nodes needs at least 2 nodes (one rank fails, the others are stopped)")
    return args


def check_pdsh(tools: list[str]) -> None:
    if "pdsh" in tools and not shutil.which("pdsh"):
        raise SystemExit("pdsh is not installed: apt-get install -y pdsh (Debian/Ubuntu; run apt-get update "
                         "first), or leave it out: --tools gpuctl,ansible")


def main() -> int:
    args = parse_args()
    bl.preflight()
    check_pdsh(args.tools)
    bl.sigterm_as_interrupt()
    netns_before = bl.netns_names()
    res = Results(bl.machine_note(), {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    with bl.state_dir("gpuctl-bench-jp-", keep=args.keep) as (root, env):
        sizes = sorted(set(args.nodes) | set(args.copy_nodes) | ({args.kill_nodes} if args.kill_nodes else set()))
        workdir = make_workdir(root, args.copy_mb) if args.copy_nodes else None
        for n in sizes:
            one_size(n, args, root, env, res, workdir)
        if workdir is not None:
            shutil.rmtree(workdir[0], ignore_errors=True)
        if args.cold_nodes:
            res.cold = measure_cold(args.cold_nodes, f"bjp{os.getpid() % 100000}cold", root, env, args.timeout)
    res.machine_after = bl.machine_note()
    left = sorted(n for n in bl.netns_names() - netns_before if n.startswith("gnbjp"))
    if left:
        res.notes.append(f"network namespaces left behind: {', '.join(left)}")
    print()
    print(report(res, args.tools))
    if args.json:
        args.json.write_text(json.dumps(asdict(res), indent=1, default=str))
        print(f"json: {args.json}")
    if args.plot:
        plot(res, args.plot, args.tools)
    failed = ([r for p in res.latency for r in p.runs if r.error] + [c for c in res.copies if c.error]
              + ([res.cold] if res.cold is not None and res.cold.error else []) + [s for s in res.kill if s.error])
    return 1 if failed or left else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # clusters are already down (every `finally` ran)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
