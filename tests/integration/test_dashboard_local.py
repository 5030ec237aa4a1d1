"""`gpuctl dashboard` (issue 38) in a real browser: Debian's chromium driven by Playwright, against
the real `gpuctl dashboard` process and a 2-node local cluster brought up by `gpuctl apply`.

Every page loads with no console error and shows what the CLI shows; a running job's lines reach
the page within a second of being printed (the browser's clock and the nodes' are this machine's);
cancel from the page is CANCELLED in `gpuctl queue` within 2 s; down from the page leaves nothing,
and the job's logs still open afterwards. Requests without the token, with a foreign Host header,
or a cross-site POST are refused. Screenshots at 1280x800 and 375x667 are taken of every page
(GPUCTL_SCREENSHOTS=DIR keeps them; README's come from here).
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from e2e import REPO, Cluster, gpuctl_env, gpuctl_python, needs_local_nodes, pids_with_env, queue_rows, wait_for

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "dash2"
TOKEN = uuid.uuid4().hex
CHROMIUM = "/usr/bin/chromium"
TASK = f"""\
name: {NAME}
num_nodes: 2
resources:
  infra: local
run: echo "rank $SKYPILOT_NODE_RANK up"
"""
# A job that prints a stamped line every 0.2 s (the time it printed it, this machine's clock), and
# lines a page must not obey: markup and a terminal escape.
TICKS = ("printf '<b>bold</b> \\033[31mred\\n'; for i in $(seq 1 30); do "
         "python3 -c 'import time; print(\"tick\", repr(time.time()), flush=True)'; sleep 0.2; done")


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory):
    """(cluster, base URL, screenshots dir) with the dashboard serving the cluster's state."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make system-deps` installs Debian's chromium for these tests")
    root = tmp_path_factory.mktemp("dashboard-local")
    cluster = Cluster(NAME, root / "state")
    task = root / "cluster.yaml"
    task.write_text(TASK)
    env = {**gpuctl_env(cluster.state_dir), "GPUCTL_DASHBOARD_TOKEN": TOKEN}
    server = subprocess.Popen([sys.executable, "-m", "gpuctl", "dashboard", "--no-browser", "--port", "0"], cwd=REPO,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"(http://\S+)/clusters\?token=(\S+)", line)
        assert match and match.group(2) == TOKEN, line
        cluster.gpuctl("apply", str(task)).check()
        shots = Path(os.environ.get("GPUCTL_SCREENSHOTS") or root / "shots")
        shots.mkdir(parents=True, exist_ok=True)
        yield cluster, match.group(1), shots
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        cluster.down_quietly()


def expect(locator):
    from playwright.sync_api import expect as playwright_expect  # the locator's own waits: no eval under the CSP

    return playwright_expect(locator)


@pytest.fixture(scope="module")
def browser(dash):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, dash):
    """A fresh browser context logged in with the token, its console errors collected."""
    _, base, _ = dash
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    tab = context.new_page()
    tab.errors = []
    tab.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" and not host_network_changed(msg.text)
           else None)
    tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    tab.on("dialog", lambda dialog: dialog.accept())
    tab.goto(f"{base}/clusters?token={TOKEN}")
    assert "token=" not in tab.url  # moved into a cookie, out of the address bar
    yield tab
    context.close()


def host_network_changed(text: str) -> bool:
    """Chromium aborts what is in flight when this machine's interfaces change, as other tests' local
    nodes come and go (veths, bridges): the machine's doing, not the page's. The page takes it in its
    stride (a log's stream reconnects and goes on from its last line), so it is no console error here."""
    return "net::ERR_NETWORK_CHANGED" in text


def shoot(tab, shots: Path, name: str) -> None:
    """The page at 1280x800, then as a phone shows it (375x667); both must be there."""
    for label, size in (("desktop", (1280, 800)), ("phone", (375, 667))):
        tab.set_viewport_size({"width": size[0], "height": size[1]})
        path = shots / f"dashboard-{name}-{label}.png"
        tab.screenshot(path=str(path))
        assert path.stat().st_size > 5000, path
    tab.set_viewport_size({"width": 1280, "height": 800})


def exec_detached(cluster: Cluster, script: str) -> int:
    res = cluster.gpuctl("exec", NAME, "-d", "--", "bash", "-c", script).check()
    m = re.search(r"^Job (\d+) detached\.", res.stdout + res.stderr, re.M)
    assert m, res.describe()
    return int(m.group(1))


def test_every_page_loads_and_shows_the_cluster(dash, page):
    cluster, base, shots = dash
    assert NAME in page.locator("#live table").inner_text()
    row = page.locator("#live tr", has_text=NAME).inner_text()
    assert "UP" in row and "local" in row and "no cloud bill" in row, row
    shoot(page, shots, "clusters")
    page.goto(f"{base}/clusters/{NAME}")
    nodes = page.locator("table.list").first.inner_text()
    assert "head" in nodes and "worker1" in nodes, nodes
    assert page.locator(".timeline .tl-row", has_text="provision").count() == 1  # the bring-up, recorded
    shoot(page, shots, "cluster")
    for path, text in (("/jobs", "Jobs"), (f"/clusters/{NAME}/jobs/1", "Job 1"), ("/managed", "Managed jobs"),
                       ("/cost", "Cost"), ("/clusters?tab=history", "Clusters")):
        page.goto(base + path)
        assert text in page.locator("h1").inner_text(), path
    page.goto(f"{base}/clusters/{NAME}/jobs/1")
    expect(page.locator("#log-state")).to_contain_text("SUCCEEDED", timeout=15000)
    log = page.locator("#log").inner_text()
    assert "rank 0 up" in log and "rank 1 up" in log, log
    assert page.errors == [], page.errors


def test_a_running_jobs_lines_reach_the_page_within_a_second(dash, page):
    cluster, base, shots = dash
    job = exec_detached(cluster, TICKS)
    page.goto(f"{base}/clusters/{NAME}/jobs/{job}?rank=0")
    # when each line arrived, by the browser's clock (this machine's, as the nodes' is)
    page.evaluate("""() => { window.seen = [];
        new MutationObserver(() => { window.seen.push([document.getElementById('log').textContent, Date.now()]); })
          .observe(document.getElementById('log'), {childList: true}); }""")
    expect(page.locator("#log-state")).to_contain_text("SUCCEEDED", timeout=60000)
    arrived: dict[str, float] = {}
    for text, at_ms in page.evaluate("window.seen"):
        for line in text.splitlines():
            arrived.setdefault(line, at_ms / 1000)
    printed = {line: float(m.group(1)) for line in arrived if (m := re.search(r"\btick (\d+\.\d+)", line))}
    lags = [arrived[line] - at for line, at in printed.items()]
    assert len(lags) >= 25, sorted(arrived)  # the page started following before most were printed
    late = [round(lag, 2) for lag in lags if lag > 1.0]
    assert statistics.median(lags) < 1.0 and len(late) <= len(lags) // 10, (statistics.median(lags), late)
    log = page.locator("#log")
    assert log.locator("b").count() == 0 and "<b>bold</b> \\x1b[31mred" in log.inner_text()  # shown, not obeyed
    expect(page.locator("h1")).to_contain_text("SUCCEEDED", timeout=5000)  # the end, in the facts at once
    shoot(page, shots, "job")
    assert page.errors == [], page.errors


def test_cancel_from_the_page_shows_in_gpuctl_queue(dash, page):
    cluster, base, _ = dash
    job = exec_detached(cluster, "sleep 300")
    page.goto(f"{base}/clusters/{NAME}/jobs/{job}")
    # the row `gpuctl queue` prints, read where it reads it (a gpuctl run per look would time gpuctl),
    # from beside the browser: the click returns only once the page it leads to has loaded
    seen: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 15
        while not seen and time.monotonic() < deadline:
            if job_status(cluster, job) == "CANCELLED":
                seen.append(time.monotonic())
            time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    clicked = time.monotonic()
    page.click("#cancel-job")
    watcher.join()
    assert seen, f"job {job} never CANCELLED in the registry"
    took = seen[0] - clicked
    rows = queue_rows(cluster.gpuctl("queue", NAME).check().stdout)
    assert any(r[0] == str(job) and "CANCELLED" in r for r in rows), rows
    assert took <= 2.0, f"CANCELLED {took:.2f} s after the click"
    expect(page.locator("#log-state")).to_have_text("done", timeout=10000)
    assert page.errors == [], page.errors


# A managed job that ended after one recovery, written through the managed store's own API: the
# page's timeline and per-attempt logs need a recovery, which a real one would take minutes to make.
SEEDED_MANAGED = """
import time
from gpuctl.managed.store import Event, Store, attempt_log
store = Store()
job = store.create(name="seeded-train", launch={}, cluster_of=lambda i: f"seeded-{i}", task_id_of=lambda i: f"t-{i}")
now = time.time()
store.add_event(Event(job=job.id, attempt=1, kind="recovery", cause="node worker1 lost (spot preemption)",
                      nodes=["1"], detected_at=now - 100, resumed_at=now - 57.5, exit_code=None, failed_rank=None))
for k in (1, 2):
    attempt_log(job.id, k).parent.mkdir(parents=True, exist_ok=True)
    attempt_log(job.id, k).write_text(f"attempt {k} says <i>hi</i>\\n")
store.set_status(job.id, "SUCCEEDED", attempt=2, recoveries=1, started_at=now - 200, ended_at=now - 10)
print(job.id)
"""


def test_a_managed_jobs_recoveries_and_attempt_logs_show(dash, page):
    cluster, base, shots = dash
    made = gpuctl_python(SEEDED_MANAGED, env=gpuctl_env(cluster.state_dir))
    assert made.returncode == 0, made.stderr
    job = int(made.stdout.split()[-1])
    page.goto(f"{base}/managed")
    row = page.locator("#live tr", has_text="seeded-train").inner_text()
    assert "SUCCEEDED" in row and "seeded-" in row, row
    page.goto(f"{base}/managed/{job}")
    timeline = page.locator("ol.recoveries").inner_text()
    assert "node worker1 lost (spot preemption)" in timeline and "nodes replaced: 1" in timeline, timeline
    assert "running again after 42.5 s" in timeline, timeline
    expect(page.locator("#log-state")).to_contain_text("SUCCEEDED", timeout=15000)
    log = page.locator("#log").inner_text()
    assert "== attempt 2: after node worker1 lost (spot preemption) ==" in log and "attempt 1 says <i>hi</i>" in log
    assert page.locator("#log i").count() == 0
    page.goto(f"{base}/managed/{job}?attempt=1")
    expect(page.locator("#log")).to_contain_text("attempt 1 says", timeout=15000)
    assert "attempt 2 says" not in page.locator("#log").inner_text()
    shoot(page, shots, "managed")
    assert page.errors == [], page.errors


def job_status(cluster: Cluster, job: int) -> str | None:
    with sqlite3.connect(f"file:{cluster.state_dir / 'state.db'}?mode=ro", uri=True, timeout=5) as db:
        row = db.execute("SELECT status FROM jobs WHERE cluster=? AND job_id=?", (NAME, job)).fetchone()
    return row[0] if row else None


def _request(base: str, method: str, path: str, headers: dict[str, str], body: str = "") -> tuple[int, str]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body.encode(), headers={"Host": parts.netloc, **headers})
        answer = conn.getresponse()
        return answer.status, answer.read().decode(errors="replace")
    finally:
        conn.close()


def test_requests_without_the_token_from_a_foreign_host_or_another_site_are_refused(dash):
    _, base, _ = dash
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert _request(base, "GET", "/clusters", auth)[0] == 200
    status, text = _request(base, "GET", "/clusters", {})
    assert status == 403 and "token" in text
    assert _request(base, "GET", "/api/jobs", {"Authorization": "Bearer wrong"})[0] == 403
    assert _request(base, "GET", "/clusters?token=wrong", {})[0] == 403
    status, text = _request(base, "GET", "/clusters", {**auth, "Host": f"rebound.example:{urlsplit(base).port}"})
    assert status == 403 and "Host" in text  # DNS rebinding: the token alone does not let it in
    form = f"cluster={NAME}&confirm={NAME}&csrf=x"
    post = {**auth, "Content-Type": "application/x-www-form-urlencoded"}
    status, text = _request(base, "POST", "/actions/down", {**post, "Origin": "http://evil.example"}, form)
    assert status == 403 and "cross-site" in text
    status, _ = _request(base, "POST", "/actions/down", {**post, "Sec-Fetch-Site": "cross-site"}, form)
    assert status == 403
    status, text = _request(base, "POST", "/actions/down", {**post, "Origin": base}, form)  # same site, no CSRF token
    assert status == 403 and "CSRF" in text
    assert (dash[0].cdir / "inventory.yml").is_file()  # nothing was taken down


def test_a_dashboard_without_a_token_is_served_on_loopback_only(dash):
    cluster, _, _ = dash
    res = cluster.gpuctl("dashboard", "--host", "0.0.0.0", "--no-token", "--no-browser")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--no-token" in res.stderr, res.describe()
    res = cluster.gpuctl("dashboard", "--host", "192.0.2.1", "--no-browser")  # not an address of this machine
    assert res.returncode == 2 and "--host 192.0.2.1" in res.stderr and "Traceback" not in res.stderr, res.describe()


def test_an_armed_clusters_autostop_and_its_time_left_show(dash, page):
    cluster, base, _ = dash
    cluster.gpuctl("autostop", NAME, "-i", "30").check()
    page.goto(f"{base}/clusters")
    row = page.locator("#live tr", has_text=NAME)
    expect(row).to_contain_text("autostop after 30 idle minute(s)")
    expect(row).to_contain_text("left", timeout=20000)  # the head's idle time, asked in the background
    left = re.search(r"(\d+)m \d+s left", row.inner_text())
    assert left and 25 <= int(left.group(1)) <= 30, row.inner_text()
    cluster.gpuctl("autostop", NAME, "--cancel").check()
    assert page.errors == [], page.errors


def followers(port: int | None) -> list[int]:
    """The dashboard's children and theirs, but the cluster's shared ssh master: it serves every gpuctl
    command on the cluster and ends by itself (ControlPersist), or with `down`."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    return [p for p in pids_with_env(f"GPUCTL_DASHBOARD_CHILD={port}") if b"ControlPersist" not in cmdline(p)]


def test_a_killed_dashboard_leaves_no_log_follower_behind(dash):
    """The `gpuctl logs` a page follows ends with the dashboard, even a SIGKILLed one."""
    cluster, _, _ = dash
    job = exec_detached(cluster, "sleep 120")
    env = {**gpuctl_env(cluster.state_dir), "GPUCTL_DASHBOARD_TOKEN": TOKEN}
    server = subprocess.Popen([sys.executable, "-m", "gpuctl", "dashboard", "--no-browser", "--port", "0"], cwd=REPO,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        base = re.search(r"(http://\S+)/clusters", server.stdout.readline()).group(1)  # type: ignore[union-attr]
        port = urlsplit(base).port
        conn = http.client.HTTPConnection(urlsplit(base).hostname, port, timeout=10)
        conn.request("GET", f"/clusters/{NAME}/jobs/{job}/events", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200
        wait_for("the page's log follower", lambda: followers(port), timeout=15)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        wait_for("no follower left", lambda: not followers(port), timeout=15)
        conn.close()
    finally:
        if server.poll() is None:
            server.kill()
        cluster.gpuctl("cancel", NAME, str(job)).check()


def test_down_from_the_page_leaves_nothing_and_the_logs_stay(dash, page):
    cluster, base, shots = dash
    footprint = cluster.footprint()
    page.goto(f"{base}/clusters/{NAME}")
    page.fill("form.danger input[name=confirm]", NAME)
    page.click("form.danger button")
    expect(page.locator("#log-state")).to_have_text("done", timeout=120000)
    assert "Down cluster" in page.locator("h1").inner_text()
    footprint.assert_gone()
    assert "No clusters." in cluster.gpuctl("status").check().stdout
    page.goto(f"{base}/clusters?tab=history")
    assert NAME in page.locator("#live table").inner_text()
    page.goto(f"{base}/clusters/{NAME}/jobs/1")  # a finished job's log, after its cluster went
    expect(page.locator("#log-state")).to_contain_text("SUCCEEDED", timeout=15000)
    assert "rank 1 up" in page.locator("#log").inner_text()
    with page.expect_download() as download:
        page.click("text=download")
    saved = Path(download.value.path())
    assert "rank 0 up" in saved.read_text() and "rank 1 up" in saved.read_text()
    shoot(page, shots, "history")
    assert page.errors == [], page.errors
    if os.environ.get("GPUCTL_SCREENSHOTS"):
        shutil.copy(shots / "dashboard-clusters-desktop.png", shots / "dashboard-readme-desktop.png")
