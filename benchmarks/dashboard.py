#!/usr/bin/env python3
"""`gpuctl dashboard` at scale: 1,000 clusters and 10,000 jobs (issue 38).

A fresh GPUCTL_STATE_DIR (a temp dir) is seeded with `--clusters` clusters (default 1,000: 90% UP,
6% STOPPED, 4% INIT, of 1-16 H100:8 nodes, made over the last 30 days, each with its cost segment),
`--jobs-per-cluster` jobs each (default 10: SUCCEEDED, FAILED, CANCELLED, the last of an UP cluster
RUNNING, of an INIT one PENDING) and `--gone` clusters that are gone (default 500: a closed segment
and no record, for the history tab and the cost charts). The first cluster, its jobs and the first
gone cluster are written through the registry's own API (`upsert_cluster`, `open_segment`, `new_job`,
`update_job`, `close_segment`: that also makes the schema); the rest, which one transaction per row
would take minutes to write, go into state.db with sqlite3 in one transaction, with the same columns,
and then every row's times are spread over the 30 days.

Then the real dashboard runs on that state (`python -m gpuctl dashboard --no-browser --port 0`, its
token in GPUCTL_DASHBOARD_TOKEN), and, from this process:

  render    /clusters and /jobs in Debian's chromium driven by Playwright: one context logs in once
            through the ?token= URL (that first visit is shown as "cold"), then each repeat opens a
            new page and times page.goto(url, wait_until="load"), with the Navigation Timing
            entry's responseStart (the HTML's first byte) and loadEventEnd. /static/dashboard.css in
            the same rounds is the browser's floor. Goal: <= 1 s each (median and max shown).
  answers   every page and JSON answer (first page, and per_page=200, the most a page holds)
            fetched with urllib and the bearer token, R times in interleaved rounds: bytes, rows,
            wall time, and the server's CPU per answer (/proc/PID/stat). Goal: none over 1 MB.
            Floors in the same rounds: the server's static CSS, and sqlite3 reading the same rows
            in this process (the latest 50 jobs; every cluster and history row, what /clusters reads).
  memory    the dashboard process's VmHWM (/proc/PID/status) after every request. Goal: <= 200 MiB.
  read model readmodel.clusters / gone_clusters / jobs / cost called in this process on the same
            state: the server's answer less HTTP and the templates (`--profile N`: cProfile's top N).

    .venv/bin/python benchmarks/dashboard.py [--repeats 5] [--clusters 1000] [--jobs-per-cluster 10]
        [--gone 500] [--plot dashboard.png] [--json dashboard.json] [--profile 25] [--keep]

Needs Playwright (a gpuctl dev dependency) and /usr/bin/chromium (`make system-deps`); no nodes, no
root. Goals are reported (PASS / MISS), not asserted: the exit code is 0 unless a measurement
failed (an answer other than 200, the dashboard not starting). The dashboard is stopped and the temp
dir removed on every path (`--keep` keeps the state dir).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import re
import secrets
import select
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

RENDER_GOAL_S = 1.0
SIZE_GOAL = 1_000_000  # bytes (1 MB)
RSS_GOAL = 200 * 2**20  # bytes (200 MiB)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
REQUEST = {"accelerator": "H100", "gpus_per_node": 8, "instance_type": "p5.48xlarge"}
NODE_PRICE = 98.32
DAY = 86400.0
REGIONS = [("aws", "us-east-1"), ("aws", "us-west-2"), ("gcp", "us-central1"), ("azure", "eastus")]
NAV = """() => { const n = performance.getEntriesByType('navigation')[0];
  return {requestStart: n.requestStart, responseStart: n.responseStart, responseEnd: n.responseEnd,
          loadEventEnd: n.loadEventEnd}; }"""


# -- seeding -------------------------------------------------------------------------------------


def seed(root: Path, n_clusters: int, jobs_per: int, n_gone: int, now: float) -> dict[str, Any]:
    """The state: template rows through the registry API, the rest cloned into state.db in bulk."""
    os.environ["GPUCTL_STATE_DIR"] = str(root)
    from gpuctl.state.registry import Registry

    t0 = time.perf_counter()
    rng = random.Random(38)
    registry = Registry(remote=None)  # makes state.db and its schema
    names = [f"c{i:04d}" for i in range(n_clusters)]
    gone = [f"g{i:04d}" for i in range(n_gone)]
    statuses = ["UP"] * 90 + ["STOPPED"] * 6 + ["INIT"] * 4
    status_of = {name: statuses[i % len(statuses)] for i, name in enumerate(names)}
    nodes_of = {name: rng.choice((1, 2, 2, 4, 4, 8, 16)) for name in names + gone}
    where = {name: rng.choice(REGIONS) for name in names + gone}

    def job_fields(name: str, k: int) -> dict[str, Any]:
        """A job's outcome: mostly done, some failed or cancelled; an UP cluster's last one runs."""
        n = nodes_of[name]
        last = k == jobs_per - 1
        if last and status_of[name] == "UP":
            return {"status": "RUNNING", "returncodes": {}, "failed_rank": None, "detail": None}
        if last and status_of[name] == "INIT":
            return {"status": "PENDING", "returncodes": {}, "failed_rank": None, "detail": None}
        roll = rng.random()
        if roll < 0.2:
            failed = rng.randrange(n)
            return {"status": "FAILED", "returncodes": {r: int(r == failed) for r in range(n)}, "failed_rank": failed,
                    "detail": f"rank {failed} exited with code 1; the other ranks were stopped"}
        if roll < 0.3:
            return {"status": "CANCELLED", "returncodes": {r: None for r in range(n)}, "failed_rank": None,
                    "detail": "cancelled (gpuctl cancel)"}
        return {"status": "SUCCEEDED", "returncodes": {r: 0 for r in range(n)}, "failed_rank": None, "detail": None}

    # 1. through the API: the first cluster, its jobs, the first gone cluster
    first = names[0]
    cloud, region = where[first]
    registry.upsert_cluster(first, cloud=cloud, region=region, zone=None, num_nodes=nodes_of[first],
                            status=status_of[first], request=REQUEST)
    registry.open_segment(first, cloud=cloud, region=region, instance_type=REQUEST["instance_type"],
                          num_nodes=nodes_of[first], use_spot=False, node_price=NODE_PRICE, price_source="benchmark")
    outcomes: dict[tuple[str, int], dict[str, Any]] = {}
    for k in range(jobs_per):
        job = registry.new_job(first, name=f"train-{k % 7}", num_nodes=nodes_of[first])
        fields = job_fields(first, k)
        outcomes[(first, job.job_id)] = fields
        registry.update_job(first, job.job_id, status=fields["status"], returncodes=fields["returncodes"],
                            failed_rank=fields["failed_rank"], detail=fields["detail"])
    if gone:
        cloud, region = where[gone[0]]
        registry.open_segment(gone[0], cloud=cloud, region=region, instance_type=REQUEST["instance_type"],
                              num_nodes=nodes_of[gone[0]], use_spot=False, node_price=NODE_PRICE,
                              price_source="benchmark")
        registry.close_segment(gone[0], "down", at=time.time())
    api_s = time.perf_counter() - t0

    # 2. the rest with sqlite3, in one transaction; then every row's times spread over 30 days
    db = sqlite3.connect(registry.path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    (token0, user) = db.execute("SELECT token, user FROM jobs WHERE cluster=? LIMIT 1", (first,)).fetchone()
    request = json.dumps(REQUEST)
    created = {name: now - rng.uniform(600, 30 * DAY) for name in names}
    db.executemany("INSERT INTO clusters VALUES (?,?,?,?,?,?,?,?,?)",
                   [(n, *where[n], None, nodes_of[n], status_of[n], request, created[n], created[n])
                    for n in names[1:]])
    db.execute("UPDATE clusters SET created_at=?, updated_at=? WHERE name=?", (created[first], created[first], first))
    segments = []
    for n in names:
        ended, how = None, None
        if status_of[n] == "STOPPED":
            ended, how = rng.uniform(created[n], now), rng.choice(("stopped", "stop"))
        segments.append((n, *where[n], REQUEST["instance_type"], nodes_of[n], 0, NODE_PRICE, "benchmark", created[n],
                         ended, how))
    for n in gone:
        start = now - rng.uniform(DAY, 30 * DAY)
        end = min(now - 60, start + rng.uniform(600, 4 * DAY))
        segments.append((n, *where[n], REQUEST["instance_type"], nodes_of[n], 0, NODE_PRICE, "benchmark", start, end,
                         "autodown" if rng.random() < 0.2 else "down"))
    db.execute("DELETE FROM history")  # the API's two rows, written again with their times
    db.executemany("INSERT INTO history (cluster, cloud, region, instance_type, num_nodes, use_spot, node_price, "
                   "price_source, started_at, ended_at, ended_how) VALUES (?,?,?,?,?,?,?,?,?,?,?)", segments)
    jobs = []
    for n in names:
        t = created[n]
        for k in range(jobs_per):
            fields = outcomes.get((n, k + 1)) or job_fields(n, k)
            t = t + rng.uniform(0, (now - t) / (jobs_per - k + 1))
            started = None if fields["status"] == "PENDING" else t + rng.uniform(1, 30)
            ended = (None if fields["status"] in ("PENDING", "RUNNING")
                     else min(now, started + rng.uniform(60, (now - started) / 3)))
            jobs.append((n, k + 1, f"train-{k % 7}", fields["status"], None, nodes_of[n], t, started, ended,
                         json.dumps({str(r): c for r, c in fields["returncodes"].items()}), fields["failed_rank"],
                         fields["detail"], token0 if n == first else secrets.token_hex(8), user))
    db.execute("DELETE FROM jobs WHERE cluster=?", (first,))  # the API's rows, written again with their times
    db.executemany("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", jobs)
    db.execute("COMMIT")
    db.close()

    registry = Registry(remote=None)  # what the dashboard will read, read back through the API
    counts = {"clusters": len(registry.clusters()), "jobs": registry.job_page(offset=0, limit=1)[0],
              "segments": len(registry.history()), "gone": n_gone}
    by_status: dict[str, int] = {}
    for rec in registry.clusters():
        by_status[rec.status] = by_status.get(rec.status, 0) + 1
    running = next(j for j in registry.jobs(first) if j.status in ("RUNNING", "FAILED", "SUCCEEDED"))
    return {**counts, "by_status": by_status, "api_s": api_s, "seed_s": time.perf_counter() - t0,
            "db_bytes": sum(p.stat().st_size for p in root.glob("state.db*")),
            "cluster": first, "job": running.job_id}


# -- the dashboard process -----------------------------------------------------------------------


class DashboardProcess:
    """`python -m gpuctl dashboard --no-browser --port 0` on the state; its URL from its first line."""

    def __init__(self, root: Path, token: str) -> None:
        self.log = root / "dashboard.stderr"
        env = {**os.environ, "GPUCTL_STATE_DIR": str(root), "GPUCTL_DASHBOARD_TOKEN": token}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([bl.gpuctl_python(), "-m", "gpuctl", "dashboard", "--no-browser", "--port", "0"],
                                     cwd=bl.REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True, start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        match = re.search(r"(http://\S+)/clusters\?token=(\S+)", line)
        if not match or match.group(2) != token:
            self.stop()
            raise RuntimeError(f"the dashboard did not print its URL: {line!r}\n{self.stderr()}")
        self.start_s = time.perf_counter() - t0
        self.base = match.group(1)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain the rest

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self, key: str) -> int:
        """A /proc/PID/status size (VmRSS, VmHWM) in bytes."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]

    def cpu(self) -> float:
        return bl.tree_cpu_so_far(self.pid) or 0.0

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- measurements --------------------------------------------------------------------------------


def fetch(url: str, token: str) -> tuple[int, bytes, float]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            body, code = answer.read(), answer.status
    except urllib.error.HTTPError as exc:
        body, code = exc.read(), exc.code
    return code, body, time.perf_counter() - t0


def rows_in(path: str, body: bytes) -> int:
    """Rows an answer holds: a JSON page's rows (a cluster's jobs), an HTML page's <tr> less headers."""
    if path.startswith("/api/"):
        doc = json.loads(body)
        page = doc.get("page") or doc.get("rows")
        return len(page["rows"]) if isinstance(page, dict) else len(doc.get("jobs") or [])
    if path.startswith("/static/"):
        return 0
    text = body.decode(errors="replace")
    return text.count("<tr") - text.count("<thead")


def browser_rounds(base: str, token: str, paths: list[str], repeats: int) -> dict[str, Any]:
    """page.goto(.., wait_until="load") of each path in a new page, interleaved rounds; the login first."""
    from playwright.sync_api import sync_playwright

    found: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            page = context.new_page()
            t0 = time.perf_counter()
            page.goto(f"{base}/clusters?token={token}", wait_until="load")
            cold = {"wall": time.perf_counter() - t0, **page.evaluate(NAV)}
            if "token=" in page.url or "Clusters" not in page.title():
                raise RuntimeError(f"the login did not land on /clusters: {page.url} {page.title()!r}")
            page.close()
            for i in range(repeats):
                for path in paths[i % len(paths):] + paths[:i % len(paths)]:
                    page = context.new_page()
                    t0 = time.perf_counter()
                    answer = page.goto(base + path, wait_until="load")
                    wall = time.perf_counter() - t0
                    if answer is None or answer.status != 200:
                        raise RuntimeError(f"{path}: {answer.status if answer else 'no answer'} in chromium")
                    found[path].append({"wall": wall, **page.evaluate(NAV)})
                    page.close()
            context.close()
        finally:
            browser.close()
    return {"cold": cold, "pages": found}


def answer_rounds(server: DashboardProcess, token: str, paths: list[str], floors: dict[str, Callable[[], Any]],
                  repeats: int) -> dict[str, dict[str, Any]]:
    """Each path fetched `repeats` times in interleaved rounds (wall time and the server's CPU per
    answer), each in-process floor run in the same rounds."""
    out: dict[str, dict[str, Any]] = {p: {"wall": [], "cpu": []} for p in [*paths, *floors]}
    names = [*paths, *floors]
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if name in floors:
                t0 = time.perf_counter()
                rows = floors[name]()
                out[name]["wall"].append(time.perf_counter() - t0)
                out[name].update(rows=rows, status="-", bytes=None)
                continue
            cpu0 = server.cpu()
            code, body, wall = fetch(server.base + name, token)
            out[name]["cpu"].append(server.cpu() - cpu0)
            out[name]["wall"].append(wall)
            if code != 200:
                raise RuntimeError(f"{name}: HTTP {code}: {body[:300]!r}\n{server.stderr()}")
            out[name].update(status=code, bytes=len(body), rows=rows_in(name, body))
    return out


def sqlite_floor(db_path: Path, *queries: str) -> Callable[[], int]:
    """A fresh connection and the queries' rows fetched: the rows an answer shows, read and no more."""
    def run() -> int:
        db = sqlite3.connect(db_path)
        try:
            return sum(len(db.execute(sql).fetchall()) for sql in queries)
        finally:
            db.close()
    return run


def readmodel_timings(repeats: int, cluster: str, profile: int) -> tuple[dict[str, list[float]], str]:
    """The read model alone, in this process, on the same state (GPUCTL_STATE_DIR is set by seed)."""
    from gpuctl.dashboard import readmodel
    from gpuctl.state.registry import Registry

    calls: dict[str, Callable[[], Any]] = {
        "readmodel.clusters (50 rows)": lambda: readmodel.clusters(Registry(remote=None)),
        "readmodel.clusters (sort=cost, 200 rows)": lambda: readmodel.clusters(Registry(remote=None), sort="cost",
                                                                                per_page=200),
        "readmodel.gone_clusters (50 rows)": lambda: readmodel.gone_clusters(Registry(remote=None)),
        "readmodel.jobs (50 rows)": lambda: readmodel.jobs(Registry(remote=None)),
        "readmodel.jobs (200 rows)": lambda: readmodel.jobs(Registry(remote=None), per_page=200),
        "readmodel.cluster (one, 10 jobs)": lambda: readmodel.cluster(Registry(remote=None), cluster),
        "readmodel.cost (100 rows, charts)": lambda: readmodel.cost(Registry(remote=None)),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    report = ""
    if profile:
        buf = io.StringIO()
        for name in ("readmodel.clusters (50 rows)", "readmodel.jobs (50 rows)", "readmodel.cost (100 rows, charts)"):
            prof = cProfile.Profile()
            prof.runcall(calls[name])
            buf.write(f"\n## cProfile: {name}\n")
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(profile)
        report = buf.getvalue()
    return times, report


# -- output --------------------------------------------------------------------------------------


def ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.0f} / {1000 * max(values):.0f}" if values else "-"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def size(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--jobs-per-cluster", type=int, default=10)
    parser.add_argument("--gone", type=int, default=500)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's top N functions of the read model's list calls")
    parser.add_argument("--keep", action="store_true", help="keep the seeded state dir")
    args = parser.parse_args()
    if not os.access(CHROMIUM, os.X_OK):
        raise SystemExit(f"{CHROMIUM} is missing: `make system-deps` installs Debian's chromium")
    bl.sigterm_as_interrupt()
    load_before = bl.machine_note()
    root = Path(tempfile.mkdtemp(prefix="gpuctl-bench-dashboard-"))
    server: DashboardProcess | None = None
    try:
        now = time.time()
        seeded = seed(root / "state", args.clusters, args.jobs_per_cluster, args.gone, now)
        name, job_id = seeded["cluster"], seeded["job"]
        token = secrets.token_hex(24)
        server = DashboardProcess(root / "state", token)
        rss_start = server.status("VmRSS")

        render_paths = ["/clusters", "/jobs"]
        browser = browser_rounds(server.base, token, [*render_paths, "/static/dashboard.css"], args.repeats)

        answer_paths = [
            "/clusters", "/clusters?per_page=200", "/clusters?tab=history", "/clusters?tab=history&per_page=200",
            f"/clusters/{name}", "/jobs", "/jobs?per_page=200", f"/jobs?page={max(1, seeded['jobs'] // 50)}",
            f"/clusters/{name}/jobs/{job_id}", "/managed", "/cost", "/cost?per_page=200",
            "/api/clusters", "/api/clusters?per_page=200", "/api/clusters?tab=history&per_page=200",
            f"/api/clusters/{name}", "/api/jobs", "/api/jobs?per_page=200", "/api/cost", "/api/cost?per_page=200",
            "/api/managed", "/api/managed?per_page=200",
        ]
        floor_css = "/static/dashboard.css"
        db_path = root / "state" / "state.db"
        floors = {
            "sqlite3: SELECT * FROM jobs ORDER BY submitted_at DESC LIMIT 50":
                sqlite_floor(db_path, "SELECT * FROM jobs ORDER BY submitted_at DESC LIMIT 50"),
            "sqlite3: every clusters + history row (what /clusters reads)":
                sqlite_floor(db_path, "SELECT * FROM clusters", "SELECT * FROM history"),
        }
        answers = answer_rounds(server, token, [*answer_paths, floor_css], floors, args.repeats)
        hwm = server.status("VmHWM")
        rss_end = server.status("VmRSS")
        server_stderr = server.stderr()
        server.stop()
        model, profile = readmodel_timings(args.repeats, name, args.profile)
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            print(f"state kept: {root}/state", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    # -- the tables
    print(f"gpuctl dashboard on {seeded['clusters']:,} clusters "
          f"({', '.join(f'{v} {k}' for k, v in sorted(seeded['by_status'].items()))}), {seeded['gone']:,} gone, "
          f"{seeded['jobs']:,} jobs, {seeded['segments']:,} cost segments; state.db {seeded['db_bytes'] / 2**20:.1f} MiB")
    print(f"seeded in {seeded['seed_s']:.1f} s (registry API for the first cluster, its jobs and one gone cluster: "
          f"{seeded['api_s']:.2f} s; the rest sqlite3, one transaction); dashboard up in {server.start_s:.2f} s; "
          f"{args.repeats} repeats")
    print(f"machine before: {load_before}")
    print(f"machine after:  {bl.machine_note()}")
    print()
    print("1. first render in chromium (a new page each time, page.goto(url, wait_until='load')), ms median / max")
    rows = []
    cold = browser["cold"]
    css_median = statistics.median(s["wall"] for s in browser["pages"][floor_css])
    rows.append(["/clusters?token=... (cold: login, 303, first render)", f"{1000 * cold['wall']:.0f}",
                 f"{cold['responseStart']:.0f}", f"{cold['loadEventEnd']:.0f}", "", ""])
    for path, samples in browser["pages"].items():
        walls = [s["wall"] for s in samples]
        floor = path.startswith("/static/")
        rows.append([path + (" (floor: the server's static CSS)" if floor else ""), ms(walls),
                     ms([s["responseStart"] / 1000 for s in samples]), ms([s["loadEventEnd"] / 1000 for s in samples]),
                     "" if floor else f"{statistics.median(walls) / css_median:.1f}x",
                     "" if floor else verdict(max(walls) <= RENDER_GOAL_S and
                                              max(s["loadEventEnd"] for s in samples) / 1000 <= RENDER_GOAL_S)])
    print(bl.table(["page", "goto -> load", "responseStart", "loadEventEnd", "/ floor",
                    f"goal: <= {RENDER_GOAL_S:g} s"], rows))
    print()
    print("2. every answer (urllib, bearer token): size; wall ms median / max; the server's CPU per answer (utime+stime,")
    print("   10 ms ticks: the mean over the repeats)")
    rows = []
    for path, a in answers.items():
        is_floor = path in floors or path == floor_css
        rows.append([path + (" (floor)" if path == floor_css else ""), str(a["status"]), size(a["bytes"]),
                     str(a["rows"]), ms(a["wall"]), f"{1000 * statistics.mean(a['cpu']):.0f}" if a["cpu"] else "-",
                     "" if is_floor else verdict(a["bytes"] <= SIZE_GOAL)])
    print(bl.table(["answer", "HTTP", "bytes", "rows", "wall ms", "server CPU ms (mean)", "goal: <= 1 MB"], rows))
    print()
    print("3. the read model alone (this process, same state), ms median / max")
    print(bl.table(["call", "wall ms"], [[k, ms(v)] for k, v in model.items()]))
    print()
    biggest = max((p for p in answers if p not in floors), key=lambda p: answers[p]["bytes"])
    render_max = {p: max(max(s["wall"], s["loadEventEnd"] / 1000) for s in browser["pages"][p]) for p in render_paths}
    goals = [
        *[[f"{p} first render in chromium <= {RENDER_GOAL_S:g} s",
           f"median {statistics.median(s['wall'] for s in browser['pages'][p]):.3f} s, max {render_max[p]:.3f} s",
           verdict(render_max[p] <= RENDER_GOAL_S)] for p in render_paths],
        ["no page or API answer over 1 MB", f"largest {answers[biggest]['bytes']:,} B ({biggest})",
         verdict(answers[biggest]["bytes"] <= SIZE_GOAL)],
        ["dashboard peak RSS (VmHWM) <= 200 MiB",
         f"{hwm / 2**20:.1f} MiB (RSS {rss_start / 2**20:.1f} MiB at start, {rss_end / 2**20:.1f} MiB at the end)",
         verdict(hwm <= RSS_GOAL)],
    ]
    print(bl.table(["goal", "measured", ""], goals))
    if server_stderr.strip():
        print("\nthe dashboard's stderr:\n" + server_stderr)
    if profile:
        print(profile)
    if args.json:
        args.json.write_text(json.dumps({"seeded": seeded, "browser": browser, "answers": answers,
                                         "readmodel": model, "vmhwm": hwm, "rss_start": rss_start,
                                         "rss_end": rss_end}, indent=2))
    if args.plot and (plt := bl.pyplot()) is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        left.boxplot([[s["wall"] for s in browser["pages"][p]] for p in browser["pages"]],
                     labels=list(browser["pages"]))
        left.axhline(RENDER_GOAL_S, color="red", linestyle="--", label="goal")
        left.set_ylabel("page.goto -> load (s)")
        left.legend()
        shown = [p for p in answers if p not in floors]
        right.barh(shown, [answers[p]["bytes"] / 1e6 for p in shown])
        right.axvline(SIZE_GOAL / 1e6, color="red", linestyle="--", label="goal")
        right.set_xlabel("answer size (MB)")
        right.invert_yaxis()
        right.tick_params(axis="y", labelsize=7)
        right.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
