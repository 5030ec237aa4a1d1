"""examples/ci: the workflow's steps, run as CI runs them, on three runners that share nothing but
the state bucket (moto's S3 on loopback) — `up` on one, `run` on a second, `down` on a third —
with the cluster on local nodes (GPUCTL_INFRA=local). AWS provisioning with shared state and a
fresh runner's `down` is covered against moto's EC2 in test_aws_moto.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import boto3
import pytest
import yaml

from e2e import cluster_netns
from mototest import MotoServer, fake_aws_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ci"
BUCKET = "gpuctl-ci-example"
# the keys of `apply --output json` (README: "Machine-readable output"); a job adds its own
APPLY_KEYS = {"schema", "command", "ok", "cluster", "status", "cloud", "region", "zone", "num_nodes", "nodes",
              "inventory", "job", "phases", "autostop"}


@pytest.fixture()
def moto(tmp_path: Path) -> Iterator[MotoServer]:
    with MotoServer(log=tmp_path / "moto.log") as server:
        boto3.client("s3", region_name="us-east-1", endpoint_url=server.url, aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
        yield server


def step(name: str, runner: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(EXAMPLE / "ci.sh"), name], cwd=EXAMPLE, env={**env, "GPUCTL_STATE_DIR": str(runner)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def test_workflow_steps_on_three_runners(moto: MotoServer, tmp_path: Path, tf_cli_config: Path) -> None:
    out = tmp_path / "artifacts"
    cluster = f"ci-{uuid.uuid4().hex[:6]}"
    env = {**fake_aws_env(moto.url), "GPUCTL_STATE_BUCKET": BUCKET, "GPUCTL_STATE_ENDPOINT_URL": moto.url,
           "GPUCTL_STATE_PREFIX": "ci/acme/train", "GPUCTL_INFRA": "local", "CLUSTER": cluster,
           "GPUCTL": f"{sys.executable} -m gpuctl", "GPUCTL_CI_OUT": str(out),
           "TF_CLI_CONFIG_FILE": str(tf_cli_config)}
    env.pop("GPUCTL_LOCAL_MODE", None)
    before = cluster_netns(cluster)
    try:
        up = step("up", tmp_path / "runner-1", env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert json.loads((out / "validate.json").read_text())["ok"] is True
        doc = json.loads((out / "up.json").read_text())
        assert set(doc) == APPLY_KEYS and doc["job"] is None, doc
        assert (doc["cluster"], doc["status"], len(doc["nodes"])) == (cluster, "UP", 2)
        # armed on the cluster: a runner killed from here on cannot leak it
        assert (doc["autostop"]["down"], doc["autostop"]["idle_minutes"]) == (True, 30), doc

        run = step("run", tmp_path / "runner-2", env)
        assert run.returncode == 0, run.stdout + run.stderr
        ran = json.loads((out / "run.json").read_text())
        assert set(ran) == APPLY_KEYS and ran["ok"] is True, ran
        job = ran["job"]
        assert job["status"] == "SUCCEEDED" and job["returncodes"] == {"0": 0, "1": 0} and job["failed_rank"] is None
        assert "rank 1 of 2" in run.stderr  # rank output goes to stderr; stdout is the JSON document
    finally:
        down = step("down", tmp_path / "runner-3", env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert json.loads((out / "down.json").read_text()) == {"schema": 1, "command": "down", "ok": True,
                                                           "cluster": cluster, "found": True, "destroyed": True}
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0
    assert cluster_netns(cluster) - before == set()
    # again, as a retried teardown job does: the cluster is gone, which is no error (terraform destroy's way)
    again = step("down", tmp_path / "runner-4", env)
    assert again.returncode == 0 and "does not exist; nothing to tear down" in again.stderr, again.stderr
    assert json.loads((out / "down.json").read_text())["found"] is False


def test_workflow_brings_up_trains_and_always_tears_down() -> None:
    flow = yaml.safe_load((EXAMPLE / "github-actions.yml").read_text())
    train, teardown = flow["jobs"]["train"], flow["jobs"]["teardown"]
    runs = [s.get("run", "") for s in train["steps"]]
    assert any("ci.sh up" in r for r in runs) and any("ci.sh run" in r for r in runs)
    assert teardown["needs"] == "train" and teardown["if"] == "always()"
    assert any("ci.sh down" in s.get("run", "") for s in teardown["steps"])
    assert "GPUCTL_STATE_BUCKET" in flow["env"] and "CLUSTER" in flow["env"]
    assert "AWS_SECRET_ACCESS_KEY" not in (EXAMPLE / "github-actions.yml").read_text()  # OIDC, no keys
    assert subprocess.run(["bash", "-n", str(EXAMPLE / "ci.sh")]).returncode == 0
    bad = subprocess.run([str(EXAMPLE / "ci.sh"), "deploy"], env={**os.environ, "GPUCTL_STATE_BUCKET": BUCKET},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown step 'deploy'" in bad.stderr
    unset = subprocess.run([str(EXAMPLE / "ci.sh"), "up"], env={k: v for k, v in os.environ.items()
                                                                if k != "GPUCTL_STATE_BUCKET"},
                           capture_output=True, text=True)
    assert unset.returncode != 0 and "set GPUCTL_STATE_BUCKET" in unset.stderr
