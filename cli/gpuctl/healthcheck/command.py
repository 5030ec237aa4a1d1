"""`gpuctl check NAME`: the all_reduce job, and what its output says about the fabric.

run_check runs node/allreduceprobe.py as ONE gpuctl job on every node (jobplane.runner.JobRunner:
prepared if needed, listed in `gpuctl queue`, its output kept for `gpuctl
logs`) with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET, collects every
rank's lines, and `analyze` turns them into a Report (pure: unit-tested on
lines the tests write). The probe's marker lines and NCCL's INFO lines go to
the job's logs, not the screen.

The nodes' Python is the one with torch: on local nodes the controller's
own interpreter (as the Python API does); elsewhere the first of the API's
venv, python3, the Deep Learning AMI's PyTorch environments and python that
imports torch, else python3 (enough for the nccl-tests path).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.errors import UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.common.safetext import finite_number, whole_number
from gpuctl.healthcheck import bandwidth, collect, fabriccheck, nccllog, pairs
from gpuctl.jobplane.runner import JobSpec
from gpuctl.node import allreduceprobe, ncclperf
from gpuctl.providers import get_provider
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import Registry

MARK = allreduceprobe.MARK  # the probe imports torch only when it runs
JOB_NAME = "gpuctl-check"
NODE_PROBE = "~/.gpuctl/lib/allreduceprobe.py"  # on every node, with ncclperf.py beside it (the prepared bundle)
METHODS = ("auto", "nccl-tests", "torch")
# TORCH_CPP_LOG_LEVEL: c10d's warnings (a client socket's hostname on local nodes) off the screen; errors stay.
NCCL_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "PYTHONUNBUFFERED": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}
# Interpreters tried for torch on nodes that do not run the controller's Python, in order.
NODE_PYTHONS = ("$HOME/.gpuctl/venv/bin/python", "python3", "/opt/conda/envs/pytorch/bin/python",
                "/opt/pytorch/bin/python3", "python")


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    expect_fabric: str | None = None
    min_busbw: float | None = None
    method: str = "auto"
    envs: Mapping[str, str] = field(default_factory=dict)
    timeout_s: int = 300  # how long a rank waits for the others to join
    pairs: bool = False  # each pair of ring neighbours alone (pairs.py)


def parse_options(*, sizes: str, expect_fabric: str | None, min_busbw: float | None, method: str = "auto",
                  envs: Mapping[str, str] | None = None, pairs: bool = False) -> Options:
    """The flags, checked before anything runs (UserError: exit 2, naming the flag)."""
    if min_busbw is not None and not min_busbw > 0:
        raise UserError(f"--min-busbw {min_busbw:g}: give a bus bandwidth in GB/s above 0")
    if method not in METHODS:
        raise UserError(f"--method {method}: use one of {', '.join(METHODS)}")
    if pairs and method == "nccl-tests":
        raise UserError("--pairs runs torch.distributed on each pair of nodes; drop --method nccl-tests")
    return Options(sizes=bandwidth.parse_sizes(sizes), expect_fabric=fabriccheck.check_fabric_flag(expect_fabric),
                   min_busbw=min_busbw, method=method, envs=dict(envs or {}), pairs=pairs)


# -- what runs on the nodes ------------------------------------------------------------


def run_script(options: Options, *, python: str | None) -> str:
    """The run stage: pick the interpreter with torch, then the probe. `python`: the controller's
    interpreter on local nodes; None elsewhere (the first of NODE_PYTHONS that imports torch)."""
    if python:
        words = shlex.quote(python)
    else:
        words = " ".join(f'"$HOME/{c[len("$HOME/"):]}"' if c.startswith("$HOME/") else shlex.quote(c)
                         for c in NODE_PYTHONS)
    args = ["--sizes", ",".join(str(s) for s in options.sizes), "--method", options.method,
            "--timeout", str(options.timeout_s), *(["--pairs"] if options.pairs else [])]
    return (f'probe="$HOME/{NODE_PROBE[2:]}"\n'
            "py= tried=\n"
            f"for c in {words}; do\n"
            '  tried="$tried${tried:+, }$c"\n'
            '  if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then py="$c"; break; fi\n'
            "done\n"
            f'exec "${{py:-python3}}" -u "$probe" {shlex.join(args)} --tried "$tried"\n')


class _CheckRunner(collect.CollectingRunner):
    """Keeps every rank's lines and shows only what a person needs."""

    def print_line(self, node: Node, line: str, **how: Any) -> None:
        if MARK in line and node.rank == 0:  # each size as it completes: the table waits for all of them
            for rec in markers([line]):
                if rec.get("kind") == "result" and _measured(rec):
                    self.reporter.info(f"  all_reduce {bandwidth.human_size(rec['size_bytes'])}: "
                                       f"{rec['time_us'] / 1000:.2f} ms on rank 0")
        if MARK in line or " NCCL INFO " in line:  # in the job's logs (`gpuctl logs`), not on the screen
            return
        super().print_line(node, line, **how)


# -- the verdict -------------------------------------------------------------------------


@dataclass
class Report:
    cluster: str
    job_id: int | None
    nodes: int
    expected: fabriccheck.Expected
    method: str = "torch"  # torch | nccl-tests
    backend: str | None = None  # nccl | gloo
    ranks: int = 0
    transport: str = "unknown"
    transport_kind: str | None = None
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    results: list[bandwidth.Measurement] = field(default_factory=list)
    min_busbw: float | None = None
    nccl_version: str | None = None
    problem: str | None = None
    pairs: list[pairs.Pair] | None = None  # --pairs: each ring pair's result
    names: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def document(self) -> dict[str, Any]:
        return {"ok": self.ok, "cluster": self.cluster, "job_id": self.job_id, "nodes": self.nodes,
                "ranks": self.ranks, "method": self.method, "backend": self.backend, "transport": self.transport,
                "transport_kind": self.transport_kind, "expected_fabric": self.expected.kind,
                "expected_source": self.expected.source, "per_rank": self.per_rank,
                "results": [r.doc() for r in self.results], "min_busbw_gbps": self.min_busbw,
                "nccl_version": self.nccl_version, "problem": self.problem,
                "pairs": None if self.pairs is None else [p.doc(self.names) for p in self.pairs],
                "slow_nodes": None if self.pairs is None else [self.names[r] for r in pairs.slow(self.pairs)[1]]}

    def text(self) -> list[str]:
        if self.pairs is not None:
            lines = [f"Cluster '{self.cluster}': all_reduce on each pair of ring neighbours ({len(self.pairs)} pairs) "
                     f"with torch.distributed {self.backend or '?'}"
                     + (f", job {self.job_id}" if self.job_id is not None else ""), *pairs.table(self.pairs, self.names)]
            if self.ok:
                lines.append(f"OK: no pair under {pairs.SLOW_RATIO:g}x the best one")
            return lines
        how = "nccl-tests' all_reduce_perf (NCCL)" if self.method == "nccl-tests" else \
            f"torch.distributed {self.backend or '?'}"
        lines = [f"Cluster '{self.cluster}': all_reduce across {self.ranks} rank(s) on {self.nodes} node(s) with "
                 f"{how}" + (f", job {self.job_id}" if self.job_id is not None else "")]
        lines.append(f"Transport: {self.transport}; expected: {self.expected.kind} ({self.expected.source})")
        if self.backend == "nccl" or self.method == "nccl-tests":
            for entry in self.per_rank:
                inside = f"; inside the node: {', '.join(entry['intra_node'])}" if entry.get("intra_node") else ""
                where = entry.get("node") or entry.get("host")
                rank = entry.get("nccl_rank")
                lines.append(f"  rank {'?' if rank is None else rank} ({where}): {entry['transport']}{inside}")
        if self.results:
            lines += bandwidth.table(self.results)
        if self.ok:
            floor = f", busbw at or above {self.min_busbw:g} GB/s" if self.min_busbw is not None else ""
            lines.append(f"OK: {self.transport} meets the expected fabric ({self.expected.kind}){floor}")
        return lines


def markers(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The probe's `__GPUCTL_CHECK__ {json}` records, in order."""
    return collect.markers(lines, MARK)


def _measured(rec: dict[str, Any]) -> bool:
    """Whether a `result` record holds a size and a time that are numbers (then made ones): a node's
    record is read, never trusted."""
    size, time_us = whole_number(rec.get("size_bytes"), minimum=1), finite_number(rec.get("time_us"))
    if size is None or time_us is None or time_us < 0:
        return False
    rec["size_bytes"], rec["time_us"] = size, time_us
    return True


def analyze(inv: Inventory, lines: Mapping[int, Sequence[str]], expected: fabriccheck.Expected, options: Options, *,
            job_id: int | None, failure: str | None = None) -> Report:
    """What the job's lines say: method, ranks, transport per process, bandwidth, and the first problem."""
    by_rank = {n.rank: n for n in inv.nodes}
    report = Report(inv.cluster, job_id, len(inv.nodes), expected, min_busbw=options.min_busbw,
                    names={n.rank: n.name for n in inv.nodes})
    recs = {rank: markers(lines.get(rank, ())) for rank in by_rank}
    problems = [(rank, str(r.get("text") or "the probe gave no reason")) for rank, rs in sorted(recs.items())
                for r in rs if r.get("kind") == "problem"]
    if options.pairs:
        found = [r for rs in recs.values() for r in rs if r.get("kind") == "pair"]
        report.method, report.backend = "pairs", next((r.get("backend") for r in found), None)
        report.ranks = max((whole_number(r.get("ranks")) or 0 for r in found), default=0)
        report.pairs = pairs.results(len(inv.nodes), found)
        logs = f"`gpuctl logs {inv.cluster} {job_id}`" if job_id is not None else f"`gpuctl logs {inv.cluster}`"
        report.problem = pairs.problem(inv.cluster, report.pairs, report.names) or (
            f"check: rank {problems[0][0]} ({by_rank[problems[0][0]].name}): {problems[0][1]}" if problems else None) or (
            f"check: the pairs' job failed: {failure}; its output: {logs}" if failure else None)
        return report
    ranks_info = [r for rs in recs.values() for r in rs if r.get("kind") == "rank"]
    head = recs.get(0, [])
    procs: list[tuple[int | None, nccllog.ProcessNet]] = []
    if any(r.get("kind") == "method" and r.get("method") == "nccl-tests" for r in head):
        report.method, report.backend = "nccl-tests", "nccl"
        head_lines = list(lines.get(0, ()))
        rows = ncclperf.parse_output(head_lines)
        report.ranks = ncclperf.ranks_in_output(head_lines)
        report.results = [bandwidth.Measurement(r.size_bytes, r.time_us, r.algbw_gbps, r.busbw_gbps) for r in rows]
        wrong = [r for r in rows if r.wrong not in ("0", "N/A", "")]
        procs = [(None, p) for p in nccllog.parse(head_lines)]
    else:
        report.ranks = max((whole_number(r.get("world_size")) or 0 for r in ranks_info), default=0)
        report.backend = next((r.get("backend") for r in ranks_info), None)
        results = [r for r in head if r.get("kind") == "result" and _measured(r)]  # a size without: not measured
        report.results = [bandwidth.measurement(r["size_bytes"], r["time_us"], report.ranks) for r in results]
        wrong = [r for r in results if r.get("wrong")]
        if report.backend == "nccl":
            procs = [(rank, p) for rank in sorted(by_rank) for p in nccllog.parse(lines.get(rank, ()))]
    report.nccl_version = next((p.version for _, p in procs if p.version), None) or next(
        (r.get("nccl") for r in ranks_info if r.get("nccl")), None)

    if report.backend == "gloo":
        report.transport, report.transport_kind = "socket (gloo)", "socket"
        for r in sorted(ranks_info, key=lambda r: whole_number(r.get("rank")) or 0):
            node_rank = whole_number(r.get("node_rank"))
            node = by_rank.get(node_rank) if node_rank is not None else None
            report.per_rank.append({"node": node.name if node else None, "node_rank": node_rank,
                                    "nccl_rank": whole_number(r.get("rank")), "host": r.get("host"),
                                    "transport": "socket (gloo)", "kind": "socket",
                                    "expected": expected.for_rank(node_rank)})
    elif procs:
        for node_rank, proc in procs:
            node = by_rank.get(node_rank) if node_rank is not None else None
            report.per_rank.append({"node": node.name if node else None, "node_rank": node_rank, **proc.doc(),
                                    "expected": expected.for_rank(node_rank)})
        transports = _unique(p.transport for _, p in procs)
        report.transport = transports[0] if len(transports) == 1 else "mixed: " + ", ".join(transports)
        kinds = _unique(p.kind for _, p in procs)
        report.transport_kind = kinds[0] if len(kinds) == 1 else "mixed"
    elif report.backend == "nccl":
        report.transport = "unknown (no NCCL INFO lines in the output)"

    report.problem = _problem(report, inv, options, problems=problems, failure=failure, wrong=bool(wrong),
                              by_rank=by_rank)
    return report


def _unique(values: Any) -> list[Any]:
    seen: list[Any] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _problem(report: Report, inv: Inventory, options: Options, *, problems: list[tuple[int, str]],
             failure: str | None, wrong: bool, by_rank: Mapping[int, Node]) -> str | None:
    """The first thing wrong, as the one line `gpuctl check` fails with; None when all is well."""
    name, exp = inv.cluster, report.expected
    logs = f"`gpuctl logs {name} {report.job_id}`" if report.job_id is not None else f"`gpuctl logs {name}`"
    if problems:
        rank, text = problems[0]
        return f"check: rank {rank} ({by_rank[rank].name}): {text}"
    if failure is not None:
        return f"check: the all_reduce job failed: {failure}; its output: {logs}"
    if not report.results:
        return f"check: no result from rank 0 (the all_reduce printed none); its output: {logs}"
    if len(report.results) < len(options.sizes):
        return f"check: {len(report.results)} of {len(options.sizes)} size(s) measured; its output: {logs}"
    if wrong:
        return f"check: the all_reduce returned wrong sums (a node's memory or network corrupts data); see {logs}"
    if report.backend == "nccl" and not report.per_rank and exp.kind != "socket":
        return (f"check: NCCL printed no NCCL INFO lines, so the transport it used is unknown; cluster '{name}' "
                f"should use {exp.kind} ({exp.source}); see {logs}")
    bad = [e for e in report.per_rank if not fabriccheck.satisfies(e.get("kind"), e["expected"])]
    if bad:
        where = "" if len(bad) == len(report.per_rank) else \
            " on " + ", ".join(_unique(str(e.get("node") or e.get("host")) for e in bad))
        should = "/".join(_unique(e["expected"] for e in bad))
        if report.backend == "gloo":
            return (f"check: torch.distributed used gloo over sockets (no CUDA GPU for NCCL){where} but cluster "
                    f"'{name}' should use {should} ({exp.source}); gloo has no {should} transport, only NCCL "
                    "on GPU nodes can use it")
        used = ", ".join(_unique(e["transport"] for e in bad))
        return (f"check: NCCL used {used}{where} but cluster '{name}' should use {should} ({exp.source}); "
                f"{fabriccheck.hint(should)}; NCCL's lines: {logs}")
    floor = options.min_busbw
    top = bandwidth.largest(report.results)
    if floor is not None and top is not None and top.busbw_gbps < floor:
        return (f"check: busbw {top.busbw_gbps:.1f} GB/s at {bandwidth.human_size(top.size_bytes)} is below "
                f"--min-busbw {floor:g}")
    return None


# -- the command ---------------------------------------------------------------------------


def run_check(inv: Inventory, *, registry: Registry, reporter: Reporter, options: Options) -> Report:
    """Run the all_reduce job on every node and judge it. A failed job is a Report with a problem;
    Ctrl-C (JobCancelled) and UserErrors (a changed host key) pass through."""
    record = registry.cluster(inv.cluster)
    expected = fabriccheck.expected_fabric(override=options.expect_fabric,
                                      fabric_file=fabriccheck.read_fabric_file(cluster_dir(inv.cluster)), cloud=inv.cloud,
                                      request=record.request if record else None)
    if options.pairs and len(inv.nodes) < pairs.MIN_NODES:
        raise UserError(f"--pairs compares pairs of nodes, so it needs {pairs.MIN_NODES} or more; cluster "
                        f"'{inv.cluster}' has {len(inv.nodes)}: `gpuctl check {inv.cluster}` measures them")
    local = get_provider(inv.cloud).local
    spec = JobSpec(name=JOB_NAME, run=run_script(options, python=sys.executable if local else None),
                   envs={**NCCL_ENV, **options.envs}, num_nodes=len(inv.nodes),
                   gpus_per_node=inv.head.gpus, queue_gpus=0)
    runner = _CheckRunner(inv, reporter=reporter, registry=registry)
    job_id, failure = collect.run_probe_job(runner, spec, registry)
    report = analyze(inv, runner.lines, expected, options, job_id=job_id, failure=failure)
    save(cluster_dir(inv.cluster), report)
    return report


PAIRS_FILE = "check-pairs.json"  # the last `check --pairs` (the dashboard's busbw per pair)
CHECK_FILE = "check.json"  # the last `check` (the transport each rank's NCCL chose)


def save(cdir: Path, report: Report) -> None:
    """The report's document, private and replaced whole, beside the cluster's other records."""
    path = Path(cdir) / (PAIRS_FILE if report.pairs is not None else CHECK_FILE)
    if not path.parent.is_dir():
        return
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({**report.document(), "checked_at": time.time()}, fh, sort_keys=True)
    os.replace(tmp, path)


def last(cdir: Path, *, pairs_run: bool) -> dict[str, Any] | None:
    """The last saved report of `check` (or of `check --pairs`), or None."""
    try:
        doc = json.loads((Path(cdir) / (PAIRS_FILE if pairs_run else CHECK_FILE)).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
