"""What the controller does with a job's events as they come (JobRunner's view of one job): print
each rank's lines with its prefix, save them per rank, say the phases and record them in the
registry; a watcher or follower that attaches later is quiet."""

from __future__ import annotations

import json
import time
from typing import Mapping, Protocol, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.ranklines import RankLines
from gpuctl.common.safetext import printable
from gpuctl.jobplane import joblogs
from gpuctl.node import protocol
from gpuctl.jobplane.events import Event
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import TERMINAL_JOB_STATES, Registry


class ViewedRunner(Protocol):
    """What a view needs of the runner whose job it shows (jobplane.runner.JobRunner)."""

    inv: Inventory
    registry: Registry
    reporter: Reporter
    by_rank: Mapping[int, Node]
    output: RankLines
    live_partials: bool

    def node_job(self, job_id: int) -> str: ...

    def output_text(self, event: Event) -> str | None: ...

    def print_line(self, node: Node, line: str, *, stage: str = protocol.STAGE_RUN, eol: bool = True) -> None: ...


class JobView:
    """What the controller does with a job's events: print, save per rank, record phases."""

    def __init__(self, runner: ViewedRunner, job_id: int, job_nodes: Sequence[Node], task: str | None, *,
                 echo: bool, ranks: Sequence[int] | None = None, quiet: bool = False,
                 hidden_paths: frozenset[str] = frozenset(), save: bool = True, record: bool = False) -> None:
        self.runner = runner
        self.record = record  # quiet, but the job's owner: it records the phases it sees
        self.hidden_paths = hidden_paths
        self.job_id = job_id
        self.job_nodes = job_nodes
        self.task = task
        self.echo = echo
        self.ranks = set(ranks) if ranks is not None else None
        self.quiet = quiet  # attaching later: no phase messages, no registry writes
        self.running = False
        self.pending: str | None = None  # what the job waits for in the head's GPU queue, while it waits
        self.unprepared: dict[int, str] = {}  # rank -> why its node is not as prepared (its own words)
        self.failed_seen = False
        self.save = save  # False: a follower from an offset, whose saved logs already hold the start
        self.logs = self._writer()

    def _writer(self) -> joblogs.LogWriter:
        run = self.runner
        return joblogs.LogWriter(run.inv.cluster, self.job_id, run.reporter.error, node_job=run.node_job(self.job_id),
                                 names={r: n.name for r, n in run.by_rank.items()})

    def reset(self) -> None:
        self.logs.close()
        self.logs = self._writer()
        self.unprepared = {}

    def _record_phase(self, phase: str) -> None:
        """The registry's state of the job at a phase: SETTING_UP, then RUNNING once every rank started
        (its start time the first phase's, and never moved back by a watcher replaying events)."""
        runner, cluster = self.runner, self.runner.inv.cluster
        job = runner.registry.job(cluster, self.job_id)
        if job is None or job.status in TERMINAL_JOB_STATES:
            return
        if job.status == "RUNNING" and phase != protocol.PHASE_RUNNING:
            return
        self.pending = None
        runner.registry.update_job(cluster, self.job_id,
                                   status="SETTING_UP" if phase == protocol.PHASE_SETUP else "RUNNING",
                                   started_at=job.started_at or time.time(), detail=None)

    def _record_pending(self, why: str) -> None:
        """PENDING in the head's queue, with what it waits for (`queue` shows it): not over a later state."""
        runner, cluster = self.runner, self.runner.inv.cluster
        job = runner.registry.job(cluster, self.job_id)
        if job is not None and job.status == "PENDING":
            runner.registry.update_job(cluster, self.job_id, detail=f"waits for {why}")

    def on_event(self, event: Event) -> None:
        runner, by_rank = self.runner, self.runner.by_rank
        shown = self.echo and event.rank in by_rank and (self.ranks is None or event.rank in self.ranks)
        if event.kind in (protocol.EV_EXIT, protocol.EV_LOST, protocol.EV_DONE):  # what waits shows first
            runner.output.end(event.rank, event.stage)
        if event.kind == protocol.EV_HELLO and event.text.startswith(protocol.HELLO_UNPREPARED):
            self.unprepared[event.rank] = event.text[len(protocol.HELLO_UNPREPARED):].strip()
        if (event.kind == protocol.EV_SHOWN and shown and runner.live_partials
                and event.stage != protocol.STAGE_AGENT):  # an unfinished line (the agent's own come whole)
            runner.print_line(by_rank[event.rank], event.text, stage=event.stage or protocol.STAGE_RUN, eol=False)
        elif event.kind == protocol.EV_OUTPUT and event.rank in by_rank:
            text = runner.output_text(event)
            if text is not None and event.stage == protocol.STAGE_AGENT:
                text = printable(text)  # the agent's own words (an error of a node's): no control characters
            if text is not None:
                if self.save:
                    self.logs.write(event.stage or protocol.STAGE_RUN, event.rank, text, event.eol)
                if shown:  # live, a line's start may have shown already (the agent's own lines come whole)
                    rest = text[event.shown:] if runner.live_partials and event.stage != protocol.STAGE_AGENT else text
                    runner.print_line(by_rank[event.rank], rest, stage=event.stage or protocol.STAGE_RUN,
                                      eol=event.eol)
        elif event.kind == protocol.EV_PHASE and event.text.startswith(protocol.PHASE_PENDING + " "):
            why = event.text[len(protocol.PHASE_PENDING) + 1:]
            first = self.pending is None
            self.pending = why
            if not self.quiet or self.record:
                self._record_pending(why)
            if self.echo:  # also `logs -f` of a waiting job: it says what the job waits for, then follows it
                runner.reporter.info(f"Job {self.job_id} is pending: it waits for {why}" if first else
                                     f"Job {self.job_id} still waits for {why}")
        elif event.kind == protocol.EV_PHASE and (not self.quiet or self.record):
            if self.pending is not None:  # out of the head's queue: what it waited for is said no more
                self.pending = None
                job = runner.registry.job(runner.inv.cluster, self.job_id)
                if job is not None and job.status == "PENDING" and job.detail:
                    runner.registry.update_job(runner.inv.cluster, self.job_id, detail=None)
            n = len(runner.inv.nodes)
            if self.quiet:  # a watcher that took the job over: its states, not its messages
                if event.text in (protocol.PHASE_SETUP, protocol.PHASE_RUNNING):
                    self._record_phase(event.text)
                    self.running = self.running or event.text == protocol.PHASE_RUNNING
            elif event.text.startswith(protocol.PHASE_PLAN + " ") and n > 1:
                for line in describe_copies(event.text[len(protocol.PHASE_PLAN) + 1:], self.hidden_paths):
                    runner.reporter.info(line)
            elif event.text == protocol.PHASE_SETUP:
                self._record_phase(event.text)
                runner.reporter.info(f"Running setup on {n} node(s)")
            elif event.text == protocol.PHASE_RUN:
                # Printed as the ranks start, before their first lines (scripts read the job id here).
                runner.reporter.info(f"Starting job {self.job_id} on {len(self.job_nodes)} node(s)")
                runner.reporter.info(f"Job {self.job_id} running ({self.task})")
            elif event.text == protocol.PHASE_RUNNING:  # every rank started
                self._record_phase(event.text)
                self.running = True
        elif (event.kind == protocol.EV_EXIT and event.stage == protocol.STAGE_RUN and event.code not in (0, None)
              and not self.failed_seen):
            self.failed_seen = True
            if not self.quiet and event.rank in by_rank:
                others = len(self.job_nodes) - 1
                runner.reporter.info(f"rank {event.rank} ({by_rank[event.rank].name}) exited with code "
                                     f"{event.code}; stopping the other {others} rank(s)")
        elif event.kind == protocol.EV_LOST and not self.quiet and event.rank in by_rank:
            runner.reporter.info(f"rank {event.rank} ({by_rank[event.rank].name}) lost: {event.text}")
        elif event.kind == protocol.EV_DONE:
            self.logs.close()


def describe_copies(plan_json: str, hidden: frozenset[str] = frozenset()) -> list[str]:
    """The head's copy plan as users read it: how many nodes get bytes from the head, and the
    paths that reach fewer of them (a filesystem shared with another node or the head). Paths
    gpuctl placed itself are not named."""
    try:
        copies = [(str(path), list(ranks)) for path, ranks in json.loads(plan_json).get("copies") or []]
    except (ValueError, AttributeError, TypeError):
        return []
    copies = [(path, ranks) for path, ranks in copies if path not in hidden]
    targets = sorted({r for _, ranks in copies for r in ranks})
    if not targets:
        return []
    lines = [f"Copying from the head to {len(targets)} node(s)"]
    for path, ranks in copies:
        if len(ranks) == len(targets):
            continue
        lines.append(f"  {path}: to none of them (they share its filesystem with the head)" if not ranks else
                     f"  {path}: to {len(ranks)} of them (the others share a filesystem with one of those)")
    return lines
