"""A job's logs on the controller, kept after the cluster is gone (as SkyPilot keeps ~/sky_logs).

Layout: `logs/<cluster>/<id>-<token>/` in the state dir (the job's name on the nodes,
JobRecord.node_job: a job id another cluster of the same name reuses never names these
files), private to the user (0700 directories, 0600 files):

- `<stage>-rank<N>.log`: one file per stage and rank, the rank's bytes as it wrote them;
- `order`: one line `STAGE RANK BYTES` per piece written to those files, in the order the
  pieces arrived (the head's events.log order: what a follower saw live), so `gpuctl logs`
  prints a finished job interleaved as it ran (`read_saved`), or grouped by rank;
- `nodes.json`: the job's node names by rank, for the `(worker1, rank=1)` prefixes once
  the cluster's inventory is gone.

Written from the job's events as they stream in (attached jobs, the detached job's
watcher), or rebuilt from the head's events.log in one call (`fetch`: cancelled jobs,
`logs` after the fact; the head agent's `events`, agentcall.read_events). Every rank's
lines pass through the head, so no node but the head is asked. `gpuctl down` leaves them;
`gpuctl logs NAME --purge` (`purge`) removes them.
Logs an older gpuctl kept in `clusters/<name>/jobs/<id>/` are still read there.
The job's runtime files (its watcher's pid and log) stay in `clusters/<name>/jobs/<id>/`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Collection, Iterator, Mapping

from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.jobplane import agentcall
from gpuctl.jobplane.events import Event, LineJoiner, Outcome, decode, encode, parse_event
from gpuctl.node import protocol
from gpuctl.provision.inventory import Inventory

STAGES = protocol.STAGES
ORDER_FILE = "order"
NODES_FILE = "nodes.json"


def logs_root() -> Path:
    """Where every cluster's job logs are kept (`~/.gpuctl/logs`)."""
    return state_root() / "logs"


def cluster_logs_dir(cluster: str) -> Path:
    return logs_root() / cluster


def job_log_dir(cluster: str, node_job: int | str) -> Path:
    """One job's saved logs: `logs/<cluster>/<node_job>`."""
    return cluster_logs_dir(cluster) / str(node_job)


def local_job_dir(cluster: str, job_id: int | str) -> Path:
    """The job's runtime files on the controller (watcher pid and log); also where an older gpuctl
    kept its logs. Removed with the cluster."""
    return cluster_dir(cluster) / "jobs" / str(job_id)


def local_log(cluster: str, node_job: int | str, stage: str, rank: int) -> Path:
    return job_log_dir(cluster, node_job) / f"{stage}-rank{rank}.log"


def _private_dirs(path: Path) -> None:
    """`path` and the directories between it and the state dir, each 0700."""
    root = state_root()
    for part in reversed([path, *[p for p in path.parents if root in p.parents]]):
        try:
            part.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _create(path: Path) -> IO[bytes]:
    """A file written afresh, 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "wb")


class LogWriter:
    """Per-(stage, rank) log files of one job and their arrival order, started afresh by this writer."""

    def __init__(self, cluster: str, job_id: int | str, on_error: Callable[[str], None] | None = None, *,
                 node_job: str | None = None, names: Mapping[int, str] | None = None) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.directory = job_log_dir(cluster, node_job or job_id)
        self.names = dict(names or {})
        self.files: dict[tuple[str, int], IO[bytes]] = {}
        self.order: IO[bytes] | None = None
        self.failed: str | None = None  # why saving stopped (a full disk...): the job goes on
        self.written: set[tuple[str, int]] = set()
        self.on_error = on_error

    def write(self, stage: str, rank: int, line: str, eol: bool = True) -> None:
        """One line of output (event text: surrogate-escaped bytes); `eol` False: no newline came with it."""
        if self.failed:
            return
        stage = stage if stage in STAGES else protocol.STAGE_RUN  # the agent's own notes go with the run log
        data = encode(line + "\n" if eol else line)  # the rank's bytes as it wrote them: invalid UTF-8, \r
        try:
            if self.order is None:
                _private_dirs(self.directory)
                if self.names:
                    with _create(self.directory / NODES_FILE) as fh:
                        fh.write(json.dumps({str(r): n for r, n in sorted(self.names.items())}).encode())
                self.order = _create(self.directory / ORDER_FILE)
            fh = self.files.get((stage, rank))
            if fh is None:
                self.written.add((stage, rank))
                fh = self.files[(stage, rank)] = _create(self.directory / f"{stage}-rank{rank}.log")
            fh.write(data)
            fh.flush()
            # After the bytes: a reader finds every indexed piece in its file (bytes not yet
            # indexed are read after the indexed ones).
            self.order.write(f"{stage} {rank} {len(data)}\n".encode())
            self.order.flush()
        except OSError as exc:
            self.failed = (f"cannot save job {self.job_id}'s logs under {self.directory}: "
                           f"{exc.strerror}; the job goes on, and its output stays on the head "
                           f"(`gpuctl logs {self.cluster} {self.job_id}` once there is room)")
            if self.on_error is not None:
                self.on_error(self.failed)
            self.close()
            # Incomplete copies would pass for the whole log: drop them, so `gpuctl logs`
            # reads the job's output from the head instead.
            for st, rk in list(self.written):
                (self.directory / f"{st}-rank{rk}.log").unlink(missing_ok=True)
            (self.directory / ORDER_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        for fh in [*self.files.values(), *([self.order] if self.order is not None else [])]:
            try:
                fh.close()
            except OSError:
                pass
        self.files.clear()
        self.order = None


def fetch(inv: Inventory, job_id: int | str, node_job: str, *, control_dir: Path | None,
          timeout: float = 300) -> Outcome | None:
    """Rebuild job `job_id`'s local logs from the head's events.log (of `node_job`, its name on the
    nodes: JobRecord.node_job); the outcome if the job ended."""
    read = read_head(inv, node_job, control_dir=control_dir, timeout=timeout)
    if read is None:
        return None
    writer = LogWriter(inv.cluster, job_id, node_job=node_job, names={n.rank: n.name for n in inv.nodes})
    try:
        for line in read.lines:
            writer.write(line.stage or protocol.STAGE_RUN, line.rank or 0, line.text, line.eol)
    finally:
        writer.close()
    return read.outcome


@dataclass(frozen=True)
class HeadLog:
    """What the head's events.log of a job says so far: its ranks' lines in the order they came,
    the outcome once the job ended, and the byte offset read up to (where a follower attaches)."""

    lines: list[Event]  # whole lines (O events; `eol` False: no newline ended it), of the inventory's ranks
    outcome: Outcome | None
    offset: int


def read_head(inv: Inventory, node_job: str, *, control_dir: Path | None, timeout: float = 300) -> HeadLog | None:
    """The job's events.log from the head, in one call; None when the head did not answer."""
    try:  # bytes: the ranks' output may be anything but a newline
        data = agentcall.read_events(inv.head, node_job, control_dir=control_dir, timeout=timeout)
    except agentcall.AgentError:
        return None
    whole = data[:data.rfind(b"\n") + 1]  # an event still being written is the next read's
    joiner = LineJoiner()
    outcome = None
    ranks = {n.rank for n in inv.nodes}
    lines = []
    for raw in whole.split(b"\n"):
        event = parse_event(decode(raw))
        for line in joiner.feed(event) if event is not None else ():
            if line.kind == protocol.EV_OUTPUT and line.rank in ranks:
                lines.append(line)
            elif line.kind == protocol.EV_DONE:
                outcome = Outcome.from_data(line.text, line.data)
    for held in joiner.flush_all():  # a line still being written, or cut by a killed coordinator
        if held.rank in ranks:
            lines.append(held)
    return HeadLog(lines, outcome, len(whole))


# -- reading saved logs --------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedLine:
    """One line of a rank's saved output (its bytes as surrogate-escaped text, no newline)."""

    stage: str
    rank: int
    text: str


def saved_dir(cluster: str, job_id: int, node_job: str) -> Path | None:
    """Where job `job_id` (`node_job` on the nodes) has saved logs: its directory under `logs/`, or
    the cluster directory's where an older gpuctl kept them; None when nothing was saved."""
    for directory in (job_log_dir(cluster, node_job), local_job_dir(cluster, job_id)):
        if any(directory.glob("*-rank*.log")):
            return directory
    return None


def saved_names(directory: Path) -> dict[int, str]:
    """The job's node names by rank, as its logs recorded them ({} when unknown)."""
    try:
        data = json.loads((directory / NODES_FILE).read_text())
        return {int(r): str(n) for r, n in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _files(directory: Path, ranks: Collection[int] | None) -> list[tuple[str, int]]:
    """(stage, rank) of every saved log file, setup before run, by rank."""
    found = []
    for path in directory.glob("*-rank*.log"):
        stage, _, rank = path.name[:-len(".log")].rpartition("-rank")
        if stage in STAGES and rank.isdigit() and (ranks is None or int(rank) in ranks):
            found.append((stage, int(rank)))
    return sorted(found, key=lambda key: (STAGES.index(key[0]), key[1]))


def read_saved(directory: Path, ranks: Collection[int] | None = None, *, by_rank: bool = False,
               tail: int | None = None) -> Iterator[SavedLine]:
    """A job's saved lines: in the order they arrived (interleaved across ranks, as they were
    printed live), or with `by_rank` each stage's lines rank after rank; only `ranks`' (None: all);
    with `tail`, only the last `tail` lines of that. Logs saved without an order are read by rank."""
    lines = _by_rank(directory, ranks) if by_rank or not (directory / ORDER_FILE).is_file() \
        else _in_order(directory, ranks)
    if tail is not None:
        yield from deque(lines, maxlen=tail) if tail > 0 else ()
        return
    yield from lines


def _by_rank(directory: Path, ranks: Collection[int] | None) -> Iterator[SavedLine]:
    for stage, rank in _files(directory, ranks):
        with open(directory / f"{stage}-rank{rank}.log", "rb") as fh:  # lines end at \n only: \r is the rank's
            for raw in fh:
                yield SavedLine(stage, rank, decode(raw[:-1] if raw.endswith(b"\n") else raw))


def _in_order(directory: Path, ranks: Collection[int] | None) -> Iterator[SavedLine]:
    """The pieces in `order`'s order, each line given once its newline arrived; then what the index
    does not cover (a writer stopped between a piece and its index line), file by file."""
    keys = _files(directory, ranks)
    files: dict[tuple[str, int], IO[bytes]] = {}
    pending: dict[tuple[str, int], bytes] = {}

    def lines_of(key: tuple[str, int], data: bytes) -> Iterator[SavedLine]:
        *done, pending[key] = (pending.get(key, b"") + data).split(b"\n")
        for raw in done:
            yield SavedLine(key[0], key[1], decode(raw))

    try:
        for key in keys:
            files[key] = open(directory / f"{key[0]}-rank{key[1]}.log", "rb")  # noqa: SIM115 - closed below
        with open(directory / ORDER_FILE, "rb") as index:
            for entry in index:
                words = entry.split()
                if len(words) != 3 or not words[1].isdigit() or not words[2].isdigit():
                    continue  # an index line being written
                key = (decode(words[0]), int(words[1]))
                if key in files:
                    yield from lines_of(key, files[key].read(int(words[2])))
        for key in keys:
            yield from lines_of(key, files[key].read())
            if pending.get(key):
                yield SavedLine(key[0], key[1], decode(pending.pop(key)))
    finally:
        for fh in files.values():
            fh.close()


def purge(cluster: str, keep: Collection[str] = (), legacy: Collection[int] = ()) -> int:
    """Remove the cluster's saved job logs except those of the jobs named in `keep` (their names on
    the nodes: unfinished jobs), and the rank logs an older gpuctl kept in the cluster directory for
    the jobs `legacy`; how many jobs' logs went."""
    removed: set[str] = set()  # job ids
    for job_id in legacy:
        for path in local_job_dir(cluster, job_id).glob("*-rank*.log"):
            path.unlink()
            removed.add(str(job_id))
    root = cluster_logs_dir(cluster)
    if root.is_dir():
        for job in root.iterdir():
            if job.name in keep or job.is_symlink() or not job.is_dir():
                continue
            shutil.rmtree(job)
            removed.add(job.name.split("-", 1)[0])
        if not any(root.iterdir()):
            root.rmdir()
    return len(removed)


def watcher_pidfile(cluster: str, job_id: int) -> Path:
    return local_job_dir(cluster, job_id) / "watch.pid"


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot) if it runs and is no
    zombie; "" where /proc is missing (macOS); None if it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def mark_watching(cluster: str, job_id: int) -> Path:
    """Record that this process watches the job (removed by `unmark_watching`).
    The start time goes with the PID: a watcher killed without cleaning up
    (SIGKILL, a reboot) must not live on in whatever process reuses its PID,
    or the job would never be looked up on the head again."""
    path = watcher_pidfile(cluster, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()} {process_start(os.getpid()) or ''}".strip())
    return path


def unmark_watching(cluster: str, job_id: int) -> None:
    path = watcher_pidfile(cluster, job_id)
    try:
        if path.read_text().split()[:1] == [str(os.getpid())]:
            path.unlink()
    except FileNotFoundError:
        pass


def is_watched(cluster: str, job_id: int) -> bool:
    """Whether the job's watcher still runs: the recorded process, alive and
    started when recorded."""
    try:
        words = watcher_pidfile(cluster, job_id).read_text().split()
        pid = int(words[0])
    except (FileNotFoundError, ValueError, IndexError):
        return False
    return same_process(pid, words[1] if len(words) > 1 else None)


def same_process(pid: int, start: str | None) -> bool:
    """Whether `pid` still runs and is the process that started at `start` (None: any start; "" where
    /proc is missing and start times cannot be told apart)."""
    started = process_start(pid)
    return started is not None and (start is None or started in ("", start))
