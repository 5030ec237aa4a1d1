"""The controller's one door to the node agent: every `gpuctl-node` call is built, run and read here.

ClusterShell reaches its remote end through one Channel; gpuctl reaches `gpuctl-node` through this
module, and no other controller module writes an agent command line (tests/unit/test_architecture.py
holds them to it). What the door owns:

- the line: `command(WORD, *values, **options)`. WORD is one of node/protocol.py's sub-commands;
  an option is named by gpuctl's code and goes as one quoted word `--name=VALUE`; the values (a job,
  a task id, a destination: anything a user may have written) come after `--`, each shell-quoted,
  so none can become an option, a second command or a redirection. `stage_command` and
  `job_command` add the job-id check for the words that take a job;
- the transport: the cluster's ssh (provision/ssh.py's argv, on the ControlMaster the playbooks
  share): `call` / `call_all` run a command and hand back a `Reply`, never an exception; `read`
  gives a command's stdout as bytes (`read_events`: a job's events.log); `start` hands back the
  ssh process of a stream (submit, attach, follow, install-peers) for the caller's own loop: one
  ssh call, read as it comes;
- the answers: `Reply.answer()` / `ask` parse the agent's JSON answer (its last JSON line: a login
  banner before it is no answer) and `json_lines` a stream of them;
- the errors, typed from the exit code: `AgentMissing` (127 no such command, 126 not executable,
  2 an agent without the word: the node needs prepare), `Unreachable` (ssh's own 255, or no
  answer in time), `AgentFailed` (the command's own failure, or no answer); each carries one
  printable line, the stderr's last (`failure` types a stream's end the same way).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

from gpuctl.common.safetext import printable
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Node

MISSING_CODES = (2, 126, 127)  # no agent, not executable, an agent without the word (argparse's usage error)
SSH_FAILED = 255  # ssh's own failure: no connection, no authentication
TIMED_OUT = 124  # provision/ssh.run_ssh's code for a call that ran out of time


class AgentError(Exception):
    """A call to the agent that got no answer: `why` is one printable line, `code` the exit code."""

    def __init__(self, why: str, code: int | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.code = code


class AgentMissing(AgentError):
    """The node has no agent, or one without this command: it needs `prepare`."""


class Unreachable(AgentError):
    """ssh did not reach the node (or it did not answer in time): the agent was never asked."""


class AgentFailed(AgentError):
    """The agent ran and failed (its stderr's last line), or answered nothing this gpuctl reads."""


def failure(code: int | None, stderr: str | bytes = "") -> AgentError | None:
    """The typed error of a call that ended with `code` and `stderr`; None for a success (0)."""
    if code == 0:
        return None
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    lines = [line for line in text.strip().splitlines() if line.strip()]
    why = printable(lines[-1].strip()) if lines else f"exit code {code}"
    kind = (AgentMissing if code in MISSING_CODES else Unreachable if code in (SSH_FAILED, TIMED_OUT)
            else AgentFailed)
    return kind(why, code)


# -- the line ---------------------------------------------------------------------------------

Value = Union[str, int, float]


@dataclass(frozen=True)
class Command:
    """One agent command: its words after the agent (`args`) and the shell line that runs it."""

    args: tuple[str, ...]

    @property
    def line(self) -> str:
        """`~/.gpuctl/bin/gpuctl-node WORD ...`: the agent's path as the node's shell expands it, every word quoted."""
        return " ".join([protocol.AGENT, *(shlex.quote(a) for a in self.args)])

    @property
    def if_installed(self) -> str:
        """The line as a guard in a longer shell command: it runs where the agent is installed and
        passes where it is not, or cannot load (its launcher's 127): the job's submit meets such a
        node and prepares it again (the controller's own checks, spec/nodepaths.py, apply all the same)."""
        return f"{{ test ! -x {protocol.AGENT} || {self.line} || test $? -eq 127; }}"

    def __str__(self) -> str:
        return self.line


def _word(value: Value) -> str:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a value for the agent")
    return f"{value:g}" if isinstance(value, float) else str(value)


def command(word: str, *values: Value, **options: Value | bool | None) -> Command:
    """`gpuctl-node WORD [--option=VALUE ...] [-- VALUE ...]`: options named by the caller's code
    (`print_offset=True` is `--print-offset`; None and False leave one out), values after `--`."""
    if word not in protocol.AGENT_COMMANDS:
        raise ValueError(f"{word!r} is not a gpuctl-node command (node/protocol.py)")
    args = [word]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        args.append(flag if value is True else f"{flag}={_word(value)}")
    if values:
        args += ["--", *(_word(v) for v in values)]
    return Command(tuple(args))


def node_job(job: str) -> str:
    """A job's name on the nodes (JobRecord.node_job), checked as the agent checks it (protocol's
    JOB_ID_PATTERN: a letter or digit, then letters, digits, '.', '_', '-'); ValueError otherwise."""
    if not re.fullmatch(protocol.JOB_ID_PATTERN, job or ""):
        raise ValueError(f"job id {job!r} must be a letter or digit, then letters, digits, '.', '_' or '-'")
    return job


def job_dir(job: str) -> str:
    """A job's directory on a node, `~/.gpuctl/jobs/JOB` (the agent expands the `~`)."""
    return f"{protocol.NODE_JOBS_DIR}/{node_job(job)}"


def stage_command(word: str, job: str, stage: str, **options: Value | bool | None) -> Command:
    """One stage of a job on one node: `gpuctl-node WORD [options] -- JOBDIR STAGE` (follow, kill, status)."""
    return command(word, job_dir(job), stage, **options)


def job_command(word: str, job: str, **options: Value | bool | None) -> Command:
    """A coordinated job on the head: `gpuctl-node WORD [options] -- JOB` (attach, events, cancel, job-status)."""
    return command(word, node_job(job), **options)


def _line(commands: Command | Sequence[Command]) -> str:
    """One shell line for one command, or several run one after the other in the same ssh call."""
    if isinstance(commands, Command):
        return commands.line
    return "; ".join(c.line for c in commands)


# -- the answers ------------------------------------------------------------------------------


def json_lines(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    """The JSON objects among `lines`, in order (anything else, such as a login banner, is skipped)."""
    for line in lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            yield data


@dataclass(frozen=True)
class Reply:
    """What one call gave back from one node: exit code, stdout and stderr (text)."""

    node: Node
    code: int
    out: str
    err: str

    @property
    def error(self) -> AgentError | None:
        """The call's typed error, None when it succeeded."""
        return failure(self.code, self.err)

    def answers(self) -> list[dict[str, Any]]:
        """Every JSON object the agent printed, one a line (a kill of several stages prints one each)."""
        return list(json_lines(self.out.splitlines()))

    def answer(self) -> dict[str, Any]:
        """The agent's JSON answer (its last JSON line); the typed error when there is none."""
        error = self.error
        if error is not None:
            raise error
        answers = self.answers()
        if not answers:
            said = [line for line in self.out.strip().splitlines() if line.strip()]
            raise AgentFailed("no answer from the agent" + (f": {printable(said[-1].strip())}" if said else ""),
                              self.code)
        return answers[-1]


# -- the transport ----------------------------------------------------------------------------


def call(node: Node, commands: Command | Sequence[Command], *, control_dir: Path | None, timeout: float = 60,
         input: str | None = None) -> Reply:
    """Run the command(s) on `node` in one ssh call, `input` on its stdin; never raises."""
    proc = ssh.run_ssh(node, _line(commands), control_dir, timeout=timeout, input=input)
    return Reply(node, proc.returncode, proc.stdout or "", proc.stderr or "")


def ask(node: Node, commands: Command | Sequence[Command], *, control_dir: Path | None, timeout: float = 60,
        input: str | None = None) -> dict[str, Any]:
    """The agent's JSON answer to the command on `node`; raises AgentError when none came."""
    return call(node, commands, control_dir=control_dir, timeout=timeout, input=input).answer()


def call_all(nodes: Sequence[Node], commands: Command | Sequence[Command], *, control_dir: Path | None,
             timeout: float = 60) -> dict[int, Reply]:
    """Run the command(s) on every node at once (one ssh call each): rank -> Reply."""
    by_rank = {n.rank: n for n in nodes}
    results = ssh.run_on_all(nodes, _line(commands), control_dir=control_dir, timeout=timeout)
    return {rank: Reply(by_rank[rank], proc.returncode, proc.stdout or "", proc.stderr or "")
            for rank, proc in results.items()}


def read(node: Node, cmd: Command, *, control_dir: Path | None, timeout: float = 300) -> bytes:
    """The command's stdout as bytes (a job's events: anything but a newline may be in them);
    raises AgentError when it failed or ran out of time."""
    return _read(node, cmd.line, control_dir=control_dir, timeout=timeout)


def read_events(head: Node, job: str, *, control_dir: Path | None, timeout: float = 300) -> bytes:
    """A job's events.log on the head as it is now: the agent's `events JOB`. An agent older than that
    word (exit 2 until the next job prepares the head again) is read around, the file read in place, so
    `logs` and `down` still save a job's output from a head prepared by an older gpuctl."""
    try:
        return read(head, job_command(protocol.CMD_EVENTS, job), control_dir=control_dir, timeout=timeout)
    except AgentMissing as exc:
        if exc.code != 2:
            raise
    return _read(head, f"cat -- {job_dir(job)}/events.log", control_dir=control_dir, timeout=timeout)


def _read(node: Node, line: str, *, control_dir: Path | None, timeout: float) -> bytes:
    argv = ssh.ssh_argv(node, line, control_dir=control_dir)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unreachable(f"no answer within {timeout:g}s", TIMED_OUT) from None
    error = failure(proc.returncode, proc.stderr)
    if error is not None:
        raise error
    return proc.stdout


def start(node: Node, cmd: Command, *, control_dir: Path | None, input: bytes | str | None = None,
          text: bool = False, own_session: bool = False, kill_after: float | None = None) -> subprocess.Popen[Any]:
    """The ssh process of a streaming call, its stdout and stderr pipes for the caller to read.

    `input` is written to its stdin, which is then closed (none: stdin is /dev/null); `own_session`
    keeps a Ctrl-C sent to gpuctl's process group from reaching ssh; `kill_after` seconds end a
    call whose far end stopped answering (the clock starts before `input` is written)."""
    argv = ssh.ssh_argv(node, cmd.line, control_dir=control_dir)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
                            start_new_session=own_session)
    if kill_after is not None:
        threading.Thread(target=_kill_after, args=(proc, kill_after), name="agent-deadline", daemon=True).start()
    if input is not None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(input)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # ssh ended early: its exit code and stderr say why
    return proc


def _kill_after(proc: subprocess.Popen[Any], seconds: float) -> None:
    """Kill `proc` if it still runs after `seconds`; return as soon as it ended."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
