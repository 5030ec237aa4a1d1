"""The node agent's job plane without a network: one-node jobs run by `submit`
in a scratch HOME (the coordinator, its events, fail states, secrets), the
claim markers that keep nodes sharing a filesystem from copying into one
directory at once, and the small pure helpers."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from e2e import pids_matching, wait_for
from gpuctl.jobplane.events import Outcome, parse_event
from gpuctl.stream import LineSplitter

AGENT_PATH = Path(__file__).resolve().parents[2] / "cli" / "gpuctl" / "jobplane" / "agent.py"


def load_agent():
    spec = importlib.util.spec_from_file_location("gpuctl_node_agent", AGENT_PATH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


agent = load_agent()


# -- pure helpers -------------------------------------------------------------------


@pytest.mark.parametrize("n,b", [(1, 4), (5, 2), (10, 3), (64, 32), (7, 100)])
def test_partition_covers_in_order_with_at_most_b_groups(n: int, b: int):
    ranks = list(range(1, n + 1))
    groups = agent.partition(ranks, b)
    assert [r for g in groups for r in g] == ranks
    assert len(groups) == min(b, n)
    assert max(map(len, groups)) - min(map(len, groups)) <= 1


@pytest.mark.parametrize("value", ["plain", "", "it's", "a b\tc\nd", "$HOME `id` \\ \"q\" ;&|<>", "--opt"])
def test_shell_quote_round_trips_through_bash(value: str):
    out = subprocess.run(["bash", "-c", f"printf %s {agent.shell_quote(value)}"], capture_output=True, text=True)
    assert out.stdout == value


def test_stage_env_text_exports_values_literally(tmp_path: Path):
    tricky = "it's \"quoted\" $HOME `id`\nsecond line"
    text = agent.stage_env_text("run", {"env": {"TRICKY": tricky, "bad name": "x", "EMPTY": ""},
                                         "rank_vars": ["GPUCTL_NODE_RANK"], "hostfile": ["10.0.0.1 slots=8"]},
                                3, str(tmp_path))
    env_file = tmp_path / "env.sh"
    env_file.write_text(text)
    out = subprocess.run(["bash", "-c", f". {env_file}; printf '%s|%s|%s|%s' \"$TRICKY\" \"$GPUCTL_NODE_RANK\" "
                          "\"$EMPTY\" \"$GPUCTL_HOSTFILE\""], capture_output=True, text=True)
    assert out.stdout == f"{tricky}|3||{tmp_path}/hostfile"
    assert "bad name" not in text


def test_dest_paths_home_relative_and_absolute():
    home = os.path.expanduser("~")
    assert agent.dest_paths("~/gpuctl_workdir/") == (f"{home}/gpuctl_workdir", "gpuctl_workdir")
    assert agent.dest_paths("/data/x") == ("/data/x", "/data/x")
    assert agent.dest_paths("~") == (home, ".")


# -- claims: one owner per filesystem -----------------------------------------------------


def _claim(args: tuple[str, str, list[dict], int]) -> list[int]:
    path_agent, token, dests, rank = args
    spec = importlib.util.spec_from_file_location("a", path_agent)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.claim_destinations(token, dests, rank)


def test_claims_on_one_filesystem_elect_exactly_one_owner(tmp_path: Path):
    shared = tmp_path / "shared"
    dests = [{"path": str(shared / "dir"), "dir": True}, {"path": str(shared / "sub" / "file.txt"), "dir": False}]
    for attempt in range(5):  # nodes racing: every one must see the same single owner
        token = f"job{attempt}-x"
        with ProcessPoolExecutor(6) as pool:
            results = list(pool.map(_claim, [(str(AGENT_PATH), token, dests, r) for r in range(6)]))
        for i in range(len(dests)):
            owners = {res[i] for res in results}
            assert len(owners) == 1, results
            owner = owners.pop()
            assert results[owner][i] == owner
    assert (shared / "dir").is_dir() and (shared / "sub").is_dir()  # created before any copy


def test_claims_on_separate_filesystems_each_own_their_copy(tmp_path: Path):
    owners = [agent.claim_destinations("t", [{"path": str(tmp_path / f"node{r}" / "w"), "dir": True}], r)
              for r in range(3)]
    assert owners == [[0], [1], [2]]


def test_release_removes_only_the_owners_markers(tmp_path: Path):
    dests = [{"path": str(tmp_path / "d"), "dir": True}]
    first = agent.claim_destinations("tok", dests, 0)
    second = agent.claim_destinations("tok", dests, 1)
    assert first == [0] and second == [0]
    agent.release_claims("tok", dests, second, 1)
    assert list((tmp_path / "d").glob(".gpuctl-claim-*"))
    agent.release_claims("tok", dests, first, 0)
    assert not list((tmp_path / "d").glob(".gpuctl-claim-*"))


# -- one-node jobs through submit -----------------------------------------------------


@pytest.fixture
def node_home(tmp_path: Path) -> Path:
    """A scratch HOME with the agent installed and prepared as fingerprint 'fp1'."""
    home = tmp_path / "home"
    (home / ".gpuctl" / "bin").mkdir(parents=True)
    (home / ".gpuctl" / "prepared").write_text("fp1\n")
    (home / ".gpuctl" / "fabric.env").write_text("export FABRIC_VAR=from-fabric\nexport OVERRIDE=fabric\n")
    return home


def payload(job: str, run: str | None, setup: str | None = None, **extra) -> dict:
    env = {"GPUCTL_NUM_NODES": "1", "OVERRIDE": "task"}
    stage = lambda script: None if script is None else {  # noqa: E731
        "script": script, "env": env, "rank_vars": ["GPUCTL_NODE_RANK"], "hostfile": ["127.0.0.1 slots=0"]}
    body = {"v": 1, "job": job, "fingerprint": "fp1", "branching": 4, "grace": 1, "workdir": "~/gpuctl_workdir",
            "job_ranks": 1, "peers": [{"rank": 0, "name": "head", "host": "127.0.0.1", "ssh": []}],
            "stages": {"setup": stage(setup), "run": stage(run)}, "sync": []}
    body.update(extra)
    return body


def submit(home: Path, body: dict, secrets_text: str = "", timeout: float = 60) -> tuple[list, Outcome | None, str]:
    data = json.dumps(body) + "\n" + json.dumps(secrets_text) + "\n"
    proc = subprocess.run([sys.executable, str(AGENT_PATH), "submit"], input=data.encode(), capture_output=True,
                          timeout=timeout, env={**os.environ, "HOME": str(home)})
    splitter = LineSplitter()
    events = [e for e in map(parse_event, splitter.feed(proc.stdout)) if e is not None]
    ended, _ = splitter.finish()
    assert ended, proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    outcome = next((Outcome.from_data(e.text, e.data) for e in events if e.kind == "D"), None)
    return events, outcome, proc.stderr.decode(errors="replace")


def test_one_node_job_streams_output_and_succeeds(node_home: Path):
    events, outcome, _ = submit(node_home, payload("7", 'echo "rank=$GPUCTL_NODE_RANK $FABRIC_VAR $OVERRIDE"; '
                                                        'echo err >&2', setup="echo setting up"))
    lines = [(e.stage, e.text) for e in events if e.kind == "O"]
    assert ("setup", "setting up") in lines
    assert ("run", "rank=0 from-fabric task") in lines and ("run", "err") in lines
    assert [e.text for e in events if e.kind == "P"][:1] == ["start"]
    assert outcome is not None and outcome.status == "SUCCEEDED" and outcome.run == {0: 0}
    job = node_home / ".gpuctl" / "jobs" / "7"
    assert json.loads((job / "job.json").read_text())["status"] == "SUCCEEDED"
    assert (job / "run.log").read_text() == "rank=0 from-fabric task\nerr\n"


def test_failing_setup_stops_before_run(node_home: Path):
    _, outcome, _ = submit(node_home, payload("8", "echo never", setup="exit 4"))
    assert outcome is not None and outcome.status == "FAILED_SETUP" and outcome.setup == {0: 4}
    assert not (node_home / ".gpuctl" / "jobs" / "8" / "run.log").exists()


def test_failing_run_is_failed_with_its_code(node_home: Path):
    _, outcome, _ = submit(node_home, payload("9", "exit 3"))
    assert outcome is not None and outcome.status == "FAILED" and outcome.run == {0: 3}
    assert outcome.first_failed == 0


def test_unprepared_node_runs_nothing(node_home: Path):
    (node_home / ".gpuctl" / "prepared").write_text("other\n")
    events, outcome, _ = submit(node_home, payload("10", "touch ~/ran"))
    assert outcome is not None and outcome.status == "UNPREPARED"
    assert any(e.kind == "H" and e.text.startswith("unprepared") for e in events)
    assert not (node_home / "ran").exists()


def test_secrets_reach_the_job_and_leave_no_file(node_home: Path):
    secret = "s3cr3t-'quoted' $x"
    _, outcome, _ = submit(node_home, payload("11", 'printf "%s" "$TOKEN" > ~/seen'),
                           secrets_text=f"export TOKEN={agent.shell_quote(secret)}\n")
    assert outcome is not None and outcome.status == "SUCCEEDED"
    assert (node_home / "seen").read_text() == secret
    job = node_home / ".gpuctl" / "jobs" / "11"
    assert not (job / "secrets.sh").exists()
    for path in job.rglob("*"):
        assert secret not in path.read_text(errors="replace"), path


def test_cancel_ends_a_running_job(node_home: Path):
    body = payload("12", "echo started; sleep 60; echo survived")
    data = json.dumps(body) + "\n" + json.dumps("") + "\n"
    env = {**os.environ, "HOME": str(node_home)}
    proc = subprocess.Popen([sys.executable, str(AGENT_PATH), "submit"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data.encode())
    proc.stdin.close()
    seen = b""
    while b"started" not in seen:
        seen += proc.stdout.readline()
    answer = subprocess.run([sys.executable, str(AGENT_PATH), "cancel", "12", "--wait", "20"], env=env,
                            capture_output=True, text=True, timeout=60)
    proc.stdin = None  # closed above
    out, _ = proc.communicate(timeout=30)
    assert json.loads(answer.stdout)["status"] == "CANCELLED"
    assert b"survived" not in seen + out
    assert b"D CANCELLED" in seen + out


# -- nothing of a job outlives whoever answers for it (issue 20, item 1) -------------------


def start_job(home: Path, body: dict, secrets_text: str) -> subprocess.Popen:
    """`submit` in the background, returned once the run stage printed its first line."""
    data = json.dumps(body) + "\n" + json.dumps(secrets_text) + "\n"
    proc = subprocess.Popen([sys.executable, str(AGENT_PATH), "submit"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "HOME": str(home)})
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data.encode())
    proc.stdin.close()
    proc.stdin = None
    seen = b""
    while b"started" not in seen:
        line = proc.stdout.readline()
        assert line, seen.decode(errors="replace")
        seen += line
    return proc


@pytest.mark.parametrize("victim", ["coordinator", "run.supervisor", "none (a background process)"])
@pytest.mark.parametrize("session", ["the stage's", "its own"])
def test_no_rank_or_secret_outlives_a_dead_owner(node_home: Path, victim: str, session: str):
    """kill -9 of the job's coordinator or of the stage's supervisor, or a script that leaves a
    process behind and exits 0: within a bounded wait no process of the job is left and no file
    holds its secret. The process is a grandchild of the stage, in the stage's process group or
    in a session of its own (as torchrun starts its workers)."""
    marker = f"gpuctl-orphan-{uuid.uuid4().hex[:10]}"
    secret = f"tok-{uuid.uuid4().hex}"
    grandchild = f"(exec -a {marker} sleep 300)" if session == "the stage's" else \
        f"setsid bash -c 'exec -a {marker} sleep 300'"
    # the background variant's stage ends at once
    script = (f"{grandchild} & echo started" if victim.startswith("none") else f"{grandchild} & echo started; wait")
    proc = start_job(node_home, payload("31", script), f"export TOKEN={agent.shell_quote(secret)}\n")
    job = node_home / ".gpuctl" / "jobs" / "31"
    try:
        if not victim.startswith("none"):  # (the background process may be gone already: the job ended)
            wait_for("the rank to start", lambda: pids_matching(marker), 10)
            name = "events.supervisor" if victim == "coordinator" else victim
            os.kill(int((job / name).read_text()), signal.SIGKILL)
        wait_for("the rank to be stopped", lambda: not pids_matching(marker), 20)
        wait_for("the secrets file to go", lambda: not (job / "secrets.sh").exists(), 10)
        for path in job.rglob("*"):
            assert secret not in path.read_text(errors="replace"), path
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


# -- a job directory is only ever its own submission's (issue 20, item 8) ------------------


def _foreign_dir(home: Path, name: str, made_by: str | None) -> dict[str, bytes]:
    """A job directory another submission made (`made_by`: its nonce; None: no record, as an older
    agent left it); what it holds, to compare with afterwards."""
    jobdir = home / ".gpuctl" / "jobs" / name
    jobdir.mkdir(parents=True)
    (jobdir / "run.log").write_text("the other controller's output\n")
    (jobdir / "job.json").write_text('{"status": "RUNNING"}')
    if made_by is not None:
        (jobdir / agent.SUBMISSION_FILE).write_text(made_by)
    return {p.name: p.read_bytes() for p in jobdir.iterdir()}


@pytest.mark.parametrize("made_by", ["other-nonce", None])
def test_submit_refuses_a_job_dir_another_submission_made(node_home: Path, made_by: str | None):
    before = _foreign_dir(node_home, "1-aaaa", made_by)
    events, outcome, _ = submit(node_home, payload("1-aaaa", "touch ~/ran", nonce="mine"))
    assert outcome is not None and outcome.status == "FAILED" and "another submission made it" in outcome.detail
    jobdir = node_home / ".gpuctl" / "jobs" / "1-aaaa"
    assert {p.name: p.read_bytes() for p in jobdir.iterdir()} == before  # not removed, not written
    assert not (node_home / "ran").exists()


def test_a_retry_of_the_same_submission_takes_its_dir_back_once_it_ended(node_home: Path):
    body = payload("2-bbbb", "echo try", nonce="same")
    _, first, _ = submit(node_home, body)
    _, second, _ = submit(node_home, body)  # e.g. after `prepare` answered UNPREPARED
    assert first is not None and second is not None and (first.status, second.status) == ("SUCCEEDED",) * 2
    proc = start_job(node_home, dict(body, stages={"setup": None, "run": payload("x", "echo started; sleep 60")
                                                   ["stages"]["run"]}), "")
    try:
        _, third, _ = submit(node_home, body)  # the same submission while its coordinator runs
        assert third is not None and third.status == "FAILED" and "already running" in third.detail
    finally:
        subprocess.run([sys.executable, str(AGENT_PATH), "cancel", "2-bbbb", "--wait", "20"],
                       env={**os.environ, "HOME": str(node_home)}, capture_output=True, timeout=60)
        proc.communicate(timeout=30)


def test_a_worker_refuses_a_job_dir_another_submission_made(node_home: Path):
    before = _foreign_dir(node_home, "3-cccc", "theirs")
    body = dict(payload("3-cccc", "touch ~/ran", nonce="mine"), subtree=[1], job_ranks=2,
                peers=[{"rank": 0, "name": "head", "host": "127.0.0.1", "ssh": []},
                       {"rank": 1, "name": "worker1", "host": "127.0.0.1", "ssh": []}])
    data = json.dumps(body) + "\n" + json.dumps("export T='x'\n") + "\nstart run\nend\n"
    proc = subprocess.run([sys.executable, str(AGENT_PATH), "relay"], input=data.encode(), capture_output=True,
                          timeout=60, env={**os.environ, "HOME": str(node_home)})
    events = [e for e in map(parse_event, LineSplitter().feed(proc.stdout)) if e is not None]
    hello = [e for e in events if e.kind == "H"]
    assert len(hello) == 1 and hello[0].rank == 1 and "another submission made it" in hello[0].text, proc.stdout
    jobdir = node_home / ".gpuctl" / "jobs" / "3-cccc"
    assert {p.name: p.read_bytes() for p in jobdir.iterdir()} == before
    assert not (node_home / "ran").exists()
