"""An AWS cluster that stopped or terminated itself (its head shut the nodes down) is seen as such by
`status`, against moto: EC2 is asked once, only for a cluster that holds an autostop setting.

The nodes here are moto instances made by boto3 with the cluster's files written as apply would
(inventory, the saved setting, the registry row); what is under test is the controller's reading."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import gpuctlfork
import pytest

from mototest import MotoServer, fake_aws_env
from gpuctl.provision.ansibleinventory import write_inventory
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.spec.autostop import Autostop
from gpuctl.state.registry import Registry

pytestmark = pytest.mark.integration


def make_cluster(state: Path, name: str, ids: list[str], *, autostop: bool) -> None:
    cdir = state / "clusters" / name
    nodes = tuple(Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=i, address=f"10.0.0.{r + 2}",
                       ssh_host=f"10.0.0.{r + 2}", ssh_user="ubuntu") for r, i in enumerate(ids))
    write_inventory(Inventory(cluster=name, cloud="aws", nodes=nodes, region="us-east-1"), cdir / "inventory.yml")
    if autostop:
        (cdir / "autostop.json").write_text(json.dumps(Autostop(idle_minutes=5, down=False).as_dict()))
    registry = Registry(path=state / "state.db", remote=None)
    registry.upsert_cluster(name, cloud="aws", region="us-east-1", zone="us-east-1a", num_nodes=len(ids), status="UP",
                            request={"instance_type": "p5.48xlarge", "region": "us-east-1"})
    registry.open_segment(name, cloud="aws", region="us-east-1", instance_type="p5.48xlarge", num_nodes=len(ids),
                          use_spot=False, node_price=55.04, price_source="list")


def status(state: Path, env: dict[str, str], name: str) -> dict:
    proc = gpuctlfork.run(["status", name, "-o", "json"],
                          env={**env, "GPUCTL_STATE_DIR": str(state)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["clusters"][0]


def test_status_sees_an_aws_cluster_that_stopped_or_terminated_itself(tmp_path: Path) -> None:
    with MotoServer() as moto:
        env = fake_aws_env(moto.url)
        ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                           aws_secret_access_key="testing")
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]

        def instances(count: int) -> list[str]:
            made = ec2.run_instances(ImageId=image, MinCount=count, MaxCount=count, InstanceType="m6i.large")
            return [i["InstanceId"] for i in made["Instances"]]

        state = tmp_path / "state"
        stopped, gone, manual = instances(2), instances(2), instances(1)
        make_cluster(state, "stops", stopped, autostop=True)
        make_cluster(state, "goes", gone, autostop=True)
        make_cluster(state, "plain", manual, autostop=False)
        ec2.stop_instances(InstanceIds=stopped)
        ec2.terminate_instances(InstanceIds=gone)
        ec2.stop_instances(InstanceIds=manual)  # no autostop setting: not its own doing, EC2 is not asked

        doc = status(state, env, "stops")
        assert doc["status"] == "STOPPED" and doc["stopped_at"] > 0, doc
        doc = status(state, env, "goes")
        assert doc["status"] == "AUTODOWNED" and doc["autodowned_at"] > 0, doc
        assert status(state, env, "plain")["status"] == "UP"
        text = gpuctlfork.run(["status"],
                              env={**env, "GPUCTL_STATE_DIR": str(state)}, timeout=120).stdout
        assert "stops: STOPPED" in text and "its disks still bill" in text and "goes: AUTODOWNED" in text
        # the history stopped counting at that time (test_aws_moto.py: apply starts a stopped cluster again)
        lives = {s.cluster: s for s in Registry(path=state / "state.db", remote=None).history()}
        assert (lives["stops"].ended_how, lives["goes"].ended_how, lives["plain"].ended_how) == \
            ("stopped", "autodown", None)
        report = json.loads(gpuctlfork.run(["cost-report", "-o", "json"],
                                           env={**env, "GPUCTL_STATE_DIR": str(state)},
                                           timeout=120).stdout)
        assert {r["name"]: r["status"] for r in report["clusters"]} == {"stops": "STOPPED", "goes": "AUTODOWNED",
                                                                         "plain": "UP"}
