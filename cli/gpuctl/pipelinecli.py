"""`gpuctl validate` of a SkyPilot pipeline (several tasks in one file, spec/pipeline.py): every
stage checked as `validate` checks a task, each problem naming its stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import typer

from gpuctl.common import output

if TYPE_CHECKING:
    from gpuctl.spec.request import ClusterRequest


def validate(file: Path, text: str, *, load: Callable[[str], Any], request: Callable[[Any], ClusterRequest],
             check: Callable[[Any, ClusterRequest], None], as_json: bool) -> None:
    """Load and check every stage (`load(text)`, `request(task)`, `check(task, req)`: validate's
    own steps); print one line per stage, or the JSON document."""
    from gpuctl import costcli
    from gpuctl.providers import get_provider, price_quote
    from gpuctl.spec.pipeline import load_pipeline

    requests: dict[int, ClusterRequest] = {}

    def check_stage(task: Any, stage_text: str) -> None:
        req = request(task)
        check(task, req)
        requests[id(task)] = req

    pipeline = load_pipeline(file, text=text, load_stage=lambda source, stage_text: load(stage_text),
                             check_stage=check_stage)
    rows = []
    for stage in pipeline.stages:
        req = requests[id(stage.task)]
        warnings = [*stage.task.warnings, *get_provider(req.cloud).task_warnings(stage.task, req)]
        for line in warnings:  # as validate says them of a task, each naming its stage
            typer.echo(f"warning: stage {stage.index} ({stage.name}): {line}", err=True)
        price, _ = price_quote(req)
        rows.append({"stage": stage.index, "name": stage.name, "line": stage.line, "num_nodes": req.num_nodes,
                     "cloud": req.cloud, "region": req.region, "instance_type": get_provider(req.cloud).instance_type(req),
                     "accelerator": req.accelerator, "gpus_per_node": req.gpus_per_node,
                     "warnings": warnings, "job_recovery": stage.task.resources.job_recovery.describe()
                     if stage.task.resources.job_recovery else None,
                     "price": costcli.document(price, req.num_nodes, req.use_spot)})
    if as_json:
        output.emit("validate", {"ok": True, "file": str(file), "pipeline": pipeline.name, "stages": rows})
        return
    typer.echo(f"{file}: OK: pipeline {pipeline.name or '(unnamed)'}, {len(rows)} stage(s), run one after "
               "another")
    for row in rows:
        gpus = f", {row['accelerator']}:{row['gpus_per_node']}" if row["accelerator"] else ""
        kind = f", {row['instance_type']}" if row["instance_type"] else ""
        typer.echo(f"  stage {row['stage']} ({row['name']}): {row['num_nodes']} node(s) on {row['cloud']}{kind}{gpus}")
