"""Pipelines (issue 39) on local netns nodes: SkyPilot's multi-document YAML run as one managed job.

Three stages: `prep` writes a file in its node's home, `train` (the same resources) reads it on the
same cluster (not made again; its setup, the same as prep's, skipped), `eval` asks for two nodes
(a cluster of its own; prep's goes). Every stage logs its runs to a directory under /tmp that every
node sees (outside their homes), so the tests count what ran where. `train` waits for a go file
there, and fails while a fail file is there.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from e2e import Cluster, ManagedJobs, kill_dead, needs_local_nodes, wait_for

from gpuctl.managed.launch import supervisor_alive
from gpuctl.state.registry import Registry

pytestmark = [pytest.mark.integration, needs_local_nodes]

PIPELINE = """\
name: pl
execution: serial
---
name: prep
resources:
  infra: local
setup: echo "setup $GPUCTL_STAGE" >> "$OUT/setups"
run: |
  echo "run $GPUCTL_STAGE $GPUCTL_STAGE_NAME $SKYPILOT_TASK_ID $(hostname) $SKYPILOT_NUM_NODES" >> "$OUT/runs"
  echo data-from-prep > ~/stage-output.txt
---
name: train
resources:
  infra: local
setup: echo "setup $GPUCTL_STAGE" >> "$OUT/setups"
run: |
  echo "run $GPUCTL_STAGE $GPUCTL_STAGE_NAME $SKYPILOT_TASK_ID $(hostname) $SKYPILOT_NUM_NODES" >> "$OUT/runs"
  if [ -e "$OUT/fail-train" ]; then echo "train fails"; exit 3; fi
  while [ ! -e "$OUT/go-train" ]; do sleep 0.2; done
  cat ~/stage-output.txt > "$OUT/train-read" 2>/dev/null || echo none > "$OUT/train-read"
---
name: eval
num_nodes: 2
resources:
  infra: local
run: |
  echo "run $GPUCTL_STAGE $GPUCTL_STAGE_NAME $SKYPILOT_TASK_ID $(hostname) $SKYPILOT_NUM_NODES" >> "$OUT/runs"
  echo "$SKYPILOT_TASK_IDS" | sed -n 1p > "$OUT/first-task-id"
"""


class Pipe(ManagedJobs):
    def __init__(self, root: Path, out: Path) -> None:
        super().__init__(root)
        self.out = out
        self.file = root / "pipeline.yaml"
        self.file.write_text(PIPELINE)

    def launch(self) -> int:
        res = self.gpuctl("jobs", "launch", str(self.file), "-d", "-o", "json", "--env", f"OUT={self.out}").check()
        return int(json.loads(res.stdout)["job"]["id"])

    def stages(self, job_id: int) -> list[dict]:
        return self.job(job_id).launch["pipeline"]["stages"]

    def wait_stage_running(self, job_id: int, index: int, timeout: float = 120) -> None:
        wait_for(f"stage {index} running", lambda: self.runs(index) and self.job(job_id).status == "RUNNING",
                 timeout, interval=0.1)

    def runs(self, stage: int | None = None) -> list[list[str]]:
        path = self.out / "runs"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if stage is None or r[1] == str(stage)]

    def clusters_left(self) -> list[str]:
        root = self.state / "clusters"
        return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def pipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipe]:
    monkeypatch.setenv("GPUCTL_MANAGED_TICK_S", "1")
    out = Path(tempfile.mkdtemp(prefix="gpuctl-pl-", dir="/tmp"))
    out.chmod(0o777)
    p = Pipe(tmp_path, out)
    yield p
    try:
        if p.store.path.exists():
            for job in p.store.all():
                if not job.terminal:
                    p.gpuctl("jobs", "cancel", str(job.id), timeout=300)
        for name in p.clusters_left():
            Cluster(name, p.state).down_quietly()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_stages_run_in_order_reusing_the_cluster_and_a_killed_supervisor_reruns_nothing(pipe: Pipe):
    job = pipe.launch()
    pipe.wait_stage_running(job, 2)
    first = pipe.job(job)
    assert pipe.stages(job)[0]["status"] == "SUCCEEDED" and pipe.stages(job)[1]["cluster"] == first.cluster
    # the supervisor dies while stage 2 runs: the next gpuctl command starts another, which must not
    # run stage 1 again
    kill_dead(first.supervisor_pid)
    pipe.gpuctl("jobs", "queue").check()
    (pipe.out / "go-train").touch()
    done = pipe.wait_status(job, ("SUCCEEDED", "FAILED", "FAILED_SUPERVISOR", "CANCELLED", "LOST"))
    assert done.status == "SUCCEEDED", (done.reason, pipe.supervisor_log(job))
    runs = pipe.runs()
    assert [r[1:3] for r in runs if r[1] != "2"] == [["1", "prep"], ["3", "eval"], ["3", "eval"]], runs
    assert len(pipe.runs(1)) == 1, runs  # stage 1 ran once, though its supervisor was replaced after it
    task_ids = {r[1]: r[3] for r in runs}
    assert len(set(task_ids.values())) == 3 and all(t.endswith(f"-{s}") for s, t in task_ids.items()), task_ids
    assert (pipe.out / "first-task-id").read_text().strip() == task_ids["1"]  # SKYPILOT_TASK_IDS, as SkyPilot's
    # train read what prep left in the node's home: the same node, not made again
    assert (pipe.out / "train-read").read_text().strip() == "data-from-prep"
    assert pipe.runs(1)[0][4] == pipe.runs(2)[0][4]
    assert (pipe.out / "setups").read_text().split("\n")[:-1] == ["setup 1"]  # train's setup, the same: skipped
    stages = pipe.stages(job)
    assert [(s["status"], s["reused"]) for s in stages] == [("SUCCEEDED", False), ("SUCCEEDED", True),
                                                             ("SUCCEEDED", False)]
    assert stages[0]["cluster"] == stages[1]["cluster"] != stages[2]["cluster"]
    made = [s.cluster for s in Registry(pipe.state / "state.db", remote=None).history()]
    assert sorted(made) == sorted([stages[0]["cluster"], stages[2]["cluster"]]), made  # two provisions in all
    assert pipe.clusters_left() == [], pipe.clusters_left()  # every cluster the pipeline made is gone
    text = pipe.gpuctl("jobs", "queue").check().stdout
    assert "└ stage 1 prep: SUCCEEDED" in text and "└ stage 3 eval: SUCCEEDED" in text, text
    logs = pipe.gpuctl("jobs", "logs", str(job), "--no-follow").check().stdout
    banners = [line for line in logs.splitlines() if line.startswith("==== stage")]
    assert banners == ["==== stage 1 of 3: prep ====", "==== stage 2 of 3: train ====",
                       "==== stage 3 of 3: eval ===="], logs
    only = pipe.gpuctl("jobs", "logs", str(job), "--stage", "2", "--no-follow").check().stdout
    assert "stage 2 of 3: train" in only and "prep" not in only and "eval" not in only, only
    doc = json.loads(pipe.gpuctl("jobs", "queue", "-o", "json").check().stdout)["jobs"][0]
    assert doc["pipeline"] == "pl" and [s["name"] for s in doc["stages"]] == ["prep", "train", "eval"]


def test_a_failed_stage_skips_the_rest_and_resume_runs_exactly_from_it(pipe: Pipe):
    (pipe.out / "fail-train").touch()
    (pipe.out / "go-train").touch()
    job = pipe.launch()
    failed = pipe.wait_status(job, ("SUCCEEDED", "FAILED", "FAILED_SUPERVISOR", "CANCELLED", "LOST"))
    assert failed.status == "FAILED" and failed.reason.startswith("stage 2 (train)"), (failed.reason,
                                                                                      pipe.supervisor_log(job))
    assert [s["status"] for s in pipe.stages(job)] == ["SUCCEEDED", "FAILED", "SKIPPED"]
    assert pipe.clusters_left() == []
    (pipe.out / "fail-train").unlink()
    res = pipe.gpuctl("jobs", "resume", str(job), "-d").check()
    assert "resumes from stage 2 (train)" in res.stdout, res.describe()
    done = pipe.wait_status(job, ("SUCCEEDED", "FAILED", "FAILED_SUPERVISOR", "CANCELLED", "LOST"))
    assert done.status == "SUCCEEDED", (done.reason, pipe.supervisor_log(job))
    assert [len(pipe.runs(i)) for i in (1, 2, 3)] == [1, 2, 2], pipe.runs()  # stage 1 kept; 2 and 3 ran
    assert [s["status"] for s in pipe.stages(job)] == ["SUCCEEDED"] * 3
    assert pipe.clusters_left() == []
    refused = pipe.gpuctl("jobs", "resume", str(job))
    assert refused.returncode == 2 and "SUCCEEDED: every stage ran" in refused.stderr, refused.describe()


def test_cancel_mid_stage_leaves_nothing(pipe: Pipe):
    job = pipe.launch()
    pipe.wait_stage_running(job, 2)
    pipe.gpuctl("jobs", "cancel", str(job), "-y").check()
    ended = pipe.wait_status(job, ("CANCELLED",), timeout=120)
    assert [s["status"] for s in pipe.stages(job)] == ["SUCCEEDED", "CANCELLED", "SKIPPED"], ended.reason
    assert pipe.clusters_left() == []
    wait_for("its supervisor ended", lambda: not supervisor_alive(pipe.job(job)), timeout=30)  # nothing runs on


# SkyPilot's pipelines that need no GPU, cloud or bucket (examples/spot_pipeline/single.yaml and
# tests/test_yamls/failed_run_pipeline.yaml), as written there but for their sleeps: end to end.
SINGLE = """\
name: dag-name

---
name: simple-task

resources:
  cpus: 2+
  memory: 8+

setup: |
  echo setup for task 1

run: |
  echo run for task 1

"""
FAILED_RUN = """\
name: pipeline

---
name: train1

num_nodes: 2

setup: |
  echo setup for train

run: |
  echo train starts
  echo train ends

---
name: train2

setup: |
  echo setup for train

run: |
  echo train starts
  echo train ends

---

name: eval1

setup: |
  echo setup for eval

run: |
  echo eval starts
  exit 1

---

name: eval2

setup: |
  echo setup for eval

run: |
  echo eval starts
  echo eval ends
"""


def test_skypilots_cpu_pipelines_end_to_end(pipe: Pipe):
    for text in (SINGLE, FAILED_RUN):
        pipe.file.write_text(text)
        res = pipe.gpuctl("jobs", "launch", str(pipe.file), "--infra", "local", "-o", "json", "-d").check()
        job = int(json.loads(res.stdout)["job"]["id"])
        pipe.wait_status(job, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_SUPERVISOR", "CANCELLED", "LOST"))
    single, failed = pipe.store.all()
    assert single.status == "SUCCEEDED", (single.reason, pipe.supervisor_log(single.id))
    assert "run for task 1" in pipe.gpuctl("jobs", "logs", str(single.id), "--no-follow").check().stdout
    assert failed.status == "FAILED" and failed.reason.startswith("stage 3 (eval1)"), failed.reason
    stages = failed.launch["pipeline"]["stages"]
    assert [s["status"] for s in stages] == ["SUCCEEDED", "SUCCEEDED", "FAILED", "SKIPPED"]
    # train1 on two nodes, then train2 and eval1 on one: a cluster for train1, one for train2 and eval1
    assert stages[0]["cluster"] != stages[1]["cluster"] == stages[2]["cluster"] and stages[2]["reused"]
    logs = pipe.gpuctl("jobs", "logs", str(failed.id), "--no-follow").stdout
    assert "eval starts" in logs and "eval ends" not in logs, logs
    assert pipe.clusters_left() == []
