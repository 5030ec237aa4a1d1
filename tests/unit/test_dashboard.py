"""The dashboard's parts without a browser: the guard's decisions, the read model over a seeded
state (sorting, filters, pages that never grow past MAX_PER_PAGE, costs per cluster and day), and
the commands its actions run (nothing from a request can become an option)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from starlette.requests import Request

from gpuctl.common.errors import UserError
from gpuctl.dashboard import commands, readmodel, serve
from gpuctl.dashboard.security import Guard, allowed_hosts, host_of
from gpuctl.state.registry import Registry


def request(method: str = "GET", path: str = "/clusters", query: str = "", **headers: str) -> Request:
    raw = [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in {"host": "127.0.0.1:8642", **headers}.items()]
    return Request({"type": "http", "method": method, "path": path, "query_string": query.encode(), "headers": raw,
                    "scheme": "http", "server": ("127.0.0.1", 8642), "root_path": ""})


GUARD = Guard(token="s3cret", port=8642, allowed_hosts=allowed_hosts("127.0.0.1"))


def test_host_header_names_without_ports():
    assert host_of("127.0.0.1:8642") == "127.0.0.1" and host_of("[::1]:80") == "::1"
    assert host_of("LocalHost") == "localhost" and host_of("::1") == "::1"
    assert allowed_hosts("0.0.0.0") is None and "10.0.0.5" in allowed_hosts("10.0.0.5")  # type: ignore[operator]


def test_the_token_is_needed_and_moves_from_the_url_into_a_cookie():
    assert GUARD.refusal(request()).status_code == 403  # type: ignore[union-attr]
    assert GUARD.refusal(request(authorization="Bearer nope")).status_code == 403  # type: ignore[union-attr]
    assert GUARD.refusal(request(authorization="Bearer s3cret")) is None
    assert GUARD.refusal(request(cookie="gpuctl-dashboard-8642=s3cret")) is None
    assert GUARD.refusal(request(cookie="gpuctl-dashboard-9999=s3cret")).status_code == 403  # type: ignore[union-attr]
    moved = GUARD.refusal(request(query="token=s3cret&page=2"))
    assert moved is not None and moved.status_code == 303 and moved.headers["location"] == "/clusters?page=2"
    cookie = moved.headers["set-cookie"]
    assert "s3cret" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert GUARD.refusal(request(query="token=wrong")).status_code == 403  # type: ignore[union-attr]


def test_a_foreign_host_and_cross_site_posts_are_refused_even_with_the_token():
    auth = {"authorization": "Bearer s3cret"}
    assert GUARD.refusal(request(host="evil.example:8642", **auth)).status_code == 403  # type: ignore[union-attr]
    assert GUARD.refusal(request(host="localhost:8642", **auth)) is None
    post = {**auth, "origin": "http://evil.example"}
    assert GUARD.refusal(request("POST", "/actions/down", **post)).status_code == 403  # type: ignore[union-attr]
    same = {"cookie": "gpuctl-dashboard-8642=s3cret", "origin": "http://127.0.0.1:8642"}
    assert GUARD.refusal(request("POST", "/actions/down", **same)) is None
    cross = {"cookie": "gpuctl-dashboard-8642=s3cret", "sec_fetch_site": "cross-site"}
    assert GUARD.refusal(request("POST", "/actions/down", **cross)).status_code == 403  # type: ignore[union-attr]
    bare = {"cookie": "gpuctl-dashboard-8642=s3cret"}  # a browser sends Origin or Sec-Fetch-Site; this is neither
    assert GUARD.refusal(request("POST", "/actions/down", **bare)).status_code == 403  # type: ignore[union-attr]
    assert GUARD.refusal(request("POST", "/actions/down", **auth)) is None  # a script with the bearer token
    assert GUARD.csrf_ok(GUARD.csrf_token()) and not GUARD.csrf_ok("") and not GUARD.csrf_ok("x" * 64)


def test_no_token_is_for_loopback_only_and_a_bad_host_is_one_line():
    serve.check_bind("127.0.0.1", no_token=True)
    serve.check_bind("0.0.0.0", no_token=False)
    with pytest.raises(UserError, match="--no-token"):
        serve.check_bind("0.0.0.0", no_token=True)
    open_guard = Guard(token=None, port=1, allowed_hosts=allowed_hosts("127.0.0.1"))
    assert open_guard.refusal(request(host="127.0.0.1:1")) is None
    with pytest.raises(UserError, match="--host 192.0.2.1"):
        serve.bind("192.0.2.1", 0)
    held = serve.bind("127.0.0.1", 0)
    try:
        with pytest.raises(UserError, match=f"--port {held.getsockname()[1]}"):
            serve.bind("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()
    assert serve.url_for("::1", 8642, "t") == "http://[::1]:8642/clusters?token=t"


def test_commands_take_only_names_and_numbers():
    assert commands.cancel_words("train", 3) == ["cancel", "train", "3"]
    assert commands.logs_words("train", 3, 1, follow=False) == ["logs", "train", "3", "--tail", "0", "--rank", "1",
                                                                 "--no-follow"]
    for bad in ("-a", "--all", "a b", "../x", ""):
        with pytest.raises(UserError):
            commands.down_words(bad)
    with pytest.raises(ValueError):
        commands.cancel_words("train", "--all")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def seeded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir with 230 clusters (every tenth STOPPED), a failed job on each, one gone cluster."""
    state = tmp_path_factory.mktemp("dashboard-state")
    registry = Registry(state / "state.db", remote=None)
    now = time.time()
    for i in range(230):
        name = f"c{i:03d}"
        registry.upsert_cluster(name, cloud="aws", region="us-east-1", zone=None, num_nodes=1 + i % 4,
                                status="STOPPED" if i % 10 == 0 else "UP",
                                request={"accelerator": "H100", "gpus_per_node": 8})
        registry.open_segment(name, cloud="aws", region="us-east-1", instance_type="p5.48xlarge",
                              num_nodes=1 + i % 4, use_spot=False, node_price=10.0, price_source="test")
        job = registry.new_job(name, name=f"python train.py --run {i}", num_nodes=1)
        registry.update_job(name, job.job_id, status="FAILED", started_at=now - 60, ended_at=now - 30,
                            returncodes={0: 7}, failed_rank=0)
    registry.open_segment("gone", cloud="aws", region="us-east-1", instance_type="p5.48xlarge", num_nodes=2,
                          use_spot=False, node_price=50.0, price_source="test")
    registry.close_segment("gone", "down")
    return state


@pytest.fixture
def seeded(seeded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(seeded_dir))
    return Registry(remote=None)


def test_clusters_are_filtered_sorted_and_paged(seeded: Registry):
    first = readmodel.clusters(seeded)
    assert first.total == 230 and len(first.rows) == readmodel.PER_PAGE and first.pages == 5
    assert first.rows[0]["name"] == "c000" and first.rows[0]["accelerators"] == "H100:8"
    by_nodes = readmodel.clusters(seeded, sort="nodes", descending=True, per_page=10)
    assert all(r["num_nodes"] == 4 for r in by_nodes.rows)
    stopped = readmodel.clusters(seeded, status="STOPPED", per_page=1000)
    assert stopped.total == 23 and stopped.per_page == readmodel.MAX_PER_PAGE
    assert [r["name"] for r in readmodel.clusters(seeded, query="C22").rows] == [f"c22{i}" for i in range(10)]
    assert readmodel.clusters(seeded, page=99).rows == []
    gone = readmodel.gone_clusters(seeded)
    assert [r["name"] for r in gone.rows] == ["gone"] and gone.rows[0]["status"] == "DOWN"


def test_jobs_are_paged_latest_first_with_the_failing_rank_and_code(seeded: Registry):
    page = readmodel.jobs(seeded, per_page=20)
    assert page.total == 230 and len(page.rows) == 20
    row = page.rows[0]
    assert row["failed_rank"] == 0 and row["exit_code"] == 7 and row["duration_s"] == 30.0 and row["user"] != "-"
    assert readmodel.jobs(seeded, cluster="c007").total == 1
    assert readmodel.jobs(seeded, status="RUNNING").total == 0


def test_cost_per_cluster_and_per_day(seeded: Registry):
    doc = readmodel.cost(seeded, per_page=10)
    assert doc["rows"].total == 231 and len(doc["rows"].rows) == 10
    labels = [b["label"] for b in doc["by_cluster"]]
    assert len(labels) == 16 and labels[-1] == "others" and max(b["width"] for b in doc["by_cluster"]) == 100.0
    assert doc["by_day"] and abs(sum(b["value"] for b in doc["by_day"]) - doc["total"]) < 0.05


def test_spreading_a_segment_over_days_keeps_its_cost():
    per_day: dict[str, float] = {}
    start = time.mktime((2026, 11, 1, 22, 0, 0, 0, 0, -1))
    from gpuctl.state.registry import Segment

    seg = Segment("x", "aws", None, None, 2, False, 3.0, "t", start, start + 6 * 3600, "down")
    edges = readmodel.day_edges(start + 30 * 3600, days=3)
    assert [d for d, _, _ in edges] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    readmodel.spread_by_day(seg, seg.started_at, seg.ended_at, edges, per_day)  # type: ignore[arg-type]
    assert per_day == {"2026-11-01": pytest.approx(12.0), "2026-11-02": pytest.approx(24.0)}


def test_pairs_as_a_matrix_and_the_bring_up_as_bars():
    report = {"pairs": [{"ranks": [0, 1], "busbw_gbps": 40.0}, {"ranks": [1, 2], "busbw_gbps": 10.0},
                        {"ranks": [2, 0], "busbw_gbps": 38.0, "wrong": False}], "slow_nodes": []}
    matrix = readmodel.pair_matrix(report, ["head", "worker1", "worker2"])
    assert matrix is not None and matrix["best"] == 40.0
    assert matrix["cells"][1][2]["slow"] and not matrix["cells"][0][1]["slow"] and matrix["cells"][0][0] is None
    assert matrix["cells"][2][1] is matrix["cells"][1][2]
    assert readmodel.pair_matrix(None, []) is None
    bars = readmodel.timeline([{"phase": "provision", "started_at": 100.0, "seconds": 2.0},
                               {"phase": "prepare", "started_at": 102.0, "seconds": 6.0}], None, now=200.0)
    assert bars is not None and bars["span_s"] == 8.0 and bars["bars"][1]["left"] == 25.0
    assert bars["bars"][1]["width"] == 75.0


def test_the_cluster_page_draws_health_findings_the_timeline_and_the_pairs():
    from gpuctl.dashboard.app import Dashboard

    nodes = [{"rank": r, "name": n, "address": f"10.0.0.{r}", "gpus": 8, "ssh": "u@h:22", "fabric": "efa x32 (eth0)",
              "transport": "NET/AWS Libfabric", "verdict": v, "action": a, "findings": f, "checked_at": 1.0}
             for r, n, v, a, f in ((0, "head", "healthy", None, []),
                                   (1, "worker1", "unhealthy", "replace",
                                    [{"check": "xid", "action": "replace", "device": "GPU3",
                                      "text": "Xid 79 <script>alert(1)</script>"}]),
                                   (2, "worker2", None, None, []))]
    doc = {"name": "c1", "exists": True, "status": "UP", "infra": "aws/us-east-1", "num_nodes": 3,
           "accelerators": "H100:8", "instance_type": "p5.48xlarge", "created_at": 1.0, "nodes": nodes,
           "fabric": "efa", "jobs": [], "age_s": 60.0, "cost_so_far": 3.0, "per_hour": 295.0, "price_source": "t",
           "no_cloud_bill": False, "autostop": "autostop after 10 idle minute(s)", "autostop_left_s": 420.0,
           "autostop_seen_at": 2.0, "health": "1 healthy, 1 unhealthy", "check": None,
           "timeline": readmodel.timeline([{"phase": "provision", "started_at": 100.0, "seconds": 20.0},
                                           {"phase": "prepare", "started_at": 120.0, "seconds": 9.0},
                                           {"phase": "wait", "started_at": 120.0, "seconds": 3.0}], None, now=0),
           "pairs": readmodel.pair_matrix({"pairs": [{"ranks": [0, 1], "busbw_gbps": 40.0},
                                                     {"ranks": [1, 2], "busbw_gbps": 9.0},
                                                     {"ranks": [2, 0], "busbw_gbps": 39.0}],
                                           "slow_nodes": ["worker1"], "problem": None}, ["head", "worker1", "worker2"])}
    board = Dashboard(Guard(token="t", port=1, allowed_hosts=None))
    html = board.env.get_template("cluster.html").render(request=request(path="/clusters/c1"), c=doc, csrf="x",
                                                        version="0", now=0.0, sync_error=None, shared=False,
                                                        title="Cluster c1")
    assert "Xid 79 &lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert" not in html
    assert "→ replace" in html and "7m 0s left" in html and "NET/AWS Libfabric" in html
    assert html.count('class="slow"') == 2 and html.count('class="pair"') == 4 and html.count('class="none"') == 3
    assert html.count('class="tl-row inner"') == 1 and "29.0 s in all" in html
    assert 'name="csrf" value="x"' in html and "Type <strong>c1</strong> to confirm" in html


@pytest.fixture
def served(seeded: Registry):
    """The dashboard app over the seeded state, served by uvicorn in a thread on a free port."""
    import threading

    import uvicorn

    from gpuctl.dashboard.app import Dashboard

    sock = serve.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    guard = Guard(token="t0k", port=port, allowed_hosts=allowed_hosts("127.0.0.1"))
    server = uvicorn.Server(uvicorn.Config(Dashboard(guard).app(), log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield port, guard
    server.should_exit = True
    thread.join(10)


def fetch(port: int, method: str, path: str, body: str = "", **headers: str) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body.encode(), headers={"Authorization": "Bearer t0k", **headers})
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


def test_pages_answer_with_their_state_and_errors_in_the_page(served, seeded: Registry, seeded_dir: Path):
    import json

    port, guard = served
    status, text = fetch(port, "GET", "/api/jobs?per_page=100000")
    doc = json.loads(text)
    assert status == 200 and doc["page"]["per_page"] == 200 and len(doc["page"]["rows"]) == 200
    assert doc["page"]["total"] == 230 and len(text) < 1_000_000
    status, text = fetch(port, "GET", "/clusters?sort=cost&dir=desc&q=c1")
    assert status == 200 and "c1" in text
    (seeded_dir / "clusters" / "c229").mkdir(parents=True, exist_ok=True)
    (seeded_dir / "clusters" / "c229" / "inventory.yml").write_text("all: [unclosed")  # broken by hand
    status, text = fetch(port, "GET", "/clusters/c229")
    assert status == 400 and "inventory.yml" in text, text  # said in the page, not a bare 500
    status, text = fetch(port, "GET", "/clusters/nope")
    assert status == 404 and "No cluster" in text
    form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": f"http://127.0.0.1:{port}"}
    status, text = fetch(port, "POST", "/actions/down", f"cluster=c007&confirm=c008&csrf={guard.csrf_token()}",
                         **form)
    assert status == 400 and "type its name" in text and seeded.cluster("c007") is not None  # nothing was done
    status, text = fetch(port, "POST", "/actions/cancel", f"cluster=-a&job=1&csrf={guard.csrf_token()}", **form)
    assert status == 400 and "cluster name &#39;-a&#39;" in text
    status, _ = fetch(port, "POST", "/actions/cancel", "cluster=c007&job=1&csrf=forged", **form)
    assert status == 403


def test_with_shared_state_the_dashboard_shows_every_runners_clusters(state_bucket, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """Runner A writes a cluster and a job to the state bucket; the dashboard (runner B, another state
    dir, the same bucket) shows both after one background pass, as `gpuctl status` would."""
    from gpuctl.dashboard.refresh import SharedStateSync
    from mototest import STATE_BUCKET

    runner_a = Registry(tmp_path / "a" / "state.db", remote=state_bucket)
    runner_a.upsert_cluster("team-run", cloud="local", region=None, zone=None, num_nodes=2, status="UP",
                            request={"state": state_bucket.where("team-run")})
    job = runner_a.new_job("team-run", name="python train.py", num_nodes=2)
    monkeypatch.setenv("GPUCTL_STATE_BUCKET", STATE_BUCKET)
    monkeypatch.setenv("GPUCTL_STATE_PREFIX", "ci/gpuctl")
    assert readmodel.clusters(Registry()).total == 0  # this runner never saw it
    sync = SharedStateSync()
    sync.once()
    assert sync.last_error is None
    assert [r["name"] for r in readmodel.clusters(Registry()).rows] == ["team-run"]
    assert [(j["cluster"], j["id"]) for j in readmodel.jobs(Registry()).rows] == [("team-run", job.job_id)]


def test_the_managed_job_page_shows_a_pipelines_stages():
    from gpuctl.dashboard.app import Dashboard

    stage = {"index": 1, "name": "prep", "line": 4, "status": "SUCCEEDED", "cluster": "pl-mj1", "reused": False,
             "setup_skipped": False, "task_id": "t-1", "first_attempt": 1, "last_attempt": 1, "started_at": 10.0,
             "ended_at": 70.0, "reason": None}
    doc = {"id": 1, "name": "pl", "status": "RUNNING", "cluster": "pl-mj1", "task_id": "t-2", "attempt": 2,
           "recoveries": 0, "transient_recoveries": 0, "restarts_on_errors": 0, "submitted_at": 1.0, "started_at": 5.0,
           "ended_at": None, "reason": None, "exit_code": None, "failed_rank": None, "cluster_removed": None,
           "supervisor_pid": 1, "events": [], "pipeline": "pl", "stage": 2, "detail": "", "attempts": [1, 2],
           "duration_s": 90.0, "terminal": False,
           "stages": [stage, {**stage, "index": 2, "name": "train", "status": "RUNNING", "reused": True,
                              "setup_skipped": True, "first_attempt": 2, "last_attempt": 2, "ended_at": None},
                      {**stage, "index": 3, "name": "eval", "status": "PENDING", "cluster": None,
                       "first_attempt": None, "last_attempt": None, "started_at": None, "ended_at": None}]}
    board = Dashboard(Guard(token="t", port=1, allowed_hosts=None))
    html = board.env.get_template("managed_job.html").render(request=request(path="/managed/1"), m=doc, csrf="x",
                                                            version="0", now=100.0, sync_error=None, shared=False,
                                                            title="Managed job 1")
    assert "Stages of pipeline pl" in html and html.count('class="current"') == 1
    assert "pl-mj1</a> (reused)" in html and "setup skipped" in html and "1m 0s" in html
    assert 'href="?stage=3"' in html
