"""The controller's door to the node agent (jobplane/agentcall.py): the lines it writes (what a shell
and the agent make of them), its typed errors from ssh's results, and its calls, answered by fakes
of provision/ssh.py or by the agent built from cli/gpuctl/node/ run locally."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuctl.jobplane import agentcall, autostop, client, joblogs
from gpuctl.managed import fencing
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory, Node
from nodeagent import COMMAND as AGENT_COMMAND

HOSTILE = ["plain", "a b", "it's", "$(id)", "`id`", "; rm -rf ~ #", "x\ny", "--help", "-h", "~/d", "*", ""]


def node(rank: int = 0) -> Node:
    return Node(name="head" if rank == 0 else f"worker{rank}", rank=rank, node_id=f"i-{rank}",
                address=f"10.0.0.{rank + 2}", ssh_host=f"10.0.0.{rank + 2}")


def words_of(line: str) -> list[str]:
    """What a node's shell hands the agent for `line` (the agent's path replaced by a printer)."""
    assert line.startswith(protocol.AGENT + " ")
    out = subprocess.run(["bash", "-c", "printf '%s\\0'" + line[len(protocol.AGENT):]], capture_output=True,
                         timeout=10, check=True).stdout
    return out.decode().split("\0")[:-1]


def faked(monkeypatch: pytest.MonkeyPatch, code: int, out: str = "", err: str = "") -> list[str]:
    """ssh answers every call with (code, out, err); the lines it was given."""
    lines: list[str] = []

    def run_ssh(n: Node, command: str, control_dir: Path | None, timeout: float | None = 60,
                *, input: str | None = None) -> subprocess.CompletedProcess[str]:
        lines.append(command)
        return subprocess.CompletedProcess(["ssh"], code, out, err)

    monkeypatch.setattr(ssh, "run_ssh", run_ssh)
    return lines


def local_agent(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """ssh to any node runs the door's line in a local shell, the agent built here standing in for
    ~/.gpuctl/bin/gpuctl-node and `home` for the node's HOME."""
    local = f"HOME={shlex.quote(str(home))} {shlex.quote(sys.executable)} {shlex.quote(str(AGENT_COMMAND))}"

    def argv(n: Node, command: str, *, control_dir: Path | None = None, **kw: object) -> list[str]:
        return ["bash", "-c", command.replace(protocol.AGENT, local)]

    monkeypatch.setattr(ssh, "ssh_argv", argv)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / ".gpuctl" / "jobs").mkdir(parents=True)
    return home


# -- the line ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", HOSTILE)
def test_every_value_reaches_the_agent_as_one_word_after_the_options(value: str) -> None:
    cmd = agentcall.command(protocol.CMD_CHECK_DEST, value, "second")
    assert words_of(cmd.line) == ["check-dest", "--", value, "second"] == list(cmd.args)


def test_options_are_named_by_the_code_and_go_as_one_word_each() -> None:
    cmd = agentcall.stage_command(protocol.CMD_FOLLOW, "12-ab", "run", offset=0, tail=None, print_offset=True,
                                  from_start=False)
    assert cmd.args == ("follow", "--offset=0", "--print-offset", "--", "~/.gpuctl/jobs/12-ab", "run")
    assert cmd.line == "~/.gpuctl/bin/gpuctl-node follow --offset=0 --print-offset -- '~/.gpuctl/jobs/12-ab' run"
    assert agentcall.command(protocol.CMD_KILL, grace=2.5).args == ("kill", "--grace=2.5")
    assert agentcall.command(protocol.CMD_SUBMIT).line == "~/.gpuctl/bin/gpuctl-node submit"


def test_a_line_is_made_only_of_the_protocols_words_and_checked_values() -> None:
    with pytest.raises(ValueError, match="not a gpuctl-node command"):
        agentcall.command("rm")
    with pytest.raises(ValueError):
        agentcall.command(protocol.CMD_FENCE, "t", True)  # a bool is no value
    for bad in ("", "-x", ".hidden", "a b", "a;b", "../up", "x" * 65):
        with pytest.raises(ValueError):
            agentcall.job_command(protocol.CMD_ATTACH, bad)
    assert agentcall.job_command(protocol.CMD_ATTACH, "12-ab3f", offset=5).args == (
        "attach", "--offset=5", "--", "12-ab3f")


def test_the_guard_runs_where_the_agent_is_and_passes_where_it_is_not(tmp_path: Path) -> None:
    guard = agentcall.command(protocol.CMD_CHECK_DEST, "~/x; touch pwned").if_installed
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    assert subprocess.run(["bash", "-c", guard], env=env, timeout=10).returncode == 0  # no agent: no check
    agent = tmp_path / ".gpuctl" / "bin" / "gpuctl-node"
    agent.parent.mkdir(parents=True)
    agent.write_text("#!/bin/sh\nprintf '%s|' \"$@\" > \"$HOME/said\"; exit 2\n")
    agent.chmod(0o755)
    assert subprocess.run(["bash", "-c", guard], env=env, timeout=10).returncode != 0  # refused: no copy
    assert (tmp_path / "said").read_text() == "check-dest|--|~/x; touch pwned|" and not (tmp_path / "pwned").exists()
    agent.write_text("#!/bin/sh\nexit 127\n")  # the launcher of an agent that cannot load: as if none
    assert subprocess.run(["bash", "-c", guard], env=env, timeout=10).returncode == 0


def test_every_word_of_the_protocol_is_a_command_of_the_agent() -> None:
    usage = subprocess.run([sys.executable, str(AGENT_COMMAND), "--help"], capture_output=True, text=True,
                           timeout=30).stdout
    choices = set(usage[usage.index("{") + 1:usage.index("}")].split(","))
    assert choices == set(protocol.AGENT_COMMANDS)


def test_a_value_that_looks_like_an_option_is_a_value_to_the_agent(monkeypatch: pytest.MonkeyPatch,
                                                                   home: Path) -> None:
    """`--` before the values: the agent reads `-h` as a job's name, not as a request for its help."""
    local_agent(monkeypatch, home)
    reply = agentcall.call(node(), agentcall.command(protocol.CMD_JOB_STATUS, "-h"), control_dir=None)
    assert reply.code == 1 and "invalid job id '-h'" in reply.err and "usage" not in reply.out
    with pytest.raises(agentcall.AgentFailed, match="invalid job id"):
        reply.answer()
    assert agentcall.ask(node(), agentcall.job_command(protocol.CMD_JOB_STATUS, "7-x"), control_dir=None) == {
        "status": "UNKNOWN"}


# -- typed errors from ssh's results -------------------------------------------------------------


@pytest.mark.parametrize("code, kind", [(127, agentcall.AgentMissing), (126, agentcall.AgentMissing),
                                        (2, agentcall.AgentMissing), (255, agentcall.Unreachable),
                                        (124, agentcall.Unreachable), (1, agentcall.AgentFailed),
                                        (137, agentcall.AgentFailed)])
def test_an_exit_code_is_a_typed_error_with_the_stderrs_last_line(monkeypatch: pytest.MonkeyPatch, code: int,
                                                                  kind: type) -> None:
    faked(monkeypatch, code, out='{"ok": true}\n', err="a warning\nthe reason \x1b]0;title\x07\n\n")
    reply = agentcall.call(node(), agentcall.command(protocol.CMD_STATUS), control_dir=None)
    assert type(reply.error) is kind and reply.error.code == code
    with pytest.raises(kind) as err:
        reply.answer()
    assert err.value.why == "the reason \\x1b]0;title\\x07" and "\n" not in str(err.value)
    faked(monkeypatch, code)
    assert agentcall.call(node(), agentcall.command(protocol.CMD_STATUS), control_dir=None).error.why == \
        f"exit code {code}"


def test_the_answer_is_the_last_json_line_and_none_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = faked(monkeypatch, 0, out='Welcome to the node\n{"a": 1}\n{"a": 2}\n')
    cmd = agentcall.command(protocol.CMD_STATUS, "x")
    assert agentcall.ask(node(), cmd, control_dir=None) == {"a": 2}
    assert lines == [cmd.line]
    assert agentcall.call(node(), cmd, control_dir=None).answers() == [{"a": 1}, {"a": 2}]
    faked(monkeypatch, 0, out="Welcome to the node\n[1, 2]\n")
    with pytest.raises(agentcall.AgentFailed, match="no answer from the agent: \\[1, 2\\]"):
        agentcall.ask(node(), cmd, control_dir=None)
    assert agentcall.failure(0, "noise") is None


def test_several_commands_are_one_call_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def run_on_all(nodes, command, *, control_dir, timeout=60):  # noqa: ANN001, ANN202 - a fake ssh.run_on_all
        seen.append((command, timeout))
        return {n.rank: subprocess.CompletedProcess([], 255 if n.rank else 0, '{"stopped": true}\n', "no route")
                for n in nodes}

    monkeypatch.setattr(ssh, "run_on_all", run_on_all)
    replies = client.kill_stage([node(0), node(1)], job_id="3-t", stage=protocol.STAGES, control_dir=None, grace=2)
    assert seen == [("~/.gpuctl/bin/gpuctl-node kill --grace=2 -- '~/.gpuctl/jobs/3-t' setup; "
                     "~/.gpuctl/bin/gpuctl-node kill --grace=2 -- '~/.gpuctl/jobs/3-t' run", 64)]
    assert replies[0].answers() == [{"stopped": True}] and replies[0].node.rank == 0
    assert isinstance(replies[1].error, agentcall.Unreachable) and replies[1].error.why == "no route"


def test_the_modules_behind_the_door_keep_their_words(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What each caller makes of the door's errors: None from the head's job calls, one line from
    autostop, a fence not confirmed."""
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    inv = Inventory(cluster="c1", cloud="aws", nodes=(node(0), node(1)))
    faked(monkeypatch, 255, err="ssh: connect to host 10.0.0.2 port 22: No route to host")
    assert client.job_status_on_head(node(), "1-a", tmp_path) is None
    assert client.cancel_on_head(node(), "1-a", tmp_path) is None
    with pytest.raises(autostop.AutostopUnreachable, match="did not answer `autostop show`: ssh: connect"):
        autostop.show(inv)
    faked(monkeypatch, 127, err="bash: gpuctl-node: command not found")
    with pytest.raises(autostop.AutostopUnreachable, match="its agent has no autostop"):
        autostop.show(inv)
    answers = {0: (0, '{"fenced": true, "epoch": 3, "stopped": ["j"], "doomed": {"time": "T"}}\n', ""),
               1: (2, "", "gpuctl-node: error: argument cmd: invalid choice: 'fence'")}

    def run_on_all(nodes, command, *, control_dir, timeout=60):  # noqa: ANN001, ANN202 - a fake ssh.run_on_all
        assert command == "~/.gpuctl/bin/gpuctl-node fence -- t 3"
        return {n.rank: subprocess.CompletedProcess([], *answers[n.rank]) for n in nodes}

    monkeypatch.setattr(ssh, "run_on_all", run_on_all)
    got = fencing.query(inv, "t", 3)
    assert got[0] == fencing.Answer(ok=True, doomed="terminate at T", stopped=("j",))
    assert not got[1].ok and "cannot fence" in got[1].detail


# -- bytes and streams ---------------------------------------------------------------------------


def test_a_jobs_events_are_read_as_bytes_through_the_agent(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """`events JOB`: the head's events.log as it is, in one call; the line still being written is dropped."""
    log = home / ".gpuctl" / "jobs" / "5-k" / "events.log"
    log.parent.mkdir()
    log.write_bytes(b"O 0 run caf\xe9 \xff\nX 0 run 0\nD SUCCEEDED {}\nO 0 run half")
    local_agent(monkeypatch, home)
    data = agentcall.read(node(), agentcall.job_command(protocol.CMD_EVENTS, "5-k"), control_dir=None)
    assert data == log.read_bytes()
    inv = Inventory(cluster="c", cloud="local", nodes=(node(),))
    read = joblogs.read_head(inv, "5-k", control_dir=None)
    assert read is not None and read.offset == len(b"O 0 run caf\xe9 \xff\nX 0 run 0\nD SUCCEEDED {}\n")
    assert read.outcome is not None and read.outcome.status == "SUCCEEDED"
    with pytest.raises(agentcall.AgentFailed, match="job 6-k has no events.log here"):
        agentcall.read(node(), agentcall.job_command(protocol.CMD_EVENTS, "6-k"), control_dir=None)
    assert joblogs.read_head(inv, "6-k", control_dir=None) is None


def test_events_from_a_head_whose_agent_predates_the_word_are_read_in_place(monkeypatch: pytest.MonkeyPatch,
                                                                             home: Path) -> None:
    """A head prepared by an older gpuctl answers `events` with argparse's exit 2 until the next job
    prepares it: its events.log is read in place, so `logs` and `down` still save the job's output."""
    log = home / ".gpuctl" / "jobs" / "8-k" / "events.log"
    log.parent.mkdir()
    log.write_bytes(b"D SUCCEEDED {}\n")
    old = home / "old-agent"
    old.write_text("#!/bin/sh\necho \"gpuctl-node: error: argument cmd: invalid choice: '$1'\" >&2; exit 2\n")
    old.chmod(0o755)
    lines = []

    def argv(n: Node, command: str, *, control_dir: Path | None = None, **kw: object) -> list[str]:
        lines.append(command)
        return ["bash", "-c", f"HOME={shlex.quote(str(home))}; " + command.replace(protocol.AGENT, str(old))]

    monkeypatch.setattr(ssh, "ssh_argv", argv)
    assert agentcall.read_events(node(), "8-k", control_dir=None) == b"D SUCCEEDED {}\n"
    assert lines == ["~/.gpuctl/bin/gpuctl-node events -- 8-k", "cat -- ~/.gpuctl/jobs/8-k/events.log"]
    old.write_text("#!/bin/sh\nexit 127\n")  # no agent at all: nothing is read around it
    with pytest.raises(agentcall.AgentMissing):
        agentcall.read_events(node(), "8-k", control_dir=None)
    with pytest.raises(ValueError):
        agentcall.read_events(node(), "8-k; rm -rf ~", control_dir=None)


def test_a_read_that_runs_out_of_time_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh, "ssh_argv", lambda *a, **kw: ["sleep", "5"])
    with pytest.raises(agentcall.Unreachable, match="no answer within 0.2s"):
        agentcall.read(node(), agentcall.job_command(protocol.CMD_EVENTS, "1-a"), control_dir=None, timeout=0.2)


def test_a_stream_is_one_ssh_process_fed_its_input(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def argv(n: Node, command: str, *, control_dir: Path | None = None, **kw: object) -> list[str]:
        seen.append(command)
        return ["sh", "-c", "cat; echo 'Connection closed' >&2; exit 255"]

    monkeypatch.setattr(ssh, "ssh_argv", argv)
    proc = agentcall.start(node(), agentcall.command(protocol.CMD_SUBMIT), control_dir=None, input=b"job\n",
                           own_session=True)
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin.closed
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=10)
    assert seen == ["~/.gpuctl/bin/gpuctl-node submit"] and out == b"job\n"
    error = agentcall.failure(proc.returncode, err)
    assert isinstance(error, agentcall.Unreachable) and error.why == "Connection closed"
    lines = ['banner', json.dumps({"node": "worker1"}), "[]", json.dumps({"node": "worker2"})]
    assert [d["node"] for d in agentcall.json_lines(lines)] == ["worker1", "worker2"]


def test_a_stream_whose_far_end_stops_answering_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh, "ssh_argv", lambda *a, **kw: ["sleep", "30"])
    began = time.monotonic()
    proc = agentcall.start(node(), agentcall.command(protocol.CMD_INSTALL_PEERS), control_dir=None, input="{}",
                           text=True, kill_after=0.3)
    assert proc.wait(timeout=10) != 0 and time.monotonic() - began < 10
