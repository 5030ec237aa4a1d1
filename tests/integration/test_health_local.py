"""Node health on real local nodes (netns), with a fake `nvidia-smi` on one node's PATH: the check
names that node and GPU and exits 1, status shows each node's verdict, apply's gate refuses to run
a job on it (its other paths: tests/unit/test_nodehealth.py), and `gpuctl replace --unhealthy`
makes that node again, alone (new id, sshd and host key; the others' sshd never restart),
prepares it, re-arms the head's autodown with it, and checks again: healthy. Then a node whose
link is shaped (tc) is the one `check --pairs` names.

The fake sits in a tmpfs mounted over /usr/local/sbin (on the nodes' PATH) inside worker1's own
mount namespace, so the other nodes and this machine never see it; a node made again has a fresh
namespace, and the fake is gone, as a bad GPU is with the machine replaced.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e import Cluster, needs_local_nodes, running

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "hl3"
# nvidia-smi's answers on an 8-GPU H100 node whose GPU 3 has 2 uncorrectable ECC errors
FAKE_NVIDIA_SMI = r"""#!/bin/sh
case "$1" in
  --query-gpu=*)
    for i in 0 1 2 3 4 5 6 7; do
      ecc=0; [ "$i" = 3 ] && ecc=2
      echo "$i, GPU-00000000-0000-0000-0000-00000000000$i, 00000000:1$i:00.0, NVIDIA H100 80GB HBM3, $ecc, [N/A], No, No, 16, 16, 5, 5, 0x0000000000000001, Enabled"
    done ;;
  nvlink) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3"; echo "	 Link 0: 26.562 GB/s"; done ;;
  *) echo "fake nvidia-smi: $*" >&2; exit 9 ;;
esac
"""


def place_fake_nvidia_smi(cluster: Cluster, rank: int, tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    sshd_pid = cluster.footprint().sshd[rank][0]
    subprocess.run(["nsenter", "-t", str(sshd_pid), "-m", "--", "sh", "-c",
                    'mount -t tmpfs -o mode=755,size=1m gpuctl-fake /usr/local/sbin && '
                    'install -m 755 "$1" /usr/local/sbin/nvidia-smi', "place", str(fake)], check=True, timeout=30)


def node_ids(cluster: Cluster) -> list[str]:
    hosts = yaml.safe_load((cluster.cdir / "inventory.yml").read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
    return [h["gpuctl_node_id"] for h in sorted(hosts.values(), key=lambda h: h["gpuctl_rank"])]


def test_a_bad_gpu_is_named_gated_and_replaced_alone(tmp_path: Path) -> None:
    cluster = Cluster(NAME, tmp_path / "state")
    task = tmp_path / "c.yaml"
    task.write_text(f'name: {NAME}\nnum_nodes: 3\nresources:\n  infra: local\nrun: "true"\n')
    try:
        cluster.gpuctl("apply", str(task), "-i", "600", "--down").check()  # autodown armed: replace must re-arm it
        never = cluster.gpuctl("replace", NAME, "--unhealthy")
        assert never.returncode == 2 and f"run `gpuctl check {NAME} --health` first" in never.stderr, never.describe()
        for bad, words in ((["replace", NAME], "name the nodes to make again"),
                           (["replace", NAME, "worker9"], "node 'worker9': cluster 'hl3' has head, worker1, worker2"),
                           (["check", NAME, "--level", "2"], "--level: it sets the DCGM run of --health"),
                           (["check", NAME, "--health", "--level", "7"], "--level 7: use 1")):
            res = cluster.gpuctl(*bad)
            assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.describe()

        before = cluster.footprint()
        place_fake_nvidia_smi(cluster, 1, tmp_path)
        res = cluster.gpuctl("check", NAME, "--health", "-o", "json")
        assert res.returncode == 1, res.describe()
        doc = json.loads(res.stdout)
        assert doc["ok"] is False and doc["unhealthy"] == ["worker1"], doc
        worker1 = doc["nodes"][1]
        assert (worker1["verdict"], worker1["action"], worker1["gpus"]) == ("unhealthy", "reset", 8)
        assert [(f["check"], f["device"]) for f in worker1["findings"]] == [("ecc", "GPU 3")]
        assert all(n["verdict"] != "unhealthy" and n["gpus"] == 0 for n in (doc["nodes"][0], doc["nodes"][2]))
        assert "worker1 (reset: GPU 3: 2 uncorrectable ECC error(s)" in res.stderr
        assert f"gpuctl replace {NAME} --unhealthy" in res.stderr
        assert (cluster.cdir / "health.json").stat().st_mode & 0o077 == 0

        status = json.loads(cluster.gpuctl("status", NAME, "-o", "json").check().stdout)["clusters"][0]
        assert [n["health_check"]["verdict"] for n in status["nodes"]] == [doc["nodes"][r]["verdict"] for r in range(3)]
        text = cluster.gpuctl("status", NAME).check().stdout
        assert "health unhealthy (reset: GPU 3: 2 uncorrectable ECC error(s)" in text, text

        gated = cluster.gpuctl("apply", str(task), "--health-check")
        assert gated.returncode == 1 and "or run without the gate: --no-health-check" in gated.stderr, gated.describe()
        assert "worker1 (reset: GPU 3" in gated.stderr
        jobs = json.loads(cluster.gpuctl("queue", NAME, "-o", "json").check().stdout)["jobs"]
        assert [j["name"] for j in jobs][-2:] == ["gpuctl-health", "gpuctl-health"]  # the task never ran

        old_ids = node_ids(cluster)
        rep = cluster.gpuctl("replace", NAME, "--unhealthy", "-o", "json")
        assert rep.returncode == 0, rep.describe()
        answer = json.loads(rep.stdout)
        assert [(r["name"], r["old_node_id"]) for r in answer["replaced"]] == [("worker1", old_ids[1])]
        assert answer["ok"] is True and answer["health"]["verdict"] != "unhealthy", answer
        assert "Preparing 1 of 3 node(s)" in rep.stderr, rep.describe()
        after = cluster.footprint()
        assert after.sshd[0] == before.sshd[0] and after.sshd[2] == before.sshd[2]  # never restarted
        assert after.sshd[1] != before.sshd[1] and running(*after.sshd[1])
        new_ids = node_ids(cluster)
        assert new_ids[1] != old_ids[1] and (new_ids[0], new_ids[2]) == (old_ids[0], old_ids[2])
        known = (cluster.cdir / "known_hosts").read_text()
        assert f"gpuctl-{old_ids[1]}" not in known and f"gpuctl-{new_ids[1]}" in known  # the new key pinned
        # the head's watcher powers off and asks the new node, not its predecessor
        setting = (after.node_dirs[0] / "home" / ".gpuctl" / "autostop.json").read_text()
        assert f"HostKeyAlias=gpuctl-{new_ids[1]}" in setting and f"gpuctl-{old_ids[1]}" not in setting
        status = json.loads(cluster.gpuctl("status", NAME, "-o", "json").check().stdout)["clusters"][0]
        assert all(n["health_check"]["verdict"] != "unhealthy" for n in status["nodes"]), status


        # a lemon: worker2's link shaped to 40 Mbit/s; the pairs it is in are slow, and only it is named
        subprocess.run(["nsenter", "-t", str(after.sshd[2][0]), "-n", "--", "tc", "qdisc", "add", "dev", "eth0",
                        "root", "tbf", "rate", "40mbit", "burst", "32kb", "latency", "50ms"], check=True, timeout=30)
        lemon = cluster.gpuctl("check", NAME, "--pairs", "--sizes", "1M", "-o", "json")
        assert lemon.returncode == 1, lemon.describe()
        found = json.loads(lemon.stdout)
        assert found["slow_nodes"] == ["worker2"], found
        assert [p["nodes"] for p in found["pairs"]] == [["head", "worker1"], ["worker1", "worker2"], ["worker2", "head"]]
        assert "worker2 is slow" in lemon.stderr and f"gpuctl replace {NAME} worker2" in lemon.stderr
        cluster.gpuctl("down", NAME).check()
        before.assert_gone()
        after.assert_gone()
    finally:
        cluster.down_quietly()
