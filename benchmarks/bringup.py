#!/usr/bin/env python3
"""Bring-up benchmark: how long a cold `gpuctl apply` takes on N local nodes, and what it costs the controller.

For each N (default 1, 8, 32, 64; --big adds 128 and 256), on fresh netns local nodes:

  cold      `gpuctl apply -o json` of a no-op `run` on a new cluster: wall, and each phase
            (provision, prepare, job) with its wall time and controller CPU, as gpuctl reports
            them in its JSON document (this process and the children it waited for)
  reapply   the same apply again, nothing changed
  grow      apply with N+1 nodes: one more node is made and prepared
  floor     in the same run, on the same nodes: pdcp copies the same bundle (agent, probe,
            launcher, settings) to every node and pdsh runs the same install step there;
            what any tool would pay to put the prepared state on the nodes

Controller CPU per node is the prepare phase's CPU divided by N; per added node, its slope over
N. The ssh ControlMasters gpuctl leaves for later calls (one per node, daemons outside gpuctl's
rusage) are counted apart: what they spent by the end of the cold apply, per node. All local nodes share this machine's cores, so the nodes' own work (python3 starting, the
fabric probe) shows up in wall times as it would not on a real cluster; compare gpuctl with the
floor, measured in the same run.

  .venv/bin/python benchmarks/bringup.py [--nodes 1,8,32,64] [--big] [--plot bringup.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

# Goals (issue 23), on this machine.
GOAL_COLD_32 = 30.0  # s
GOAL_COLD_32_VS_1 = 3.0  # cold(32) / cold(1)
GOAL_COLD_64 = 60.0  # s
GOAL_CPU_PER_NODE_MS = 50.0  # controller CPU of prepare per node
GOAL_REAPPLY = 3.0  # s
GOAL_GROW_32 = 10.0  # s, 32 -> 33

SSH_OPTIONS = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes", "LogLevel=ERROR")
# The floor's bundle and the module's bootstrap, as gpuctl makes them (prepare.py).
BUNDLE_SCRIPT = """
import json, sys
from gpuctl.configplane import prepare
print(json.dumps({"bootstrap": prepare.install_bootstrap(),
                  "bundle": {"files": prepare.agent_files(), "ssh": None, "fabric": {"head": sys.argv[1]},
                             "fingerprint": "bench-floor"}}))
"""


@dataclass
class Point:
    n: int
    cold: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    reapply: float | None = None
    grow: float | None = None
    grow_prepare: float | None = None
    floor: float | None = None
    floor_cpu: float | None = None
    masters_cpu: float | None = None  # the cold apply's ssh ControlMasters (daemons: not in gpuctl's rusage)

    @property
    def cpu_per_node_ms(self) -> float | None:
        return self.cpu["prepare"] * 1000 / self.n if "prepare" in self.cpu else None


def apply_json(yaml_path: Path, env: dict[str, str], timeout: float) -> tuple[float, dict]:
    g = bl.run_gpuctl("apply", str(yaml_path), "-o", "json", env=env, timeout=timeout)
    doc = json.loads("".join(ln.text for ln in g.stdout))
    return (g.ended or 0) - g.started, doc


def task(root: Path, name: str, n: int) -> Path:
    path = root / f"{name}-{n}.yaml"
    path.write_text(f"name: {name}\nnum_nodes: {n}\nresources:\n  infra: local\nrun: 'true'\n")
    return path


def floor(cdir: Path, n: int, env: dict[str, str], root: Path, timeout: float) -> bl.Timed:
    """pdcp the bundle and the bootstrap to the first `n` nodes, pdsh the install step (and clean up)."""
    hosts = sorted(bl.read_inventory(cdir), key=lambda h: int(h["gpuctl_rank"]))[:n]
    bundle, boot = root / "floor-bundle.json", root / "floor-boot.py"
    made = subprocess.run([bl.gpuctl_python(), "-c", BUNDLE_SCRIPT, hosts[0]["gpuctl_address"]],
                          capture_output=True, text=True, env=env, check=True)
    floor_files = json.loads(made.stdout)
    bundle.write_text(json.dumps(floor_files["bundle"]))
    boot.write_text(floor_files["bootstrap"])
    key = hosts[0]["ansible_ssh_private_key_file"]
    ssh_env = {**env, "PDSH_SSH_ARGS_APPEND": " ".join([f"-i {key}", *(f"-o {o}" for o in SSH_OPTIONS)])}
    common = ["-R", "ssh", "-f", str(len(hosts)), "-l", hosts[0]["ansible_user"],
              "-w", ",".join(h["ansible_host"] for h in hosts)]
    steps = [["pdcp", *common, str(bundle), str(boot), "."],
             ["pdsh", "-S", *common,
              "python3 floor-boot.py < floor-bundle.json >/dev/null; rc=$?; rm -f floor-boot.py floor-bundle.json; "
              "exit $rc"]]
    wall = cpu = 0.0
    for argv in steps:
        t = bl.timed_command(argv, ssh_env, timeout=timeout)
        if t.rc != 0:
            raise RuntimeError(f"floor: {shlex.join(argv[:2])} failed:\n{t.output}")
        wall, cpu = wall + t.wall, cpu + t.cpu
    return bl.Timed(0, wall, cpu, "")


def one_size(n: int, root: Path, env: dict[str, str], timeout: float) -> Point:
    name = f"bu{n}"
    p = Point(n)
    cdir = Path(env["GPUCTL_STATE_DIR"]) / "clusters" / name
    try:
        p.cold, doc = apply_json(task(root, name, n), env, timeout)
        for ph in doc.get("phases") or []:
            p.phases[ph["phase"]] = ph["seconds"]
            p.cpu[ph["phase"]] = ph["controller_cpu_s"]
        hosts = bl.read_inventory(cdir)
        masters = bl.ssh_masters(bl.control_hash(h["ansible_host"], int(h.get("ansible_port", 22)), h["ansible_user"])
                                 for h in hosts)
        p.masters_cpu = bl.cpu_seconds(list(masters))
        p.reapply, _ = apply_json(task(root, name, n), env, timeout)
        p.grow, doc = apply_json(task(root, name, n + 1), env, timeout)
        p.grow_prepare = next((ph["seconds"] for ph in doc.get("phases") or [] if ph["phase"] == "prepare"), None)
        t = floor(cdir, n, env, root, timeout)  # last: it leaves another fingerprint on the nodes
        p.floor, p.floor_cpu = t.wall, t.cpu
    finally:
        if cdir.exists():
            bl.run_gpuctl("down", name, env=env, timeout=timeout, check=False)
    print(f"N={n}: cold {bl.fmt_s(p.cold, 1)} s, prepare {bl.fmt_s(p.phases.get('prepare'), 1)} s "
          f"({bl.fmt_s(p.cpu_per_node_ms, 0)} ms CPU/node), floor {bl.fmt_s(p.floor, 1)} s", file=sys.stderr)
    return p


def report(points: list[Point]) -> str:
    rows = []
    for p in points:
        rows.append([str(p.n), bl.fmt_s(p.cold, 1), bl.fmt_s(p.phases.get("provision"), 1),
                     bl.fmt_s(p.phases.get("prepare"), 1), bl.fmt_s(p.phases.get("job"), 1),
                     bl.fmt_s(p.cpu.get("prepare"), 2), bl.fmt_s(p.cpu_per_node_ms, 0),
                     bl.fmt_s(p.masters_cpu * 1000 / p.n if p.masters_cpu is not None else None, 0),
                     bl.fmt_s(p.reapply, 1), bl.fmt_s(p.grow, 1), bl.fmt_s(p.floor, 1),
                     bl.fmt_s(p.floor_cpu * 1000 / p.n if p.floor_cpu is not None else None, 0),
                     bl.fmt_s(p.phases["prepare"] / p.floor if p.floor and "prepare" in p.phases else None, 1)])
    return bl.table(["N", "cold s", "provision", "prepare", "job", "prepare CPU s", "CPU ms/node", "+ masters ms/node",
                     "reapply s", "grow N+1 s", "floor s", "floor CPU ms/node", "prepare/floor"], rows)


def cpu_per_added_node_ms(points: list[Point]) -> float | None:
    """The prepare phase's controller CPU per added node: the least-squares slope over N (what a
    fixed cost, such as ansible-playbook starting, does not distort)."""
    slope = bl.slope([p.n for p in points], [p.cpu.get("prepare") for p in points])
    return None if slope is None else slope * 1000


def goals(points: list[Point]) -> list[str]:
    by_n = {p.n: p for p in points}
    out = []

    def check(what: str, value: float | None, goal: float, unit: str = "s") -> None:
        ok = None if value is None else value <= goal
        out.append(f"{'PASS' if ok else 'FAIL' if ok is False else 'n/a '}  {what}: "
                   f"{bl.fmt_s(value, 2)} {unit} (goal <= {goal:g} {unit})")

    if 32 in by_n:
        check("cold apply, 32 nodes", by_n[32].cold, GOAL_COLD_32)
        if 1 in by_n and by_n[1].cold:
            check("cold apply, 32 nodes / 1 node", (by_n[32].cold or 0) / by_n[1].cold, GOAL_COLD_32_VS_1, "x")
        check("adding one node to 32", by_n[32].grow, GOAL_GROW_32)
    if 64 in by_n:
        check("cold apply, 64 nodes", by_n[64].cold, GOAL_COLD_64)
    added = cpu_per_added_node_ms(points)
    check("controller CPU of prepare per added node (slope over N)", added, GOAL_CPU_PER_NODE_MS, "ms")
    if 32 in by_n:  # the size the goal was set at: a re-apply still runs the no-op job on every node
        check("re-apply with nothing changed, 32 nodes", by_n[32].reapply, GOAL_REAPPLY)
    return out


def plot(points: list[Point], path: Path) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    ns = [p.n for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    ax = axes[0]
    ax.plot(ns, [p.cold for p in points], marker="o", label="cold apply")
    ax.plot(ns, [p.phases.get("prepare") for p in points], marker="o", label="prepare phase")
    ax.plot(ns, [p.floor for p in points], marker="o", label="floor: pdcp + pdsh install")
    ax.plot(ns, [p.grow for p in points], marker="o", label="grow N -> N+1")
    ax.set(title="bring-up wall time", xlabel="nodes", ylabel="s")
    ax = axes[1]
    ax.plot(ns, [p.cpu_per_node_ms for p in points], marker="o", label="gpuctl prepare")
    ax.plot(ns, [p.floor_cpu * 1000 / p.n if p.floor_cpu is not None else None for p in points], marker="o",
            label="floor")
    ax.axhline(GOAL_CPU_PER_NODE_MS, linestyle="--", color="grey", label="goal")
    ax.set(title="controller CPU per node", xlabel="nodes", ylabel="ms")
    for ax in axes:
        if len(ns) > 1 and max(ns) / min(ns) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=lambda t: sorted({int(x) for x in t.split(",") if x.strip()}),
                    default=[1, 8, 32, 64], help="cluster sizes N; default 1,8,32,64")
    ap.add_argument("--big", action="store_true", help="also 128 and 256 nodes (memory permitting)")
    ap.add_argument("--timeout", type=float, default=1800, help="per-command limit in seconds")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir (logs)")
    args = ap.parse_args()
    sizes = sorted(set(args.nodes) | ({128, 256} if args.big else set()))
    bl.preflight()
    if not (shutil.which("pdsh") and shutil.which("pdcp")):
        raise SystemExit("pdsh and pdcp are needed for the floor: apt-get install -y pdsh")
    bl.sigterm_as_interrupt()
    note = bl.machine_note()
    points = []
    with bl.state_dir("gpuctl-bench-bu-", keep=args.keep) as (root, env):
        for n in sizes:
            points.append(one_size(n, root, env, args.timeout))
    print(f"\nBring-up on local netns nodes ({note}); a no-op run; floor: pdcp + pdsh of the same bundle "
          "and install step\n")
    print(report(points))
    added = cpu_per_added_node_ms(points)
    if added is not None:
        print(f"\nController CPU of prepare per added node (slope over N): {added:.0f} ms")
    print()
    print("\n".join(goals(points)))
    if args.json:
        args.json.write_text(json.dumps({"machine": note, "points": [asdict(p) for p in points]}, indent=1))
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
