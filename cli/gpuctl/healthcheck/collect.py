"""What both checks' jobs share: a JobRunner that keeps every rank's run-stage lines, and the
probe's `MARK {json}` records read back from them (the probes run on the nodes: they print, the
controller judges).

This is where node data enters the checks: the lines are kept printable (common/safetext.py:
an escape sequence in nvidia-smi's or NCCL's output never reaches a table, an error line or
health.json), and so is every string of a record once its JSON is read."""

from __future__ import annotations

import json
from typing import Any, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.errors import JobFailed
from gpuctl.common.safetext import clean, printable
from gpuctl.jobplane.events import Event
from gpuctl.node.protocol import STAGE_RUN
from gpuctl.jobplane.runner import JobRunner, JobSpec
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import Registry


class CollectingRunner(JobRunner):
    """A JobRunner that keeps every rank's run-stage lines in `lines`, by rank (printable), and shows
    them only whole (its print_line judges whole lines); a line holding `hide` (a probe's document)
    is kept but not shown."""

    live_partials = False

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry, hide: str | None = None) -> None:
        super().__init__(inv, reporter=reporter, registry=registry)
        self.lines: dict[int, list[str]] = {n.rank: [] for n in inv.nodes}
        self.hide = hide

    def print_line(self, node: Node, line: str, **how: Any) -> None:
        if self.hide is None or self.hide not in line:
            super().print_line(node, line, **how)

    def output_text(self, event: Event) -> str | None:
        if event.stage == STAGE_RUN and event.rank in self.lines:
            self.lines[event.rank].append(printable(event.text))
        return event.text


def run_probe_job(runner: JobRunner, spec: JobSpec, registry: Registry) -> tuple[int | None, str | None]:
    """(job id, the job's failure or None): a failed probe job is something to judge, not an error.
    Ctrl-C (JobCancelled) and UserErrors (a changed host key) pass through."""
    try:
        return runner.run(spec, run_setup=False, sync_file_mounts=True, detach=False).job_id, None
    except JobFailed as exc:
        job = registry.job(runner.inv.cluster, exc.job_id) if exc.job_id is not None else None
        return exc.job_id, exc.message + _said_by_failed_rank(runner, job)


def _said_by_failed_rank(runner: JobRunner, job: Any) -> str:
    """The failing rank's last line (`python3: Permission denied`): an exit code alone is no reason."""
    lines = getattr(runner, "lines", {}).get(getattr(job, "failed_rank", None)) or []
    last = next((line.strip() for line in reversed(lines) if line.strip()), None)
    return f"; rank {job.failed_rank} said: {last[:300]}" if last else ""


def markers(lines: Sequence[str], mark: str) -> list[dict[str, Any]]:
    """The `MARK {json}` records (objects only) in these lines, in order."""
    found = []
    for line in lines:
        at = line.find(mark + " ")
        if at < 0:
            continue
        try:
            rec = json.loads(line[at + len(mark) + 1:])
        except ValueError:
            continue
        if isinstance(rec, dict):
            found.append(clean(rec))
    return found
