#!/usr/bin/env python3
"""Kill-after-failure and Ctrl-C delays of `gpuctl exec` on a local cluster.

One K-node local cluster (default 3) is brought up once; then, R times each
(interleaved, so load from other work hits every scenario alike):

  fail          rank K-1 exits 1 while ranks 0..K-2 run `sleep 3600` (bash +
                sleep: the rank's process group). Rank K-1 fails on a signal
                from this script (a go-file), 1 s after gpuctl printed
                "Job N running", and writes `date +%s.%N` just before `exit 1`.
                Measured from that timestamp: until gpuctl prints that it stops
                the other ranks (detect), until every process of the other
                ranks is gone (killed), until gpuctl exits (exit, code 1).
  sigint        every rank sleeps; SIGINT to gpuctl's pid (`kill -INT`), with
                GPUCTL_CANCEL_ON_INTERRUPT=1 (a plain Ctrl-C only stops following).
  sigint-group  the same, SIGINT to gpuctl's whole process group, as a
                terminal's Ctrl-C does (its ssh followers get it too).
                Measured from the signal: until every rank's process is gone,
                until gpuctl exits (code 130).
  fail-ignoreterm, sigint-ignoreterm
                as fail / sigint, but the sleeping ranks ignore SIGTERM
                (`trap '' TERM`, inherited by sleep): only the SIGKILL after
                gpuctl's grace (launch.KILL_GRACE_S) ends them, the worst case.
                sigint-ignoreterm is not in the default set.

Rank processes are found by a per-job marker in their environment
(BENCH_MARKER=..., /proc/PID/environ; local nodes share this machine's process
table), then polled every 20 ms by PID and start time.

    .venv/bin/python benchmarks/kill_after_failure.py [--nodes 3] [--repeats 5] [--plot kill.png]

Needs what the local nodes need (root for netns mode, terraform, sshd, rsync).
Everything lives in a temp GPUCTL_STATE_DIR; the cluster is torn down
(`gpuctl down`) and checked to be gone even when the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

POLL_S = 0.02
GOAL_S = 5.0
SCENARIOS = ("fail", "sigint", "sigint-group", "fail-ignoreterm", "sigint-ignoreterm")
DEFAULT_SCENARIOS = ("fail", "sigint", "sigint-group", "fail-ignoreterm")

RUN_SCRIPT = """\
if [ "$GPUCTL_NODE_RANK" = "$BENCH_FAIL_RANK" ]; then
  end=$((SECONDS + 300))
  while [ ! -e "$BENCH_DIR/go-$BENCH_MARKER" ] && [ "$SECONDS" -lt "$end" ]; do sleep 0.05; done
  date +%s.%N > "$BENCH_DIR/fail-$BENCH_MARKER"
  exit 1
fi
echo "rank $GPUCTL_NODE_RANK sleeping"
if [ "$BENCH_IGNORE_TERM" = 1 ]; then trap '' TERM; fi  # inherited by sleep: only SIGKILL ends it
sleep 3600
"""


@dataclass
class Sample:
    scenario: str
    rep: int
    rc: int | None
    t0: float | None = None  # failure timestamp / signal time (time.time())
    detect: float | None = None  # fail: t0 -> gpuctl's "stopping the other rank(s)" line
    killed: float | None = None  # t0 -> every tracked rank process gone
    exit: float | None = None  # t0 -> gpuctl exited
    tracked: int = 0  # rank processes watched
    leftovers: list[int] = field(default_factory=list)
    error: str | None = None


def write_task(path: Path, *, marker: str, fail_rank: int, ts_dir: Path, ignore_term: bool, nodes: int) -> None:
    envs = {"BENCH_MARKER": marker, "BENCH_FAIL_RANK": str(fail_rank), "BENCH_DIR": str(ts_dir),
            "BENCH_IGNORE_TERM": "1" if ignore_term else "0"}
    # `gpuctl exec NAME FILE` runs on the file's num_nodes first nodes, as `sky exec` does.
    lines = ["name: bench-kill", f"num_nodes: {nodes}", "envs:"] + [f"  {k}: {json.dumps(v)}" for k, v in envs.items()]
    lines += ["run: |"] + ["  " + ln for ln in RUN_SCRIPT.splitlines()]
    path.write_text("\n".join(lines) + "\n")


def wait_running(g: bl.Gpuctl, timeout: float) -> bl.Line:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = g.first(bl.JOB_RUNNING)
        if line is not None:
            return line
        if g.poll() is not None:
            break
        time.sleep(0.02)
    raise RuntimeError("the job did not start:\n" + g.describe())


def rank_processes(marker: str, ranks: set[int], per_rank: int, timeout: float) -> dict[int, str]:
    """pid -> start time of the marked processes of `ranks`, once each has `per_rank`."""
    deadline = time.monotonic() + timeout
    while True:
        found = bl.find_env_processes(f"BENCH_MARKER={marker}")
        mine = {pid: start for pid, (start, env) in found.items()
                if env.get("GPUCTL_NODE_RANK", "").isdigit() and int(env["GPUCTL_NODE_RANK"]) in ranks}
        counts = {r: 0 for r in ranks}
        for pid, (start, env) in found.items():
            if pid in mine:
                counts[int(env["GPUCTL_NODE_RANK"])] += 1
        if all(c >= per_rank for c in counts.values()) or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def one_job(scenario: str, rep: int, *, cluster: str, nodes: int, root: Path, ts_dir: Path,
            env: dict[str, str], settle: float, timeout: float) -> Sample:
    marker = f"b{os.getpid()}r{rep}{scenario.replace('-', '')}{secrets.token_hex(4)}"
    failing = scenario.startswith("fail")
    fail_rank = nodes - 1 if failing else -1
    task = root / f"task-{marker}.yaml"
    write_task(task, marker=marker, fail_rank=fail_rank, ts_dir=ts_dir, ignore_term=scenario.endswith("-ignoreterm"),
               nodes=nodes)
    watched = {r for r in range(nodes) if r != fail_rank}
    # Ctrl-C ends the job here: what is measured is how fast (a plain Ctrl-C only stops following)
    g = bl.Gpuctl("exec", cluster, str(task), env={**env, "GPUCTL_CANCEL_ON_INTERRUPT": "1"})
    s = Sample(scenario, rep, None)
    try:
        wait_running(g, timeout)
        procs = rank_processes(marker, watched, per_rank=2, timeout=15)
        s.tracked = len(procs)
        time.sleep(settle)  # gpuctl is following every rank by now
        if failing:
            (ts_dir / f"go-{marker}").touch()
        else:
            s.t0 = time.time()
            g.interrupt(group=scenario == "sigint-group")
        t_killed = t_exit = None
        deadline = time.monotonic() + timeout
        while (t_killed is None or t_exit is None) and time.monotonic() < deadline:
            now = time.time()
            if t_killed is None and not any(bl.proc_alive(p, st) for p, st in procs.items()):
                t_killed = now
            if t_exit is None and g.poll() is not None:
                t_exit = g.ended or now
            time.sleep(POLL_S)
        s.rc = g.wait(timeout=60)
        if failing:
            ts_file = ts_dir / f"fail-{marker}"
            s.t0 = float(ts_file.read_text().strip()) if ts_file.exists() else None
            line = g.first(r"exited with code \d+; stopping the other")
            if s.t0 is not None and line is not None:
                s.detect = line.t - s.t0
        if s.t0 is not None:
            s.killed = None if t_killed is None else max(t_killed - s.t0, 0.0)
            s.exit = None if t_exit is None else t_exit - s.t0
        expected = 1 if failing else 130
        if s.rc != expected:
            s.error = f"gpuctl exit code {s.rc}, expected {expected}"
        if s.killed is None:
            s.error = (s.error + "; " if s.error else "") + "rank processes still running at the timeout"
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        s.error = str(exc).splitlines()[0]
        print(str(exc), file=sys.stderr)
    finally:
        if g.poll() is None:
            g.stop()
        s.rc = g.proc.returncode
        (ts_dir / f"go-{marker}").touch()  # never leave a rank waiting
        time.sleep(0.2)
        left = bl.find_env_processes(f"BENCH_MARKER={marker}")
        s.leftovers = sorted(left)
        for pid in left:  # a leftover rank would skew the next repetitions
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if s.leftovers:
            s.error = (s.error + "; " if s.error else "") + f"left running after gpuctl exited: {s.leftovers}"
    return s


def report(samples: list[Sample], *, nodes: int, note_before: str, note_after: str) -> str:
    out = [f"kill-after-failure and Ctrl-C delays, {nodes} local nodes; seconds min / median / max",
           f"machine before: {note_before}", f"machine after:  {note_after}", ""]
    rows = []
    for sc in SCENARIOS:
        mine = [s for s in samples if s.scenario == sc]
        if not mine:
            continue
        ok = [s for s in mine if s.error is None]
        start = "failure timestamp" if sc.startswith("fail") else "signal"
        rows.append([sc, f"{len(ok)}/{len(mine)}", start,
                     bl.fmt_summary([s.detect for s in ok]) if sc.startswith("fail") else "-",
                     bl.fmt_summary([s.killed for s in ok]), bl.fmt_summary([s.exit for s in ok]),
                     "yes" if ok and max(s.killed for s in ok) < GOAL_S else "NO"])
    out.append(bl.table(["scenario", "ok", "from", "gpuctl notices", "all rank processes gone",
                         "gpuctl exited", f"all < {GOAL_S:g} s"], rows))
    out += ["", "per repetition:"]
    out.append(bl.table(["scenario", "rep", "rc", "detect s", "killed s", "exit s", "tracked pids", "error"],
                        [[s.scenario, s.rep, s.rc, bl.fmt_s(s.detect), bl.fmt_s(s.killed), bl.fmt_s(s.exit),
                          s.tracked, s.error or ""] for s in samples]))
    return "\n".join(out)


def plot(samples: list[Sample], path: Path, nodes: int) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, offsets = [], {"detect": -0.2, "killed": 0.0, "exit": 0.2}
    colors = {"detect": "tab:blue", "killed": "tab:red", "exit": "tab:gray"}
    for i, sc in enumerate(s for s in SCENARIOS if any(x.scenario == s for x in samples)):
        labels.append(sc)
        for metric, dx in offsets.items():
            ys = [getattr(s, metric) for s in samples if s.scenario == sc and s.error is None]
            ys = [y for y in ys if y is not None]
            ax.scatter([i + dx] * len(ys), ys, color=colors[metric], s=18,
                       label=metric)
    ax.axhline(GOAL_S, color="tab:green", linestyle="--", linewidth=1, label=f"goal {GOAL_S:g} s")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds after the failure / signal")
    ax.set_title(f"gpuctl: kill-after-failure and Ctrl-C, {nodes} local nodes")
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", "-k", type=int, default=3, help="cluster size K (rank K-1 fails); default 3")
    ap.add_argument("--repeats", "-r", type=int, default=5, help="repetitions per scenario; default 5")
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)}; default {','.join(DEFAULT_SCENARIOS)}")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between 'Job N running' and the failure / signal; default 1")
    ap.add_argument("--timeout", type=float, default=300, help="per-job limit in seconds")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir (logs) after teardown")
    args = ap.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or args.nodes < 2 and any(s.startswith("fail") for s in scenarios):
        ap.error(f"unknown scenario(s) {bad}" if bad else "fail needs --nodes >= 2")
    bl.preflight()
    bl.sigterm_as_interrupt()
    note_before = bl.machine_note()
    samples: list[Sample] = []
    name = f"benchkill{os.getpid() % 100000}"
    with bl.state_dir("gpuctl-bench-kill-", keep=args.keep) as (root, env):
        ts_dir = root / "ts"
        ts_dir.mkdir()
        os.chmod(ts_dir, 0o1777)  # ranks write here (loopback nodes may run as another user)
        print(f"bringing up {args.nodes} local nodes ({note_before})", flush=True)
        with bl.LocalCluster(name, args.nodes, root, env) as cluster:
            # One unmeasured job first: every scenario then finds warm ControlMaster connections.
            bl.run_gpuctl("exec", cluster.name, "--", "true", env=env)
            for rep in range(args.repeats):
                for sc in scenarios:
                    s = one_job(sc, rep, cluster=cluster.name, nodes=args.nodes, root=root, ts_dir=ts_dir,
                                env=env, settle=args.settle, timeout=args.timeout)
                    samples.append(s)
                    print(f"  {sc:<17} rep {rep}: detect {bl.fmt_s(s.detect)}  killed {bl.fmt_s(s.killed)}  "
                          f"exit {bl.fmt_s(s.exit)}  rc {s.rc}" + (f"  ERROR {s.error}" if s.error else ""),
                          flush=True)
    print()
    print(report(samples, nodes=args.nodes, note_before=note_before, note_after=bl.machine_note()))
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in samples], indent=1))
    if args.plot:
        plot(samples, args.plot, args.nodes)
    return 0 if samples and all(s.error is None for s in samples) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # clusters are already down (every `finally` ran)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
