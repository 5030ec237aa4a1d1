"""A stage's log as it grows: as the bytes themselves (follow, attach) or as O/o/u events (a job's ranks).

`follow_stage` prints a log from an offset until the stage ended, then the
SENTINEL line (the controller's stream.py reads it; `attach` follows the
coordinator's events.log this way). `LocalStage` reads a running stage's log
into O/o events of at most OUT_PIECE bytes for the relay, and a line left
unfinished for SHOW_AFTER_S (a prompt, a progress bar redrawn with \\r) into a
`u` event at once; `ev` writes every other event. `LineReader` reads lines from a pipe without blocking.
"""

import os
import select
import signal
import time

from gpuctl.node.containers import stage_container
from gpuctl.node.jobdir import Stage
from gpuctl.node.procs import kill_all, killpg, stage_processes
from gpuctl.node.protocol import (
    EV_EXIT, EV_OUTPUT, EV_PIECE, EV_SHOWN, EXIT_UNKNOWN, OFFSET_HEADER, OUT_PIECE, SENTINEL, SHOW_AFTER_S,
)


POLL_S = 0.15
CHUNK = 65536
# How a rank's output starts on the wire: the end of a line, a piece of one, a piece to show now (out_events).
LINE_HEAD = (EV_OUTPUT + " ").encode()
PIECE_HEAD = (EV_PIECE + " ").encode()
SHOWN_HEAD = (EV_SHOWN + " ").encode()
OUTPUT_HEADS = (LINE_HEAD, PIECE_HEAD, SHOWN_HEAD)


class Out(object):
    """Writes to stdout (fd 1); notices when the reader went away."""

    def __init__(self):
        self.fd = 1
        self.poller = select.poll()
        self.poller.register(self.fd, 0)  # only error / hang-up conditions

    def write(self, data):
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def idle(self, seconds, wake=None):
        """Sleep up to `seconds`, or until `wake` has news; False early if the reader closed the pipe."""
        watched = wake.fd if wake is not None else None
        if watched is not None:
            self.poller.register(watched, select.POLLIN)
        try:
            for fd, ev in self.poller.poll(int(seconds * 1000)):
                if fd == self.fd and ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    return False
                if fd == watched:
                    wake.drain()
        finally:
            if watched is not None:
                self.poller.unregister(watched)
        return True


class Wake(object):
    """The read end of a pipe whose writer has news when it writes: the job's forked coordinator (a
    byte per event it appends) or a stage's supervisor (the line of its exit). The reader wakes at
    once instead of at its next poll; once the writer is gone (EOF), it polls as before."""

    def __init__(self, fd):
        self.fd = fd

    def drain(self):
        """Read what is there; at EOF (or a read error) close the pipe."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()

    def close(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _tail_offset(fh, size, lines):
    """Byte offset where the last `lines` lines of the file start."""
    if lines <= 0:
        return size
    seen = 0
    end = size
    # A final line without a newline counts as a line too.
    if size:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            end = size - 1
    pos = end
    while pos > 0:
        step = min(CHUNK, pos)
        pos -= step
        fh.seek(pos)
        block = fh.read(step)
        idx = len(block)
        while True:
            idx = block.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == lines:
                return pos + idx + 1
    return 0


def cmd_follow(args):
    return follow_stage(Stage(args.jobdir, args.stage), Out(), offset=args.offset, tail=args.tail,
                        print_offset=args.print_offset)


def follow_stage(st, out, offset=None, tail=None, print_offset=False, wake=None):
    """Print the stage's log from `offset` (or the last `tail` lines) until it ended, then the sentinel.
    `wake`: a Wake whose writer says when the log grew (else it is read every POLL_S)."""
    try:
        while not os.path.exists(st.log):
            if not out.idle(POLL_S):
                return 0
        with open(st.log, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if offset is not None:
                start = min(max(offset, 0), size)
            elif tail is not None:
                start = _tail_offset(fh, size, tail)
            else:
                start = 0
            fh.seek(start)
            if print_offset:
                out.write(("%s %d\n" % (OFFSET_HEADER, start)).encode())
            at_line_start = True
            lost_since = None
            while True:
                chunk = fh.read(CHUNK)
                if chunk:
                    out.write(chunk)
                    at_line_start = chunk.endswith(b"\n")
                    continue
                code = st.exit_code()
                if code is not None:
                    rest = fh.read()  # the stage wrote everything before its exit was recorded
                    if rest:
                        out.write(rest)
                        at_line_start = rest.endswith(b"\n")
                        continue
                    out.write(("%s%s %d\n" % ("" if at_line_start else "\n", SENTINEL, code)).encode())
                    return 0
                if not st.supervisor_alive():
                    # No supervisor and no exit: it died without recording one
                    # (OOM killer, reboot...). Allow a launch a moment to start it.
                    lost_since = lost_since or time.time()
                    if time.time() - lost_since > 3.0 and st.exit_code() is None:
                        out.write(("%s%s unknown\n" % ("" if at_line_start else "\n", SENTINEL)).encode())
                        return 0
                else:
                    lost_since = None
                if not out.idle(POLL_S, wake):
                    return 0
    except (BrokenPipeError, ConnectionResetError):
        return 0


def ev(*fields):
    """An event of the agent's own (not a rank's output: out_events): one line, whatever its text holds."""
    return (" ".join(str(f) for f in fields).replace("\n", " ") + "\n").encode("utf-8", "replace")


def out_events(head, line, ended, shown=False):
    """A rank's `line` (bytes, no newline) as O/o events of at most OUT_PIECE bytes: `head` is
    b"RANK STAGE "; the last is O if the line `ended` with its newline, else o (more follows),
    or u when it is to be `shown` now (the rank left the line unfinished)."""
    frames = []
    while len(line) > OUT_PIECE:
        frames.append(PIECE_HEAD + head + line[:OUT_PIECE] + b"\n")
        line = line[OUT_PIECE:]
    frames.append((LINE_HEAD if ended else SHOWN_HEAD if shown else PIECE_HEAD) + head + line + b"\n")
    return b"".join(frames)


class LineReader(object):
    """Non-blocking line reader over one fd."""

    def __init__(self, fd):
        self.fd = fd
        self.buf = b""
        self.eof = False
        os.set_blocking(fd, False)

    def read_lines(self):
        try:
            data = os.read(self.fd, CHUNK)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            self.eof = True
            rest, self.buf = self.buf, b""
            return [rest] if rest else []
        self.buf += data
        parts = self.buf.split(b"\n")
        self.buf = parts.pop()
        return parts


class LocalStage(object):
    """A stage started on this node: its log is read as it grows into O/o/u events (out_events).

    The start of a line whose newline has not come yet is held, so a line read in
    two chunks still goes out whole; held for SHOW_AFTER_S, it goes out as a `u`
    event (the rank waits mid-line: a prompt, `echo -n`, a progress bar redrawn
    with \\r). A rank that streams lines never waits that long mid-line: its
    output costs one clock reading per chunk read, nothing per line.
    """

    def __init__(self, st, exit_fd=None):
        self.st = st
        self.exit_notice = Wake(exit_fd)  # the supervisor's pipe (stages.start_stage_watched); fd None: polled only
        self.fh = open(st.log, "rb")  # noqa: SIM115 - read for the reader's life, closed by close()
        self.buf = b""  # the start of a line whose newline has not come yet (< OUT_PIECE bytes)
        self.held_at = None  # when `buf` began to wait
        self.lost_since = None
        self.done = False

    def poll(self, emit, rank):
        head = ("%d %s " % (rank, self.st.name)).encode()
        chunk = self.fh.read(CHUNK)
        while chunk:
            self._lines(chunk, emit, head)
            chunk = self.fh.read(CHUNK)
        if self.buf and time.time() - self.held_at >= SHOW_AFTER_S:
            emit(out_events(head, self.buf, False, shown=True))
            self.buf, self.held_at = b"", None
        code = self.st.exit_code()
        if code is None and not self.st.supervisor_alive():
            self.lost_since = self.lost_since or time.time()
            if time.time() - self.lost_since < 3.0:
                return
            code = EXIT_UNKNOWN
            # Its supervisor died without recording an exit: nobody else would stop what is left.
            pgid = self.st.pgid()
            if pgid is not None:
                tree = [] if stage_container(self.st) else stage_processes(pgid)  # before its parents die
                killpg(pgid, signal.SIGKILL)
                kill_all(tree, signal.SIGKILL)
        elif code is None:
            return
        chunk = self.fh.read(CHUNK)  # written before the exit was recorded
        while chunk:
            self._lines(chunk, emit, head)
            chunk = self.fh.read(CHUNK)
        if self.buf:  # the last line has no newline: it stays without one
            emit(out_events(head, self.buf, False))
            self.buf = b""
        self.fh.close()
        self.done = True
        self.exit_notice.close()
        emit(ev(EV_EXIT, rank, self.st.name, code))

    def _lines(self, data, emit, head):
        parts = (self.buf + data).split(b"\n")
        rest = parts.pop()
        if parts or not self.buf:  # a line began to wait now
            self.held_at = time.time()
        frames = [out_events(head, line, True) for line in parts]
        if len(rest) >= OUT_PIECE:  # a long line goes out in pieces as it comes, never held whole
            cut = len(rest) - len(rest) % OUT_PIECE
            frames.append(out_events(head, rest[:cut], False))
            rest = rest[cut:]
        self.buf = rest
        if frames:
            emit(b"".join(frames))
