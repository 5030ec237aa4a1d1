"""The node's side of a broadcast: `python -m gpuctl.api.remote CALLFILE`.

The job's run stage starts this on every node with the Python that runs
functions there. It reads the call file (wire.py), loads the function with
cloudpickle, runs it inside the plugins' environment, and prints its return
value, or the error with its traceback, as marker lines on the stage's own
stdout (a copy of fd 1 taken before the function runs, so output control and
anything the function does to sys.stdout cannot swallow them). Exit 0 on
success, 1 on any error: a non-zero exit is what makes the job plane stop the
other ranks (fail-fast).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from gpuctl.api import wire

CALL_FILE_MAX_AGE_S = 24 * 3600  # call files of earlier broadcasts are removed after a day


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def _remove_old_calls(path: str, now: float) -> None:
    """Best effort: the call files of broadcasts a day old (never the current one)."""
    folder = os.path.dirname(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        other = os.path.join(folder, name)
        if other == path or not name.endswith(".pkl"):
            continue
        try:
            if now - os.stat(other).st_mtime > CALL_FILE_MAX_AGE_S:
                os.unlink(other)
        except OSError:
            pass


def _traceback(exc: BaseException, skip: int = 0) -> str:
    tb = exc.__traceback__
    for _ in range(skip):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run(path: str, out_fd: int) -> int:
    with open(path, "rb") as fh:
        header, body = wire.decode_call(fh.read())
    _remove_old_calls(path, time.time())
    dumps: Any = None

    def fail(stage: str, exc: BaseException, skip: int = 0) -> int:
        _flush()
        record = wire.error_record(stage, exc, _traceback(exc, skip), dumps)
        wire.write_markers(out_fd, header.nonce, wire.ERROR, json.dumps(record).encode())
        return 1

    if header.python != wire.python_version():
        return fail("load", RuntimeError(
            f"this node's Python is {wire.python_version()} ({sys.executable}) and the function was pickled by "
            f"Python {header.python}; cloudpickle needs the same minor version on both sides"))
    try:
        import cloudpickle
    except ImportError as exc:
        return fail("load", exc)
    dumps = cloudpickle.dumps
    try:
        call = cloudpickle.loads(body)
    except BaseException as exc:  # noqa: BLE001 - a missing module above all: reported, not raised
        return fail("load", exc)
    try:
        from gpuctl.api import plugins, runtime

        info = runtime.instance_info()
        with plugins.around_all(call["plugins"], info):
            value = call["fn"](*call["args"], **call["kwargs"])
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a function that exits returned nothing
        return fail("call", exc, skip=1)
    try:
        data = cloudpickle.dumps(value)
    except BaseException as exc:  # noqa: BLE001
        return fail("result", exc)
    _flush()
    wire.write_markers(out_fd, header.nonce, wire.RESULT, data)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--":
        args = args[1:]
    if len(args) != 1:
        sys.stderr.write("usage: python -m gpuctl.api.remote CALLFILE\n")
        return 2
    out_fd = os.dup(1)  # the stage's log, whatever the function does to stdout
    return run(os.path.expanduser(args[0]), out_fd)


def _other_non_daemon_threads() -> list[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def exit_now(code: int) -> None:
    """End the process with `code` once its result is written, as Python's own exit
    would up to C-level teardown: the function's non-daemon threads are waited for (a
    checkpoint upload), atexit handlers run (an experiment tracker's), then os._exit.

    torch's gloo threads can abort the process in that teardown ("terminate called
    without an active exception", exit 134) after the function returned and
    destroy_process_group ran: about one rank in 100 of the DDP example here. The
    result was already delivered; such an exit would still fail the job.
    """
    _flush()
    while pending := _other_non_daemon_threads():
        for thread in pending:
            thread.join()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
