"""Managed jobs on a node, without nodes: epoch fencing (admission, `fence`) and AWS spot
interruption notices, run for real through the built agent in a scratch HOME (its stages, its
submit, a fake instance-metadata server on 127.0.0.1)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

from e2e import wait_for
from gpuctl.jobplane import client
from gpuctl.node import protocol
from gpuctl.jobplane.events import Event, Outcome, parse_event
from gpuctl.jobplane.payload import build_payload
from gpuctl.provision.inventory import Inventory, Node
from nodeagent import AGENT_PATH, COMMAND as AGENT_COMMAND

NOTICE = {"action": "terminate", "time": "2026-11-26T08:22:00Z"}
NOTICE_LINE = ("gpuctl-node: spot interruption notice: terminate at 2026-11-26T08:22:00Z; "
               "ranks on this node got SIGTERM to checkpoint")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch HOME, prepared as fingerprint 'fp1', that this process and the agents it runs use."""
    home = tmp_path / "home"
    (home / ".gpuctl" / "bin").mkdir(parents=True)
    (home / ".gpuctl" / "prepared").write_text("fp1\n")
    (home / ".gpuctl" / "installed.json").write_text("{}\n")  # nothing installed to check: the agent runs from the cache
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def agent(home: Path) -> ModuleType:
    """The built agent, loaded after HOME is set: its ~/.gpuctl paths are the scratch HOME's."""
    spec = importlib.util.spec_from_file_location(f"gpuctl_node_{uuid.uuid4().hex[:8]}", AGENT_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.GPUCTL_DIR == str(home / ".gpuctl")
    return module


def run_agent(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AGENT_COMMAND), *args], capture_output=True, text=True, timeout=timeout)


def fence(task: str, epoch: int, grace: float = 1) -> dict:
    proc = run_agent("fence", "--grace", str(grace), "--", task, str(epoch))
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


# -- the epoch record ------------------------------------------------------------------------


def test_admit_records_newer_and_equal_epochs_and_refuses_older(agent: ModuleType):
    assert agent.newest("t") is None
    assert agent.admit("t", 2) is None and agent.newest("t") == 2
    assert agent.admit("t", 2) is None  # the same attempt's other stage, or another node on this home
    assert agent.admit("t", 3) is None and agent.newest("t") == 3
    assert agent.admit("t", 1) == "epoch 1 of task t refused: a newer attempt (epoch 3) owns this task's ranks"
    assert agent.newest("t") == 3
    assert agent.raise_to("t", 1) == 3 and agent.newest("t") == 3  # never lowered
    assert agent.raise_to("t", 5) == 5 and agent.admit("t", 4) is not None
    assert agent.newest("other") is None and agent.admit("other", 0) is None  # one record per task


def test_task_ids_map_to_distinct_safe_file_names(agent: ModuleType):
    tasks = ["a/b", "a_b", "../../x", "-rf", "", "t" * 300, "ünï cødé"]
    files = [agent.epoch_file(t) for t in tasks]
    assert len(set(files)) == len(tasks)
    for path in files:
        assert os.path.dirname(path) == agent.EPOCHS_DIR
        name = os.path.basename(path)
        assert not name.startswith(("-", ".")) and len(name) < 100 and name.isascii()
    for i, task in enumerate(tasks[:4]):
        assert agent.admit(task, i) is None and agent.newest(task) == i


@pytest.mark.parametrize("epoch, says", [
    ("3", "must be an object"),
    ({"task": "", "value": 1}, "is not a task id"),
    ({"task": 7, "value": 1}, "is not a task id"),
    ({"task": "t"}, "value None of task t is not a whole number"),
    ({"task": "t", "value": True}, "value True"),
    ({"task": "t", "value": -1}, "value -1"),
    ({"task": "t", "value": "2"}, "value '2'"),
])
def test_a_malformed_epoch_is_a_problem(agent: ModuleType, epoch: Any, says: str):
    got, problem = agent.job_epoch({"epoch": epoch})
    assert got is None and says in problem
    assert agent.job_epoch({}) == (None, None)
    assert agent.job_epoch({"epoch": {"task": "t", "value": 0}}) == (("t", 0), None)


ADMITTER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("a", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
for v in sys.argv[3:]:
    if m.admit("race", int(v)) is None:
        print(v)
"""


def test_concurrent_admits_from_processes_lose_no_newer_epoch(agent: ModuleType, tmp_path: Path):
    """Eight processes admit interleaved epochs at once: the record ends at the largest of all (an
    unlocked read-compare-write would let a smaller one overwrite it), that one is always admitted,
    and every admitted epoch was at least the record when it was checked."""
    rnd = random.Random(7)
    values = list(range(400))
    rnd.shuffle(values)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", ADMITTER, str(AGENT_PATH), str(go),
                               *map(str, values[i::8])], stdout=subprocess.PIPE, text=True) for i in range(8)]
    time.sleep(0.5)
    go.touch()
    admitted = [int(v) for p in procs for v in p.communicate(timeout=120)[0].split()]
    assert all(p.returncode == 0 for p in procs)
    assert agent.newest("race") == 399 and 399 in admitted
    assert 0 < len(admitted) < 400  # some were refused: the processes did overlap


def test_concurrent_admits_from_threads_keep_the_newest(agent: ModuleType):
    results: dict[int, str | None] = {}

    def admit(v: int) -> None:
        results[v] = agent.admit("threads", v)

    threads = [threading.Thread(target=admit, args=(v,)) for v in [5, 9, 1, 9, 3, 7, 2, 8] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert agent.newest("threads") == 9 and results[9] is None


def test_a_fence_waits_for_a_start_under_admission(agent: ModuleType):
    """The start race: a relay admitted for epoch 1 holds the lock until its stage exists; a fence
    for epoch 2 that comes meanwhile waits for it, and afterwards epoch 1 is refused."""
    with agent.admission("race", 1) as problem:
        assert problem is None
        proc = subprocess.Popen([sys.executable, str(AGENT_COMMAND), "fence", "race", "2"], stdout=subprocess.PIPE,
                                text=True)
        time.sleep(1.0)
        assert proc.poll() is None, "fence did not wait for the admitted start"
        assert agent.newest("race") == 1
    out, _ = proc.communicate(timeout=30)
    assert json.loads(out)["epoch"] == 2 and agent.newest("race") == 2
    assert "a newer attempt (epoch 2)" in agent.admit("race", 1)


# -- fence ---------------------------------------------------------------------------------------


def test_fence_with_nothing_running_is_an_idempotent_answer(home: Path):
    for _ in range(2):
        assert fence("t", 4) == {"fenced": True, "epoch": 4, "stopped": [], "running": [], "doomed": None}
    assert fence("t", 2)["epoch"] == 2  # an older fence raises nothing and stops nothing
    assert fence("t", 3)["stopped"] == [] and fence("t", 4)["epoch"] == 4


@pytest.mark.parametrize("args, says", [
    (["t", "-1"], "gpuctl-node: epoch value -1 of task t is not a whole number >= 0"),
    (["", "1"], "gpuctl-node: epoch task '' is not a task id"),
    (["t", "two"], "invalid int value: 'two'"),
])
def test_fence_refuses_a_bad_epoch(home: Path, args: list[str], says: str):
    proc = run_agent("fence", *args)
    assert proc.returncode == 2 and says in proc.stderr and not proc.stdout
    assert not (home / ".gpuctl" / "epochs").exists() or not any((home / ".gpuctl" / "epochs").iterdir())


def test_fence_command_is_what_the_agent_parses(home: Path):
    from gpuctl.managed.fencing import fence_command

    assert fence_command("my task", 3, 1.5).line == "~/.gpuctl/bin/gpuctl-node fence --grace=1.5 -- 'my task' 3"
    command = fence_command("-x", 2).line.replace(protocol.AGENT, f"{sys.executable} {AGENT_COMMAND}")
    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["epoch"] == 2, out.stderr
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError):
            fence_command("t", bad)  # type: ignore[arg-type]


def test_the_payload_carries_epoch_and_spot_notice_only_when_given():
    inv = Inventory(cluster="c", cloud="aws", nodes=(Node(name="head", rank=0, node_id="n0", address="10.0.0.2",
                                                          ssh_host="10.0.0.2", ssh_port=22, ssh_user="ubuntu"),))
    plain = build_payload(inv, job_id=1, fingerprint="f", job_nodes=1, setup=None, run=None)
    assert "epoch" not in plain and "spot_notice" not in plain
    body = build_payload(inv, job_id=1, fingerprint="f", job_nodes=1, setup=None, run=None,
                         epoch={"task": "job-7", "value": 3},
                         spot_notice={"url": "http://169.254.169.254", "interval_s": 5.0})
    assert body["epoch"] == {"task": "job-7", "value": 3}
    assert body["spot_notice"] == {"url": "http://169.254.169.254", "interval_s": 5.0}


def payload(job: str, run: str | None, setup: str | None = None, **extra: Any) -> dict:
    stage = lambda script: None if script is None else {  # noqa: E731
        "script": script, "env": {}, "rank_vars": ["GPUCTL_NODE_RANK"], "hostfile": None}
    body = {"v": 1, "job": job, "fingerprint": "fp1", "branching": 4, "grace": 1, "workdir": "~/gpuctl_workdir",
            "job_ranks": 1, "peers": [{"rank": 0, "name": "head", "host": "127.0.0.1", "ssh": []}],
            "stages": {"setup": stage(setup), "run": stage(run)}, "sync": []}
    body.update(extra)
    return body


def events_of(stdout: bytes) -> tuple[list[Event], Outcome | None]:
    splitter = client.event_splitter(None)
    events = [e for e in map(parse_event, splitter.feed(stdout)) if e is not None]
    assert splitter.finish()[0], stdout.decode(errors="replace")
    outcome = next((Outcome.from_data(e.text, e.data) for e in events if e.kind == "D"), None)
    return events, outcome


def submit(body: dict) -> tuple[list[Event], Outcome | None]:
    data = json.dumps(body) + "\n" + json.dumps("") + "\n"
    proc = subprocess.run([sys.executable, str(AGENT_COMMAND), "submit"], input=data.encode(), capture_output=True,
                          timeout=60)
    return events_of(proc.stdout)


def start_job(body: dict) -> tuple[subprocess.Popen, bytes]:
    """`submit` in the background, returned once the run stage printed `started`."""
    data = json.dumps(body) + "\n" + json.dumps("") + "\n"
    proc = subprocess.Popen([sys.executable, str(AGENT_COMMAND), "submit"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data.encode())
    proc.stdin.close()
    proc.stdin = None
    seen = b""
    while b"started" not in seen:
        line = proc.stdout.readline()
        assert line, seen.decode(errors="replace")
        seen += line
    return proc, seen


def group_of(home: Path, job: str) -> int:
    return int((home / ".gpuctl" / "jobs" / job / "run.pid").read_text())


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_fence_stops_an_older_attempt_and_leaves_the_current_one(home: Path):
    """Two attempts of task t run here (epochs 1 and 2): `fence t 2` stops the first one's rank
    (TERM, then KILL: its script ignores TERM), whose job then fails; the second runs on. Then a
    third submission of epoch 1 is refused before anything of it starts."""
    old, old_seen = start_job(payload("old", "trap '' TERM; echo started; sleep 60",
                               epoch={"task": "t", "value": 1}))
    new, _ = start_job(payload("new", "echo started; sleep 60", epoch={"task": "t", "value": 2}))
    try:
        new_group = group_of(home, "new")
        for job, value in (("old", 1), ("new", 2)):
            assert json.loads((home / ".gpuctl" / "jobs" / job / "epoch.json").read_text()) == \
                {"task": "t", "value": value}
        answer = fence("t", 2)
        assert answer == {"fenced": True, "epoch": 2, "stopped": ["old"], "running": [], "doomed": None}
        assert not group_alive(group_of(home, "old"))
        out, _ = old.communicate(timeout=30)
        _, outcome = events_of(old_seen + out)
        assert outcome is not None and outcome.status == "FAILED" and outcome.run == {0: 128 + signal.SIGKILL}
        assert group_alive(new_group) and fence("t", 2)["stopped"] == []  # idempotent; same epoch left alone
        events, outcome = submit(payload("again", "touch ~/ran", setup="touch ~/set-up",
                                         epoch={"task": "t", "value": 1}))
        assert outcome is not None and outcome.status == "FAILED_SETUP" and outcome.setup == {0: 127}
        refused = [e.text for e in events if e.kind == "O" and e.stage == "setup"]
        assert refused == ["gpuctl-node: epoch 1 of task t refused: a newer attempt (epoch 2) owns this task's ranks"]
        assert not (home / "set-up").exists() and not (home / "ran").exists()
        assert not (home / ".gpuctl" / "jobs" / "again" / "epoch.json").exists()
    finally:
        run_agent("cancel", "new", "--wait", "20")
        new.communicate(timeout=30)
        old.kill() if old.poll() is None else None
    assert not group_alive(new_group)


def test_fence_finds_the_heads_payload_before_the_first_stage(agent: ModuleType, home: Path):
    jobs = home / ".gpuctl" / "jobs"
    for name, files in {"head": {"payload.json": json.dumps({"epoch": {"task": "t", "value": 3}})},
                        "worker": {"epoch.json": json.dumps({"task": "t", "value": 4}),
                                   "payload.json": json.dumps({"epoch": {"task": "t", "value": 1}})},
                        "torn": {"epoch.json": "{", "payload.json": "not json"},
                        "plain": {"payload.json": json.dumps({"job": "plain"})}}.items():
        (jobs / name).mkdir(parents=True)
        for file, text in files.items():
            (jobs / name / file).write_text(text)
    assert agent.jobdir_epoch(str(jobs / "head")) == ("t", 3)
    assert agent.jobdir_epoch(str(jobs / "worker")) == ("t", 4)  # what was admitted here wins
    assert agent.jobdir_epoch(str(jobs / "torn")) is None and agent.jobdir_epoch(str(jobs / "plain")) is None
    assert agent.fence("t", 9, 0.5)["stopped"] == []  # nothing of them runs: nothing to stop, no error


def old_job(home: Path, name: str, files: dict[str, str]) -> Path:
    jobdir = home / ".gpuctl" / "jobs" / name
    jobdir.mkdir(parents=True)
    (jobdir / "epoch.json").write_text(json.dumps({"task": "t", "value": 1}))
    for file, text in files.items():
        (jobdir / file).write_text(text)
    return jobdir


def test_fence_trusts_no_recorded_group_without_its_supervisor(home: Path, tmp_path: Path):
    """An older attempt's directory from before a reboot: its run.pid is now another process's
    group and its supervisor's pid another program's. `fence` leaves that process alone."""
    termed = tmp_path / "termed"
    other = subprocess.Popen(["bash", "-c", 'trap \'echo TERM >> "$0"\' TERM; while :; do sleep 1 & wait $!; done',
                              str(termed)], start_new_session=True)
    try:
        old_job(home, "ancient", {"run.pid": str(other.pid), "run.supervisor": str(os.getpid())})
        time.sleep(0.3)
        assert fence("t", 2) == {"fenced": True, "epoch": 2, "stopped": [], "running": [], "doomed": None}
        time.sleep(0.3)
        assert other.poll() is None and not termed.exists()
    finally:
        other.kill()
        other.wait()


def test_fence_stops_what_a_dead_supervisor_left_by_its_tag(home: Path):
    """An older attempt's rank left running when its supervisor was killed: found by the stage's
    tag in its environment, TERMed, then KILLed (it ignores TERM)."""
    tag = uuid.uuid4().hex
    left = subprocess.Popen(["bash", "-c", "trap '' TERM; while :; do sleep 1; done"], start_new_session=True,
                            env={**os.environ, "GPUCTL_NODE_STAGE": tag})
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        old_job(home, "orphaned", {"run.pid": str(left.pid), "run.supervisor": str(dead.pid), "run.tag": tag})
        time.sleep(0.3)
        answer = fence("t", 2, grace=0.5)
        assert answer["stopped"] == ["orphaned"] and answer["running"] == []
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:
        left.kill() if left.poll() is None else None


# -- spot interruption notices --------------------------------------------------------------


class FakeIMDS:
    """The instance metadata service on 127.0.0.1: IMDSv2 (a token from PUT, required by GET) or
    IMDSv1 (PUT refused, GET without a token); 404 for the first `quiet` GETs, then the notice."""

    def __init__(self, v2: bool = True, quiet: int = 2, body: bytes = json.dumps(NOTICE).encode()):
        self.v2, self.quiet, self.body = v2, quiet, body
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers (lower-case)
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                imds.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
                ok = imds.v2 and self.path == "/latest/api/token" and \
                    self.headers.get("X-aws-ec2-metadata-token-ttl-seconds") == "21600"
                self.answer(200, b"tok-123") if ok else self.answer(403)

            def do_GET(self) -> None:
                imds.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if imds.v2 and self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                    return self.answer(401)
                if self.path != "/latest/meta-data/spot/instance-action":
                    return self.answer(404)
                gets = sum(1 for r in imds.requests if r[0] == "GET")
                self.answer(404) if gets <= imds.quiet else self.answer(200, imds.body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self) -> list[dict[str, str]]:
        return [headers for method, _, headers in self.requests if method == "GET"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def imds() -> Iterator[FakeIMDS]:
    server = FakeIMDS()
    yield server
    server.close()


@pytest.fixture
def stand_in(agent: ModuleType, tmp_path: Path) -> Iterator[tuple[Any, Path, subprocess.Popen]]:
    """A run stage's stand-in: bash in a session of its own (STAGE.pid its group) that writes a line
    to a file for each SIGTERM and carries on; only SIGKILL ends it."""
    jobdir = tmp_path / "home" / ".gpuctl" / "jobs" / "spot"
    jobdir.mkdir(parents=True)
    termed = tmp_path / "termed"
    proc = subprocess.Popen(["bash", "-c", 'trap \'echo TERM >> "$0"\' TERM; while :; do sleep 1 & wait $!; done',
                             str(termed)], start_new_session=True)
    st = agent.Stage(str(jobdir), "run")
    (jobdir / "run.pid").write_text(str(proc.pid))
    time.sleep(0.3)  # the trap is set
    yield st, termed, proc
    proc.kill()
    proc.wait()


def test_a_spot_notice_dooms_the_node_and_terms_the_ranks_once(agent: ModuleType, imds: FakeIMDS, stand_in):
    st, termed, proc = stand_in
    watch = agent.SpotWatch(imds.url, 0.05, lambda: [st]).start()
    doomed = Path(agent.DOOMED_FILE)
    wait_for("the doomed mark", doomed.exists, 10, 0.05)
    wait_for("the TERM", termed.exists, 10, 0.05)
    record = json.loads(doomed.read_text())
    assert {k: record[k] for k in ("action", "time")} == NOTICE and record["noticed_at"].endswith("Z")
    assert doomed.stat().st_mode & 0o777 == 0o600
    assert watch.take_report() == NOTICE_LINE[len("gpuctl-node: "):]
    assert watch.take_report() is None  # reported once
    gets = len(imds.gets())
    time.sleep(1.5)
    assert len(imds.gets()) == gets == 3  # 404, 404, the notice; then no more polls
    assert proc.poll() is None and termed.read_text() == "TERM\n"  # TERM only, once: no KILL after it
    puts = [h for m, _, h in imds.requests if m == "PUT"]
    assert len(puts) == 1 and puts[0]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"  # the token is reused
    assert all(h["x-aws-ec2-metadata-token"] == "tok-123" for h in imds.gets())
    assert agent.doomed_record() == record
    watch.stop()


def test_imdsv1_fallback_when_no_token_is_given(agent: ModuleType, stand_in):
    st, termed, _ = stand_in
    server = FakeIMDS(v2=False, quiet=0)
    try:
        watch = agent.SpotWatch(server.url, 0.05, lambda: [st])
        assert watch.poll_once() == NOTICE
        assert "x-aws-ec2-metadata-token" not in server.gets()[0]
        assert [m for m, _, _ in server.requests] == ["PUT", "GET"]
    finally:
        server.close()


def test_an_expired_token_is_asked_for_again(agent: ModuleType, imds: FakeIMDS):
    watch = agent.SpotWatch(imds.url, 0.05, lambda: [])
    assert watch.poll_once() is None and watch.token == "tok-123"
    watch.token = "stale"  # IMDS answers 401
    assert watch.poll_once() is None and watch.token is None
    assert watch.poll_once() == NOTICE  # a new token, then the notice
    assert [m for m, _, _ in imds.requests] == ["PUT", "GET", "GET", "PUT", "GET"]


def test_an_unreachable_endpoint_is_no_notice_and_no_error(agent: ModuleType):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    watch = agent.SpotWatch("http://127.0.0.1:%d" % port, 0.05, lambda: [])
    started = time.monotonic()
    assert watch.poll_once() is None and time.monotonic() - started < 5
    watch.start()
    time.sleep(0.5)
    assert watch._thread.is_alive() and watch.take_report() is None and agent.doomed_record() is None
    watch.stop()
    watch._thread.join(5)
    assert not watch._thread.is_alive()


def test_a_silent_endpoint_times_out_in_a_second(agent: ModuleType):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts, never answers
        started = time.monotonic()
        assert agent.imds_request("http://127.0.0.1:%d/x" % s.getsockname()[1], timeout=0.5) is None
        assert time.monotonic() - started < 3


@pytest.mark.parametrize("body", [b"<html>proxy</html>", b"[]", b'{"time": "x"}', b'{"action": ""}', b"\xff"])
def test_an_answer_that_is_no_notice_is_ignored(agent: ModuleType, body: bytes):
    server = FakeIMDS(quiet=0, body=body)
    try:
        assert agent.SpotWatch(server.url, 0.05, lambda: []).poll_once() is None
    finally:
        server.close()


def test_a_notice_the_node_cannot_record_still_terms_the_ranks(agent: ModuleType, stand_in, monkeypatch):
    st, termed, _ = stand_in
    blocked = Path(agent.GPUCTL_DIR) / "no-dir" / "doomed"  # its directory is a file: ENOTDIR
    (Path(agent.GPUCTL_DIR) / "no-dir").write_text("")
    monkeypatch.setattr(agent, "DOOMED_FILE", str(blocked))
    text = agent.SpotWatch("http://unused", 1, lambda: [st]).act(NOTICE)
    wait_for("the TERM", termed.exists, 10, 0.05)
    assert text.startswith(NOTICE_LINE[len("gpuctl-node: "):] + " (the node is not marked doomed: cannot write ")


def test_a_notice_with_no_rank_running_says_so(agent: ModuleType):
    stopped = agent.Stage(os.path.join(agent.JOBS_DIR, "none"), "run")
    assert agent.SpotWatch("http://unused", 1, lambda: [stopped]).act({"action": "stop", "time": None}) == \
        "spot interruption notice: stop at an unknown time; no rank runs on this node"


def test_a_torn_doomed_mark_is_still_a_mark(agent: ModuleType):
    os.makedirs(agent.GPUCTL_DIR, exist_ok=True)
    Path(agent.DOOMED_FILE).write_text("{")
    assert agent.doomed_record() == {"action": "unknown", "time": None, "noticed_at": None}


@pytest.mark.parametrize("spec, expected", [
    (None, (None, None)),
    ({"url": "http://h/", "interval_s": 2}, (("http://h", 2.0), None)),
    ({}, (("http://169.254.169.254", 5.0), None)),
    ("yes", (None, "spot_notice must be an object {url, interval_s}, not 'yes'")),
    ({"url": "ftp://h"}, (None, "spot_notice url 'ftp://h' is not an http(s) URL")),
    ({"interval_s": 0}, (None, "spot_notice interval_s 0 is not a number of seconds above 0")),
    ({"interval_s": "5"}, (None, "spot_notice interval_s '5' is not a number of seconds above 0")),
])
def test_spot_notice_settings(agent: ModuleType, spec: Any, expected: tuple):
    assert agent.spot_notice_config({} if spec is None else {"spot_notice": spec}) == expected


def test_a_job_reports_the_notice_its_ranks_got_and_fence_hands_on_the_doomed_mark(home: Path, imds: FakeIMDS):
    """Through submit: the run stage's relay polls the fake IMDS; the notice reaches the job's
    events once, the rank (which checkpoints on TERM and exits 0) gets SIGTERM, and `fence`
    answers with the doomed mark."""
    script = "trap 'echo checkpointed > ~/ckpt; exit 0' TERM; echo started; sleep 60 & wait $!"
    events, outcome = submit(payload("spot", script, spot_notice={"url": imds.url, "interval_s": 0.1}))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    assert (home / "ckpt").read_text() == "checkpointed\n"
    agent_lines = [e.text for e in events if e.kind == "O" and e.stage == "gpuctl"]
    assert agent_lines == [NOTICE_LINE]
    order = [(e.kind, e.stage) for e in events if e.kind in "OX" and e.stage in ("gpuctl", "run")]
    assert order.index(("O", "gpuctl")) < order.index(("X", "run"))
    record = json.loads((home / ".gpuctl" / "doomed").read_text())
    assert fence("anything", 1)["doomed"] == record


def test_a_job_with_an_unusable_spot_notice_runs_and_says_why(home: Path):
    events, outcome = submit(payload("nospot", "echo ran", spot_notice={"url": "ftp://x"}))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    assert [e.text for e in events if e.kind == "O" and e.stage == "gpuctl"] == [
        "gpuctl-node: no spot notice watch: spot_notice url 'ftp://x' is not an http(s) URL"]
