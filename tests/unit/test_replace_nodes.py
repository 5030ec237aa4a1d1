"""Replacing lost nodes, without making any: which resources a node is (node_addresses), that
`-replace` reaches terraform, provisioner/lifecycle.replace_nodes against a fake terraform, and
lost_nodes as AWS (a stubbed EC2) and this machine's /proc (a fake cluster directory) answer it.

The real thing runs in tests/integration/test_replace_local.py (netns nodes) and
test_aws_moto.py (moto).
"""

from __future__ import annotations

import calendar
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
from botocore.stub import Stubber

from gpuctl.common.console import Reporter
from gpuctl.common.errors import ClusterNotFound, UserError
from gpuctl.common.paths import cluster_dir, state_root, terraform_dir
from gpuctl.providers import get_provider
from gpuctl.providers.aws import instances
from gpuctl.providers.aws import preflight as aws_preflight
from gpuctl.providers.base import BaseProvider
from gpuctl.providers.local import nodestate
from gpuctl.provision import lifecycle, provisioner
from gpuctl.provision.ansibleinventory import write_inventory
from gpuctl.provision.inventory import Inventory, inventory_from_outputs, load_inventory
from gpuctl.provision.sshkeys import ensure_cluster_key
from gpuctl.provision.terraform import TerraformRoot
from gpuctl.state.registry import Registry

# -- node_addresses ------------------------------------------------------------------------------


def test_node_addresses_name_each_providers_counted_node_resource() -> None:
    assert get_provider("local").node_addresses([1]) == ["module.cluster.terraform_data.node[1]"]
    assert get_provider("aws").node_addresses([0, 2]) == ["module.cluster.aws_instance.node[0]",
                                                          "module.cluster.aws_instance.node[2]"]
    with pytest.raises(UserError, match="infra ssh: gpuctl did not make these nodes"):
        get_provider("ssh").node_addresses([0])
    with pytest.raises(ValueError):
        get_provider("local").node_addresses([-1])


def test_the_base_provider_knows_no_lost_node_and_cannot_make_one() -> None:
    base = BaseProvider()
    assert base.lost_nodes(Path("/nonexistent"), Inventory("c", "x", ()), None) == {}
    with pytest.raises(UserError, match="cannot make one again"):
        base.node_addresses([0])


def test_node_addresses_exist_in_the_modules() -> None:
    """The resource each provider names is the module's counted one (a renamed resource fails here)."""
    for cloud, module in (("local", "local-nodes"), ("aws", "aws-gpu-instance-group")):
        kind, name = get_provider(cloud).node_resource.split(".")
        text = "".join(p.read_text() for p in (terraform_dir() / "modules" / module).glob("*.tf"))
        block = text[text.index(f'resource "{kind}" "{name}" {{'):]
        assert "count = var.node_count" in block.split("\n}\n")[0], cloud


# -- -replace reaches terraform -----------------------------------------------------------------

FAKE_TF = """#!/bin/sh
# Fake terraform: records each command's argv, answers apply and output as a cluster would.
printf '%s\\n' "$@" > "$FAKE_TF_DIR/$1.argv"
case "$1" in
  apply|plan)
    echo '{"type":"planned_change"}'
    echo '{"type":"apply_complete"}'
    echo '{"type":"change_summary","changes":{"operation":"'"$1"'","add":1,"change":0,"remove":1}}' ;;
  output) cat "$FAKE_TF_DIR/outputs.json" ;;
esac
exit 0
"""


@pytest.fixture
def fake_tf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `terraform` first on PATH; the directory where it records and reads."""
    where = tmp_path / "faketf"
    where.mkdir()
    (where / "terraform").write_text(FAKE_TF)
    (where / "terraform").chmod(0o755)
    monkeypatch.setenv("FAKE_TF_DIR", str(where))
    monkeypatch.setenv("PATH", f"{where}:{os.environ['PATH']}")
    return where


def argv(fake: Path, command: str) -> list[str]:
    return (fake / f"{command}.argv").read_text().splitlines()


def test_replace_addresses_reach_apply_and_plan(fake_tf: Path, tmp_path: Path) -> None:
    root = TerraformRoot(tmp_path / "root")
    addrs = ["module.cluster.aws_instance.node[1]", "module.cluster.aws_instance.node[3]"]
    assert root.apply(replace=addrs) is True
    assert [a for a in argv(fake_tf, "apply") if a.startswith("-replace")] == [f"-replace={a}" for a in addrs]
    seen: list[tuple[int, int]] = []
    root.apply(lambda done, total: seen.append((done, total)), replace=addrs[:1])  # the streamed apply
    assert seen == [(1, 1)]
    assert [a for a in argv(fake_tf, "apply") if a.startswith("-replace")] == [f"-replace={addrs[0]}"]
    root.plan(replace=addrs[1:])
    assert [a for a in argv(fake_tf, "plan") if a.startswith("-replace")] == [f"-replace={addrs[1]}"]
    root.apply()
    assert not [a for a in argv(fake_tf, "apply") if a.startswith("-replace")]


# -- provisioner / lifecycle.replace_nodes against the fake ----------------------------------------

NAME = "rep"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG5ldy1ub2RlLWtleS1mb3ItdGVzdHMtb25seS14eHh4eA== gpuctl-local-node-1"


def outputs(ids: list[str]) -> dict[str, Any]:
    return {"nodes": [{"id": i, "private_ip": f"10.213.0.{r + 2}", "ssh_host": f"10.213.0.{r + 2}", "ssh_port": 22}
                      for r, i in enumerate(ids)], "ssh_user": "gpuctl"}


@pytest.fixture
def made(fake_tf: Path, _isolated_state: Path) -> Iterator[Path]:
    """A 3-node local cluster as apply leaves it (request, inventory, root, state, known hosts),
    whose next `terraform output` says rank 1 is a new node."""
    cdir = cluster_dir(NAME)
    (cdir / "terraform").mkdir(parents=True)
    (cdir / "cluster.json").write_text(json.dumps({"name": NAME, "cloud": "local", "num_nodes": 3}))
    key, _ = ensure_cluster_key(cdir)
    inv = inventory_from_outputs(outputs(["id-0", "id-1", "id-2"]), cluster=NAME, cloud="local", ssh_key=str(key),
                                 gpus_per_node=0)
    write_inventory(inv, cdir / "inventory.yml")
    module = terraform_dir() / "modules" / "local-nodes"
    (cdir / "terraform" / "main.tf.json").write_text(json.dumps({"module": {"cluster": {"source": str(module)}}}))
    (cdir / "terraform" / "terraform.tfstate").write_text(json.dumps(
        {"outputs": {"nodes": {"value": outputs(["id-0", "id-1", "id-2"])["nodes"]}}, "resources": [{}]}))
    (cdir / "known_hosts").write_text("".join(f"{n.host_key_alias} ssh-ed25519 AAAAold{n.rank}\n" for n in inv.nodes))
    (fake_tf / "outputs.json").write_text(json.dumps({k: {"value": v} for k, v in
                                                      outputs(["id-0", "id-1-new", "id-2"]).items()}))
    boot = cdir / "nodes" / "node1" / "sshd"
    boot.mkdir(parents=True)
    (boot / "ssh_host_ed25519_key.pub").write_text(HOST_KEY + "\n")
    yield cdir


def test_replace_nodes_applies_only_those_nodes_and_keeps_ranks(made: Path, fake_tf: Path) -> None:
    before = load_inventory(made / "inventory.yml", cluster=NAME)
    said: list[str] = []
    inv = provisioner.replace_nodes(NAME, [1], on_progress=said.append)
    assert [a for a in argv(fake_tf, "apply") if a.startswith("-replace")] == [
        "-replace=module.cluster.terraform_data.node[1]"]
    assert [(n.rank, n.name, n.node_id) for n in inv.nodes] == [(0, "head", "id-0"), (1, "worker1", "id-1-new"),
                                                                (2, "worker2", "id-2")]
    assert [n.address for n in inv.nodes] == [n.address for n in before.nodes]
    assert load_inventory(made / "inventory.yml", cluster=NAME) == inv
    assert "terraform apply: replacing module.cluster.terraform_data.node[1]" in said
    assert json.loads((made / "cluster.json").read_text()) == {"name": NAME, "cloud": "local", "num_nodes": 3}


def test_a_rank_is_the_nodes_place_in_the_state_not_a_guess(made: Path, fake_tf: Path) -> None:
    """The state's `nodes` output (module order) decides the index, should an inventory list ranks otherwise."""
    state = made / "terraform" / "terraform.tfstate"
    data = json.loads(state.read_text())
    data["outputs"]["nodes"]["value"] = [data["outputs"]["nodes"]["value"][i] for i in (0, 2, 1)]
    state.write_text(json.dumps(data))
    (fake_tf / "outputs.json").write_text(json.dumps({"nodes": {"value": outputs(["id-0", "id-2", "id-1-new"])["nodes"]}}))
    inv = provisioner.replace_nodes(NAME, [1])
    assert "-replace=module.cluster.terraform_data.node[2]" in argv(fake_tf, "apply")
    assert [(n.rank, n.node_id) for n in inv.nodes] == [(0, "id-0"), (1, "id-1-new"), (2, "id-2")]


def test_replace_refuses_unknown_ranks_and_clusters(made: Path, fake_tf: Path) -> None:
    with pytest.raises(UserError, match=r"^cluster 'rep' has no node of rank 7; its nodes are head \(0\), "
                                        r"worker1 \(1\), worker2 \(2\): name one of them$"):
        provisioner.replace_nodes(NAME, [1, 7])
    with pytest.raises(ClusterNotFound, match="cluster 'nope' not found"):
        provisioner.replace_nodes("nope", [1])
    assert not (fake_tf / "apply.argv").exists()  # nothing was applied
    assert provisioner.replace_nodes(NAME, []) == load_inventory(made / "inventory.yml", cluster=NAME)


def test_replace_refuses_nodes_gpuctl_did_not_make(made: Path, fake_tf: Path) -> None:
    (made / "cluster.json").write_text(json.dumps({"name": NAME, "cloud": "ssh", "num_nodes": 3}))
    with pytest.raises(UserError, match="gpuctl did not make these nodes"):
        provisioner.replace_nodes(NAME, [1])
    assert not (fake_tf / "apply.argv").exists()


def test_lifecycle_replace_records_up_and_trusts_only_the_new_key(made: Path, fake_tf: Path) -> None:
    registry = Registry(remote=None)
    registry.upsert_cluster(NAME, cloud="local", region=None, zone=None, num_nodes=3, status="INIT", request={})
    out = io.StringIO()
    old = load_inventory(made / "inventory.yml", cluster=NAME)
    inv = lifecycle.replace_nodes(NAME, [1], reporter=Reporter(stream=out, plain=True), registry=registry)
    assert inv.nodes[1].node_id == "id-1-new"
    record = registry.cluster(NAME)
    assert record is not None and record.status == "UP"
    known = (made / "known_hosts").read_text().splitlines()
    assert f"{old.nodes[1].host_key_alias} ssh-ed25519 AAAAold1" not in known  # the lost node's key went
    assert f"{inv.nodes[1].host_key_alias} {' '.join(HOST_KEY.split()[:2])}" in known  # the new one pinned
    assert {f"{n.host_key_alias} ssh-ed25519 AAAAold{n.rank}" for n in (old.nodes[0], old.nodes[2])} <= set(known)
    assert "id-1-new" in (state_root() / "ssh" / f"{NAME}.conf").read_text()
    assert "==> Replacing worker1 of cluster 'rep'" in out.getvalue()
    with pytest.raises(ClusterNotFound):
        lifecycle.replace_nodes("nope", [0], reporter=Reporter(stream=out, plain=True), registry=registry)


# -- lost_nodes: AWS -----------------------------------------------------------------------------

IDS = ["i-0000000000000000a", "i-0000000000000000b", "i-0000000000000000c", "i-0000000000000000d",
       "i-0000000000000000e"]


def instance(node_id: str, state: str, code: str | None = None) -> dict[str, Any]:
    codes = {"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48, "stopping": 64, "stopped": 80}
    inst: dict[str, Any] = {"InstanceId": node_id, "State": {"Name": state, "Code": codes[state]}}
    if code:
        inst["StateReason"] = {"Code": code, "Message": f"{code}: test"}
    return inst


@pytest.fixture
def ec2(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stubber]:
    """instances.describe's EC2 client, stubbed (nothing leaves this process)."""
    client = boto3.client("ec2", region_name="eu-west-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    asked: dict[str, Any] = {}

    def fake_client(sess: Any, service: str, region: str, settings: Any, **timeouts: int) -> Any:
        asked.update(region=region, **timeouts)
        return client

    monkeypatch.setattr(aws_preflight, "client", fake_client)
    with Stubber(client) as stub:
        stub.asked = asked  # type: ignore[attr-defined]
        yield stub


def aws_inventory() -> Inventory:
    return inventory_from_outputs(outputs(IDS), cluster="spot", cloud="aws", ssh_key=None, gpus_per_node=8,
                                  region="eu-west-1")


def test_aws_lost_nodes_name_every_node_that_is_not_running(ec2: Stubber, tmp_path: Path) -> None:
    ec2.add_response("describe_instances", {"Reservations": [{"Instances": [
        instance(IDS[0], "running"),
        instance(IDS[1], "stopped", "Client.UserInitiatedShutdown"),
        instance(IDS[2], "terminated"),
        instance(IDS[3], "terminated", "Server.SpotInstanceTermination"),
        # IDS[4]: EC2 no longer lists it
    ]}]}, {"Filters": [{"Name": "instance-id", "Values": IDS}]})
    lost = get_provider("aws").lost_nodes(tmp_path, aws_inventory(), {"region": "us-east-1"})
    assert lost == {
        1: f"instance {IDS[1]} is stopped (Client.UserInitiatedShutdown)",
        2: f"instance {IDS[2]} is terminated",
        3: f"preempted (spot): instance {IDS[3]} is terminated (Server.SpotInstanceTermination)",
        4: f"instance {IDS[4]} is gone (EC2 no longer lists it: terminated)",
    }
    assert ec2.asked == {"region": "eu-west-1", "read_timeout": instances.LOSS_READ_TIMEOUT,  # type: ignore[attr-defined]
                         "attempts": instances.LOSS_ATTEMPTS}
    ec2.assert_no_pending_responses()


def test_aws_losses_read_spot_stops_and_pending_nodes() -> None:
    found = [instance("i-1", "stopping", "Server.SpotInstanceShutdown"), instance("i-2", "pending"),
             instance("i-3", "shutting-down")]
    assert instances.losses(["i-1", "i-2", "i-3"], found) == {
        "i-1": "preempted (spot): instance i-1 is stopping (Server.SpotInstanceShutdown)",
        "i-3": "instance i-3 is shutting-down"}


def test_aws_lost_nodes_conclude_nothing_when_ec2_cannot_be_asked(ec2: Stubber, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ec2.add_client_error("describe_instances", "UnauthorizedOperation", "not allowed")
    assert get_provider("aws").lost_nodes(tmp_path, aws_inventory(), None) == {}

    def no_network(*args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import ConnectTimeoutError
        raise ConnectTimeoutError(endpoint_url="https://ec2.eu-west-1.amazonaws.com")

    monkeypatch.setattr(aws_preflight, "client", no_network)
    assert get_provider("aws").lost_nodes(tmp_path, aws_inventory(), None) == {}


def test_aws_node_states_still_read_the_same_answer(ec2: Stubber) -> None:
    ec2.add_response("describe_instances", {"Reservations": [{"Instances": [
        {**instance(IDS[0], "stopped"), "StateTransitionReason": "User initiated (2026-11-26 07:00:00 GMT)"}]}]})
    states = get_provider("aws").node_states(IDS[:2], "eu-west-1")
    when = float(calendar.timegm((2026, 11, 26, 7, 0, 0)))
    assert states == {IDS[0]: ("stopped", when), IDS[1]: ("terminated", None)}


# -- lost_nodes: local (/proc) -------------------------------------------------------------------


def start_time(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_text()
    return data[data.rfind(")") + 2:].split()[19]


@pytest.fixture
def listener() -> Iterator[tuple[int, int]]:
    """A process listening on a loopback port, standing in for a node's sshd: (pid, port)."""
    code = textwrap.dedent("""\
        import socket, sys, time
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
        print(s.getsockname()[1], flush=True); time.sleep(600)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    try:
        yield proc.pid, port
    finally:
        proc.kill()
        proc.wait()


def local_node(cdir: Path, rank: int, *, mode: str, pid: int, start: str, netns: str = "") -> None:
    node = cdir / "nodes" / f"node{rank}"
    node.mkdir(parents=True)
    (node / "node.env").write_text(f"LN_MODE={mode}\nLN_INDEX={rank}\nLN_DIR={node}\nLN_NETNS={netns}\n")
    (node / "sshd.pid").write_text(f"{pid} {start}\n")


def local_inventory(ports: list[int]) -> Inventory:
    return inventory_from_outputs({"nodes": [{"id": f"n{r}", "private_ip": "127.0.0.1", "ssh_port": p}
                                             for r, p in enumerate(ports)]},
                                  cluster="loc", cloud="local", ssh_key=None, gpus_per_node=0)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_local_loopback_nodes_are_lost_when_their_sshd_is(tmp_path: Path, listener: tuple[int, int]) -> None:
    pid, port = listener
    cdir = tmp_path / "loc"
    local_node(cdir, 0, mode="loopback", pid=pid, start=start_time(pid))
    gone = dead_pid()
    local_node(cdir, 1, mode="loopback", pid=gone, start="1")
    local_node(cdir, 2, mode="loopback", pid=pid, start=str(int(start_time(pid)) + 1))  # a reused pid
    # rank 3: no directory at all
    lost = get_provider("local").lost_nodes(cdir, local_inventory([port, port + 1, port + 2, port + 3]), None)
    assert lost == {1: f"its sshd (pid {gone}) has exited", 2: f"its sshd (pid {pid}) has exited",
                    3: f"its directory {cdir.resolve()}/nodes/node3 is gone (the node was removed)"}


def test_local_netns_nodes_are_lost_without_namespace_or_listener(tmp_path: Path, listener: tuple[int, int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own namespace stands in for the nodes' (a link in a fake /run/netns): the
    listener is in it, listening on its port."""
    pid, port = listener
    netns_dir = tmp_path / "netns"
    netns_dir.mkdir()
    monkeypatch.setattr(nodestate, "NETNS_DIR", netns_dir)
    (netns_dir / "here").symlink_to(f"/proc/{os.getpid()}/ns/net")
    cdir = tmp_path / "loc"
    for rank in range(3):
        local_node(cdir, rank, mode="netns", pid=pid, start=start_time(pid), netns="here")
    local_node(cdir, 3, mode="netns", pid=pid, start=start_time(pid), netns="deleted")
    ports = [port, port, socket_free_port(), port]
    lost = get_provider("local").lost_nodes(cdir, local_inventory(ports), None)
    assert lost == {2: f"no sshd listens on port {ports[2]} in network namespace here",
                    3: "its network namespace deleted is gone"}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to unshare a netns")
def test_local_netns_node_whose_sshd_runs_in_another_namespace_is_lost(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{proc.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "unshare did not enter a new namespace"
            time.sleep(0.02)
        netns_dir = tmp_path / "netns"
        netns_dir.mkdir()
        monkeypatch.setattr(nodestate, "NETNS_DIR", netns_dir)
        (netns_dir / "here").symlink_to(f"/proc/{os.getpid()}/ns/net")
        local_node(tmp_path / "loc", 0, mode="netns", pid=proc.pid, start=start_time(proc.pid), netns="here")
        lost = get_provider("local").lost_nodes(tmp_path / "loc", local_inventory([22]), None)
        assert lost == {0: f"its sshd (pid {proc.pid}) is no longer in network namespace here"}
    finally:
        proc.kill()
        proc.wait()


def socket_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
