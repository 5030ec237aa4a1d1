"""What the dashboard's pages show, read from the state the CLI writes: the registry, the managed
jobs' store and each cluster's records (inventory, fabric, health, checks, bring-up phases).

Reads only: no page waits on a node (what only a head knows, the autostop idle time, comes from
headwatch.py's cache). A list is read in one query, sorted and filtered on what the rows hold, and
only the rows of the page shown get their files read, so 1,000 clusters or 10,000 jobs cost one
page's worth. Text that came from nodes is already `printable` where it was recorded; the
templates escape everything else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gpuctl.common.paths import cluster_dir
from gpuctl.configplane import fabricrecord
from gpuctl.healthcheck import command as checkcommand
from gpuctl.healthcheck import health
from gpuctl.jobplane import autostop, joblogs
from gpuctl.managed import store as managed_store
from gpuctl.provision import bringuprecord
from gpuctl.provision.provisioner import load_inventory_of
from gpuctl.state import costs
from gpuctl.state.registry import TERMINAL_JOB_STATES, ClusterRecord, JobRecord, Registry, Segment

PER_PAGE = 50
MAX_PER_PAGE = 200  # no answer grows with the state: a page is at most this many rows


@dataclass(frozen=True)
class Page:
    """One page of a list: its rows, where it starts, and how many rows match in all."""

    rows: list[dict[str, Any]]
    number: int
    per_page: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))


def page_bounds(page: int, per_page: int) -> tuple[int, int]:
    """(page, per_page) brought into range: pages from 1, at most MAX_PER_PAGE rows."""
    return max(1, page), min(max(1, per_page), MAX_PER_PAGE)


def infra(record: ClusterRecord) -> str:
    return "/".join(p for p in (record.cloud, record.region, record.zone) if p)


def accelerators(request: dict[str, Any]) -> str:
    """"H100:8" per node, as `resources.accelerators` says it; "-" for CPU nodes."""
    name, count = request.get("accelerator"), request.get("gpus_per_node") or 0
    return f"{name}:{count}" if name else (f"{count} GPU(s)" if count else "-")


# -- clusters ------------------------------------------------------------------------------------

CLUSTER_SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "name": lambda r: r["name"], "status": lambda r: r["status"], "infra": lambda r: r["infra"],
    "nodes": lambda r: r["num_nodes"], "age": lambda r: r["age_s"],
    "cost": lambda r: r["cost_so_far"] if r["cost_so_far"] is not None else -1.0,
    "per_hour": lambda r: r["per_hour"] if r["per_hour"] is not None else -1.0,
}


def clusters(registry: Registry, *, query: str = "", status: str = "", sort: str = "name", descending: bool = False,
             page: int = 1, per_page: int = PER_PAGE, idle: Callable[[str], dict[str, Any] | None] | None = None,
             now: float | None = None) -> Page:
    """The clusters that are up (or stopped, or being made), filtered, sorted, one page; each row
    of the page with its fabric, health summary and autostop setting."""
    now = time.time() if now is None else now
    page, per_page = page_bounds(page, per_page)
    by_cluster: dict[str, list[Segment]] = {}
    for seg in registry.history():
        by_cluster.setdefault(seg.cluster, []).append(seg)
    rows = []
    needle = query.strip().lower()
    for rec in registry.clusters():
        if needle and needle not in rec.name.lower() or status and rec.status != status:
            continue
        rows.append({"name": rec.name, "status": rec.status, "infra": infra(rec), "cloud": rec.cloud,
                     "num_nodes": rec.num_nodes, "accelerators": accelerators(rec.request),
                     "instance_type": rec.request.get("instance_type"), "created_at": rec.created_at,
                     **costs.cluster_cost(rec.name, registry, rec.created_at, now,
                                          history=by_cluster.get(rec.name, []))})
    rows.sort(key=CLUSTER_SORTS.get(sort, CLUSTER_SORTS["name"]), reverse=descending)
    shown = rows[(page - 1) * per_page: page * per_page]
    for row in shown:
        row.update(_cluster_extras(row["name"], idle, now))
    return Page(shown, page, per_page, len(rows))


def _cluster_extras(name: str, idle: Callable[[str], dict[str, Any] | None] | None, now: float) -> dict[str, Any]:
    """A listed cluster's fabric, health summary and autostop (with time left, where a head said)."""
    cdir = cluster_dir(name)
    try:
        inv = load_inventory_of(name)
    except Exception:  # noqa: BLE001 - an unreadable inventory is shown as none, not as a broken page
        inv = None
    return {"fabric": (fabricrecord.load_fabric(cdir) or {}).get("kind"),
            "health": _health_summary(health.last_verdicts(cdir, inv) if inv is not None else {}),
            **_autostop_view(name, idle, now)}


def _health_summary(verdicts: Mapping[int, Mapping[str, Any]]) -> str | None:
    """"2 healthy, 1 unhealthy": how many nodes had each verdict at the last check; None if never checked."""
    counts: dict[str, int] = {}
    for entry in verdicts.values():
        counts[entry["verdict"]] = counts.get(entry["verdict"], 0) + 1
    return ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items())) or None


def _autostop_view(name: str, idle: Callable[[str], dict[str, Any] | None] | None, now: float) -> dict[str, Any]:
    """The cluster's autostop setting, and the time left as its head last said (headwatch)."""
    setting = autostop.saved(name)
    seen = idle(name) if idle is not None and setting is not None else None
    left = None
    if setting is not None and seen and seen.get("idle_s") is not None:
        left = max(0.0, setting.idle_minutes * autostop.minute_seconds() - seen["idle_s"] - (now - seen["at"]))
    return {"autostop": setting.describe() if setting is not None else None,
            "autostop_left_s": left, "autostop_seen_at": seen.get("at") if seen else None}


GONE_SORTS = {"name": lambda r: r["name"], "ended": lambda r: r["ended_at"] or 0.0,
              "cost": lambda r: r["cost"] if r["cost"] is not None else -1.0}


def gone_clusters(registry: Registry, *, query: str = "", page: int = 1, per_page: int = PER_PAGE,
                  now: float | None = None) -> Page:
    """The history tab: clusters that are gone (down, autodowned, or taken down by another runner),
    each with its last life: launched, ended and how, what it cost in all."""
    now = time.time() if now is None else now
    page, per_page = page_bounds(page, per_page)
    names = {r.name for r in registry.clusters()}
    lives: dict[str, list[dict[str, Any]]] = {}
    for seg in registry.history():
        if seg.cluster not in names:
            lives.setdefault(seg.cluster, []).append(costs.segment_row(seg, names, now))
    needle = query.strip().lower()
    rows = []
    for name, segs in lives.items():
        if needle and needle not in name.lower():
            continue
        last = segs[-1]
        known = [s["cost"] for s in segs if s["cost"] is not None]
        rows.append({"name": name, "status": last["status"], "cloud": last["cloud"], "region": last["region"],
                     "num_nodes": last["num_nodes"], "instance_type": last["instance_type"],
                     "launched_at": segs[0]["launched_at"], "ended_at": last["ended_at"],
                     "no_cloud_bill": all(s["no_cloud_bill"] for s in segs),
                     "cost": round(sum(known), 4) if len(known) == len(segs) else None})
    rows.sort(key=lambda r: r["ended_at"] or 0.0, reverse=True)
    return Page(rows[(page - 1) * per_page: page * per_page], page, per_page, len(rows))


def cluster(registry: Registry, name: str, *, idle: Callable[[str], dict[str, Any] | None] | None = None,
            now: float | None = None) -> dict[str, Any] | None:
    """One cluster: its nodes (fabric, NCCL transport, health verdict and findings), its bring-up
    timeline, its jobs and the last `check --pairs` as a matrix. None when neither the registry
    nor a kept job knows the name."""
    now = time.time() if now is None else now
    rec = registry.cluster(name)
    jobs = registry.jobs(name)
    if rec is None and not jobs:
        return None
    cdir = cluster_dir(name)
    inv = load_inventory_of(name) if rec is not None else None
    fabric = fabricrecord.load_fabric(cdir) or {}
    by_rank = {n.get("rank"): n for n in fabric.get("nodes", []) if isinstance(n, dict)}
    verdicts = health.last_verdicts(cdir, inv) if inv is not None else {}
    check = checkcommand.last(cdir, pairs_run=False) or {}
    transports = {}
    for entry in check.get("per_rank") or []:
        if isinstance(entry, dict):
            transports[str(entry.get("node") or entry.get("host"))] = str(entry.get("transport") or "")
    nodes = []
    for node in inv.nodes if inv is not None else ():
        found = by_rank.get(node.rank)
        verdict = verdicts.get(node.rank)
        nodes.append({"rank": node.rank, "name": node.name, "address": node.address, "gpus": node.gpus,
                      "ssh": f"{node.ssh_user}@{node.ssh_host}:{node.ssh_port}",
                      "fabric": fabricrecord.node_line(found) if found else None,
                      "transport": transports.get(node.name) or (check.get("transport") if check else None),
                      "verdict": verdict["verdict"] if verdict else None,
                      "action": verdict.get("action") if verdict else None,
                      "findings": verdict.get("findings", []) if verdict else [],
                      "checked_at": verdict.get("checked_at") if verdict else None})
    doc: dict[str, Any] = {
        "name": name, "exists": rec is not None, "status": rec.status if rec else "GONE",
        "infra": infra(rec) if rec else None, "num_nodes": rec.num_nodes if rec else None,
        "accelerators": accelerators(rec.request) if rec else None,
        "instance_type": rec.request.get("instance_type") if rec else None,
        "created_at": rec.created_at if rec else None, "nodes": nodes, "fabric": fabric.get("kind"),
        "jobs": [job_row(j, now) for j in reversed(jobs)],
        "timeline": timeline(bringuprecord.load(cdir) if rec else [], jobs[-1] if jobs else None, now),
        "pairs": pair_matrix(checkcommand.last(cdir, pairs_run=True), [n["name"] for n in nodes]),
        "check": {"transport": check.get("transport"), "expected": check.get("expected_fabric"),
                  "problem": check.get("problem"), "checked_at": check.get("checked_at")} if check else None,
    }
    if rec is not None:
        doc.update(costs.cluster_cost(name, registry, rec.created_at, now))
        doc.update(_autostop_view(name, idle, now), health=_health_summary(verdicts))  # the files read above
    return doc


def timeline(phases: Sequence[dict[str, Any]], last_job: JobRecord | None, now: float) -> dict[str, Any] | None:
    """The bring-up's phases and the job after them as bars on one time axis (percent of the span):
    provision, prepare (and the wait for SSH, and the head's install inside it), then the job."""
    bars = [{"label": p["phase"], "start": float(p["started_at"]), "end": float(p["started_at"]) + float(p["seconds"]),
             "inner": p["phase"] in ("wait", "head_install")} for p in phases if p["phase"] != "job"]
    if last_job is not None and last_job.started_at and bars and last_job.started_at >= bars[0]["start"]:
        bars.append({"label": f"job {last_job.job_id}", "start": last_job.started_at,
                     "end": last_job.ended_at or now, "inner": False})
    if not bars:
        return None
    first, last = min(b["start"] for b in bars), max(b["end"] for b in bars)
    span = max(last - first, 1e-3)
    for bar in bars:
        bar["seconds"] = round(bar["end"] - bar["start"], 2)
        bar["left"] = round(100 * (bar["start"] - first) / span, 2)
        bar["width"] = max(0.5, round(100 * (bar["end"] - bar["start"]) / span, 2))
    return {"bars": bars, "span_s": round(span, 2), "started_at": first}


def pair_matrix(report: dict[str, Any] | None, names: Sequence[str]) -> dict[str, Any] | None:
    """The last `check --pairs` as an N x N matrix of busbw (GB/s) with a shade per cell: the best
    pair darkest, a slow pair (under pairs.SLOW_RATIO of it) marked."""
    if not report or not isinstance(report.get("pairs"), list):
        return None
    pairs = [p for p in report["pairs"] if isinstance(p, dict) and isinstance(p.get("ranks"), list)]
    size = max([len(names)] + [max(p["ranks"]) + 1 for p in pairs if p["ranks"]])
    labels = [names[i] if i < len(names) else str(i) for i in range(size)]
    best = max((float(p.get("busbw_gbps") or 0) for p in pairs), default=0.0)
    cells: list[list[dict[str, Any] | None]] = [[None] * size for _ in range(size)]
    from gpuctl.healthcheck.pairs import SLOW_RATIO  # the threshold `check --pairs` judges with

    for p in pairs:
        a, b = int(p["ranks"][0]), int(p["ranks"][1])
        busbw = float(p.get("busbw_gbps") or 0)
        cell = {"busbw": busbw, "shade": round(busbw / best, 3) if best else 0.0,
                "slow": busbw <= 0 or busbw < SLOW_RATIO * best or bool(p.get("wrong"))}
        cells[a][b] = cells[b][a] = cell
    return {"labels": labels, "cells": cells, "best": best, "checked_at": report.get("checked_at"),
            "slow_nodes": report.get("slow_nodes") or [], "problem": report.get("problem")}


# -- jobs ----------------------------------------------------------------------------------------


def job_row(job: JobRecord, now: float) -> dict[str, Any]:
    end = job.ended_at or (now if job.status not in TERMINAL_JOB_STATES else None)
    failed = job.failed_rank
    return {"cluster": job.cluster, "id": job.job_id, "name": job.name or "-", "user": job.user or "-",
            "status": job.status, "submitted_at": job.submitted_at, "started_at": job.started_at,
            "ended_at": job.ended_at, "num_nodes": job.num_nodes, "detail": job.detail,
            "duration_s": round(end - job.started_at, 1) if job.started_at and end else None,
            "failed_rank": failed, "exit_code": job.returncodes.get(failed) if failed is not None else
            next((c for _, c in sorted(job.returncodes.items()) if c), None),
            "ended": job.status in TERMINAL_JOB_STATES}


def jobs(registry: Registry, *, cluster: str | None = None, status: str | None = None, page: int = 1,
         per_page: int = PER_PAGE, now: float | None = None) -> Page:
    now = time.time() if now is None else now
    page, per_page = page_bounds(page, per_page)
    total, rows = registry.job_page(offset=(page - 1) * per_page, limit=per_page, cluster=cluster or None,
                                    status=status or None)
    return Page([job_row(j, now) for j in rows], page, per_page, total)


def job(registry: Registry, name: str, job_id: int, now: float | None = None) -> dict[str, Any] | None:
    """A job's row and its ranks: node, exit code (from the inventory, else the kept log's names)."""
    now = time.time() if now is None else now
    record = registry.job(name, job_id)
    if record is None:
        return None
    inv = load_inventory_of(name) if registry.cluster(name) is not None else None
    names = {n.rank: n.name for n in inv.nodes} if inv is not None else {}
    saved = joblogs.saved_dir(name, job_id, record.node_job)
    if saved is not None:
        names = {**joblogs.saved_names(saved), **names}
    ranks = [{"rank": r, "node": names.get(r, "-"), "exit_code": record.returncodes.get(r)}
             for r in range(record.num_nodes)]
    return {**job_row(record, now), "ranks": ranks, "cluster_exists": inv is not None,
            "log_saved": saved is not None}


# -- managed jobs ----------------------------------------------------------------------------------


def managed_jobs(store: managed_store.Store, *, page: int = 1, per_page: int = PER_PAGE,
                 now: float | None = None) -> Page:
    now = time.time() if now is None else now
    page, per_page = page_bounds(page, per_page)
    every = list(reversed(store.all())) if store.path.exists() else []
    rows = []
    for j in every[(page - 1) * per_page: page * per_page]:
        events = store.events(j.id)
        rows.append({**managed_store.job_document(j, events), "detail": managed_store.last_cause(j, events),
                     "duration_s": round((j.ended_at or now) - j.started_at, 1) if j.started_at else None})
    return Page(rows, page, per_page, len(every))


def managed_job(store: managed_store.Store, job_id: int, now: float | None = None) -> dict[str, Any] | None:
    """A managed job, its recoveries as a timeline (cause, nodes replaced, when detected, how long
    until every rank ran again) and its attempts' logs."""
    now = time.time() if now is None else now
    j = store.get(job_id) if store.path.exists() else None
    if j is None:
        return None
    events = store.events(job_id)
    doc = managed_store.job_document(j, events)
    for event in doc["events"]:
        event["back_after_s"] = (round(event["resumed_at"] - event["detected_at"], 1)
                                 if event["resumed_at"] else None)
    attempts = [k for k in range(1, j.attempt + 1) if managed_store.attempt_log(job_id, k).exists()]
    return {**doc, "detail": managed_store.last_cause(j, events), "attempts": attempts,
            "duration_s": round((j.ended_at or now) - j.started_at, 1) if j.started_at else None,
            "terminal": j.terminal}


def attempt_text(job_id: int, attempt: int) -> str | None:
    path = managed_store.attempt_log(job_id, attempt)
    return path.read_text(errors="replace") if path.is_file() else None


# -- cost ----------------------------------------------------------------------------------------


def cost(registry: Registry, *, page: int = 1, per_page: int = 100, days: int = 30,
         now: float | None = None) -> dict[str, Any]:
    """`cost-report`'s rows (a page of them, the latest first), the total, and two charts: the cost
    of each cluster (the costliest first) and of each day (local time), over every segment."""
    now = time.time() if now is None else now
    page, per_page = page_bounds(page, per_page)
    names = {r.name for r in registry.clusters()}
    segments = registry.history()
    rows = [costs.segment_row(s, names, now) for s in segments]
    billed = [r for r in rows if r["cost"] is not None and not r["no_cloud_bill"]]
    per_cluster: dict[str, float] = {}
    for r in billed:
        per_cluster[r["name"]] = per_cluster.get(r["name"], 0.0) + r["cost"]
    per_day: dict[str, float] = {}
    edges = day_edges(now, days)
    for seg in segments:
        if seg.node_price in (None, 0.0):
            continue
        spread_by_day(seg, seg.started_at, seg.ended_at or now, edges, per_day)
    top = sorted(per_cluster.items(), key=lambda kv: -kv[1])
    ordered = list(reversed(rows))
    return {"rows": Page(ordered[(page - 1) * per_page: page * per_page], page, per_page, len(rows)),
            "total": round(sum(r["cost"] for r in billed), 2), "unknown": sum(1 for r in rows if r["cost"] is None),
            "by_cluster": bars(top[:15], others=sum(v for _, v in top[15:])),
            "by_day": bars(sorted(per_day.items())[-days:])}


def day_edges(now: float, days: int) -> list[tuple[str, float, float]]:
    """The last `days` local days up to `now`: (date, start, end) each, oldest first."""
    edges = []
    lt = time.localtime(now)
    for back in range(days - 1, -1, -1):
        start = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday - back, 0, 0, 0, 0, 0, -1))
        end = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday - back + 1, 0, 0, 0, 0, 0, -1))
        edges.append((time.strftime("%Y-%m-%d", time.localtime(start)), start, end))
    return edges


def spread_by_day(seg: Segment, start: float, end: float, edges: Sequence[tuple[str, float, float]],
                  out: dict[str, float]) -> None:
    """What the segment cost on each of the days in `edges` (its stretch outside them is not charted)."""
    rate = (seg.node_price or 0.0) * seg.num_nodes / 3600.0
    for day, day_start, day_end in edges:
        overlap = min(end, day_end) - max(start, day_start)
        if overlap > 0:
            out[day] = out.get(day, 0.0) + rate * overlap


def bars(items: Sequence[tuple[str, float]], others: float = 0.0) -> list[dict[str, Any]]:
    """Chart bars: label, value and width in percent of the largest."""
    items = list(items) + ([("others", others)] if others > 0 else [])
    top = max((v for _, v in items), default=0.0)
    return [{"label": k, "value": round(v, 2), "width": round(100 * v / top, 1) if top else 0.0} for k, v in items]
