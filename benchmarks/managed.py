#!/usr/bin/env python3
"""Managed jobs: a node dies mid-run; how soon the supervisor sees it and every rank runs again.

For each N in --nodes (default 4, 16), R times (--repeats, default 3), on fresh netns local nodes:

  launch    `gpuctl jobs launch task.yaml -d -o json` of a job on N nodes (`infra: local`) whose
            ranks loop 600 steps of 0.25 s; each rank first takes `flock -n CKPT/rank-RANK.lock`
            (CKPT: a 0777 dir under /tmp, outside the nodes' homes) or writes a line to CKPT/dupes
            and exits 97, so two copies of one rank never go unnoticed, and logs
            `start RANK ATTEMPT TIME` to CKPT/events
  kill      once every rank of attempt 1 logged its start: the node of one rank dies (SIGKILL to
            every process in its network namespace, then `ip netns del`); a worker, and in the
            second repeat the head (rank 0)
  measure   detect       the job's recovery event's detected_at - the kill
            running      its resumed_at - the kill (the supervisor's word: every rank runs again,
                         seen at its next tick)
            ranks        the last `start RANK 2` line of the rank script - the kill (the ranks' word)
            only lost    the other nodes' sshd (pid and start time, nodes/node<rank>/sshd.pid) are
                         the same processes, still alive, and the lost rank has a new one
            duplicates   lines in CKPT/dupes, and (rank, attempt) pairs that started twice
            leaked       after `gpuctl jobs cancel ID`: what is left of every node the cluster had
                         (namespace, sshd, node dir, processes with its GPUCTL_NODE_TAG, ssh
                         masters), the cluster dir, a live supervisor; and the job must be
                         CANCELLED with its cluster marked destroyed
  floor     in the same run, after each job: a cold `gpuctl apply` of a 1-node local cluster with
            `run: "true"` (making and preparing one node from nothing, then running a no-op job):
            the reference a recovery is held to, reported as running / floor. Not a strict lower
            bound: the cold apply also makes the cluster's bridge, keys and masters, which a
            replacement reuses, so a worker's recovery can come in under it

The job's state is read from `$GPUCTL_STATE_DIR/managed.db` (gpuctl.managed.store), polled every
0.1 s; no `gpuctl jobs` command runs while a job is measured (each one would also look for dead
supervisors). The supervisor polls every GPUCTL_MANAGED_TICK_S (default 5 s; --tick sets it), so
detection and resumed_at carry up to one tick of wait by design.

With --takeover, the state is shared in S3 (a moto server on loopback stands in) and the job's
first runner dies with the node: runner A launches; once every rank runs, A's supervisor is
SIGKILLed, A's state dir is removed (all but the local nodes' homes: they stand for the cloud's
machines) and a node dies, all at once. Runner B, with a state dir of its own, has run `gpuctl
jobs queue` every --poll seconds (default 30) since the launch, as a scheduled job would; its first
call after the lease's term (GPUCTL_MANAGED_LEASE_S, 30 s) takes the job over. Measured: the
kill -> B's taking call, and -> every rank running again (the event's resumed_at in B's store, and
the rank script's start lines); goal: running again <= poll + 60 s, 0 duplicates, 0 leaked after
B's `jobs cancel`.

  .venv/bin/python benchmarks/managed.py [--nodes 4,16] [--repeats 3] [--tick S] [--plot managed.png] [--json out.json]
  .venv/bin/python benchmarks/managed.py --takeover [--nodes 4] [--repeats 2] [--poll 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

# Goals (managed jobs), on this machine.
GOAL_DETECT_S = 15.0
GOAL_RUNNING_S = 60.0
STEPS = 600
STEP_S = 0.25
POLL_S = 0.1
TERMINAL = ("SUCCEEDED", "CANCELLED", "FAILED", "FAILED_SETUP", "FAILED_NO_RESOURCE", "FAILED_SUPERVISOR")

RANK_SCRIPT = r"""
exec 9>"$CKPT/rank-$GPUCTL_NODE_RANK.lock"
if ! flock -n 9; then echo "dup $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT $(date +%s.%N)" >> "$CKPT/dupes"; exit 97; fi
echo "start $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT $(date +%s.%N)" >> "$CKPT/events"
echo "$GPUCTL_TASK_ID" >> "$CKPT/tasks"
step=0
while [ "$step" -lt "$STEPS" ]; do
  sleep "$STEP_S" & wait $!
  step=$((step + 1))
done
echo "end $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT $(date +%s.%N)" >> "$CKPT/events"
"""


@dataclass
class Sample:
    n: int
    rep: int
    lost_rank: int
    job_id: int | None = None
    cluster: str | None = None
    bring_up: float | None = None  # launch -> every rank of attempt 1 started
    kill: float | None = None  # time.time() after the SIGKILLs
    detect: float | None = None  # event.detected_at - kill
    running: float | None = None  # event.resumed_at - kill
    ranks: float | None = None  # last `start RANK 2` of the rank script - kill
    first_rank: float | None = None  # first `start RANK 2` - kill
    cause: str | None = None
    event_nodes: list[str] = field(default_factory=list)
    only_lost: bool | None = None
    replaced_detail: str | None = None
    duplicates: int | None = None
    leaked: list[str] = field(default_factory=list)
    final_status: str | None = None
    cancel: float | None = None  # `gpuctl jobs cancel ID` from start to exit (the cluster gone)
    floor: float | None = None
    stages: list[tuple[str, float]] = field(default_factory=list)  # the supervisor's stages after the kill
    supervisor_lines: list[str] = field(default_factory=list)  # its log from the kill to the end of attempt 2's start
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return self.running / self.floor if self.running is not None and self.floor else None


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = POLL_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class Job:
    """One managed job under test: its task file, bucket (CKPT), store row and cluster records."""

    def __init__(self, root: Path, env: dict[str, str], n: int, rep: int) -> None:
        self.env = env
        self.n = n
        self.state = Path(env["GPUCTL_STATE_DIR"])
        self.ckpt = Path(tempfile.mkdtemp(prefix="gpuctl-bench-mj-ckpt-", dir="/tmp"))
        self.ckpt.chmod(0o777)
        self.task = root / f"mj{n}r{rep}.yaml"
        body = "\n".join("  " + line if line else "" for line in RANK_SCRIPT.strip().splitlines())
        self.task.write_text(f"name: mj{n}r{rep}\nnum_nodes: {n}\nresources:\n  infra: local\n"
                             f"envs:\n  CKPT: '{self.ckpt}'\n  STEPS: '{STEPS}'\n  STEP_S: '{STEP_S}'\n"
                             f"run: |\n{body}\n")
        self.id: int | None = None
        self.cluster: str | None = None
        self._store: Any = None

    def store(self) -> Any:
        if self._store is None:
            # lazy: the benchmark runs gpuctl as a subprocess; only the job's row is read in-process
            from gpuctl.managed.store import Store
            self._store = Store(self.state / "managed.db")
        return self._store

    def launch(self, timeout: float) -> int:
        g = bl.run_gpuctl("jobs", "launch", str(self.task), "-d", "-o", "json", env=self.env, timeout=timeout)
        doc = json.loads("".join(ln.text for ln in g.stdout))
        self.id = int(doc["job"]["id"])
        self.cluster = self.row().cluster
        return self.id

    def row(self) -> Any:
        assert self.id is not None
        return self.store().get(self.id)

    def events(self) -> list[Any]:
        assert self.id is not None
        return self.store().events(self.id)

    @property
    def cdir(self) -> Path:
        return self.state / "clusters" / (self.cluster or "?")

    def rank_lines(self, kind: str = "start") -> list[tuple[int, int, float]]:
        """(rank, attempt, time) of the rank script's `start` (or `end`) lines."""
        path = self.ckpt / "events"
        out = []
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4 and parts[0] == kind:
                    out.append((int(parts[1]), int(parts[2]), float(parts[3])))
        return out

    def started(self, attempt: int) -> dict[int, float]:
        """rank -> first start time in `attempt`."""
        out: dict[int, float] = {}
        for rank, att, t in self.rank_lines():
            if att == attempt:
                out.setdefault(rank, t)
        return out

    def duplicates(self) -> int:
        path = self.ckpt / "dupes"
        dupes = len(path.read_text().splitlines()) if path.exists() else 0
        seen: dict[tuple[int, int], int] = {}
        for rank, att, _ in self.rank_lines():
            seen[(rank, att)] = seen.get((rank, att), 0) + 1
        return dupes + sum(c - 1 for c in seen.values() if c > 1)

    def supervisor_log(self) -> str:
        path = self.state / "managed" / str(self.id) / "supervisor.log"
        return path.read_text(errors="replace") if path.exists() else "(no supervisor log)"

    def cancel(self, timeout: float) -> bl.Gpuctl | None:
        if self.id is None:
            return None
        row = self.row()
        if row is None or row.status in TERMINAL:
            return None
        return bl.run_gpuctl("jobs", "cancel", str(self.id), "-o", "json", env=self.env, timeout=timeout,
                             check=False)

    def close(self) -> None:
        shutil.rmtree(self.ckpt, ignore_errors=True)


# -- the nodes --------------------------------------------------------------------------------


@dataclass
class NodeRecord:
    rank: int
    netns: str | None
    tag: str | None
    node_dir: Path | None
    sshd: tuple[int, str] | None


def read_nodes(cdir: Path) -> dict[int, NodeRecord]:
    """rank -> what the local-nodes module wrote for node<rank> (node.env, sshd.pid)."""
    out = {}
    for d in (cdir / "nodes").glob("node*"):
        if not d.is_dir() or not d.name[4:].isdigit():
            continue
        rank = int(d.name[4:])
        env = bl._env_file(d / "node.env") if (d / "node.env").exists() else {}
        sshd = None
        if (d / "sshd.pid").exists():
            try:
                pid, start = (d / "sshd.pid").read_text().split()
                sshd = (int(pid), start)
            except ValueError:
                pass
        out[rank] = NodeRecord(rank, env.get("LN_NETNS"), env.get("LN_TAG"),
                               Path(env["LN_DIR"]) if env.get("LN_DIR") else None, sshd)
    return out


def untouched(before: dict[int, NodeRecord], after: dict[int, NodeRecord], lost_rank: int) -> list[int]:
    """The ranks other than the lost one whose sshd is the same process as before, still alive."""
    return [r for r in before if r != lost_rank and after.get(r) and after[r].sshd == before[r].sshd
            and after[r].sshd is not None and bl.proc_alive(*after[r].sshd)]


def kill_node(ns: str) -> float:
    """The machine dies: SIGKILL to every process in its namespace (again, until none is left),
    then the namespace goes. Returns the time of the kill."""
    killed = None
    for _ in range(20):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if killed is None:
            killed = time.time()
        time.sleep(0.02)
    if killed is None:
        killed = time.time()
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return killed


def tagged_processes(tags: set[str]) -> list[str]:
    """Live processes whose environment carries GPUCTL_NODE_TAG=<one of tags> (one /proc scan)."""
    wanted = {f"GPUCTL_NODE_TAG={t}".encode() for t in tags}
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        env = bl._environ(name)
        if env and wanted & set(env) and bl.proc_alive(int(name)):
            found.append(f"pid {name} (node tag)")
    return found


def ssh_masters_of(cdir: Path) -> list[str]:
    """Live `ssh: PATH [mux]` whose socket is in the cluster's control dir (clusters/<name>/cm, or
    a per-cluster dir under the temp dir when that path is too long for a socket)."""
    import hashlib
    cm = (cdir / "cm").absolute()
    digest = hashlib.sha1(str(cm).encode()).hexdigest()[:12]
    dirs = {str(cm), f"{tempfile.gettempdir()}/gpuctl-{os.getuid()}-{digest}", f"/tmp/gpuctl-{os.getuid()}-{digest}"}
    return [f"ssh master {pid}" for pid, path in bl.mux_masters().items() if str(path.parent) in dirs]


def leftovers(cdir: Path, records: list[NodeRecord]) -> list[str]:
    netns = bl.netns_names()
    left = sorted({f"netns {r.netns}" for r in records if r.netns and r.netns in netns})
    left += sorted({f"sshd {r.sshd[0]}" for r in records if r.sshd and bl.proc_alive(*r.sshd)})
    left += sorted({f"dir {r.node_dir}" for r in records if r.node_dir and r.node_dir.exists()})
    left += tagged_processes({r.tag for r in records if r.tag})
    left += ssh_masters_of(cdir)
    if cdir.exists():
        left.append(f"dir {cdir}")
    return left


# -- one sample --------------------------------------------------------------------------------


def lost_rank_for(n: int, rep: int) -> int:
    """A worker, and in the second repeat the head; workers cycle over rank 1, the last, the middle."""
    if rep == 1 or n == 1:
        return 0
    workers = [1, n - 1, n // 2]
    return workers[(0 if rep == 0 else rep - 1) % len(workers)]


def stage_lines(log: str, since: float) -> tuple[list[tuple[str, float]], list[str]]:
    """The supervisor's lines from the kill on (its `HH:MM:SS` lines tell when), and the
    `X: done in Ys` stages among them, up to the line that says attempt 2's ranks all run."""
    day = time.strftime("%Y-%m-%d", time.localtime(since))
    lines, stages, on = [], [], False
    for line in log.splitlines():
        head = line.split(" ", 1)[0]
        if len(head) == 8 and head[2] == ":" and head[5] == ":":
            t = time.mktime(time.strptime(f"{day} {head}", "%Y-%m-%d %H:%M:%S"))
            if t >= int(since):
                on = True
        if not on:
            continue
        lines.append(line)
        m = bl.STAGE_DONE.match(line)
        if m:
            title = m["title"]
            stages.append(("replace" if title.startswith("Replacing") else bl.stage_key(title), float(m["secs"])))
        if "attempt 2: every rank runs" in line:
            break
    return stages, lines


def one_job(n: int, rep: int, root: Path, env: dict[str, str], timeout: float, keep_dir: Path) -> Sample:
    s = Sample(n, rep, lost_rank_for(n, rep))
    job = Job(root, env, n, rep)
    records: list[NodeRecord] = []
    try:
        t0 = time.time()
        s.job_id = job.launch(timeout)
        s.cluster = job.cluster
        wait_for(f"managed job {job.id} RUNNING", lambda: _check_alive(job) == "RUNNING", timeout)
        wait_for(f"every rank of attempt 1 ({n})", lambda: len(job.started(1)) == n, timeout)
        s.bring_up = max(job.started(1).values()) - t0
        before = read_nodes(job.cdir)
        records += before.values()
        lost = before[s.lost_rank]
        assert lost.netns, f"node{s.lost_rank} has no network namespace (loopback mode?)"
        s.kill = kill_node(lost.netns)
        print(f"  N={n} rep {rep}: killed node{s.lost_rank} ({lost.netns}) of job {job.id}", file=sys.stderr,
              flush=True)

        def resumed() -> Any:
            _check_alive(job)
            evs = [e for e in job.events() if e.attempt == 1]
            return evs and evs[0].resumed_at is not None and len(job.started(2)) == n and evs[0]

        ev = wait_for(f"every rank of attempt 2 of job {job.id}", resumed, timeout)
        s.detect = ev.detected_at - s.kill
        s.running = ev.resumed_at - s.kill
        s.cause, s.event_nodes = ev.cause, list(ev.nodes)
        starts = job.started(2)
        s.ranks = max(starts.values()) - s.kill
        s.first_rank = min(starts.values()) - s.kill
        after = read_nodes(job.cdir)
        records += after.values()
        same = untouched(before, after, s.lost_rank)
        new = after.get(s.lost_rank)
        renewed = new is not None and new.sshd is not None and new.sshd != lost.sshd and bl.proc_alive(*new.sshd)
        s.only_lost = len(same) == n - 1 and renewed and s.event_nodes == [str(s.lost_rank)]
        if not s.only_lost:
            s.replaced_detail = (f"unchanged {len(same)}/{n - 1}, lost rank renewed {renewed}, "
                                 f"event nodes {s.event_nodes}")
        s.stages, s.supervisor_lines = stage_lines(job.supervisor_log(), s.kill)
        s.duplicates = job.duplicates()
    except Exception as exc:  # noqa: BLE001 - recorded; the job is cancelled and checked below
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            g = job.cancel(timeout)
            if g is not None and g.ended is not None:
                s.cancel = g.ended - g.started
            if g is not None and g.proc.returncode != 0:
                s.error = (s.error + "; " if s.error else "") + f"jobs cancel exited {g.proc.returncode}"
                print(g.describe(), file=sys.stderr)
            if job.id is not None:
                row = job.row()
                s.final_status = row.status if row else None
                if s.duplicates is None or job.duplicates() > s.duplicates:
                    s.duplicates = job.duplicates()  # what happened up to the cancel counts too
                if row is not None and row.supervisor_pid and bl.proc_alive(row.supervisor_pid):
                    try:  # wait for the supervisor to exit after writing the end state
                        wait_for("the supervisor's exit", lambda: not bl.proc_alive(row.supervisor_pid), 30)
                    except TimeoutError:
                        s.leaked.append(f"supervisor {row.supervisor_pid}")
                if job.cluster:
                    records += read_nodes(job.cdir).values()
                    s.leaked += leftovers(job.cdir, records)
                if row is not None and not (row.status == "CANCELLED" and row.destroyed) and s.error is None:
                    s.error = f"job ended {row.status} (destroyed={row.destroyed}): {row.reason}"
            if s.error or s.leaked:
                kept = keep_dir / f"job{job.id}-N{n}-rep{rep}"
                if job.id is not None and (job.state / "managed" / str(job.id)).exists():
                    shutil.copytree(job.state / "managed" / str(job.id), kept, dirs_exist_ok=True)
                    if (job.ckpt / "events").exists():
                        shutil.copy(job.ckpt / "events", kept / "rank-events")
                    print(f"  job {job.id}: {s.error or ''} leaked {s.leaked}; its logs: {kept}\n"
                          f"--- supervisor.log\n{job.supervisor_log()}", file=sys.stderr, flush=True)
        finally:
            job.close()
    return s


def _check_alive(job: Job) -> str:
    row = job.row()
    if row is None:
        raise RuntimeError(f"managed job {job.id} is gone from the store")
    if row.status in TERMINAL:
        raise RuntimeError(f"managed job {job.id} ended {row.status}: {row.reason}")
    return row.status


def cancel_all(env: dict[str, str], timeout: float) -> None:
    """Every managed job of the run that has not ended is cancelled (its supervisor takes its cluster
    down); an interrupted run leaves none behind."""
    db = Path(env["GPUCTL_STATE_DIR"]) / "managed.db"
    if not db.exists():
        return
    from gpuctl.managed.store import Store  # lazy: as Job.store
    for row in Store(db).all():
        if row.status not in TERMINAL:
            print(f"cleanup: gpuctl jobs cancel {row.id} ({row.status})", file=sys.stderr)
            bl.run_gpuctl("jobs", "cancel", str(row.id), env=env, timeout=timeout, check=False)


def floor_apply(name: str, root: Path, env: dict[str, str], timeout: float) -> float:
    """A cold `gpuctl apply` of one local node with `run: "true"`: make and prepare one node from
    nothing and run on it; then down (checked)."""
    with bl.LocalCluster(name, 1, root, env, run="true", provision_only=False, timeout=timeout) as c:
        g = c.provision_run
        assert g is not None and g.ended is not None
        return g.ended - g.started


# -- the report --------------------------------------------------------------------------------


def report(samples: list[Sample], tick: str) -> str:
    rows = []
    for s in samples:
        rows.append([str(s.n), str(s.rep), f"{s.lost_rank}" + (" (head)" if s.lost_rank == 0 else ""),
                     bl.fmt_s(s.detect, 1), bl.fmt_s(s.running, 1), bl.fmt_s(s.ranks, 1), bl.fmt_s(s.floor, 1),
                     bl.fmt_s(s.ratio, 1) + ("x" if s.ratio is not None else ""),
                     "-" if s.only_lost is None else ("yes" if s.only_lost else "NO"),
                     "-" if s.duplicates is None else str(s.duplicates), str(len(s.leaked)),
                     bl.fmt_s(s.bring_up, 1), bl.fmt_s(s.cancel, 1)])
    out = [bl.table(["N", "repeat", "lost rank", "detect s", "running again s", "ranks started s", "floor s",
                     "running/floor", "only lost replaced", "duplicates", "leaked", "bring-up s", "cancel s"], rows)]
    out.append(f"\ndetect = event detected_at - kill; running again = event resumed_at - kill (the supervisor, "
               f"tick {tick}); ranks started = the rank script's last attempt-2 start line - kill; floor = cold "
               f"`gpuctl apply` of 1 local node, run: true; bring-up = launch -> every rank of attempt 1 started; "
               f"cancel = `gpuctl jobs cancel` until it exits, the cluster gone")
    srows = []
    for n in sorted({s.n for s in samples}):
        ss = [s for s in samples if s.n == n]

        def p50max(vals: list[float | None]) -> str:
            got = bl.summary([v for v in vals if v is not None])
            return "-" if got is None else f"{got[1]:.1f} / {got[2]:.1f}"

        srows.append([str(n), str(len(ss)), p50max([s.detect for s in ss]), p50max([s.running for s in ss]),
                      p50max([s.ranks for s in ss]), p50max([s.floor for s in ss]), p50max([s.ratio for s in ss]),
                      str(sum(1 for s in ss if s.error))])
    out.append("\n" + bl.table(["N", "samples", "detect p50 / max", "running again p50 / max",
                                "ranks started p50 / max", "floor p50 / max", "ratio p50 / max", "errors"], srows))
    stage_rows = []
    for s in samples:
        if s.stages:
            stage_rows.append([str(s.n), str(s.rep), ", ".join(f"{k} {v:.1f}" for k, v in s.stages)])
    if stage_rows:
        out.append("\nThe supervisor's stages from the kill until attempt 2 runs (its log, `done in` lines):\n")
        out.append(bl.table(["N", "repeat", "stages s"], stage_rows))
    for s in samples:
        if s.error or s.leaked or s.replaced_detail:
            out.append(f"\nN={s.n} repeat {s.rep} (job {s.job_id}): "
                       + "; ".join(x for x in (s.error, s.replaced_detail,
                                               f"leaked: {', '.join(s.leaked)}" if s.leaked else None) if x))
    return "\n".join(out)


def goals(samples: list[Sample]) -> list[str]:
    out = []

    def check(what: str, values: list[float | None], goal: float, unit: str = "s") -> None:
        vals = [v for v in values if v is not None]
        missing = len(values) - len(vals)
        worst = max(vals) if vals else None
        ok = worst is not None and worst <= goal and missing == 0
        out.append(f"{'PASS' if ok else 'FAIL'}  {what}: max {bl.fmt_s(worst, 1)} {unit} over {len(vals)} "
                   f"sample(s){f', {missing} without a value' if missing else ''} (goal <= {goal:g} {unit})")

    check("detection (event detected_at - kill)", [s.detect for s in samples], GOAL_DETECT_S)
    check("ranks running again (event resumed_at - kill)", [s.running for s in samples], GOAL_RUNNING_S)
    check("ranks running again (rank script's own start lines - kill)", [s.ranks for s in samples], GOAL_RUNNING_S)
    dup = [s.duplicates for s in samples]
    ok = all(d == 0 for d in dup)
    out.append(f"{'PASS' if ok else 'FAIL'}  duplicate ranks: {sum(d or 0 for d in dup)}"
               f"{' (some samples unmeasured)' if None in dup else ''} (goal 0)")
    leaked = sum(len(s.leaked) for s in samples)
    ok = leaked == 0 and all(s.final_status == "CANCELLED" for s in samples)
    out.append(f"{'PASS' if ok else 'FAIL'}  leaked after cancel: {leaked} "
               f"(jobs CANCELLED: {sum(s.final_status == 'CANCELLED' for s in samples)}/{len(samples)}) (goal 0)")
    only = [s.only_lost for s in samples]
    ok = all(o is True for o in only)
    out.append(f"{'PASS' if ok else 'FAIL'}  only the lost node replaced: {sum(o is True for o in only)}/{len(only)}")
    return out


def plot(samples: list[Sample], path: Path, tick: str) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    ns = sorted({s.n for s in samples})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, n in enumerate(ns):
        ss = [s for s in samples if s.n == n]
        for j, s in enumerate(ss):
            dx = (j - (len(ss) - 1) / 2) * 0.06
            marker = "s" if s.lost_rank == 0 else "o"
            if s.detect is not None:
                ax.scatter(i - 0.15 + dx, s.detect, color="tab:blue", marker=marker, zorder=3,
                           label="detected (event)" if (i, j) == (0, 0) else None)
            if s.running is not None:
                ax.scatter(i + 0.15 + dx, s.running, color="tab:orange", marker=marker, zorder=3,
                           label="ranks running again (event)" if (i, j) == (0, 0) else None)
            if s.ranks is not None:
                ax.scatter(i + 0.15 + dx, s.ranks, color="tab:orange", marker="_", s=120, zorder=3,
                           label="last rank started (rank script)" if (i, j) == (0, 0) else None)
        floors = [s.floor for s in ss if s.floor is not None]
        if floors:
            fl = bl.summary(floors)[1]
            ax.hlines(fl, i - 0.35, i + 0.35, colors="tab:green", linestyles="-",
                      label="floor: cold apply of 1 node (p50)" if i == 0 else None)
    ax.axhline(GOAL_DETECT_S, linestyle="--", color="tab:blue", alpha=0.5, label=f"goal detect {GOAL_DETECT_S:g} s")
    ax.axhline(GOAL_RUNNING_S, linestyle="--", color="tab:orange", alpha=0.5,
               label=f"goal running again {GOAL_RUNNING_S:g} s")
    ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
    ax.set_xlim(-0.6, len(ns) - 0.4)
    ax.set_ylim(bottom=0)
    ax.set(title=f"managed job: one node killed (square: the head); supervisor tick {tick}",
           ylabel="s after the kill")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def one_sample(n: int, rep: int, root: Path, env: dict[str, str], timeout: float, keep_dir: Path) -> Sample:
    """One job with a node killed, then the floor beside it."""
    s = one_job(n, rep, root, env, timeout, keep_dir)
    try:
        s.floor = floor_apply(f"floor{n}r{rep}", root, env, timeout)
    except Exception as exc:  # noqa: BLE001 - the floor is a column, the sample stays
        s.error = (s.error + "; " if s.error else "") + f"floor: {exc}"
    print(f"  N={n} rep {rep}: lost rank {s.lost_rank}, detect {bl.fmt_s(s.detect, 1)} s, running again "
          f"{bl.fmt_s(s.running, 1)} s (ranks {bl.fmt_s(s.ranks, 1)} s), floor {bl.fmt_s(s.floor, 1)} s, "
          f"only lost {s.only_lost}, dupes {s.duplicates}, leaked {len(s.leaked)}"
          + (f"  ERROR {s.error}" if s.error else ""), file=sys.stderr, flush=True)
    return s


# -- --takeover: the first runner dies with the node ---------------------------------------------

GOAL_BEYOND_POLL_S = 60.0
LOST_RANK: int | None = None  # --lost-rank: the same rank every time
STATE_BUCKET = "gpuctl-bench-state"


@dataclass
class Takeover:
    n: int
    rep: int
    lost_rank: int
    poll: float
    job_id: int | None = None
    took: float | None = None  # runner B's call that took the job over (its start) - kill
    running: float | None = None  # event resumed_at - kill
    ranks: float | None = None  # last `start RANK 2` line - kill
    same_task: bool | None = None
    only_lost: bool | None = None
    duplicates: int | None = None
    leaked: list[str] = field(default_factory=list)
    final_status: str | None = None
    said: str = ""  # runner B's line when it took the job over
    error: str | None = None


def moto_state(root: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A moto S3 on loopback with the state bucket; the environment every runner shares."""
    import socket

    import boto3
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(root / "moto.log", "wb")  # noqa: SIM115 - the server's whole life
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    shared = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
              "GPUCTL_STATE_BUCKET": STATE_BUCKET, "GPUCTL_STATE_PREFIX": "bench", "GPUCTL_STATE_ENDPOINT_URL": url}
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=url, aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    wait_for("the moto server", lambda: _bucket(s3), 30, interval=0.2)
    return server, shared


def _bucket(s3: Any) -> bool:
    try:
        s3.create_bucket(Bucket=STATE_BUCKET)
        return True
    except Exception as exc:  # noqa: BLE001 - not up yet
        return "BucketAlready" in type(exc).__name__ or "BucketAlready" in str(exc)


def one_takeover(n: int, rep: int, root: Path, env: dict[str, str], poll: float, timeout: float) -> Takeover:
    t = Takeover(n, rep, lost_rank_for(n, rep) if LOST_RANK is None else LOST_RANK, poll)
    env_a = {**env, "GPUCTL_STATE_DIR": str(root / f"a{n}r{rep}")}
    env_b = {**env, "GPUCTL_STATE_DIR": str(root / f"b{n}r{rep}")}
    job = Job(root, env_a, n, rep)
    store_b: Any = None
    records: list[NodeRecord] = []
    cdir_a = None
    try:
        launched = time.time()
        t.job_id = job.launch(timeout)
        from gpuctl.managed.store import Store  # lazy, as Job.store
        store_b = Store(Path(env_b["GPUCTL_STATE_DIR"]) / "managed.db", remote=None)
        wait_for(f"managed job {job.id} RUNNING", lambda: _check_alive(job) == "RUNNING", timeout)
        wait_for(f"every rank of attempt 1 ({n})", lambda: len(job.started(1)) == n, timeout)
        cdir_a = job.cdir
        before = read_nodes(cdir_a)
        records += before.values()
        supervisor = job.row().supervisor_pid
        # runner B has polled since the launch; the kill lands somewhere in its period
        next_poll = launched + poll * (int((time.time() - launched) / poll) + 1)
        os.kill(supervisor, signal.SIGKILL)
        for path in Path(env_a["GPUCTL_STATE_DIR"]).iterdir():
            if path.name != "clusters":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in cdir_a.iterdir():
            if path.name != "nodes":
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        lost = before[t.lost_rank]
        assert lost.netns, f"node{t.lost_rank} has no network namespace"
        kill = kill_node(lost.netns)
        print(f"  N={n} rep {rep}: runner A gone, node{t.lost_rank} killed; runner B polls every {poll:g} s",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout
        while t.took is None:
            time.sleep(max(0.0, next_poll - time.time()))
            next_poll += poll
            asked = time.time()
            g = bl.run_gpuctl("jobs", "queue", env=env_b, timeout=timeout)
            said = [ln.text for ln in g.stderr if "Taking over managed job" in ln.text]
            if said:
                t.took, t.said = asked - kill, said[0]
            if time.monotonic() > deadline:
                raise TimeoutError("runner B never took the job over")

        def resumed() -> Any:
            row = store_b.get(job.id)
            if row is None or row.status in TERMINAL:
                raise RuntimeError(f"job {job.id} is {row.status if row else 'gone'} on runner B")
            evs = [e for e in store_b.events(job.id) if e.attempt == 1]
            return evs and evs[0].resumed_at is not None and len(job.started(2)) == n and evs[0]

        ev = wait_for(f"every rank of attempt 2 of job {job.id}", resumed, timeout)
        t.running = ev.resumed_at - kill
        t.ranks = max(job.started(2).values()) - kill
        after = read_nodes(cdir_a)
        records += after.values()
        same = untouched(before, after, t.lost_rank)
        t.only_lost = len(same) == n - 1 and list(ev.nodes) == [str(t.lost_rank)]
        t.duplicates = job.duplicates()
        tasks = set((job.ckpt / "tasks").read_text().split())
        t.same_task = tasks == {store_b.get(job.id).task_id}
    except Exception as exc:  # noqa: BLE001 - recorded; the job is cancelled and checked below
        t.error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            if t.job_id is not None:
                g = bl.run_gpuctl("jobs", "cancel", str(t.job_id), env=env_b, timeout=timeout, check=False)
                if g.proc.returncode != 0:
                    t.error = (t.error + "; " if t.error else "") + f"jobs cancel exited {g.proc.returncode}"
                    print(g.describe(), file=sys.stderr)
                row = store_b.get(t.job_id) if store_b is not None else None
                t.final_status = row.status if row else None
                if t.duplicates is None or job.duplicates() > t.duplicates:
                    t.duplicates = job.duplicates()
                if cdir_a is not None:
                    records += read_nodes(cdir_a).values()
                    cdir_b = Path(env_b["GPUCTL_STATE_DIR"]) / "clusters" / (job.cluster or "?")
                    t.leaked += [x for x in leftovers(cdir_b, records)]
                    t.leaked += [f"dir {d}" for d in (cdir_a / "nodes",) if d.exists() and any(d.iterdir())]
                if (Path(env_b["GPUCTL_STATE_DIR"]) / "managed" / str(t.job_id) / "secrets.json").exists():
                    t.leaked.append("secrets.json on runner B")
        finally:
            job.close()
    print(f"  N={n} rep {rep}: taken over {bl.fmt_s(t.took, 1)} s, running again {bl.fmt_s(t.running, 1)} s "
          f"(ranks {bl.fmt_s(t.ranks, 1)} s) after the kill; dupes {t.duplicates}, leaked {len(t.leaked)}"
          + (f"  ERROR {t.error}" if t.error else ""), file=sys.stderr, flush=True)
    return t


def takeover_main(args: argparse.Namespace) -> int:
    note = bl.machine_note()
    samples: list[Takeover] = []
    with bl.state_dir("gpuctl-bench-mjt-", keep=args.keep) as (root, env):
        for var in ("GPUCTL_MANAGED_TICK_S", "GPUCTL_MANAGED_GRACE_S", "GPUCTL_MANAGED_BACKOFF_S",
                    "GPUCTL_MANAGED_LEASE_S"):
            env.pop(var, None)
        if args.tick is not None:
            env["GPUCTL_MANAGED_TICK_S"] = str(args.tick)
        server, shared = moto_state(root)
        env.update(shared)
        try:
            for n in args.nodes:
                for rep in range(args.repeats):
                    samples.append(one_takeover(n, rep, root, env, args.poll, args.timeout))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    lease = os.environ.get("GPUCTL_MANAGED_LEASE_S") or "30 (default)"
    print(f"\nManaged jobs: the first runner and a node die at once; a second runner polls `gpuctl jobs queue` "
          f"every {args.poll:g} s ({note}); lease term {lease} s, shared state in moto S3\n")
    rows = [[str(t.n), str(t.rep), f"{t.lost_rank}" + (" (head)" if t.lost_rank == 0 else ""), bl.fmt_s(t.took, 1),
             bl.fmt_s(t.running, 1), bl.fmt_s(t.ranks, 1),
             bl.fmt_s(None if t.running is None else t.running - args.poll, 1),
             "-" if t.only_lost is None else ("yes" if t.only_lost else "NO"),
             "-" if t.same_task is None else ("yes" if t.same_task else "NO"),
             "-" if t.duplicates is None else str(t.duplicates), str(len(t.leaked)), t.final_status or "-"]
            for t in samples]
    print(bl.table(["N", "repeat", "lost rank", "taken over s", "running again s", "ranks started s",
                    "beyond poll s", "only lost replaced", "same task id", "duplicates", "leaked",
                    "after cancel"], rows))
    print("\ntaken over = runner B's `jobs queue` that took the job (its start) - kill; running again = the "
          "event's resumed_at (B's supervisor) - kill; ranks started = the rank script's last attempt-2 start - "
          "kill; beyond poll = running again - the poll interval")
    for t in samples:
        if t.said:
            print(f"  N={t.n} repeat {t.rep}, runner B said: {t.said}")
        if t.error or t.leaked:
            print(f"  N={t.n} repeat {t.rep}: {t.error or ''} leaked: {', '.join(t.leaked) or 'nothing'}")
    checks = []
    worst = max((t.running for t in samples if t.running is not None), default=None)
    ok = worst is not None and worst - args.poll <= GOAL_BEYOND_POLL_S and all(t.running is not None for t in samples)
    checks.append(f"{'PASS' if ok else 'FAIL'}  running again: max {bl.fmt_s(worst, 1)} s after the kill = "
                  f"poll {args.poll:g} s + {bl.fmt_s(None if worst is None else worst - args.poll, 1)} s "
                  f"(goal <= poll + {GOAL_BEYOND_POLL_S:g} s)")
    dup = sum(t.duplicates or 0 for t in samples)
    checks.append(f"{'PASS' if dup == 0 and all(t.duplicates is not None for t in samples) else 'FAIL'}  "
                  f"duplicate ranks: {dup} (goal 0)")
    leaked = sum(len(t.leaked) for t in samples)
    ok = leaked == 0 and all(t.final_status == "CANCELLED" for t in samples)
    checks.append(f"{'PASS' if ok else 'FAIL'}  leaked after runner B's cancel: {leaked} (goal 0)")
    same = all(t.same_task for t in samples)
    checks.append(f"{'PASS' if same else 'FAIL'}  every attempt's ranks had the job's one task id: "
                  f"{sum(bool(t.same_task) for t in samples)}/{len(samples)}")
    only = all(t.only_lost for t in samples)
    checks.append(f"{'PASS' if only else 'FAIL'}  only the lost node replaced: "
                  f"{sum(bool(t.only_lost) for t in samples)}/{len(samples)}")
    print("\n" + "\n".join(checks))
    return 0 if all(c.startswith("PASS") for c in checks) and not any(t.error for t in samples) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=lambda t: sorted({int(x) for x in t.split(",") if x.strip()}), default=[4, 16],
                    help="cluster sizes N; default 4,16")
    ap.add_argument("--repeats", type=int, default=3, help="jobs per N (the second kills the head); default 3")
    ap.add_argument("--tick", type=float, help="GPUCTL_MANAGED_TICK_S for the supervisors (default: gpuctl's, 5 s)")
    ap.add_argument("--timeout", type=float, default=900, help="per-command and per-wait limit in seconds")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir (logs)")
    ap.add_argument("--takeover", action="store_true",
                    help="shared state: the first runner dies with the node, a second one polls and takes over")
    ap.add_argument("--poll", type=float, default=30.0, help="--takeover: runner B's poll interval in s (30)")
    ap.add_argument("--lost-rank", type=int, help="--takeover: kill this rank every time (default: a worker, "
                                                 "then the head)")
    args = ap.parse_args()
    global LOST_RANK
    LOST_RANK = args.lost_rank
    if min(args.nodes) < 2:
        ap.error("--nodes: each N must be at least 2 (a worker is killed)")
    bl.preflight()
    if os.geteuid() != 0:
        raise SystemExit("the nodes must be netns nodes (run as root): a node dies by its namespace")
    bl.sigterm_as_interrupt()
    if args.takeover:
        return takeover_main(args)
    note = bl.machine_note()
    tick = f"{args.tick:g} s" if args.tick is not None else "5 s (default)"
    samples: list[Sample] = []
    keep_dir = Path(tempfile.mkdtemp(prefix="gpuctl-bench-mj-logs-", dir="/tmp"))  # failed jobs' logs
    try:
        with bl.state_dir("gpuctl-bench-mj-", keep=args.keep) as (root, env):
            for var in ("GPUCTL_MANAGED_TICK_S", "GPUCTL_MANAGED_GRACE_S", "GPUCTL_MANAGED_BACKOFF_S"):
                env.pop(var, None)  # gpuctl's defaults unless asked
            if args.tick is not None:
                env["GPUCTL_MANAGED_TICK_S"] = str(args.tick)
            print(f"managed jobs on local netns nodes: N = {args.nodes}, {args.repeats} repeat(s), tick {tick} "
                  f"({note})", file=sys.stderr, flush=True)
            try:
                for n in args.nodes:
                    for rep in range(args.repeats):
                        samples.append(one_sample(n, rep, root, env, args.timeout, keep_dir))
            finally:
                cancel_all(env, args.timeout)  # then state_dir takes down any cluster still there
    finally:
        if not any(keep_dir.iterdir()):
            keep_dir.rmdir()
    print(f"\nManaged jobs: one node killed mid-run, on local netns nodes ({note}; after: {bl.machine_note()}); "
          f"supervisor tick {tick}\n")
    print(report(samples, tick))
    print()
    print("\n".join(goals(samples)))
    if args.json:
        args.json.write_text(json.dumps({"machine": note, "tick": tick, "samples": [asdict(s) for s in samples]},
                                        indent=1))
    if args.plot:
        plot(samples, args.plot, tick)
    ok = all(line.startswith("PASS") for line in goals(samples)) and not any(s.error for s in samples)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # jobs are cancelled and clusters down (every `finally` ran)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
