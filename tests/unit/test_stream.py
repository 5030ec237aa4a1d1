"""Log following: prefixes, the follow protocol's parsing, ssh argv, and the node
agent's side of the protocol (run locally, without ssh)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


from gpuctl.common.console import Reporter
from gpuctl.jobplane import client, stream
from gpuctl.jobplane.events import MAX_EVENT, Event, LineJoiner, decode, encode, parse_event
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Node
from nodeagent import COMMAND as AGENT_COMMAND


def node(rank: int, **kw: object) -> Node:
    base = dict(name="head" if rank == 0 else f"worker{rank}", rank=rank, node_id=f"i-{rank}",
                address=f"10.0.0.{rank + 1}", ssh_host=f"10.0.0.{rank + 1}")
    base.update(kw)
    return Node(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------- prefixes


def test_format_prefix() -> None:
    assert stream.format_prefix(node(0)) == "(head, rank=0)"
    assert stream.format_prefix(node(1)) == "(worker1, rank=1)"
    assert stream.format_prefix(node(12)) == "(worker12, rank=12)"


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("line, expected", [
    ("__GPUCTL_EXIT__ 0", (True, 0)),
    ("__GPUCTL_EXIT__ 143\n", (True, 143)),
    ("__GPUCTL_EXIT__ -1", (True, -1)),
    ("__GPUCTL_EXIT__ unknown", (True, None)),
    ("__GPUCTL_EXIT__", (False, None)),
    ("__GPUCTL_EXIT__ 1 2", (False, None)),
    ("__GPUCTL_EXIT__ x", (False, None)),
    ("echo __GPUCTL_EXIT__ 0", (False, None)),
    ("", (False, None)),
])
def test_parse_sentinel(line: str, expected: tuple[bool, int | None]) -> None:
    assert stream.parse_sentinel(line) == expected


def test_parse_offset() -> None:
    assert stream.parse_offset("__GPUCTL_OFFSET__ 0") == 0
    assert stream.parse_offset("__GPUCTL_OFFSET__ 1234\n") == 1234
    assert stream.parse_offset("__GPUCTL_OFFSET__ -1") is None
    assert stream.parse_offset("hello") is None


def test_splitter_lines_across_chunks_and_offsets() -> None:
    sp = stream.LineSplitter()
    assert sp.feed(b"__GPUCTL_OFF") == []
    assert sp.feed(b"SET__ 10\nhel") == []
    assert sp.header_seen and sp.offset == 10
    assert sp.feed(b"lo\nw\xc3\xa9rld\r\npart") == ["hello", "wérld"]
    assert sp.offset == 10 + len(b"hello\n") + len(b"w\xc3\xa9rld\r\n")
    assert sp.feed(b"ial\n") == ["partial"]
    assert sp.finish() == (False, None)  # EOF without sentinel: connection dropped


def test_splitter_sentinel_only_counts_as_last_line() -> None:
    sp = stream.LineSplitter()
    out = sp.feed(b"__GPUCTL_OFFSET__ 0\na\n__GPUCTL_EXIT__ 5\nb\n")
    assert out == ["a", "__GPUCTL_EXIT__ 5", "b"]  # the rank printed it: just a line
    assert sp.offset == len(b"a\n__GPUCTL_EXIT__ 5\nb\n")
    assert sp.feed(b"__GPUCTL_EXIT__ 7\n") == []
    assert sp.finish() == (True, 7)
    assert sp.offset == len(b"a\n__GPUCTL_EXIT__ 5\nb\n")  # the sentinel is not log content


def test_splitter_shows_text_before_header() -> None:
    sp = stream.LineSplitter()
    assert sp.feed(b"Welcome banner\n__GPUCTL_OFFSET__ 3\nx\n") == ["Welcome banner", "x"]
    assert sp.offset == 5


def test_splitter_long_line_passed_on_in_pieces() -> None:
    sp = stream.LineSplitter()
    sp.feed(b"__GPUCTL_OFFSET__ 0\n")
    out = sp.feed(b"x" * (stream.MAX_LINE + 10))
    assert out == ["x" * stream.MAX_LINE]
    assert sp.offset == stream.MAX_LINE
    assert sp.feed(b"\n") == ["x" * 10]


def test_follow_command_resumes_from_offset() -> None:
    assert stream._follow_command("42", "run", None, True).line == (
        "~/.gpuctl/bin/gpuctl-node follow --print-offset -- '~/.gpuctl/jobs/42' run")
    assert stream._follow_command("42", "run", None, False).args[:3] == ("follow", "--tail=0", "--print-offset")
    assert stream._follow_command("42", "run", 99, True).args[:3] == ("follow", "--offset=99", "--print-offset")
    with pytest.raises(ValueError):
        stream._follow_command("4 2; rm -rf /", "run", None, True)


# ---------------------------------------------------------------- ssh argv


def test_ssh_argv_uses_shared_control_socket(tmp_path: Path) -> None:
    n = node(1, ssh_port=2222, ssh_user="ubuntu", ssh_key="/k/id")
    argv = ssh.ssh_argv(n, ["echo", "a b"], control_dir=tmp_path)
    assert argv[0] == "ssh" and argv[-3:] == ["--", "10.0.0.2", "echo 'a b'"]  # no host can become an option
    joined = " ".join(argv)
    assert "StrictHostKeyChecking=no" not in joined
    for opt in ("-p 2222", "-l ubuntu", "-i /k/id", "StrictHostKeyChecking=accept-new",
                "BatchMode=yes", "ControlMaster=auto", f"ControlPath={tmp_path}/%C", "IdentitiesOnly=yes"):
        assert opt in joined
    assert "ProxyCommand" not in joined


def test_ssh_bastion_gets_the_same_options() -> None:
    n = node(1, ssh_key="/k/id", proxy_jump="ubuntu@3.3.3.3:2200")
    opts = ssh.ssh_options(n, None)
    proxy = next(o for o in opts if o.startswith("ProxyCommand="))
    assert "-W %h:%p -- ubuntu@3.3.3.3" in proxy and "-p 2200" in proxy
    assert "StrictHostKeyChecking=accept-new" in proxy and "-i /k/id" in proxy
    # ssh -G parses it (no connection is made)
    out = subprocess.run(["ssh", "-G", *opts, n.ssh_host], capture_output=True, text=True, check=True).stdout
    assert "proxycommand ssh " in out


def test_control_dir_is_short_enough(tmp_path: Path) -> None:
    short = ssh.control_dir_for(tmp_path / "cm")
    assert short == tmp_path / "cm" or len(str(tmp_path)) > 40
    long = ssh.control_dir_for(tmp_path / ("x" * 80) / "cm")
    assert len(f"{long}/{'0' * 40}.{'r' * 16}") < 108
    assert long == ssh.control_dir_for(tmp_path / ("x" * 80) / "cm")  # stable per cluster
    assert (long.stat().st_mode & 0o777) == 0o700
    long.rmdir()


# ------------------------------------------------ the node agent, locally


def agent(*args: str, timeout: float = 30, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(AGENT_COMMAND), *args], capture_output=True, text=True,
                          timeout=timeout, **kw)  # type: ignore[call-overload]


@pytest.fixture
def jobdir(tmp_path: Path) -> Path:
    d = tmp_path / "jobs" / "1"
    d.mkdir(parents=True)
    (d / "env.sh").write_text("export GREETING='hello world'\n")
    (d / "secrets.sh").write_text("export TOKEN='t0k'\n")
    return d


def test_agent_launch_follow_status(jobdir: Path, tmp_path: Path) -> None:
    (jobdir / "run.sh").write_text(
        'echo "$GREETING ${#TOKEN} $(pwd)"\n'
        'echo "pgid=$(ps -o pgid= $$ | tr -d " ") pid=$$"\n'
        'echo __GPUCTL_EXIT__ 0\n'
        'printf "no newline"\n'
        'exit 7\n')
    r = agent("launch", str(jobdir), "run", "--workdir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    pgid = int((jobdir / "run.pid").read_text())
    f = agent("follow", str(jobdir), "run", "--print-offset")
    sp = stream.LineSplitter()
    lines = sp.feed(f.stdout.encode())
    assert lines == ["hello world 3 " + str(tmp_path), f"pgid={pgid} pid={pgid}", "__GPUCTL_EXIT__ 0", "no newline"]
    assert sp.finish() == (True, 7)
    assert json.loads(agent("status", str(jobdir), "run").stdout) == {
        "pid": pgid, "running": False, "exit": 7, "killed": False}

    # Resume from an offset and tail: no line repeated.
    first_two = len("hello world 3 " + str(tmp_path) + "\n") + len(f"pgid={pgid} pid={pgid}\n")
    out = agent("follow", str(jobdir), "run", "--offset", str(first_two), "--print-offset").stdout
    assert out == f"__GPUCTL_OFFSET__ {first_two}\n__GPUCTL_EXIT__ 0\nno newline\n__GPUCTL_EXIT__ 7\n"
    assert agent("follow", str(jobdir), "run", "--tail", "1").stdout == "no newline\n__GPUCTL_EXIT__ 7\n"
    assert agent("follow", str(jobdir), "run", "--tail", "0").stdout == "__GPUCTL_EXIT__ 7\n"


def test_agent_wait_returns_exit_code_and_missing_workdir_runs_in_home(jobdir: Path, tmp_path: Path) -> None:
    (jobdir / "setup.sh").write_text('pwd; exit 3\n')
    home = tmp_path / "home"
    home.mkdir()
    r = agent("launch", str(jobdir), "setup", "--wait", "--workdir", str(tmp_path / "nope"),
              env={**os.environ, "HOME": str(home)})
    assert r.returncode == 3
    assert (jobdir / "setup.log").read_text() == f"{home}\n"
    assert (jobdir / "setup.exit").read_text() == "3"
    assert agent("launch", str(jobdir), "missing").returncode == 2


def test_agent_follow_is_live_and_waits_for_the_log(jobdir: Path) -> None:
    follower = subprocess.Popen([sys.executable, str(AGENT_COMMAND), "follow", str(jobdir), "run"],
                                stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # the log does not exist yet: follow waits for it
        (jobdir / "run.sh").write_text("echo first; sleep 6; echo second\n")
        t0 = time.monotonic()
        assert agent("launch", str(jobdir), "run").returncode == 0
        assert follower.stdout is not None
        assert follower.stdout.readline() == "first\n"
        assert time.monotonic() - t0 < 4.5  # well before the stage ends
        assert follower.stdout.readline() == "second\n"
        assert follower.stdout.readline() == "__GPUCTL_EXIT__ 0\n"
        assert follower.wait(timeout=5) == 0
    finally:
        follower.kill()
        follower.wait()


def test_agent_kill_ends_the_whole_process_group(jobdir: Path) -> None:
    (jobdir / "run.sh").write_text(
        "trap 'echo got TERM' TERM\n"
        "sleep 300 &\n"
        "echo $! > " + str(jobdir / "child.pid") + "\n"
        "wait\n"
        "sleep 300\n")
    assert agent("launch", str(jobdir), "run").returncode == 0
    deadline = time.monotonic() + 5
    while not (jobdir / "child.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((jobdir / "child.pid").read_text())
    running = json.loads(agent("status", str(jobdir), "run").stdout)
    assert running["running"] is True and running["exit"] is None
    r = agent("kill", str(jobdir), "run", "--grace", "1")
    status = json.loads(r.stdout)
    assert status["running"] is False and status["killed"] is True
    assert status["exit"] in (143, 137)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert agent("follow", str(jobdir), "run").stdout.endswith(f"__GPUCTL_EXIT__ {status['exit']}\n")
    # Killing an ended stage is a no-op.
    assert json.loads(agent("kill", str(jobdir), "run").stdout)["exit"] == status["exit"]


def test_agent_follow_reports_unknown_when_the_supervisor_dies(jobdir: Path) -> None:
    (jobdir / "run.sh").write_text("sleep 300\n")
    assert agent("launch", str(jobdir), "run").returncode == 0
    supervisor = int((jobdir / "run.supervisor").read_text())
    pgid = int((jobdir / "run.pid").read_text())
    try:
        os.kill(supervisor, signal.SIGKILL)
        out = agent("follow", str(jobdir), "run").stdout
        assert out == "__GPUCTL_EXIT__ unknown\n"
    finally:
        os.killpg(pgid, signal.SIGKILL)


def test_agent_refuses_a_second_launch_while_running(jobdir: Path) -> None:
    (jobdir / "run.sh").write_text("sleep 300\n")
    assert agent("launch", str(jobdir), "run").returncode == 0
    try:
        r = agent("launch", str(jobdir), "run")
        assert r.returncode == 3 and "already running" in r.stderr
    finally:
        agent("kill", str(jobdir), "run", "--grace", "0")


# -- the job plane's event stream -------------------------------------------------------


@pytest.mark.parametrize("step", [4096, 65536, 1 << 20, 3 << 20])
def test_an_event_is_never_cut_and_an_overlong_one_never_read_in_parts(step: int) -> None:
    """An event longer than any the agent writes (here: an old agent's 1 MiB + 64 KiB piece that
    ends in an event-looking remainder, in the audit's shape) is dropped whole, whatever the read
    size; the offset still counts its bytes, and the events around it come through intact."""
    over = b"O 0 run " + b"x" * (MAX_EVENT + 5) + b"D SUCCEEDED {}\n"
    ok = b"O 0 run " + b"y" * (MAX_EVENT - 100) + b"\n"
    data = b"__GPUCTL_OFFSET__ 7\nP run\n" + over + b"X 0 run 1\n" + ok + b"D FAILED {}\n"
    sp = client.event_splitter(None)
    lines = [line for i in range(0, len(data), step) for line in sp.feed(data[i:i + step])]
    assert [parse_event(line).kind for line in lines] == ["P", "X", "O", "D"]  # type: ignore[union-attr]
    assert lines[2] == ok[:-1].decode()
    assert sp.offset == 7 + len(data) - len(b"__GPUCTL_OFFSET__ 7\n")


def test_event_lines_keep_their_bytes() -> None:
    sp = client.event_splitter(None)
    lines = sp.feed(b"__GPUCTL_OFFSET__ 0\nO 0 run \xff\xfe\xc3 bin\r\nO 0 run a\rb\r\n")
    assert [encode(line) for line in lines] == [b"O 0 run \xff\xfe\xc3 bin\r", b"O 0 run a\rb\r"]


def ev_o(kind: str, rank: int, text: str, stage: str = "run") -> Event:
    return Event(kind, rank, stage=stage, text=text)


def test_joiner_puts_pieces_back_per_rank_and_stage() -> None:
    j = LineJoiner()
    assert j.feed(ev_o("o", 0, "ab")) == [] and j.feed(ev_o("o", 1, "xy")) == []
    assert j.feed(ev_o("o", 0, "c", stage="setup")) == []
    assert j.feed(ev_o("O", 0, "d")) == [ev_o("O", 0, "abd")]
    assert j.feed(ev_o("O", 1, "z")) == [ev_o("O", 1, "xyz")]
    assert j.feed(ev_o("O", 0, "e", stage="setup")) == [ev_o("O", 0, "ce", stage="setup")]
    assert j.feed(ev_o("O", 2, "whole")) == [ev_o("O", 2, "whole")]
    assert j.held == 0 and not j.pending


def test_joiner_hands_on_an_unfinished_line_at_the_stage_end_without_a_newline() -> None:
    j = LineJoiner()
    j.feed(ev_o("o", 0, "no newline"))
    j.feed(ev_o("o", 1, "lost mid-line"))
    x = Event("X", 0, stage="run", code=0)
    assert j.feed(x) == [Event("O", 0, stage="run", text="no newline", eol=False), x]
    lost = Event("L", 1, text="gone")
    assert j.feed(lost) == [Event("O", 1, stage="run", text="lost mid-line", eol=False), lost]
    j.feed(ev_o("o", 2, "cut"))
    done = Event("D", text="CANCELLED")
    assert j.feed(done) == [Event("O", 2, stage="run", text="cut", eol=False), done]


def test_joiner_hands_on_what_it_holds_when_the_stream_ends_without_an_end() -> None:
    j = LineJoiner()
    j.feed(ev_o("o", 0, "cut by a killed coordinator"))
    j.feed(ev_o("o", 1, "so was this", stage="setup"))
    assert j.flush_all() == [Event("O", 0, stage="run", text="cut by a killed coordinator", eol=False),
                             Event("O", 1, stage="setup", text="so was this", eol=False)]
    assert j.held == 0 and not j.pending and j.flush_all() == []


def test_joiner_memory_is_bounded_and_every_character_stays_in_order() -> None:
    j = LineJoiner(limit=10, total=15)
    out = [e for piece in ("abcd", "efgh", "ijkl", "mn") for e in j.feed(ev_o("o", 0, piece))]
    out += j.feed(ev_o("O", 0, "op"))
    assert [(e.text, e.eol) for e in out] == [("abcdefghijkl", False), ("mnop", True)]
    out = [e for r, piece in ((1, "12345678"), (2, "12345678")) for e in j.feed(ev_o("o", r, piece))]
    assert [(e.rank, e.text, e.eol) for e in out] == [(2, "12345678", False)]  # all open lines over 15
    assert j.held == 8


def test_a_rank_line_that_is_not_utf8_is_printed_as_its_bytes() -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    rep = Reporter(stream=out, plain=True)
    rep.rank_line("(head, rank=0)", 0, decode(b"\xff\xfe bin\r"))
    rep.rank_line("(head, rank=0)", 0, "plain ✓")
    assert raw.getvalue() == b"(head, rank=0) \xff\xfe bin\r\n(head, rank=0) plain \xe2\x9c\x93\n"
