"""The dashboard's actions and live logs do what the CLI does, with the CLI's own code.

Down and a managed job's cancel are `gpuctl down` and `gpuctl jobs cancel` in a child process:
exactly what the CLI does (locks, kept logs, the supervisor, shared state), in a session of its own
so that stopping the dashboard does not cut a teardown short. Cancelling a job is the function
`gpuctl cancel` calls (jobplane.jobs.cancel), run in a thread here: the job is CANCELLED in the
registry within moments of the click, with no interpreter to start first. Either way `gpuctl queue`
and `status` see the result at once. Live logs are `gpuctl logs` (or `gpuctl jobs logs`) followed
line by line: the same lines, live from the head or kept after the cluster went.

Every argument is a validated cluster name or a number, after the command's own words: nothing a
request carries can become an option.
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from gpuctl.common.safetext import printable
from gpuctl.dashboard.security import TOKEN_ENV
from gpuctl.spec.request import check_cluster_name

MAX_RUNS = 50  # the actions whose output the dashboard keeps (the newest)
MAX_LINES = 5000  # of each one's output


def gpuctl_argv(words: Sequence[str]) -> list[str]:
    """The argv of a gpuctl command in this Python, this package, this environment."""
    return [sys.executable, "-m", "gpuctl", *words]


def cancel_words(cluster: str, job_id: int) -> list[str]:
    return ["cancel", check_cluster_name(cluster), str(int(job_id))]


def cancel_job(cluster: str, job_id: int, say: Callable[[str], None]) -> int:
    """`gpuctl cancel CLUSTER JOB`, in this process: the same function, the same lines."""
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane import jobs
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.provisioner import load_inventory_of
    from gpuctl.state.registry import AUTODOWNED, STOPPED, Registry

    registry = Registry()
    record = registry.cluster(check_cluster_name(cluster))
    inv = load_inventory_of(cluster) if record is not None else None
    if record is None or inv is None or record.status in (AUTODOWNED, STOPPED):
        say(f"error: cluster '{cluster}' is {'stopped' if record and record.status == STOPPED else 'gone'}: "
            "nothing of its jobs runs there to cancel")
        return 2
    job = registry.job(cluster, job_id)
    if job is None:
        say(f"error: cluster '{cluster}' has no job {job_id}")
        return 2
    runner = JobRunner(inv, reporter=Reporter(stream=_Lines(say), plain=True), registry=registry)
    say(jobs.cancel(runner, job)[0])
    return 0


class _Lines(io.TextIOBase):
    """A text stream whose every whole line goes to `say` (a Reporter's output, in the page)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.say(line)
        return len(text)

    def isatty(self) -> bool:
        return False


def cancel_managed_words(job_id: int) -> list[str]:
    return ["jobs", "cancel", str(int(job_id)), "--yes"]


def down_words(cluster: str) -> list[str]:
    return ["down", check_cluster_name(cluster)]


def logs_words(cluster: str, job_id: int, rank: int | None, *, follow: bool) -> list[str]:
    words = ["logs", check_cluster_name(cluster), str(int(job_id)), "--tail", "0"]
    if rank is not None:
        words += ["--rank", str(int(rank))]
    return words + ([] if follow else ["--no-follow"])


def managed_logs_words(job_id: int, attempt: int | None, *, stage: int | None = None) -> list[str]:
    return (["jobs", "logs", str(int(job_id))] + ([] if attempt is None else ["--attempt", str(int(attempt))])
            + ([] if stage is None else ["--stage", str(int(stage))]))


CHILD_ENV = "GPUCTL_DASHBOARD_CHILD"  # marks the dashboard's children (its port), for whoever looks


def _child_env() -> dict[str, str]:
    # unbuffered: each line reaches the page as it is printed; plain: no terminal, no colours; and
    # not the dashboard's token: a child has no use for it
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return {**env, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "TERM": "dumb", CHILD_ENV: os.environ.get(CHILD_ENV, "1")}


def _die_with_parent() -> None:
    """In a child that only serves a page (a followed log): it ends when the dashboard does, even a
    SIGKILLed one (Linux: PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG = 1


async def start(words: Sequence[str], *, outlive: bool = False) -> asyncio.subprocess.Process:
    """The command in a session of its own; unless it must `outlive` the dashboard (a teardown), it
    ends with the dashboard."""
    return await asyncio.create_subprocess_exec(
        *gpuctl_argv(words), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=_child_env(), start_new_session=True,
        preexec_fn=None if outlive else _die_with_parent)


async def lines_of(words: Sequence[str]) -> AsyncIterator[str]:
    """The command's output, line by line and `printable` (control characters shown, not obeyed);
    the child is stopped if the reader goes away first (a closed page)."""
    proc = await start(words)
    try:
        async for line in _read(proc):
            yield line
        await proc.wait()
    finally:
        if proc.returncode is None:
            _stop(proc)


async def _read(proc: asyncio.subprocess.Process) -> AsyncIterator[str]:
    assert proc.stdout is not None
    while raw := await proc.stdout.readline():
        yield printable(raw.decode(errors="surrogateescape").rstrip("\n"))


def _stop(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # its session: `gpuctl logs` and the ssh it runs
    except ProcessLookupError:
        pass


async def output_of(words: Sequence[str], timeout: float = 120.0) -> tuple[int, bytes]:
    """(exit code, stdout) of a command that ends by itself (a saved log to download)."""
    proc = await asyncio.create_subprocess_exec(
        *gpuctl_argv(words), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=_child_env(), start_new_session=True, preexec_fn=_die_with_parent)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        _stop(proc)
        raise
    return proc.returncode or 0, out


@dataclass
class ActionRun:
    """One action taken from a page: its command, its output so far, how it ended."""

    id: str
    title: str
    words: list[str]
    back: str  # the page to go back to
    started_at: float = field(default_factory=time.time)
    lines: list[str] = field(default_factory=list)
    returncode: int | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def command(self) -> str:
        return "gpuctl " + " ".join(self.words)


class Actions:
    """The actions started from the pages, the newest MAX_RUNS kept with their output."""

    def __init__(self) -> None:
        self.runs: dict[str, ActionRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def begin(self, title: str, words: list[str], back: str) -> ActionRun:
        run = ActionRun(secrets.token_hex(8), title, words, back)
        self._keep(run)
        task = asyncio.get_running_loop().create_task(self._run(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    async def _run(self, run: ActionRun) -> None:
        try:
            proc = await start(run.words, outlive=True)  # a teardown cut short would leave nodes billing
        except OSError as exc:
            run.lines.append(f"error: could not start {run.command}: {exc}")
            run.returncode = 127
            run.changed.set()
            return
        async for line in _read(proc):
            if len(run.lines) < MAX_LINES:
                run.lines.append(line)
            run.changed.set()
        run.returncode = await proc.wait()
        run.changed.set()

    def begin_call(self, title: str, call: Callable[[Callable[[str], None]], int], back: str,
                   command: str) -> ActionRun:
        """An action done by a function of gpuctl's (`call(say)` -> exit code) in a worker thread."""
        run = ActionRun(secrets.token_hex(8), title, command.split()[1:], back)
        self._keep(run)
        loop = asyncio.get_running_loop()

        def say(line: str) -> None:
            run.lines.append(printable(line))
            loop.call_soon_threadsafe(run.changed.set)

        async def work() -> None:
            try:
                run.returncode = await asyncio.to_thread(call, say)
            except Exception as exc:  # noqa: BLE001 - the action's failure is its output, in the page
                run.lines.append(printable(f"error: {exc}"))
                run.returncode = 1
            run.changed.set()
        task = loop.create_task(work())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    def _keep(self, run: ActionRun) -> None:
        self.runs[run.id] = run
        while len(self.runs) > MAX_RUNS:
            oldest = next(iter(self.runs))
            if self.runs[oldest].returncode is None:
                break
            del self.runs[oldest]

    async def wait_done(self, run: ActionRun, timeout: float) -> None:
        """Until the run ended or `timeout` passed (a quick action's result shows on its page at once)."""
        deadline = time.monotonic() + timeout
        while run.returncode is None and time.monotonic() < deadline:
            run.changed.clear()
            try:
                await asyncio.wait_for(run.changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
