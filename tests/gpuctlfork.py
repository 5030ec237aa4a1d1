"""The suite's `python -m gpuctl ARGS` runs, forked from one warm process per test worker.

The suite runs `gpuctl` about a thousand times; most runs are short, and a fresh Python spends
most of such a run importing gpuctl, pydantic, typer and PyYAML (0.2-0.3 CPU-s each time, while
both of CI's cores are busy). A fork server imports them once per worker; each run is then a
fork of it: a process of its own with its own pid, stdio, working directory, environment and
exit status, running the same `gpuctl.__main__` as `python -m gpuctl` does, with the interpreter's
exit steps (non-daemon threads joined, atexit handlers) before it ends.

What a fork cannot give falls back to a real subprocess: an environment whose PYTHON*, locale or
coverage variables differ from the server's (they act at interpreter start), a terminal on stdio,
and GPUCTL_TEST_NO_FORK=1 (everything). What the first run of a fresh interpreter does (startup
cost, lazy imports) is tested with real processes elsewhere (test_cli_start, benchmarks/start.py).

Protocol: a SOCK_SEQPACKET pair to the server; a request is one message (JSON: args, env, cwd)
carrying four descriptors (a reply socket, then stdin, stdout, stderr). The server answers on the
reply socket with "pid N" and, once the run has ended, "exit CODE" (negative: killed by a signal).
"""

from __future__ import annotations

import array
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

TESTS = Path(__file__).resolve().parent
# Variables that act when an interpreter starts: a run asking for other values than the server's
# gets a real interpreter.
_STARTUP_VARS = ("PYTHON", "LC_", "LANG", "COVERAGE")
_MAX_REQUEST = 1 << 20


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_VARS)}


# -- the server (runs in its own interpreter) ---------------------------------------------------


def _preload() -> None:
    """Import what gpuctl's commands import, and what they load lazily, once."""
    import importlib
    import pkgutil

    import gpuctl

    for info in pkgutil.walk_packages(gpuctl.__path__, "gpuctl."):
        # gpuctl.node runs on nodes (some of its modules are scripts); the controller imports its own share
        if info.name.endswith("__main__") or info.name.startswith("gpuctl.node."):
            continue
        try:
            importlib.import_module(info.name)
        except (Exception, SystemExit):  # noqa: BLE001 - an optional backend's import error shows in its own run
            pass
    for name in ("ansible_runner", "boto3", "botocore.config", "botocore.exceptions"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            pass


def serve(fd: int) -> None:
    """The fork server's loop: one fork per request until the worker closes its end."""
    import gc

    master = socket.socket(fileno=fd)
    _preload()
    gc.collect()
    gc.freeze()  # forks share these pages instead of each copying them as the collector walks them
    replies: dict[int, socket.socket] = {}

    def reap(*_: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reply = replies.pop(pid, None)
            if reply is not None:
                try:
                    reply.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                reply.close()

    signal.signal(signal.SIGCHLD, reap)
    fds_room = socket.CMSG_SPACE(4 * array.array("i").itemsize)
    # A child whose SIGCHLD did not get its exit reaped (seen once in a full run: a zombie, its worker
    # waiting on it until its timeout) is reaped at the next second's look.
    master.settimeout(1.0)
    while True:
        try:
            msg, ancdata, _flags, _addr = master.recvmsg(_MAX_REQUEST, fds_room)
        except TimeoutError:
            reap()
            continue
        if not msg:
            return
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        reply = socket.socket(fileno=fds[0])
        stdio = list(fds[1:4])
        request = json.loads(msg)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the pid is known before its exit is
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, stdio, [master, reply, *replies.values()])
            replies[pid] = reply
            reply.sendall(f"pid {pid}\n".encode())
        finally:
            for f in stdio:
                os.close(f)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _child(request: dict[str, Any], stdio: list[int], sockets: list[socket.socket]) -> None:
    """Become `python -m gpuctl ARGS` and exit as it would; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for s in sockets:
            s.close()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in stdio:
            if fd > 2:
                os.close(fd)
        if request.get("new_session"):
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        code = _run_main(request["args"])
    finally:
        os._exit(code)


def _run_main(args: list[str]) -> int:
    import runpy
    import traceback

    sys.argv = ["gpuctl", *args]
    code = 0
    interrupted = False
    try:
        runpy.run_module("gpuctl", run_name="__main__", alter_sys=True)
    except SystemExit as end:
        if end.code is None:
            code = 0
        elif isinstance(end.code, int):
            code = end.code & 0xFF
        else:
            print(end.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: the reader went away
                pass
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


# -- the worker's side --------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import gpuctlfork; gpuctlfork.serve({theirs.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.env)
        theirs.close()
        self.sock = ours
        self.owner = os.getpid()
        self.lock = threading.Lock()

    def spawn(self, request: dict[str, Any], fds: Sequence[int]) -> socket.socket:
        mine, theirs = socket.socketpair()
        try:
            with self.lock:
                self.sock.sendmsg([json.dumps(request).encode()],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno(), *fds]))])
        finally:
            theirs.close()
        return mine

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: _Server | None = None
_server_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.owner != os.getpid() or _server.proc.poll() is not None:
            _server = _Server()
            atexit.register(_server.close)
        return _server


class ForkedProcess:
    """A forked `gpuctl` run, with the part of Popen's interface the suite uses."""

    def __init__(self, argv: list[str], reply: socket.socket) -> None:
        self.args = argv
        self.returncode: int | None = None
        self._reply = reply
        self._buffer = b""
        self.pid = int(self._line(None).split()[1])

    def _line(self, timeout: float | None) -> str:
        self._reply.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._reply.recv(256)
            if not chunk:
                raise RuntimeError(f"the gpuctl fork server went away during {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(0).split()[1])
            except (BlockingIOError, socket.timeout):
                return None
            self._reply.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout).split()[1])
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._reply.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forkable(env: dict[str, str], fds: Sequence[int]) -> bool:
    if os.environ.get("GPUCTL_TEST_NO_FORK") == "1" or env.get("GPUCTL_TEST_NO_FORK") == "1":
        return False
    if any(os.isatty(fd) for fd in fds):
        return False
    return True


def spawn(args: Sequence[str], *, env: dict[str, str], cwd: Path | str, stdin: int, stdout: int,
          stderr: int, new_session: bool = False) -> ForkedProcess | subprocess.Popen:
    """Start `python -m gpuctl ARGS` on these descriptors: forked where it can be, else a real interpreter.
    `new_session`: in a session (and process group) of its own, as Popen's start_new_session."""
    argv = [sys.executable, "-m", "gpuctl", *args]
    fds = (stdin, stdout, stderr)
    if _forkable(env, fds):
        server = _get_server()
        if _startup_env(env) == _startup_env(server.env):
            request = {"args": list(args), "env": env, "cwd": str(Path(cwd).resolve()), "new_session": new_session}
            return ForkedProcess(argv, server.spawn(request, fds))
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=new_session)


def popen_text(args: Sequence[str], *, env: dict[str, str], cwd: Path | str,
               input_text: str | None = None, new_session: bool = False) -> tuple[ForkedProcess | subprocess.Popen, IO[str], IO[str]]:
    """Start a run with its stdout and stderr as text pipes (errors replaced); stdin is /dev/null
    or `input_text`. The caller reads both pipes to their end and waits for the process."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    if input_text is None:
        in_r = os.open(os.devnull, os.O_RDONLY)
        in_w = None
    else:
        in_r, in_w = os.pipe()
    try:
        proc = spawn(args, env=env, cwd=cwd, stdin=in_r, stdout=out_w, stderr=err_w, new_session=new_session)
    except BaseException:
        for fd in (out_r, err_r, in_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, in_r):
            os.close(fd)
    if in_w is not None:
        def feed() -> None:
            with open(in_w, "w", encoding="utf-8") as fh:
                try:
                    fh.write(input_text or "")
                except BrokenPipeError:
                    pass
        threading.Thread(target=feed, daemon=True).start()
    out = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115 - the caller reads and closes them
    err = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115
    return proc, out, err


def run(args: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | str | None = None,
        timeout: float | None = None, input: str | None = None,
        new_session: bool = False) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, -m, gpuctl, *args], capture_output=True, text=True, ...)`, forked.
    On a timeout the run is killed (with its process group, under `new_session`: SIGTERM, then
    SIGKILL after 30 s) and TimeoutExpired raised with the output read so far."""
    env = dict(os.environ) if env is None else env
    proc, out, err = popen_text(args, env=env, cwd=cwd or os.getcwd(), input_text=input, new_session=new_session)
    chunks: dict[str, str] = {}

    def drain(name: str, stream: IO[str]) -> None:
        with stream:
            chunks[name] = stream.read()

    readers = [threading.Thread(target=drain, args=("out", out), daemon=True),
               threading.Thread(target=drain, args=("err", err), daemon=True)]
    for t in readers:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        proc.wait(timeout=timeout)
        for t in readers:
            t.join(None if deadline is None else max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if new_session:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        for t in readers:
            t.join(5)
        raise subprocess.TimeoutExpired(proc.args, timeout, chunks.get("out"), chunks.get("err")) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, chunks.get("out", ""), chunks.get("err", ""))


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
