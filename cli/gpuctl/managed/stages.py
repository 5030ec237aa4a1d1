"""A pipeline's stages, kept in its managed job's row (`launch["pipeline"]`).

A pipeline (spec/pipeline.py) runs as one managed job whose stages run one after another. Which
stage runs, and how each one that ran ended (its cluster, its attempts, when, why), is part of
the job's row: written in the same transaction as the rest of the row (the stage that succeeded
and the next one's start are one write, so a supervisor that restarts never runs a succeeded
stage again), and carried with the row to the state bucket with shared state.

These are pure functions over that dict; the supervisor does the I/O.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Mapping

from gpuctl.managed.store import ManagedJob
from gpuctl.spec.pipeline import stage_env

# what a cluster is made of: two stages asking the same run on one cluster, the next on the same nodes
SHAPE_FIELDS = ("cloud", "region", "zone", "instance_type", "accelerator", "gpus_per_node", "cpus", "memory",
                "use_spot", "disk_size", "image_id", "network_tier", "num_nodes", "inventory_path")


def new(name: str | None, stages: list[tuple[str, int]], first_cluster: str, base_task_id: str) -> dict[str, Any]:
    """The pipeline's record at launch: every stage PENDING, the first one current."""
    return {"name": name, "current": 1, "task_id": base_task_id, "clusters": [first_cluster],
            "stages": [{"index": i, "name": n, "line": line, "status": "PENDING", "cluster": None,
                        "task_id": None, "first_attempt": None, "last_attempt": None, "started_at": None,
                        "ended_at": None, "reason": None, "reused": False, "setup_skipped": False}
                       for i, (n, line) in enumerate(stages, start=1)]}


def of(job: ManagedJob) -> dict[str, Any] | None:
    record = job.launch.get("pipeline")
    return record if isinstance(record, dict) and record.get("stages") else None


def current(record: Mapping[str, Any]) -> dict[str, Any]:
    return record["stages"][int(record["current"]) - 1]


def task_id(record: Mapping[str, Any], index: int) -> str:
    """SKYPILOT_TASK_ID of stage `index`: the job's id with the stage, as SkyPilot numbers a
    pipeline's tasks."""
    return f"{record['task_id']}-{index}"


def job_vars(record: Mapping[str, Any], stage: Mapping[str, Any]) -> dict[str, str]:
    """What the stage's ranks are told of the pipeline: which stage they are, and (SkyPilot's
    SKYPILOT_TASK_IDS) every stage's task id, one a line: a later stage finds an earlier one's
    outputs under its id."""
    return {**stage_env(stage["index"], stage["name"]),
            "SKYPILOT_TASK_IDS": "\n".join(task_id(record, s["index"]) for s in record["stages"])}


def started(launch: Mapping[str, Any], *, cluster: str, attempt: int) -> dict[str, Any]:
    """The current stage has begun (its first attempt is `attempt`, on `cluster`)."""
    out = copy.deepcopy(dict(launch))
    stage = current(out["pipeline"])
    if stage["status"] != "RUNNING":
        stage.update(status="RUNNING", started_at=stage["started_at"] or time.time(), ended_at=None, reason=None)
    if stage["first_attempt"] is None:
        stage["first_attempt"] = attempt
    stage["last_attempt"] = attempt
    stage["cluster"] = cluster
    stage["task_id"] = task_id(out["pipeline"], stage["index"])
    return out


def closed(launch: Mapping[str, Any], status: str, reason: str | None, *, attempt: int) -> dict[str, Any]:
    """The current stage ended `status`; the stages after it, when it did not succeed, are SKIPPED."""
    out = copy.deepcopy(dict(launch))
    record = out["pipeline"]
    stage = current(record)
    stage.update(status=status, ended_at=time.time(), reason=reason)
    if stage["first_attempt"] is not None:
        stage["last_attempt"] = max(attempt, stage["first_attempt"])
    if status != "SUCCEEDED":
        for later in record["stages"][stage["index"]:]:
            if later["status"] == "PENDING":
                later.update(status="SKIPPED", reason=f"stage {stage['index']} ({stage['name']}) ended {status}")
    return out


def advanced(launch: Mapping[str, Any], *, cluster: str, reused: bool = False,
             setup_skipped: bool = False) -> dict[str, Any]:
    """The next stage is current, on `cluster` (`reused`: the stage before's, as it is)."""
    out = copy.deepcopy(dict(launch))
    record = out["pipeline"]
    record["current"] = int(record["current"]) + 1
    nxt = current(record)
    nxt.update(cluster=cluster, reused=reused, setup_skipped=setup_skipped)
    if cluster not in record["clusters"]:
        record["clusters"].append(cluster)
    return out


def not_reused(launch: Mapping[str, Any]) -> dict[str, Any]:
    """The current stage's cluster was made again (the stage before's went meanwhile): its setup runs."""
    out = copy.deepcopy(dict(launch))
    current(out["pipeline"]).update(reused=False, setup_skipped=False)
    return out


def same_setup(before: Any, after: Any) -> bool:
    """Whether a stage's setup would do on the nodes what the stage before's did (spec Tasks): the
    same script, in the same environment, workdir, files and container."""
    fields = ("setup", "envs", "workdir", "file_mounts", "container_image")
    return all(getattr(before, f, None) == getattr(after, f, None) for f in fields)


def resumed(launch: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """`jobs resume`: from the first stage that did not succeed, every stage from it on PENDING
    again; the stages that succeeded are kept. A stage's attempts so far stay its own (attempts are
    numbered across the stages, and a skipped stage had none). (the launch, that stage's index)"""
    out = copy.deepcopy(dict(launch))
    record = out["pipeline"]
    first = next(s for s in record["stages"] if s["status"] != "SUCCEEDED")
    for stage in record["stages"][first["index"] - 1:]:
        stage.update(status="PENDING", cluster=None, task_id=None, ended_at=None, reason=None, reused=False,
                     setup_skipped=False)
    record["current"] = first["index"]
    return out, first["index"]


def same_cluster(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether a stage asking `b` (a cluster request, as a dict) runs on the cluster made for `a`."""
    return all(a.get(f) == b.get(f) for f in SHAPE_FIELDS)


def stage_of_attempt(record: Mapping[str, Any], attempt: int) -> dict[str, Any] | None:
    """The stage attempt `attempt` belonged to (attempts are numbered across the stages)."""
    for stage in record["stages"]:
        first, last = stage.get("first_attempt"), stage.get("last_attempt")
        if first is not None and first <= attempt <= (last if last is not None else first):
            return stage
    return None
