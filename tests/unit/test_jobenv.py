from __future__ import annotations

import json
import subprocess

from gpuctl.jobplane import jobenv
from gpuctl.provision.inventory import Inventory, Node, hostfile_lines


def inventory(n: int = 3, gpus: int = 8) -> Inventory:
    nodes = tuple(
        Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=f"i-{r}", address=f"10.0.0.{10 + r}",
             ssh_host=f"10.0.0.{10 + r}", gpus=gpus)
        for r in range(n)
    )
    return Inventory(cluster="c1", cloud="aws", region="us-east-1", zone="us-east-1a", nodes=nodes)


def test_run_env_uses_only_the_jobs_nodes():
    inv = inventory(3)
    env = jobenv.run_env(inv, inv.first(2), task="t-1", gpus_per_node=8, envs={"A": "1"})
    c = env.common
    assert c["GPUCTL_NODE_IPS"] == "10.0.0.10\n10.0.0.11" == c["SKYPILOT_NODE_IPS"]
    assert c["GPUCTL_NUM_NODES"] == "2" == c["SKYPILOT_NUM_NODES"]
    assert c["GPUCTL_NUM_GPUS_PER_NODE"] == "8" == c["SKYPILOT_NUM_GPUS_PER_NODE"]
    assert c["MASTER_ADDR"] == "10.0.0.10" and c["MASTER_PORT"] == "29500"
    assert c["GPUCTL_TASK_ID"] == "t-1" == c["SKYPILOT_TASK_ID"]
    assert c["A"] == "1"
    assert json.loads(c["GPUCTL_CLUSTER_INFO"]) == {
        "cluster_name": "c1", "cloud": "aws", "region": "us-east-1", "zone": "us-east-1a",
        "num_nodes": 2, "ips": ["10.0.0.10", "10.0.0.11"]}
    assert c["SKYPILOT_CLUSTER_INFO"] == c["GPUCTL_CLUSTER_INFO"]
    assert env.rank_vars == ("GPUCTL_NODE_RANK", "SKYPILOT_NODE_RANK")
    assert "SKYPILOT_SETUP_NODE_IPS" not in c


def test_setup_env_follows_skypilot_split():
    inv = inventory(3)
    env = jobenv.setup_env(inv, task="t-1", gpus_per_node=8, envs={})
    c = env.common
    assert c["SKYPILOT_SETUP_NODE_IPS"] == "10.0.0.10\n10.0.0.11\n10.0.0.12"
    assert c["SKYPILOT_NUM_NODES"] == "3"
    for run_only in ("SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert run_only not in c
    assert env.rank_vars == ("GPUCTL_NODE_RANK", "SKYPILOT_SETUP_NODE_RANK")
    # GPUCTL_* names are present in both stages
    assert c["GPUCTL_NUM_GPUS_PER_NODE"] == "8"


def test_user_envs_cannot_override_job_identity_but_can_set_master_port():
    inv = inventory(2)
    env = jobenv.run_env(inv, inv.nodes, task="t", gpus_per_node=0,
                         envs={"GPUCTL_NUM_NODES": "99", "SKYPILOT_NODE_IPS": "x", "MASTER_PORT": "12345"})
    assert env.common["GPUCTL_NUM_NODES"] == "2"
    assert env.common["SKYPILOT_NODE_IPS"] == "10.0.0.10\n10.0.0.11"
    assert env.common["MASTER_PORT"] == "12345"


def test_hostfile_lines_head_first():
    inv = inventory(2, gpus=4)
    assert hostfile_lines(reversed(inv.nodes)) == ["10.0.0.10 slots=4", "10.0.0.11 slots=4"]


def test_task_id_unique_per_job():
    assert jobenv.task_id("c1", 1, "2026") != jobenv.task_id("c1", 2, "2026")


def test_secrets_script_round_trips_through_bash():
    tricky = {"TOKEN": "a'b\"c $HOME `x` \\ \nline2", "EMPTY": ""}
    script = jobenv.secrets_script(tricky) + 'printf "%s|%s" "$TOKEN" "$EMPTY"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == tricky["TOKEN"] + "|"
