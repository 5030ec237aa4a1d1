"""managed/stages.py: a pipeline's stage record as the job's row carries it, and the store taking a
pipeline's row from the state bucket although its task id changes with every stage."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from gpuctl.managed import stages
from gpuctl.managed.store import Store


def launch(n: int = 3) -> dict:
    return {"cluster_token": "tok", "pipeline": stages.new("pl", [(f"s{i}", i) for i in range(1, n + 1)], "pl-mj1",
                                                             "base")}


def test_a_stage_starts_ends_and_hands_over():
    doc = stages.started(launch(), cluster="pl-mj1", attempt=1)
    first = stages.current(doc["pipeline"])
    assert (first["status"], first["first_attempt"], first["task_id"]) == ("RUNNING", 1, "base-1")
    doc = stages.started(doc, cluster="pl-mj1", attempt=2)  # a recovery: the same stage's next attempt
    doc = stages.closed(doc, "SUCCEEDED", None, attempt=2)
    doc = stages.advanced(doc, cluster="pl-mj1", reused=True, setup_skipped=True)
    record = doc["pipeline"]
    assert record["current"] == 2 and stages.stage_of_attempt(record, 2)["name"] == "s1"
    assert stages.current(record)["reused"] and not stages.current(stages.not_reused(doc)["pipeline"])["reused"]
    failed = stages.closed(stages.started(doc, cluster="pl-mj1", attempt=3), "FAILED", "exit 3", attempt=3)
    assert [s["status"] for s in failed["pipeline"]["stages"]] == ["SUCCEEDED", "FAILED", "SKIPPED"]
    again, first_left = stages.resumed(failed)
    assert first_left == 2 and [s["status"] for s in again["pipeline"]["stages"]] == ["SUCCEEDED", "PENDING", "PENDING"]
    assert stages.stage_of_attempt(again["pipeline"], 3)["name"] == "s2"  # its earlier attempt stays its own


def test_what_a_stage_may_share_with_the_one_before():
    a = {"cloud": "local", "num_nodes": 1, "accelerator": None, "name": "x"}
    assert stages.same_cluster(a, {**a, "name": "y"}) and not stages.same_cluster(a, {**a, "num_nodes": 2})
    task = SimpleNamespace(setup="pip install x", envs={"A": "1"}, workdir=None, file_mounts={}, container_image=None)
    assert stages.same_setup(task, SimpleNamespace(**vars(task)))
    assert not stages.same_setup(task, SimpleNamespace(**{**vars(task), "envs": {"A": "2"}}))


def test_the_bucket_row_of_a_pipeline_is_taken_though_its_task_id_changed(tmp_path: Path):
    store = Store(tmp_path / "managed.db", remote=None)
    job = store.create(name="pl", launch=launch(), cluster_of=lambda i: "pl-mj1", task_id_of=lambda i: "base-1")
    theirs = {**asdict(job), "task_id": "base-2", "status": "RUNNING"}  # another runner's supervisor, stage 2
    assert store._import({"job": theirs, "events": []}, store.get(job.id))
    assert (store.get(job.id).task_id, store.get(job.id).status) == ("base-2", "RUNNING")
    other = {**theirs, "launch": {"cluster_token": "another"}}  # another job that had this id before sharing
    assert not store._import({"job": other, "events": []}, store.get(job.id))
