"""The node agent's job plane without a network: one-node jobs run by `submit`
in a scratch HOME (the coordinator, its events, fail states, secrets), the
claim markers that keep nodes sharing a filesystem from copying into one
directory at once, and the small pure helpers."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import select
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e import pids_matching, wait_for
from gpuctl.configplane import bundle
from gpuctl.jobplane import agentcall, client, joblogs
from gpuctl.jobplane.events import PIECE, Event, LineJoiner, Outcome, encode, parse_event
from gpuctl.jobplane.stream import LineSplitter
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory, Node
from nodeagent import AGENT_PATH, COMMAND as AGENT_COMMAND

# ~/.gpuctl/bin/gpuctl-node on a node: imports the agent from ~/.gpuctl/lib/gpuctl_node.py
LAUNCHER_PATH = bundle.NODE / "launcher.py"


def local_head(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Every agent call the controller makes (agentcall, over provision/ssh.py) is answered by the
    agent built here, with `home` as the node's HOME: the door's lines, run by a shell, unchanged."""
    local = f"HOME={shlex.quote(str(home))} {shlex.quote(sys.executable)} {shlex.quote(str(AGENT_COMMAND))}"

    def argv(node: Node, command: str, *, control_dir: Path | None = None, **kw: object) -> list[str]:
        assert command.startswith(protocol.AGENT + " ")
        return ["bash", "-c", local + command[len(protocol.AGENT):]]

    monkeypatch.setattr(ssh, "ssh_argv", argv)


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
    (home / ".gpuctl" / "installed.json").write_text("{}\n")  # nothing installed to check: the agent runs from the cache
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


def submit(home: Path, body: dict, secrets_text: str = "", timeout: float = 60,
           command: Path = AGENT_COMMAND) -> tuple[list, Outcome | None, str]:
    data = json.dumps(body) + "\n" + json.dumps(secrets_text) + "\n"
    proc = subprocess.run([sys.executable, str(command), "submit"], input=data.encode(), capture_output=True,
                          timeout=timeout, env={**os.environ, "HOME": str(home)})
    splitter = client.event_splitter(None)  # as the controller reads it: 64 KiB at a time
    lines = [line for i in range(0, len(proc.stdout), 65536) for line in splitter.feed(proc.stdout[i:i + 65536])]
    events = [e for e in map(parse_event, lines) if e is not None]
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


def test_the_installed_command_imports_the_agent_and_keeps_its_bytecode(node_home: Path, monkeypatch):
    """As the prepare play installs them: bin/gpuctl-node imports lib/gpuctl_node.py, so the first
    call leaves the agent's bytecode in lib/__pycache__ and later calls do not compile it again; the
    coordinator (a fork of `submit`) and the stage's supervisor (a fork of the coordinator) are that command."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as some images set it: the launcher caches all the same
    lib = node_home / ".gpuctl" / "lib"
    lib.mkdir()
    shutil.copy(AGENT_PATH, lib / "gpuctl_node.py")
    command = node_home / ".gpuctl" / "bin" / "gpuctl-node"
    shutil.copy(LAUNCHER_PATH, command)
    events, outcome, _ = submit(node_home, payload("12", 'tr "\\0" " " < /proc/$PPID/cmdline; echo'), command=command)
    assert outcome is not None and outcome.status == "SUCCEEDED"
    supervisor = [e.text for e in events if e.kind == "O" and e.stage == "run"]
    assert supervisor and f"{command} submit" in supervisor[0], supervisor
    assert list((lib / "__pycache__").glob("gpuctl_node.*.pyc"))
    # a node whose agent is cut short (its cached bytecode then no longer matches) or gone: 127, as for a
    # missing command, so the controller prepares it again
    agent_text = (lib / "gpuctl_node.py").read_bytes()
    before_main = agent_text[:agent_text.index(b"\ndef main(")]  # whole definitions, main's not among them
    for damage, says in ((lambda: (lib / "gpuctl_node.py").write_bytes(before_main), "AttributeError"),
                         (lambda: (lib / "gpuctl_node.py").write_bytes(before_main + b"\ndef cut(sho"),
                          "SyntaxError"),
                         (lambda: (lib / "gpuctl_node.py").unlink(), "ModuleNotFoundError")):
        damage()
        broken = subprocess.run([sys.executable, str(command), "job-status", "12"], capture_output=True, text=True,
                                env={**os.environ, "HOME": str(node_home)}, cwd=str(node_home))
        assert broken.returncode == 127 and "cannot load the agent" in broken.stderr, broken.stderr
        assert says in broken.stderr and "prepares this node again" in broken.stderr, broken.stderr


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
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:  # a file written whole, then renamed (job.json.tmpN), as we looked
            continue
        assert secret not in text, path


def test_cancel_ends_a_running_job(node_home: Path):
    body = payload("12", "echo started; sleep 60; echo survived")
    data = json.dumps(body) + "\n" + json.dumps("") + "\n"
    env = {**os.environ, "HOME": str(node_home)}
    proc = subprocess.Popen([sys.executable, str(AGENT_COMMAND), "submit"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data.encode())
    proc.stdin.close()
    seen = b""
    while b"started" not in seen:
        seen += proc.stdout.readline()
    answer = subprocess.run([sys.executable, str(AGENT_COMMAND), "cancel", "12", "--wait", "20"], env=env,
                            capture_output=True, text=True, timeout=60)
    proc.stdin = None  # closed above
    out, _ = proc.communicate(timeout=30)
    assert json.loads(answer.stdout)["status"] == "CANCELLED"
    assert b"survived" not in seen + out
    assert b"D CANCELLED" in seen + out


# -- a rank's output, byte for byte ----------------------------------------------------


def awkward_output(seed: int) -> bytes:
    """Lines no framing may bend: several MiB without a newline, binary and invalid UTF-8, \\r,
    lines that are events or the sentinel themselves, one ending just past each piece size,
    an event-looking remainder where the old controller cut at 1 MiB, and no final newline."""
    rnd = random.Random(seed)
    noise = lambda n: bytes(rnd.choice(b"\x00\xff\xfe\xc3\r\t x") for _ in range(n))  # noqa: E731 - no \n
    lines = [b"x" * 1_200_000, b"y" * (1 << 20) + b"D SUCCEEDED {}", noise(rnd.randint(2 << 20, 3 << 20)),
             b"D SUCCEEDED {}", b"X 0 run 1", b"O 0 run forged", b"o 1 run forged", b"L 0 gone", b"P run",
             b"__GPUCTL_EXIT__ 0", b"__GPUCTL_OFFSET__ 5", b"progress 1%\rprogress 2%\r", b"crlf\r", b"",
             b"\xff\xfe not utf-8 \xc3", "wérld ✓".encode()]
    lines += [b"p" * n for n in (PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, rnd.randint(1, 5 * PIECE))]
    rnd.shuffle(lines)
    return b"\n".join(lines) + b"\n" + noise(rnd.randint(PIECE, 3 * PIECE)) + b"D FAILED {}"


def rank_bytes(events: list[Event], rank: int = 0, stage: str = "run") -> bytes:
    """What the controller makes of the events: the rank's lines, joined, as the rank log holds them."""
    joiner = LineJoiner()
    whole = [w for e in events for w in joiner.feed(e)]
    return b"".join(encode(e.text) + (b"\n" if e.eol else b"")
                    for e in whole if e.kind == "O" and (e.rank, e.stage) == (rank, stage))


@pytest.mark.parametrize("seed", [1, 2])
def test_output_round_trips_through_the_head_byte_for_byte(node_home: Path, tmp_path: Path, seed: int,
                                                             monkeypatch: pytest.MonkeyPatch):
    """stage log -> LocalStage -> coordinator -> events.log -> submit's stream -> the controller's
    splitter and joiner -> rank log, and `gpuctl logs`' rebuild from events.log: the same bytes."""
    data = awkward_output(seed)
    (node_home / "out.bin").write_bytes(data)
    events, outcome, err = submit(node_home, payload("20", 'cat "$HOME/out.bin"'))
    assert outcome is not None and outcome.status == "SUCCEEDED", err
    assert rank_bytes(events) == data
    assert [e.kind for e in events if e.kind not in "Oou"] == ["P", "H", "P", "S", "P", "X", "D"]
    log = node_home / ".gpuctl" / "jobs" / "20" / "events.log"
    assert max(map(len, log.read_bytes().split(b"\n"))) <= PIECE + 64  # no hop holds a longer event

    writer = joblogs.LogWriter("c", 20)  # what JobView saves from the joined events
    joiner = LineJoiner()
    for whole in (w for e in events for w in joiner.feed(e)):
        if whole.kind == "O":
            writer.write(whole.stage or "run", whole.rank or 0, whole.text, whole.eol)
    writer.close()
    assert joblogs.local_log("c", 20, "run", 0).read_bytes() == data

    joblogs.local_log("c", 20, "run", 0).unlink()
    local_head(monkeypatch, node_home)  # `gpuctl-node events 20`, answered by the agent in node_home
    node = Node("head", 0, "n0", "127.0.0.1", "127.0.0.1", 22, "u", "/k", 0)
    fetched = joblogs.fetch(Inventory(cluster="c", cloud="local", region=None, zone=None, nodes=(node,)), 20, "20",
                            control_dir=None)
    assert fetched is not None and fetched.status == "SUCCEEDED"
    assert joblogs.local_log("c", 20, "run", 0).read_bytes() == data


def test_events_prints_the_log_as_it_is_now_and_names_a_missing_job(node_home: Path):
    """`gpuctl-node events JOB`: the head's events.log in one read, bytes as they are (a line still
    being written too: the reader drops it); a job without one is exit 1 and one line."""
    _, outcome, _ = submit(node_home, payload("23", "printf 'a\\377b\\n'; printf half"))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    log = node_home / ".gpuctl" / "jobs" / "23" / "events.log"
    with open(log, "ab") as fh:
        fh.write(b"O 0 run being writ")
    env = {**os.environ, "HOME": str(node_home)}
    read = subprocess.run([sys.executable, str(AGENT_COMMAND), "events", "--", "23"], capture_output=True, env=env,
                          timeout=30)
    assert read.returncode == 0 and read.stdout == log.read_bytes() and b"a\xffb" in read.stdout, read.stderr
    for job, says in (("24", b"gpuctl-node: job 24 has no events.log here"), ("-h", b"invalid job id '-h'")):
        missing = subprocess.run([sys.executable, str(AGENT_COMMAND), "events", "--", job], capture_output=True,
                                 env=env, timeout=30)
        assert missing.returncode == 1 and says in missing.stderr and not missing.stdout


def test_a_line_cut_by_a_killed_coordinator_keeps_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """events.log ends mid-line, with no X or D (the coordinator was killed while a rank wrote a
    long line): `gpuctl logs`' rebuild keeps every byte that reached the head."""
    data = bytes(range(256)).replace(b"\n", b"") * 700  # several pieces, none of them a newline
    log = tmp_path / ".gpuctl" / "jobs" / "21" / "events.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"__GPUCTL_OFFSET__ 0\n" + agent.out_events(b"0 run ", b"whole", True)
                    + agent.out_events(b"0 run ", data, False))
    local_head(monkeypatch, tmp_path)
    node = Node("head", 0, "n0", "127.0.0.1", "127.0.0.1", 22, "u", "/k", 0)
    inv = Inventory(cluster="c", cloud="local", region=None, zone=None, nodes=(node,))
    assert joblogs.fetch(inv, 21, "21", control_dir=None) is None  # no outcome: the job never said
    assert joblogs.local_log("c", 21, "run", 0).read_bytes() == b"whole\n" + data


def test_relay_passes_output_on_unchanged(tmp_path: Path):
    """A worker's frames, read by its parent relay (LineReader) and passed up (_from_child)."""
    data = awkward_output(3)
    frames = b"".join(agent.out_events(b"1 run ", line, True) for line in data.split(b"\n"))
    read, write = os.pipe()
    sent = []
    relay = agent.Relay({"job": "21", "peers": [{"rank": 0, "name": "head", "host": "h", "ssh": []}]}, "", 0,
                        sent.append)
    child = type("Child", (), {"rank": 1, "hello": False, "open_ranks": {1}})()
    reader = agent.LineReader(read)

    def child_relay() -> None:
        with os.fdopen(write, "wb") as stdout:
            stdout.write(frames + agent.ev("X", 1, "run", 0))

    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(child_relay)
        while not reader.eof:
            select.select([read], [], [])
            for line in reader.read_lines():
                relay._from_child(child, line)
        sending.result()
    os.close(read)
    passed = b"".join(sent)
    assert passed == frames + b"X 1 run 0\n"
    events = [parse_event(line) for line in client.event_splitter(0).feed(b"__GPUCTL_OFFSET__ 0\n" + passed)]
    assert rank_bytes([e for e in events if e is not None], rank=1) == data + b"\n"
    assert child.open_ranks == {1}  # no output line was taken for an L or H of its own


def test_a_resumed_stream_loses_and_repeats_no_byte(node_home: Path, monkeypatch: pytest.MonkeyPatch):
    """The controller's connection drops mid-line, twice, at awkward places: `attach --offset`
    resumes exactly, and lines that span the drop are joined whole."""
    data = awkward_output(4)
    (node_home / "out.bin").write_bytes(data)
    _, outcome, _ = submit(node_home, payload("22", 'cat "$HOME/out.bin"'))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    cuts = iter([PIECE * 3 + 17, 1_500_000])  # bytes each dropped connection delivers before it ends
    env = {**os.environ, "HOME": str(node_home)}

    def start(self: client.Session, command: agentcall.Command, stdin_data: bytes | None) -> None:
        # `gpuctl-node attach --offset=N -- 22`: the local agent plays the head
        line = shlex.join([sys.executable, str(AGENT_COMMAND), *command.args])
        cut = next(cuts, None)
        self.proc = subprocess.Popen(["bash", "-c", line + (f" | head -c {cut}" if cut else "")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env)
        self.stderr = bytearray()

    monkeypatch.setattr(client.Session, "_start", start)
    monkeypatch.setattr(client.time, "sleep", lambda seconds: None)  # the reconnection back-off
    seen: list[Event] = []
    session = client.Session(Node("head", 0, "n0", "h", "h", 22, "u", "/k", 0), "22", node_home, seen.append)
    resumed = session.attach(0)
    assert next(cuts, None) is None  # both drops happened
    assert resumed is not None and resumed.status == "SUCCEEDED"
    assert b"".join(encode(e.text) + (b"\n" if e.eol else b"") for e in seen if e.kind == "O") == data


# -- a full disk ---------------------------------------------------------------------------


def disk_full(path: str, *args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_node_that_cannot_write_the_job_is_a_problem_not_unprepared(node_home: Path, rank: int,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """ENOSPC where a node writes the job's files (the head's scripts, a worker's directory):
    `H RANK problem` naming the path, so the job fails at once instead of preparing again."""
    monkeypatch.setenv("HOME", str(node_home))
    monkeypatch.setattr(agent, "PREPARED_FILE", str(node_home / ".gpuctl" / "prepared"))
    monkeypatch.setattr(agent, "INSTALLED_FILE", str(node_home / ".gpuctl" / "installed.json"))
    monkeypatch.setattr(agent, "JOBS_DIR", str(node_home / ".gpuctl" / "jobs"))
    monkeypatch.setattr(agent, "write_private", disk_full)
    body = payload("30", "echo never")
    body["peers"].append({"rank": 1, "name": "worker1", "host": "127.0.0.2", "ssh": []})
    if rank == 0:
        os.makedirs(agent.job_dir("30"), 0o700)  # the head's submit made it; a worker makes its own
    sent: list[bytes] = []
    relay = agent.Relay(body, "export S=1\n", rank, sent.append)
    assert relay.prepare_local() is False
    jobdir = node_home / ".gpuctl" / "jobs" / "30"  # the first file it writes there
    assert len(sent) == 1 and sent[0].startswith(f"H {rank} problem cannot write {jobdir}/".encode()), sent
    assert sent[0].endswith(b": No space left on device\n"), sent


def test_submit_to_a_full_head_fails_the_job_in_one_line(node_home: Path):
    """The head cannot write the job at all: FAILED at once, naming the head and the path; nothing
    left behind, no coordinator started."""
    run = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('a', sys.argv[1]); "
           "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
           "exec(sys.argv[2], vars(m)); sys.exit(m.main(['submit']))")
    full = ("import errno, os\ndef write_private(path, *args):\n"
            "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)\n")
    data = json.dumps(payload("31", "echo never")) + "\n" + json.dumps("") + "\n"
    proc = subprocess.run([sys.executable, "-c", run, str(AGENT_PATH), full], input=data.encode(),
                          capture_output=True, timeout=60, env={**os.environ, "HOME": str(node_home)})
    assert proc.returncode == 0 and not proc.stderr, proc.stderr.decode(errors="replace")
    splitter = client.event_splitter(None)
    events = [e for e in map(parse_event, splitter.feed(proc.stdout)) if e is not None]
    assert splitter.finish()[0]
    jobdir = node_home / ".gpuctl" / "jobs" / "31"
    why = f"cannot write {jobdir}/payload.json: No space left on device"
    assert [(e.kind, e.text) for e in events] == [("H", f"problem {why}"), ("D", "FAILED")]
    assert Outcome.from_data("FAILED", events[-1].data).detail == f"head: {why}"
    assert not jobdir.exists()


# -- nothing of a job outlives whoever answers for it (issue 20, item 1) -------------------


def start_job(home: Path, body: dict, secrets_text: str) -> subprocess.Popen:
    """`submit` in the background, returned once the run stage printed its first line."""
    data = json.dumps(body) + "\n" + json.dumps(secrets_text) + "\n"
    proc = subprocess.Popen([sys.executable, str(AGENT_COMMAND), "submit"], stdin=subprocess.PIPE,
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
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:  # a file written whole, then renamed (job.json.tmpN), as we looked
                continue
            assert secret not in text, path
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def test_kill_finds_what_escaped_both_the_group_and_a_dead_supervisor(node_home: Path):
    """A stage leaves a daemon in a session of its own and exits; then its supervisor and the
    coordinator are both killed -9, so the daemon is re-parented to init, outside any tree of the
    job's. `gpuctl-node kill` (what cancel runs on every node) still stops it: every process of a
    stage carries the stage's tag in its environment."""
    marker = f"gpuctl-escaped-{uuid.uuid4().hex[:10]}"
    setup = f"setsid bash -c 'exec -a {marker} sleep 300' &"  # setup leaves it and ends; run goes on
    proc = start_job(node_home, payload("32", "echo started; sleep 300", setup=setup), "")
    job = node_home / ".gpuctl" / "jobs" / "32"
    try:
        wait_for("the daemon to start", lambda: pids_matching(marker), 10)
        assert (job / "setup.exit").read_text().strip() == "0"
        for name in ("setup.supervisor", "events.supervisor"):
            os.kill(int((job / name).read_text()), signal.SIGKILL)
        proc.kill()
        proc.communicate()
        assert pids_matching(marker)  # nothing of the job's is left to stop it
        killed = subprocess.run([sys.executable, str(AGENT_COMMAND), "kill", str(job), "setup", "--grace", "1"],
                                env={**os.environ, "HOME": str(node_home)}, capture_output=True, text=True,
                                timeout=30)
        assert killed.returncode == 0 and json.loads(killed.stdout)["stopped"] is True, killed.stderr
        wait_for("the escaped daemon to be stopped", lambda: not pids_matching(marker), 10)
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
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
        subprocess.run([sys.executable, str(AGENT_COMMAND), "cancel", "2-bbbb", "--wait", "20"],
                       env={**os.environ, "HOME": str(node_home)}, capture_output=True, timeout=60)
        proc.communicate(timeout=30)


def test_a_worker_refuses_a_job_dir_another_submission_made(node_home: Path):
    before = _foreign_dir(node_home, "3-cccc", "theirs")
    body = dict(payload("3-cccc", "touch ~/ran", nonce="mine"), subtree=[1], job_ranks=2,
                peers=[{"rank": 0, "name": "head", "host": "127.0.0.1", "ssh": []},
                       {"rank": 1, "name": "worker1", "host": "127.0.0.1", "ssh": []}])
    data = json.dumps(body) + "\n" + json.dumps("export T='x'\n") + "\nstart run\nend\n"
    proc = subprocess.run([sys.executable, str(AGENT_COMMAND), "relay"], input=data.encode(), capture_output=True,
                          timeout=60, env={**os.environ, "HOME": str(node_home)})
    events = [e for e in map(parse_event, LineSplitter().feed(proc.stdout)) if e is not None]
    hello = [e for e in events if e.kind == "H"]
    assert len(hello) == 1 and hello[0].rank == 1 and "another submission made it" in hello[0].text, proc.stdout
    jobdir = node_home / ".gpuctl" / "jobs" / "3-cccc"
    assert {p.name: p.read_bytes() for p in jobdir.iterdir()} == before
    assert not (node_home / "ran").exists()


def copy_targets(n: int, job_ranks: int, claims: dict[int, list[int]], setup: bool) -> list[list]:
    """The head's copy plan (P plan) for one destination on `n` nodes."""
    coord = object.__new__(agent.Coordinator)
    coord.payload = {"job": "1", "nonce": "n", "copy_branching": 4, "peers": [{"name": f"n{r}"} for r in range(n)],
                     "sync": [{"path": "~/gpuctl_workdir", "dir": True}],
                     "stages": {"setup": {"script": "true"} if setup else None, "run": {"script": "true"}}}
    coord.n, coord.job_ranks, coord.lost, coord.synced, coord.claims = n, job_ranks, {}, {}, claims
    plans: list[list] = []
    coord.write = lambda data: plans.append(json.loads(data.decode().split(" ", 2)[2])["copies"]) \
        if data.startswith(f"{agent.EV_PHASE} {agent.PHASE_PLAN} ".encode()) else None

    class Relay:
        def command(self, line: str) -> None:
            if line.startswith("sync "):
                for _, dst, idx in json.loads(line.split(" ", 1)[1]):
                    for _ in idx:
                        coord.on_event(f"{agent.EV_SYNCED} {dst} 0 ok\n".encode())

    coord.relay = Relay()
    coord.wait = lambda predicate, timeout=None: bool(predicate())
    assert coord.do_sync() is True
    return plans[0]


def test_a_job_on_fewer_nodes_gets_copies_on_its_nodes_only():
    own = {r: [r] for r in range(4)}
    assert copy_targets(4, 1, own, setup=False) == [["~/gpuctl_workdir", []]]  # the head alone: nothing to copy
    assert copy_targets(4, 2, own, setup=False) == [["~/gpuctl_workdir", [1]]]
    # setup runs on every node: every node gets the files
    assert copy_targets(4, 2, own, setup=True) == [["~/gpuctl_workdir", [1, 2, 3]]]
    # worker1 shares a filesystem whose copy worker3 owns: the copy goes to worker3, which worker1 sees
    shared = {0: [0], 1: [3], 2: [2], 3: [3]}
    assert copy_targets(4, 2, shared, setup=False) == [["~/gpuctl_workdir", [3]]]


def test_a_wave_waits_for_every_push_to_a_rank_not_just_the_first():
    """A rank that gets two destinations in one wave (workdir and a file_mount) is synced once both
    pushes reported: its run must not start while the second copy is still going."""
    coord = object.__new__(agent.Coordinator)
    coord.payload = {"job": "1", "nonce": "n", "copy_branching": 4, "peers": [{"name": "head"}, {"name": "worker1"}],
                     "sync": [{"path": "~/gpuctl_workdir", "dir": True}, {"path": "~/own/data", "dir": True}]}
    coord.n, coord.job_ranks, coord.lost, coord.synced = 2, 2, {}, {}
    coord.claims = {0: [0, 0], 1: [1, 1]}  # worker1 owns both destinations: two pushes from the head
    coord.write = lambda data: None
    reports: list[list[str]] = []  # the Y events each sync command brings back
    sent: list[str] = []

    class Relay:
        def command(self, line: str) -> None:
            sent.append(line.split()[0])
            for line_ in reports.pop(0) if line.startswith("sync ") else []:
                coord.on_event(line_.encode())

    coord.relay = Relay()
    coord.wait = lambda predicate, timeout=None: bool(predicate())  # as the condition stands right after
    reports.append([f"{agent.EV_SYNCED} 1 0 ok\n"])  # only the workdir's push has ended
    assert coord.do_sync() is False and coord.sync_failure == "sync cancelled"
    reports.append([f"{agent.EV_SYNCED} 1 0 ok\n", f"{agent.EV_SYNCED} 1 0 ok\n"])
    assert coord.do_sync() is True and sent[-1] == agent.RELAY_RELEASE
    reports.append([f"{agent.EV_SYNCED} 1 0 ok\n", f"{agent.EV_SYNCED} 1 23 rsync: no space left\n"])
    assert coord.do_sync() is False and coord.sync_failure == "sync failed: worker1: rsync: no space left"


# -- destinations made through sudo -----------------------------------------------------


def _fake_sudo(tmp_path: Path) -> dict[str, str]:
    """PATH with a `sudo` that runs its command marked as privileged, and a `mkdir` that refuses
    unprivileged callers (a login user other than root, below a root-owned /opt)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text('#!/bin/sh\n[ "$1" = -n ] && shift\nexec env FAKE_ROOT=1 "$@"\n')
    (bin_dir / "mkdir").write_text('#!/bin/sh\n[ -n "$FAKE_ROOT" ] || { echo "mkdir: Permission denied" >&2; exit 1; }\n'
                                   'exec /bin/mkdir "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_a_destination_made_through_sudo_leaves_what_is_above_it_passable(tmp_path: Path, monkeypatch) -> None:
    """`/opt/x/data: ./src` for a login user other than root: the directories made above the
    destination are root's and must stay passable by that user (sudo keeps the caller's umask, 077
    in the agent and in a hardened session), the destination itself is the user's."""
    from gpuctl.jobplane.upload import make_dir_command

    env = _fake_sudo(tmp_path)
    dest = tmp_path / "opt" / "x" / "data"
    # the controller's side: the shell its rsync runs on the head first
    proc = subprocess.run(["bash", "-c", "umask 077; " + make_dir_command(str(dest))], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [(p.stat().st_mode & 0o777) for p in (dest.parent.parent, dest.parent)] == [0o755, 0o755]
    assert dest.is_dir() and dest.stat().st_uid == os.getuid()
    # the agent's side, on a node that has no copy yet
    dest2 = tmp_path / "opt2" / "y" / "data"

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", args[0])

    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setattr(agent.os, "makedirs", refuse)
    monkeypatch.setattr(agent.os, "geteuid", lambda: 1000)
    old = os.umask(0o077)
    try:
        agent.ensure_dir(str(dest2))
    finally:
        os.umask(old)
        monkeypatch.undo()
    assert [(p.stat().st_mode & 0o777) for p in (dest2.parent.parent, dest2.parent, dest2)] == [0o755] * 3


def test_destinations_inside_another_are_pushed_after_it() -> None:
    """Two rsyncs into one tree at once race (exit 23): a file_mount in the workdir waits for the workdir."""
    from gpuctl.node.relay import sync_levels

    paths = ["~/gpuctl_workdir", "~/gpuctl_workdir/data", "~/mounted/a.txt", "~/gpuctl_workdir/conf/s.txt",
             "/opt/x/", "/opt/x/y", "~/gpuctl_workdir/data/z"]
    levels = [[d["path"] for d in level] for level in sync_levels([{"path": p} for p in paths])]
    assert levels == [["~/gpuctl_workdir", "~/mounted/a.txt", "/opt/x/"],
                      ["~/gpuctl_workdir/data", "~/gpuctl_workdir/conf/s.txt", "/opt/x/y"],
                      ["~/gpuctl_workdir/data/z"]]
    assert sync_levels([{"path": "~/a"}, {"path": "~/ab"}]) == [[{"path": "~/a"}, {"path": "~/ab"}]]


def test_every_level_of_destinations_is_answered_when_no_push_can_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rsync on the node: each destination is answered at once (exit 127), the nested ones too, so
    the head's wave never waits for a push that was never started."""
    sent: list[bytes] = []
    peers = [{"rank": r, "name": f"n{r}", "host": "h", "ssh": []} for r in (0, 1)]
    relay = agent.Relay({"job": "22", "peers": peers, "sync": [{"path": "~/gpuctl_workdir", "dir": True},
                                                              {"path": "~/gpuctl_workdir/data", "dir": True}]},
                        "", 0, sent.append)
    monkeypatch.setattr(agent.shutil, "which", lambda name: None)
    relay._sync([[0, 1, [0, 1]]])
    answers = [e for e in sent if e.startswith(b"Y ")]
    assert len(answers) == 2 and all(e.startswith(b"Y 1 127 rsync is not installed") for e in answers), sent
    assert relay.later_pushes == {1: []} and relay.pushes == []
