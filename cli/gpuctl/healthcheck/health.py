"""`gpuctl check NAME --health`: every node's own verdict, and what to do with it (issue 26).

run_health runs nodehealth.py as ONE gpuctl job on every node (the job plane's fan-out: one ssh
call to the head; the job shows in `gpuctl queue` and its output stays for `gpuctl logs`), tells
each node what it was made with (GPUs per node, the EFA count and fabric the provider attached),
and gathers one document per node. `analyze` (pure, unit-tested) turns the lines into a Report:
a node whose probe printed nothing is unhealthy too, since nothing says it is fit.

The last report is kept in clusters/<name>/health.json, keyed by node id: `gpuctl status` shows
each node's verdict, `gpuctl replace --unhealthy` picks its nodes from it, and a node made again
(a new id) has no verdict until it is checked.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gpuctl.common.errors import UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.common.safetext import clean, printable, whole_number
from gpuctl.node import nodehealth
from gpuctl.providers import get_provider
from gpuctl.provision.inventory import Inventory
from gpuctl.state.registry import Registry

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter

# The job part (the runner) loads when a check runs: `status` reads only the saved verdicts.

MARK = nodehealth.MARK
JOB_NAME = "gpuctl-health"
NODE_FILE = "~/.gpuctl/lib/nodehealth.py"  # on every node (the prepared bundle)
HEALTH_FILE = "health.json"
LEVELS = (0, 1, 2, 3, 4)  # dcgmi diag -r LEVEL; 0: no DCGM run
VERDICTS = ("healthy", "degraded", "unhealthy")
ACTIONS = nodehealth.ACTIONS  # most severe first


def check_level(level: int) -> int:
    if level not in LEVELS:
        raise UserError(f"--level {level}: use 1 (dcgmi diag -r 1, seconds), 2 (about 2 minutes), 3 or 4, "
                        "or 0 for no DCGM run")
    return level


@dataclass(frozen=True)
class Expectations:
    """What the nodes were made with, as the probe compares against."""

    gpus: int = 0
    efa: int = 0
    fabric: str | None = None  # efa | ib | roce; None: no RDMA fabric attached

    def argv(self) -> list[str]:
        args = ["--expect-gpus", str(self.gpus), "--expect-efa", str(self.efa)]
        return args + (["--expect-fabric", self.fabric] if self.fabric else [])


def expectations(inv: Inventory, request: Mapping[str, Any] | None) -> Expectations:
    provider = get_provider(inv.cloud)
    fabric = provider.expected_fabric(request)
    return Expectations(gpus=provider.expected_gpus(inv.head.gpus), efa=provider.expected_efa(request) or 0,
                        fabric=fabric if fabric in ("efa", "ib", "roce") else None)


def recorded_request(registry: Registry, name: str) -> dict[str, Any] | None:
    """The cluster's one record of its request (the registry's, as the provider prepared it: with what
    preflight learnt, the EFA count), which every check reads."""
    record = registry.cluster(name)
    return dict(record.request) if record is not None and record.request else None


def run_script(expect: Expectations, level: int, *, python: str | None) -> str:
    """The run stage: the probe under the node's python3 (the controller's on local nodes)."""
    args = [*expect.argv(), "--level", str(level)]
    return f'exec {shlex.quote(python) if python else "python3"} -u "$HOME/{NODE_FILE[2:]}" {shlex.join(args)}\n'


# -- the verdict -------------------------------------------------------------------------------


@dataclass
class Report:
    cluster: str
    job_id: int | None
    checked_at: float
    nodes: list[dict[str, Any]] = field(default_factory=list)
    failure: str | None = None  # the job's own failure, when it failed
    answered: int = 0  # nodes whose probe reported

    @property
    def unhealthy(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes if n["verdict"] == "unhealthy"]

    @property
    def ok(self) -> bool:
        return not self.unhealthy

    @property
    def verdict(self) -> str:
        return max((n["verdict"] for n in self.nodes), key=VERDICTS.index, default="healthy")

    @property
    def problem(self) -> str | None:
        """The one line `check --health` fails with (exit 1); None when no node is unhealthy."""
        if self.ok:
            return None
        if not self.answered and self.failure:
            return f"health: the health job failed before any node reported: {self.failure}"
        names = ", ".join(f"{n['name']} ({n['action']}: {first_text(n)})" for n in self.unhealthy)
        return (f"health: {len(self.unhealthy)} of {len(self.nodes)} node(s) unhealthy: {names}; replace them: "
                f"gpuctl replace {self.cluster} --unhealthy")

    def document(self) -> dict[str, Any]:
        return {"ok": self.ok, "cluster": self.cluster, "job_id": self.job_id,
                "checked_at": self.checked_at, "verdict": self.verdict,
                "unhealthy": [n["name"] for n in self.unhealthy], "nodes": self.nodes, "problem": self.problem}

    def text(self) -> list[str]:
        job = f", job {self.job_id}" if self.job_id is not None else ""
        lines = [f"Cluster '{self.cluster}': health of {len(self.nodes)} node(s){job}",
                 f"  {'NODE':<10} {'RANK':<4} {'VERDICT':<9} {'ACTION':<8} {'GPUS':<4} FINDINGS"]
        for node in self.nodes:
            lines.append(f"  {node['name']:<10} {node['rank']:<4} {node['verdict']:<9} {node['action'] or '-':<8} "
                         f"{node['gpus']:<4} {len(node['findings'])}")
        for node in self.nodes:
            for f in node["findings"]:
                where = f"{node['name']} {f['device']}" if f.get("device") else node["name"]
                lines.append(f"  {f['action']:<8} {where}: {f['check']}: {f['text']}")
        if self.failure:
            lines.append(f"  the health job: {self.failure}")
        if self.ok:
            lines.append(f"OK: no node is unhealthy ({self.verdict})")
        return lines


def first_text(node: Mapping[str, Any]) -> str:
    """The most severe finding of a node, with its device."""
    findings = sorted(node.get("findings") or [],
                      key=lambda f: ACTIONS.index(f["action"]) if f["action"] in ACTIONS else len(ACTIONS))
    if not findings:
        return "no finding"
    top = findings[0]
    return (f"{top['device']}: " if top.get("device") else "") + top["text"]


def markers(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The probe's node documents in these lines."""
    from gpuctl.healthcheck import collect

    return [rec for rec in collect.markers(lines, MARK) if rec.get("kind") == "node"]


def analyze(inv: Inventory, lines: Mapping[int, Sequence[str]], *, job_id: int | None,
            failure: str | None = None, now: float | None = None) -> Report:
    """One entry per node from its probe's document; a node without one is unhealthy."""
    report = Report(inv.cluster, job_id, time.time() if now is None else now, failure=failure)
    logs = f"gpuctl logs {inv.cluster} {job_id}" if job_id is not None else f"gpuctl logs {inv.cluster}"
    for node in inv.nodes:
        docs = markers(lines.get(node.rank, ()))
        doc = docs[-1] if docs else None
        if doc is None or doc.get("verdict") not in VERDICTS:
            findings = [{"check": "probe", "action": "reboot", "device": None,
                         "text": f"the node gave no health report (its output: `{logs}`)"}]
            entry = {"verdict": "unhealthy", "action": "reboot", "gpus": 0, "findings": findings, "checks": {}}
        else:
            report.answered += 1
            entry = node_entry(doc)
        report.nodes.append({"name": node.name, "rank": node.rank, "node_id": node.node_id,
                             "address": node.address, **entry})
    return report


def node_entry(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A node's entry from its probe's document (strings already printable: collect.markers), its
    fields checked: a GPU count that is not a whole number counts none and is a finding, a finding
    of no known action is watched (monitor), a node action unknown is its findings' most severe,
    and anything but text where text goes is made text."""
    findings = [_finding(f) for f in doc.get("findings") or [] if isinstance(f, dict)]
    gpus = whole_number(doc.get("gpus") or 0)
    if gpus is None:
        findings.append({"check": "probe", "action": "monitor", "device": None,
                         "text": f"the probe's GPU count ({printable(str(doc.get('gpus')))}) is not a number"})
    action = doc.get("action")
    if action not in ACTIONS:  # none, or not one of ours: the most severe of its findings'
        action = next((a for a in ACTIONS if any(f["action"] == a for f in findings)), None)
    checks = doc.get("checks")
    return {"verdict": doc["verdict"], "action": action, "gpus": gpus or 0,
            "findings": findings,
            "checks": {str(k): str(v) for k, v in checks.items()} if isinstance(checks, dict) else {}}


def _finding(raw: Mapping[str, Any]) -> dict[str, Any]:
    action, device = raw.get("action"), raw.get("device")
    return {"check": str(raw.get("check") or "probe"), "action": action if action in ACTIONS else "monitor",
            "device": device if isinstance(device, str) and device else None, "text": str(raw.get("text") or "")}


# -- the record ----------------------------------------------------------------------------------


def save(cdir: Path, report: Report) -> None:
    """health.json, private and written whole."""
    path = Path(cdir) / HEALTH_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(report.document(), fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def last_verdicts(cdir: Path, inv: Inventory) -> dict[int, dict[str, Any]]:
    """{rank: the node's entry of the last report} for the nodes it still describes (same node id)."""
    try:
        doc = json.loads((Path(cdir) / HEALTH_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        return {}
    # Cleaned again: a record an older gpuctl wrote may hold a node's escape sequences.
    by_id = {n.get("node_id"): clean(n) for n in doc["nodes"] if isinstance(n, dict) and n.get("verdict") in VERDICTS}
    return {node.rank: {**by_id[node.node_id], "checked_at": doc.get("checked_at")}
            for node in inv.nodes if node.node_id in by_id}


def status_text(entry: Mapping[str, Any]) -> str:
    """`status`'s word on a checked node: its last verdict, and the worst finding."""
    if entry["verdict"] == "healthy":
        return "health healthy"
    return f"health {entry['verdict']} ({entry.get('action')}: {first_text(entry)})"


def status_doc(entry: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`status -o json`'s health_check of a node: None when no report describes it (never checked, or
    made again since)."""
    if entry is None:
        return None
    return {"verdict": entry["verdict"], "action": entry.get("action"), "checked_at": entry.get("checked_at"),
            "finding": first_text(entry) if entry.get("findings") else None}


# -- the job ---------------------------------------------------------------------------------------


def run_health(inv: Inventory, *, registry: Registry, reporter: Reporter, level: int = 1,
               expect: Expectations | None = None) -> Report:
    """The health job on every node, judged and recorded. Ctrl-C and UserErrors pass through.
    `expect`: what the nodes were made with, when the caller already read it."""
    from gpuctl.healthcheck import collect
    from gpuctl.jobplane.runner import JobSpec

    expect = expect or expectations(inv, recorded_request(registry, inv.cluster))
    local = get_provider(inv.cloud).local
    spec = JobSpec(name=JOB_NAME, run=run_script(expect, level, python=sys.executable if local else None),
                   num_nodes=len(inv.nodes), gpus_per_node=inv.head.gpus, queue_gpus=0)
    runner = collect.CollectingRunner(inv, reporter=reporter, registry=registry, hide=MARK)  # the document unshown
    job_id, failure = collect.run_probe_job(runner, spec, registry)
    report = analyze(inv, runner.lines, job_id=job_id, failure=failure)
    if report.answered:  # a job no node answered says nothing of them
        save(cluster_dir(inv.cluster), report)
    return report

