"""The controller's side of the job plane: one SSH session to the head per job.

`submit` starts `gpuctl-node submit` on the head over the cluster's
ControlMaster (agentcall.start: the door's one ssh process, read here as it
streams), writes the job and its secrets to its stdin, and hands every
event that comes back to `on_event` in the calling thread. A dropped
connection is resumed with `gpuctl-node attach JOB --offset N` from the byte
after the last whole event: nothing is lost or repeated. The ssh process runs
in its own session, so a Ctrl-C sent to gpuctl's process group reaches only
gpuctl, which then cancels the job through the head (`cancel`).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gpuctl.jobplane import agentcall
from gpuctl.jobplane.events import MAX_EVENT, Event, LineJoiner, Outcome, parse_event
from gpuctl.jobplane.stream import LineSplitter
from gpuctl.node import protocol
from gpuctl.provision.inventory import Node

# The outcome of a job whose coordinator ended without writing one (killed, or the head's agent with it).
COORDINATOR_GONE = "the job's coordinator on the head ended without an outcome"

# What a submit or attach that never got the head's first line raises (runner.py prepares the head
# and submits again): the head has no (or an older) agent, or ssh or the agent failed before it answered.
AgentMissing = agentcall.AgentMissing
HeadUnreachable = agentcall.Unreachable


@dataclass
class Session:
    """One job's event stream from the head."""

    head: Node
    job: str  # the job's name on the nodes (JobRecord.node_job)
    control_dir: Path
    on_event: Callable[[Event], None]
    offset: int | None = None
    outcome: Outcome | None = None
    header_seen: bool = False
    proc: subprocess.Popen[bytes] | None = None
    stderr: bytearray = field(default_factory=bytearray)
    lines: LineJoiner = field(default_factory=LineJoiner)  # across reconnections: a line may span them
    on_idle: Callable[[], None] | None = None  # after each read, and 4 times a second while none comes

    # -- connections ----------------------------------------------------------
    def _start(self, command: agentcall.Command, stdin_data: bytes | None) -> None:
        self.stderr = bytearray()
        self.proc = agentcall.start(self.head, command, control_dir=self.control_dir, input=stdin_data,
                                    own_session=True)

    def submit(self, payload: Mapping[str, Any], secrets_text: str,
               stop: Callable[[], bool] = lambda: False) -> Outcome | None:
        """Run the job; its outcome, or None when `stop()` said to leave it running."""
        data = (json.dumps(payload, separators=(",", ":")) + "\n" + json.dumps(secrets_text) + "\n").encode()
        self._start(agentcall.command(protocol.CMD_SUBMIT), data)
        return self._pump(stop, first=True)

    def attach(self, offset: int = 0, stop: Callable[[], bool] = lambda: False) -> Outcome | None:
        """Stream a submitted job's events from `offset` (0: all of them again)."""
        self.offset = offset
        self._start(agentcall.job_command(protocol.CMD_ATTACH, self.job, offset=offset), None)
        return self._pump(stop, first=True)

    def _pump(self, stop: Callable[[], bool], *, first: bool) -> Outcome | None:
        failures = 0
        while True:
            ended = self._read_connection(stop)
            if self.outcome is not None:
                return self.outcome
            if ended:
                for held in self.lines.flush_all():  # the coordinator died mid-line: its bytes so far
                    self.on_event(held)
                self.outcome = Outcome("FAILED", detail=COORDINATOR_GONE)
                return self.outcome
            if stop():
                return None
            assert self.proc is not None
            error = agentcall.failure(self.proc.returncode, bytes(self.stderr)) or \
                HeadUnreachable("the head ended the stream without its last line", self.proc.returncode)
            if not self.header_seen:
                # no first line: the head did not take the job (an agent that failed is one to prepare again)
                raise error if isinstance(error, (AgentMissing, HeadUnreachable)) else \
                    HeadUnreachable(error.why, error.code)
            failures += 1
            if failures > 3:
                raise HeadUnreachable(f"the connection to the head dropped {failures} times: {error.why}", error.code)
            time.sleep(min(2.0 ** (failures - 1), 8.0))
            self._start(agentcall.job_command(protocol.CMD_ATTACH, self.job, offset=self.offset or 0), None)

    def _read_connection(self, stop: Callable[[], bool]) -> bool:
        """Read one connection to its end; True when the stream ended with the agent's sentinel."""
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        splitter = event_splitter(self.offset)
        sel = selectors.DefaultSelector()
        for pipe, kind in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ, kind)
        try:
            open_pipes = 2
            while open_pipes:
                if stop():
                    self.close()
                    return False
                for key, _ in sel.select(timeout=0.25):
                    try:
                        data = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                        continue
                    if key.data == "err":
                        self.stderr += data
                        del self.stderr[:-4096]
                        continue
                    for line in splitter.feed(data):
                        if splitter.header_seen:
                            self.header_seen = True
                        event = parse_event(line)
                        if event is not None:
                            self.offset = splitter.offset
                            self._handle(event)
                            if stop():
                                self.close()
                                return False
                    if splitter.header_seen:
                        self.header_seen = True
                        self.offset = splitter.offset
                if self.on_idle is not None:  # a progress bar's held update shows even if the rank goes quiet
                    self.on_idle()
        finally:
            sel.close()
        self.proc.wait()
        ended, _ = splitter.finish()
        if splitter.header_seen:
            self.offset = splitter.offset
        return ended

    def _handle(self, event: Event) -> None:
        for whole in self.lines.feed(event):
            if whole.kind == protocol.EV_DONE:
                self.outcome = Outcome.from_data(whole.text, whole.data)
            self.on_event(whole)

    def close(self) -> None:
        """Leave the job running on the cluster; end this controller's connection."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_until_started(self, timeout: float = 15.0) -> None:
        """After a Ctrl-C: let a submit that is under way reach the point where the job exists on
        the head (its first line), so a cancel cannot arrive before the job it cancels."""
        if self.header_seen or self.proc is None:
            return
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        splitter = event_splitter(None)
        while time.monotonic() < deadline and self.proc.poll() is None and not splitter.header_seen:
            try:
                data = os.read(self.proc.stdout.fileno(), 65536)
            except BlockingIOError:
                time.sleep(0.05)
                continue
            if not data:
                break
            for line in splitter.feed(data):
                event = parse_event(line)
                if event is not None:
                    self._handle(event)
        self.header_seen = self.header_seen or splitter.header_seen


def event_splitter(offset: int | None) -> LineSplitter:
    """A splitter for `submit`/`attach` output: events whole or not at all, bytes kept as sent."""
    return LineSplitter(offset=offset, max_line=MAX_EVENT, frames=True)


def cancel_on_head(head: Node, job: str, control_dir: Path, wait: float = 30.0) -> dict[str, Any] | None:
    """Ask the head's coordinator to end the job everywhere; its outcome, or None if unreachable."""
    try:
        return agentcall.ask(head, agentcall.job_command(protocol.CMD_CANCEL, job, wait=float(wait)),
                             control_dir=control_dir, timeout=wait + 30)
    except agentcall.AgentError:
        return None


def job_status_on_head(head: Node, job: str, control_dir: Path) -> dict[str, Any] | None:
    """The head's record of a job (job.json), {"status": "RUNNING"|"LOST"|"UNKNOWN"}, or None if unreachable."""
    try:
        return agentcall.ask(head, agentcall.job_command(protocol.CMD_JOB_STATUS, job), control_dir=control_dir,
                             timeout=30)
    except agentcall.AgentError:
        return None


def kill_stage(nodes: Sequence[Node], *, job_id: str, stage: str | Sequence[str], control_dir: Path | None,
               grace: float = 10.0, timeout: float = 60) -> dict[int, agentcall.Reply]:
    """SIGTERM, then SIGKILL after `grace` s, the stage's process group on every node at once.

    Several stages are ended in one ssh round per node. Each reply's answers() are the agent's
    statuses ({pid, running, exit, killed, stopped}), one per stage.
    """
    stages = [stage] if isinstance(stage, str) else list(stage)
    commands = [agentcall.stage_command(protocol.CMD_KILL, job_id, s, grace=float(grace)) for s in stages]
    return agentcall.call_all(nodes, commands, control_dir=control_dir, timeout=timeout + grace * len(stages))
