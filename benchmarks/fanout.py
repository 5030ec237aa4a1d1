#!/usr/bin/env python3
"""Stage latency of gpuctl against node count (fan-out) on local nodes.

For each N (default 1, 2, 4, 8):
  1. one after the other, `gpuctl apply cluster.yaml --provision-only` (a
     trivial task): the provisioning stage, and each terraform command in it
     (init, apply, output) timed by a `terraform` shim first on gpuctl's PATH;
  2. with every cluster up, `gpuctl exec NAME -- true` R times each (default
     4), round-robin over N so that load from other work hits every N alike:
     end to end and per stage from gpuctl's plain output (`==> X` ...
     `X: done in Ys`, timed here to the ms): wait, sync, env, run, plus
     `startup` (process start to the first stage line: imports, registry,
     inventory) and `watch` ("Job N running" to exit: following the ranks,
     log copy-back, registry). Each stage's CPU time (user+sys of gpuctl and
     every descendant it reaped: ansible-playbook, its forks, ssh, rsync; not
     sshd or modules on the nodes) comes from /proc/PID/stat at each stage
     line, a measure far less disturbed by other load than wall time. The
     first exec is cold (its wait stage opens the ssh connections) and is
     reported apart; the others are warm (ControlMaster). Peak memory (PSS)
     of gpuctl's process tree is sampled every 0.25 s;
  3. `gpuctl down` of each (and its terraform destroy), then a check that the
     nodes' network namespaces, sshd processes and directories are gone.

A stage whose time grows by a constant per node is walking nodes one by one
or is bound by this machine's cores (compare `cpu`); the "s/node" row is the
least-squares slope over N, the ratio table divides by the smallest N.

    .venv/bin/python benchmarks/fanout.py [--nodes 1,2,4,8] [--repeats 4] [--plot fanout.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

EXEC_STAGES = ("startup", "wait", "sync", "env", "run", "watch", "total")


@dataclass
class ExecSample:
    stages: dict[str, float]  # wall seconds
    cpu: dict[str, float]  # CPU seconds of gpuctl's process tree, same keys
    peak_pss_mb: float
    peak_procs: int
    rc: int
    # playbook stem -> {"span": s, "tasks": {task: [per-host s]}, "skew": {task: s}} (ansible-runner events)
    playbooks: dict[str, dict] = field(default_factory=dict)


@dataclass
class Point:
    n: int
    provision: float | None = None  # gpuctl's provisioning stage
    tf: dict[str, float] = field(default_factory=dict)  # init/apply/output during provisioning
    provision_total: float | None = None  # whole `apply --provision-only` command
    execs: list[ExecSample] = field(default_factory=list)
    down: float | None = None
    tf_destroy: float | None = None
    loads: list[float] = field(default_factory=list)  # 1-min load average after each exec
    error: str | None = None

    def warm(self, stage: str, *, cpu: bool = False) -> float | None:
        runs = self.execs[1:] or self.execs  # one run only: it is all we have
        vals = [(e.cpu if cpu else e.stages).get(stage) for e in runs if e.rc == 0]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def warm_playbook(self, stage: str, get) -> float | None:
        """Median over the warm execs of get(playbook record of `stage`)."""
        vals = []
        for e in (self.execs[1:] or self.execs):
            pb = e.playbooks.get(stage)
            v = get(pb) if pb is not None and e.rc == 0 else None
            if v is not None:
                vals.append(v)
        return statistics.median(vals) if vals else None

    def warm_min(self, stage: str) -> float | None:
        runs = self.execs[1:] or self.execs
        vals = [e.stages.get(stage) for e in runs if e.rc == 0 and e.stages.get(stage) is not None]
        return min(vals) if vals else None

    def cold(self, stage: str) -> float | None:
        return self.execs[0].stages.get(stage) if self.execs and self.execs[0].rc == 0 else None


PLAYBOOK_STAGES = ("wait", "sync", "env", "run")
BASELINE = "baseline"


def exec_once(cluster: bl.LocalCluster, env: dict[str, str], timeout: float) -> ExecSample:
    before = bl.artifact_dirs(cluster.cdir)
    g = bl.Gpuctl("exec", cluster.name, "--", "true", env=env)
    mem = bl.TreeMemorySampler(g.proc.pid)
    try:
        rc = g.wait(timeout=timeout)
    finally:
        mem.stop()
    if rc != 0:
        print(g.describe(), file=sys.stderr)
    stages = g.stages()
    assert g.ended is not None
    first = g.first(bl.STAGE_START)
    running = g.first(bl.JOB_RUNNING)
    if first is not None:
        stages["startup"] = first.t - g.started
    if running is not None:
        stages["watch"] = g.ended - running.t
    stages["total"] = g.ended - g.started
    cpu = g.stages(cpu=True)
    if first is not None and first.cpu is not None:
        cpu["startup"] = first.cpu
    if g.cpu is not None:
        cpu["total"] = g.cpu
        if running is not None and running.cpu is not None:
            cpu["watch"] = g.cpu - running.cpu
    playbooks = {}
    for d in sorted(bl.artifact_dirs(cluster.cdir) - before):
        run = bl.read_playbook_run(d)
        if run is not None:
            playbooks[run.playbook] = {
                "span": run.span,
                "tasks": run.tasks,
                "skew": {t: max(v) - min(v) for t, v in run.starts.items() if v},
            }
    return ExecSample(stages, cpu, mem.peak_bytes / 2**20, mem.peak_procs, rc, playbooks)


Variant = tuple[str, dict[str, str]]  # name, extra environment for gpuctl


def run_all(counts: list[int], variants: list[Variant], *, root: Path, env: dict[str, str], tf_log: Path,
            repeats: int, timeout: float) -> dict[str, list[Point]]:
    """Bring every cluster up (one after the other), then run the execs round-robin
    over N and variants (load from other work spreads over all of them alike), then
    tear down."""
    keys = [(v, n) for v, _ in variants for n in counts]
    envs = {v: {**env, **extra} for v, extra in variants}
    points = {k: Point(k[1]) for k in keys}
    clusters: dict[tuple[str, int], bl.LocalCluster] = {}
    with ExitStack() as stack:
        for i, (v, n) in enumerate(keys):
            p = points[(v, n)]
            print(f"N={n} {v}: provisioning ({bl.machine_note()})", flush=True)
            t0 = time.time()
            cluster = bl.LocalCluster(f"fo{n}v{i}x{os.getpid() % 100000}", n, root, envs[v])
            try:
                stack.enter_context(cluster)
            except Exception as exc:  # noqa: BLE001 - recorded; the others still run
                p.error = "provisioning: " + str(exc).splitlines()[0]
                print(f"N={n} {v}: {exc}", file=sys.stderr)
                with suppress(Exception):
                    cluster.down()
                continue
            clusters[(v, n)] = cluster
            assert cluster.provision_run is not None
            p.provision = cluster.provision_run.stages().get("provision")
            p.provision_total = (cluster.provision_run.ended or 0) - cluster.provision_run.started
            p.tf = bl.terraform_times(tf_log, since=t0)
        for i in range(repeats):
            for (v, n), cluster in clusters.items():
                s = exec_once(cluster, envs[v], timeout)
                points[(v, n)].execs.append(s)
                points[(v, n)].loads.append(os.getloadavg()[0])
                print(f"  N={n:<3} {v} exec {i}: "
                      + "  ".join(f"{k} {x:.2f}" for k, x in sorted(s.stages.items()))
                      + f"  cpu {s.cpu.get('total', 0):.2f}"
                      + f"  peak {s.peak_pss_mb:.0f} MB / {s.peak_procs} procs  rc {s.rc}", flush=True)
        for k in reversed(list(clusters)):  # teardown, measured (ExitStack then finds them gone)
            cluster = clusters[k]
            t_down = time.time()
            try:
                cluster.down()
            except Exception as exc:  # noqa: BLE001
                points[k].error = "teardown: " + str(exc).splitlines()[0]
            if cluster.down_run is not None:
                points[k].down = cluster.down_run.stages().get("down")
                points[k].tf_destroy = bl.terraform_times(tf_log, since=t_down).get("destroy")
    return {v: [points[(v, n)] for n in counts] for v, _ in variants}


def compare(results: dict[str, list[Point]]) -> str:
    """Each variant against the first one: warm median wall and CPU, as a ratio."""
    names = list(results)
    base = {p.n: p for p in results[names[0]]}
    rows = []
    for v in names[1:]:
        for p in results[v]:
            b = base.get(p.n)
            if b is None or not p.execs or not b.execs:
                continue
            for st in (*PLAYBOOK_STAGES, "total"):
                cells = []
                for cpu in (False, True):
                    x, y = p.warm(st, cpu=cpu), b.warm(st, cpu=cpu)
                    cells += [bl.fmt_s(y), bl.fmt_s(x), "-" if x is None or not y else f"{x / y:.2f}"]
                rows.append([p.n, st, v, *cells])
    return bl.table(["N", "stage", "variant", f"wall {names[0]}", "wall variant", "ratio",
                     f"cpu {names[0]}", "cpu variant", "ratio"], rows)


def task_table(ok: list[Point]) -> list[str]:
    """Per task: the slowest host's time at the smallest and the largest N, and at the
    largest N the spread of the hosts' start times (hosts taken one by one would show
    a spread growing with N)."""
    if not ok:
        return []
    lo, hi = ok[0], ok[-1]
    rows = []
    for st in PLAYBOOK_STAGES:
        names: list[str] = []
        for p in (lo, hi):
            for e in p.execs[1:] or p.execs:
                for t in (e.playbooks.get(st) or {}).get("tasks", {}):
                    if t not in names:
                        names.append(t)
        for t in names:
            slow = lambda p: p.warm_playbook(st, lambda pb: max(pb["tasks"][t]) if t in pb["tasks"] else None)  # noqa: E731
            fast = lambda p: p.warm_playbook(st, lambda pb: min(pb["tasks"][t]) if t in pb["tasks"] else None)  # noqa: E731
            skew = hi.warm_playbook(st, lambda pb: pb["skew"].get(t))
            rows.append([st, t[:60], bl.fmt_s(slow(lo)), f"{bl.fmt_s(fast(hi))} .. {bl.fmt_s(slow(hi))}",
                         bl.fmt_s(skew)])
    return ["", f"per task, seconds (warm median; N={lo.n}: slowest host; N={hi.n}: fastest .. slowest host, "
                f"and the spread of the hosts' start times):",
            bl.table(["stage", "task", f"N={lo.n}", f"N={hi.n}", f"N={hi.n} start spread"], rows)]


def slope(points: list[Point], get) -> float | None:
    xy = [(p.n, get(p)) for p in points if get(p) is not None]
    if len(xy) < 2:
        return None
    mx = statistics.mean(x for x, _ in xy)
    my = statistics.mean(y for _, y in xy)
    den = sum((x - mx) ** 2 for x, _ in xy)
    return sum((x - mx) * (y - my) for x, y in xy) / den if den else None


def report(points: list[Point], *, repeats: int, note_before: str, note_after: str, variant: str = "") -> str:
    ok = [p for p in points if p.execs]
    out = [f"fan-out: seconds per stage against node count N (local nodes)" + (f", variant {variant}" if variant else ""),
           f"machine before: {note_before}", f"machine after:  {note_after}", ""]

    out.append(f"`gpuctl exec NAME -- true`, warm (median of {max(repeats - 1, 0)} runs after the first):")
    rows = []
    for p in ok:
        peak = max((e.peak_pss_mb for e in p.execs[1:]), default=None)
        rows.append([p.n, *(bl.fmt_s(p.warm(s)) for s in EXEC_STAGES), bl.fmt_s(p.warm_min("total")),
                     "-" if peak is None else f"{peak:.0f}",
                     f"{statistics.median(p.loads):.1f}" if p.loads else "-"])
    rows.append(["s/node", *(bl.fmt_s(slope(ok, lambda p, s=s: p.warm(s)), 3) for s in EXEC_STAGES),
                 bl.fmt_s(slope(ok, lambda p: p.warm_min("total")), 3), "", ""])
    out.append(bl.table(["N", *EXEC_STAGES, "total min", "peak PSS MB", "load"], rows))

    out += ["", "CPU seconds of gpuctl's process tree (ansible-playbook and forks included; nodes' sshd "
            "and modules not), warm median:"]
    rows = [[p.n, *(bl.fmt_s(p.warm(s, cpu=True)) for s in EXEC_STAGES)] for p in ok]
    rows.append(["s/node", *(bl.fmt_s(slope(ok, lambda p, s=s: p.warm(s, cpu=True)), 3) for s in EXEC_STAGES)])
    out.append(bl.table(["N", *EXEC_STAGES], rows))

    out += ["", "inside the play (ansible-runner events: playbook start to stats) / outside it (stage minus "
            "play: ansible-playbook start-up, inventory, exit; runner), warm median:"]
    rows = []
    for p in ok:
        cells = []
        for st in PLAYBOOK_STAGES:
            inside = p.warm_playbook(st, lambda pb: pb["span"])
            wall = p.warm(st)
            outside = None if inside is None or wall is None else wall - inside
            cells.append(f"{bl.fmt_s(inside)} / {bl.fmt_s(outside)}")
        rows.append([p.n, *cells])
    out.append(bl.table(["N", *PLAYBOOK_STAGES], rows))
    out += task_table(ok)

    base = next((p for p in ok if p.n == min(q.n for q in ok)), None) if ok else None
    if base is not None:
        out += ["", f"ratio to N={base.n} (warm exec):"]
        rows = []
        for p in ok:
            cells = []
            for s in EXEC_STAGES:
                a, b = p.warm(s), base.warm(s)
                cells.append("-" if a is None or not b else f"{a / b:.2f}")
            rows.append([p.n, *cells])
        out.append(bl.table(["N", *EXEC_STAGES], rows))

    out += ["", "first (cold) exec, provisioning and teardown:"]
    cold_stages = ("wait", "total")
    rows = []
    for p in ok:
        rows.append([p.n, *(bl.fmt_s(p.cold(s)) for s in cold_stages), bl.fmt_s(p.provision),
                     bl.fmt_s(p.tf.get("init")), bl.fmt_s(p.tf.get("apply")), bl.fmt_s(p.tf.get("output")),
                     bl.fmt_s(p.down), bl.fmt_s(p.tf_destroy)])
    getters = [lambda p: p.cold("wait"), lambda p: p.cold("total"), lambda p: p.provision,
               lambda p: p.tf.get("init"), lambda p: p.tf.get("apply"), lambda p: p.tf.get("output"),
               lambda p: p.down, lambda p: p.tf_destroy]
    rows.append(["s/node", *(bl.fmt_s(slope(ok, g), 3) for g in getters)])
    out.append(bl.table(["N", "cold wait", "cold total", "provision stage", "tf init", "tf apply",
                         "tf output", "down stage", "tf destroy"], rows))
    for p in points:
        if p.error:
            out.append(f"N={p.n}: ERROR {p.error}")
    return "\n".join(out)


def plot(points: list[Point], path: Path) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    ok = [p for p in points if p.execs]
    ns = [p.n for p in ok]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for s in EXEC_STAGES:
        a1.plot(ns, [p.warm(s) for p in ok], marker="o", label=s, linewidth=2.5 if s == "total" else 1.2)
        a2.plot(ns, [p.warm(s, cpu=True) for p in ok], marker="o", label=s, linewidth=2.5 if s == "total" else 1.2)
    a1.set_title("gpuctl exec NAME -- true: wall (warm, median)")
    a2.set_title("the same: CPU of gpuctl's process tree")
    for label, get in (("provision stage", lambda p: p.provision), ("terraform apply", lambda p: p.tf.get("apply")),
                       ("cold exec total", lambda p: p.cold("total")), ("down stage", lambda p: p.down)):
        a3.plot(ns, [get(p) for p in ok], marker="o", label=label)
    a3.set_title("provisioning, first exec, teardown (wall)")
    for ax in (a1, a2, a3):
        ax.set_xlabel("nodes")
        ax.set_ylabel("seconds")
        ax.set_xticks(ns)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,2,4,8", help="comma-separated node counts; default 1,2,4,8")
    ap.add_argument("--repeats", "-r", type=int, default=4, help="execs per N (the first is cold); default 4")
    ap.add_argument("--timeout", type=float, default=900, help="per-command limit in seconds")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every measurement as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir (logs) after teardown")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V[,K=V...]",
                    help="also measure gpuctl with this extra environment (e.g. an ANSIBLE_* setting, which "
                         "overrides ansible.cfg), on clusters of its own, interleaved with the baseline; "
                         "repeatable")
    args = ap.parse_args()
    counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    variants: list[Variant] = [(BASELINE, {})]
    for spec in args.variant:
        name, _, assigns = spec.partition(":")
        extra = dict(a.split("=", 1) for a in assigns.split(",") if "=" in a)
        if not name or not extra or name == BASELINE:
            ap.error(f"--variant {spec!r}: want NAME:K=V[,K=V...]")
        variants.append((name, extra))
    if not counts or min(counts) < 1 or args.repeats < 1:
        ap.error("--nodes needs positive counts, --repeats >= 1")
    bl.preflight()
    bl.sigterm_as_interrupt()
    note_before = bl.machine_note()
    with bl.state_dir("gpuctl-bench-fanout-", keep=args.keep) as (root, env):
        shim_dir, tf_log = bl.terraform_shim(root)
        env["PATH"] = f"{shim_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        results = run_all(counts, variants, root=root, env=env, tf_log=tf_log, repeats=args.repeats,
                          timeout=args.timeout)
    note_after = bl.machine_note()
    for v, points in results.items():
        print()
        print(report(points, repeats=args.repeats, note_before=note_before, note_after=note_after,
                     variant=v if len(results) > 1 else ""))
    if len(results) > 1:
        print()
        print("variants against the baseline (warm median seconds):")
        print(compare(results))
    if args.json:
        args.json.write_text(json.dumps({v: [asdict(p) for p in pts] for v, pts in results.items()}, indent=1))
    if args.plot:
        plot(results[BASELINE], args.plot)
    points = [p for pts in results.values() for p in pts]
    return 0 if points and all(p.error is None for p in points) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # clusters are already down (every `finally` ran)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
