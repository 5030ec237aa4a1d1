"""Live, rank-prefixed output of a stage from every node at once.

Ansible returns a task's output only when the task ends, so each node's stage
writes `~/.gpuctl/jobs/<job>/<stage>.log` and the controller follows those
files: one `ssh node gpuctl-node follow ... --print-offset` per node (each
agentcall.start's ssh process), all read by one selector loop in the caller's
thread (no per-node walking, and `on_line` is never called concurrently). The
ssh connections ride on the ControlMaster sockets of the playbooks (same
`control_dir`).

Protocol (gpuctl-node follow): a first line `__GPUCTL_OFFSET__ <byte offset>`
when the log is open, then the log bytes verbatim, then, once the stage has
ended and the log is drained, `__GPUCTL_EXIT__ <code>` (or `unknown`) and EOF.
The sentinel counts only as the last line before EOF, so a rank printing the
same text does not end its stream. A dropped connection is resumed from the
byte offset after the last whole line received: no line is lost or repeated.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from gpuctl.jobplane import agentcall
from gpuctl.node import protocol
from gpuctl.node.protocol import OFFSET_HEADER, SENTINEL
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Node

MAX_LINE = 1 << 20  # a longer run without newline is passed on in pieces


def format_prefix(node: Node) -> str:
    """`(head, rank=0)`, `(worker1, rank=1)`, ... as SkyPilot users know them."""
    return f"({node.name}, rank={node.rank})"


def parse_sentinel(line: str) -> tuple[bool, int | None]:
    """(is it the exit sentinel, exit code or None when the agent could not tell)."""
    parts = line.strip().split()
    if len(parts) != 2 or parts[0] != SENTINEL:
        return False, None
    if parts[1].lstrip("-").isdigit():
        return True, int(parts[1])
    return (True, None) if parts[1] == "unknown" else (False, None)


def parse_offset(line: str) -> int | None:
    parts = line.strip().split()
    if len(parts) == 2 and parts[0] == OFFSET_HEADER and parts[1].isdigit():
        return int(parts[1])
    return None


@dataclass
class LineSplitter:
    """Turns one connection's bytes into log lines, tracking the resume offset.

    `offset` is the log byte offset just after the last line handed out; the
    sentinel is held back until EOF proves it was the agent's last line.

    A stage's log (`frames=False`) may hold lines of any length: a run longer
    than `max_line` without a newline is passed on in pieces. The job plane's
    events (`frames=True`) are never cut: a piece of an event would be read as
    an event of its own, so a line longer than `max_line` (no agent of ours
    writes one) is dropped whole, and lines are decoded so that they encode
    back to the same bytes.
    """

    offset: int | None = None
    header_seen: bool = False
    held: bytes | None = None  # a sentinel-looking line, pending
    buf: bytearray = field(default_factory=bytearray)
    max_line: int = MAX_LINE
    frames: bool = False
    skipping: bool = False  # frames: inside an over-long line, dropped up to its newline

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        lines: list[str] = []
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                if len(self.buf) >= self.max_line and self.header_seen:
                    if self.frames:
                        lines.extend(self._skip(len(self.buf)))
                        self.buf.clear()
                        self.skipping = True
                        return lines
                    piece = bytes(self.buf[:self.max_line])
                    del self.buf[:self.max_line]
                    lines.extend(self._line(piece, len(piece)))
                    continue
                return lines
            raw = bytes(self.buf[:nl])
            del self.buf[: nl + 1]
            if self.skipping or (self.frames and nl >= self.max_line and self.header_seen):
                self.skipping = False
                lines.extend(self._skip(nl + 1))
                continue
            lines.extend(self._line(raw, nl + 1))

    def _decode(self, raw: bytes) -> str:
        if self.frames:
            return raw.decode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "replace").rstrip("\r")

    def _release_held(self) -> list[str]:
        if self.held is None:
            return []
        line = self._decode(self.held)
        self.offset = (self.offset or 0) + len(self.held) + 1
        self.held = None
        return [line]

    def _skip(self, size: int) -> list[str]:
        out = self._release_held()
        self.offset = (self.offset or 0) + size
        return out

    def _line(self, raw: bytes, size: int) -> list[str]:
        if not self.header_seen:
            off = parse_offset(raw.decode("ascii", "replace"))
            if off is not None:
                self.header_seen = True
                self.offset = off
                return []
            # Not our agent talking (a login banner?): show it, it may explain a failure.
            return [raw.decode("utf-8", "replace")]
        out = self._release_held()
        if parse_sentinel(raw.decode("utf-8", "replace"))[0]:
            self.held = raw
            return out
        out.append(self._decode(raw))
        self.offset = (self.offset or 0) + size
        return out

    def finish(self) -> tuple[bool, int | None]:
        """At EOF: (the stage ended, its exit code)."""
        if self.held is not None and not self.buf and not self.skipping:
            return parse_sentinel(self.held.decode("utf-8", "replace"))
        return False, None


@dataclass
class _Follower:
    node: Node
    offset: int | None
    proc: subprocess.Popen[bytes] | None = None
    splitter: LineSplitter = field(default_factory=LineSplitter)
    started: bool = False  # the stage's log exists (header seen at least once)
    failures: int = 0  # consecutive connections that ended without progress
    retry_at: float | None = None
    done: bool = False
    code: int | None = None
    err: bytearray = field(default_factory=bytearray)


def _follow_command(job_id: str, stage: str, offset: int | None, from_start: bool) -> agentcall.Command:
    return agentcall.stage_command(protocol.CMD_FOLLOW, job_id, stage, offset=offset,
                                   tail=0 if offset is None and not from_start else None, print_offset=True)


def follow(
    nodes: Sequence[Node],
    *,
    job_id: str,
    stage: str,
    on_line: Callable[[Node, str], None],
    control_dir: Path,
    stop: threading.Event | None = None,
    from_start: bool = True,
    on_exit: Callable[[Node, int | None], None] | None = None,
    retries: int = 3,
    start_grace: float = 5.0,
    abort: threading.Event | None = None,
) -> dict[int, int | None]:
    """Follow `stage` of `job_id` on `nodes`; return rank -> exit code once every node's stage ended.

    `on_line(node, line)` gets each line (without newline) as it arrives, from
    the calling thread. None is a node whose exit is unknown: unreachable or
    dropped after `retries` reconnection attempts without progress, or lost.

    `stop`: set when whoever starts the stage is done (e.g. its playbook
    returned). Nodes whose stage has started are still followed to their end;
    nodes whose stage has not started within `start_grace` s get None.
    `abort`: set to stop following at once (remaining nodes get None).
    `on_exit(node, code)` is called as each node's stage ends, e.g. to kill
    the other ranks when one fails.
    """
    control = ssh.control_dir_for(control_dir)
    followers = {n.rank: _Follower(node=n, offset=None) for n in nodes}
    sel = selectors.DefaultSelector()
    stop_seen_at: float | None = None

    def start(f: _Follower) -> None:
        f.splitter = LineSplitter(offset=f.offset)
        f.err = bytearray()
        f.proc = agentcall.start(f.node, _follow_command(job_id, stage, f.offset, from_start), control_dir=control)
        for pipe, kind in ((f.proc.stdout, "out"), (f.proc.stderr, "err")):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ, (f, kind))
        f.retry_at = None

    def close(f: _Follower, *, kill: bool) -> None:
        if f.proc is None:
            return
        for pipe in (f.proc.stdout, f.proc.stderr):
            if pipe is not None:
                try:
                    sel.unregister(pipe)
                except (KeyError, ValueError):
                    pass
        if kill and f.proc.poll() is None:
            f.proc.terminate()
        try:
            f.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            f.proc.kill()
            f.proc.wait()
        for pipe in (f.proc.stdout, f.proc.stderr):
            if pipe is not None:
                pipe.close()
        f.proc = None

    def finish(f: _Follower, code: int | None) -> None:
        f.done, f.code = True, code
        if on_exit is not None:
            on_exit(f.node, code)

    def ended(f: _Follower) -> None:
        """The connection's stdout hit EOF: the stage ended, or the connection dropped."""
        rest = f.splitter.buf  # a final partial line only comes before a sentinel, never alone
        done, code = f.splitter.finish()
        close(f, kill=True)
        if done and not rest:
            finish(f, code)
            return
        progressed = f.splitter.header_seen and f.splitter.offset != f.offset
        if f.splitter.header_seen:
            f.started = True
            f.offset = f.splitter.offset
        f.failures = 0 if progressed else f.failures + 1
        if f.failures > retries:
            finish(f, None)
            return
        f.retry_at = time.monotonic() + min(2.0 ** max(f.failures - 1, 0), 8.0)

    try:
        for f in followers.values():
            start(f)
        while not all(f.done for f in followers.values()):
            if abort is not None and abort.is_set():
                break
            now = time.monotonic()
            if stop is not None and stop.is_set() and stop_seen_at is None:
                stop_seen_at = now
            if stop_seen_at is not None and now - stop_seen_at > start_grace:
                for f in followers.values():
                    if not f.done and not f.started and not f.splitter.header_seen:
                        close(f, kill=True)
                        finish(f, None)
            for f in followers.values():
                if not f.done and f.proc is None and f.retry_at is not None and now >= f.retry_at:
                    start(f)
            if not sel.get_map():
                time.sleep(0.1)
                continue
            for key, _ in sel.select(timeout=0.2):
                f, kind = key.data
                if f.proc is None:
                    continue
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if kind == "err":
                    if data:
                        f.err += data[-4096:]
                        del f.err[:-4096]
                    else:
                        sel.unregister(key.fileobj)
                    continue
                if not data:
                    ended(f)
                    continue
                for line in f.splitter.feed(data):
                    on_line(f.node, line)
                if f.splitter.header_seen:
                    f.started = True
    finally:
        for f in followers.values():
            close(f, kill=True)
        sel.close()
    return {rank: (f.code if f.done else None) for rank, f in sorted(followers.items())}
