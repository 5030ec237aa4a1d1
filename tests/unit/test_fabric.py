"""Fabric detection in prepare (issue 12, item 1): the node-side probe on fake sysfs trees (EFA on a
p5 with 32 devices, 8 mlx5 InfiniBand ports with one down, RoCE, none), the env each node writes,
and the controller's fabric.json (configplane/fabric.py) and status lines."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuctl.configplane import bundle
from gpuctl.configplane import fabricrecord, playbooks, prepare
from gpuctl.node import fabricprobe
from gpuctl.node import install as agent
from gpuctl.providers import get_provider
from gpuctl.providers.aws.catalog import GPUDIRECT_RDMA_FAMILIES
from gpuctl.providers.aws.provider import efa_fabric_env
from gpuctl.provision.inventory import Inventory, Node

HEAD = "10.0.0.2"
SHIPPED = Path(fabricprobe.__file__)  # lib/gpuctl-fabric-probe on a node (configplane/bundle.py)
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


# -- fake trees ---------------------------------------------------------------------------


class Tree:
    """A node's /sys, /dev, /proc and / under tmp_path, and a PATH of fake commands."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys, self.dev, self.proc, self.fs = root / "sys", root / "dev", root / "proc", root / "fs"
        self.bin = root / "bin"
        for d in (self.sys, self.dev, self.proc, self.fs, self.bin):
            d.mkdir(parents=True)
        self.verbs = 0

    def device(self, name: str, driver: str | None, ports: dict[int, dict]) -> None:
        """SYS/class/infiniband/NAME with device/driver -> .../drivers/DRIVER, its ports, and a
        uverbs char device (SYS/class/infiniband_verbs/uverbsK/ibdev, DEV/infiniband/uverbsK)."""
        base = self.sys / "class" / "infiniband" / name
        (base / "device").mkdir(parents=True)
        if driver:
            target = self.sys / "bus" / "pci" / "drivers" / driver
            target.mkdir(parents=True, exist_ok=True)
            (base / "device" / "driver").symlink_to(target)
        (base / "node_type").write_text("1: CA\n")
        for number, spec in ports.items():
            pdir = base / "ports" / str(number)
            (pdir / "gids").mkdir(parents=True)
            state = spec.get("state", "ACTIVE")
            (pdir / "state").write_text({"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN", "INIT": "2: INIT"}[state] + "\n")
            (pdir / "phys_state").write_text("5: LinkUp\n" if state == "ACTIVE" else "3: Disabled\n")
            (pdir / "link_layer").write_text(spec["link_layer"] + "\n")
            (pdir / "rate").write_text(spec.get("rate", "400 Gb/sec (4X NDR)") + "\n")
            gids = spec.get("gids", {})
            for i in range(max(list(gids) + [7]) + 1):  # the kernel lists every slot; empty ones are zero
                gid, gid_type = gids.get(i, (ZERO_GID, None))
                (pdir / "gids" / str(i)).write_text(gid + "\n")
                if gid_type:
                    for sub, value in (("types", gid_type), ("ndevs", spec.get("ndev", "ens1f0"))):
                        (pdir / "gid_attrs" / sub).mkdir(parents=True, exist_ok=True)
                        (pdir / "gid_attrs" / sub / str(i)).write_text(value + "\n")
        uverbs = f"uverbs{self.verbs}"
        self.verbs += 1
        (self.sys / "class" / "infiniband_verbs" / uverbs).mkdir(parents=True)
        (self.sys / "class" / "infiniband_verbs" / uverbs / "ibdev").write_text(name + "\n")
        (self.dev / "infiniband").mkdir(exist_ok=True)
        (self.dev / "infiniband" / uverbs).write_text("")

    def command(self, name: str, script: str) -> None:
        path = self.bin / name
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)

    def route_via(self, dev: str) -> None:
        """A fake `ip`: the route to any address goes out of `dev`."""
        self.command("ip", f"""case "$2 $3" in
  "route get") echo '[{{"dst":"'"$4"'","dev":"{dev}","prefsrc":"10.0.0.9","flags":[],"cache":[]}}]' ;;
  *) echo '[]' ;;
esac
""")

    def file(self, rel: str, text: str = "") -> None:
        path = self.fs / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def probe(self, **kw) -> dict:
        kw.setdefault("head", HEAD)
        return fabricprobe.probe(sys_root=str(self.sys), dev_root=str(self.dev), proc_root=str(self.proc),
                                 root=str(self.fs), path=str(self.bin), **kw)


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path / "node")


def p5(tree: Tree, *, fi_info: bool = True, fi_devices: int = 32) -> list[str]:
    """A p5.48xlarge: 32 EFA devices (rdmap*, driver efa), aws-ofi-nccl and libfabric from the
    EFA installer, the ENA interface ens32 toward the head, and `fi_info -p efa` when asked."""
    names = [f"rdmap{79 + i}s0" for i in range(32)]
    for name in names:
        tree.device(name, "efa", {1: {"link_layer": "Unspecified", "rate": "100 Gb/sec (4X EDR)"}})
    tree.file("/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so")
    tree.file("/opt/amazon/efa/lib/libfabric.so.1")
    tree.route_via("ens32")
    if fi_info:
        blocks = "".join(f"provider: efa\n    fabric: efa\n    domain: {n}-{kind}\n    version: 122.0\n"
                         for n in names[:fi_devices] for kind in ("rdm", "dgrm"))
        tree.command("fi_info", f"cat <<'EOF'\n{blocks}EOF\n" if fi_devices else
                     "echo 'fi_getinfo: -61 (No data available)' >&2; exit 1\n")
    return names


def mlx5_ib(tree: Tree, down: int | None = 3) -> list[str]:
    """8 mlx5 InfiniBand HCAs, port 1 each, one DOWN; a soft-RoCE rxe0 too (never used)."""
    names = [f"mlx5_{i}" for i in range(8)]
    for i, name in enumerate(names):
        tree.device(name, "mlx5_core", {1: {"link_layer": "InfiniBand", "state": "DOWN" if i == down else "ACTIVE"}})
    tree.device("rxe0", None, {1: {"link_layer": "Ethernet", "gids": {1: ("fe80:0000:0000:0000:0000:0000:0000:0001",
                                                                          "RoCE v2")}}})
    tree.route_via("ib0")
    return names


V4 = "0000:0000:0000:0000:0000:ffff:0a00:00{:02x}"
LINK_LOCAL = "fe80:0000:0000:0000:1a2b:3cff:fe4d:5e6f"


def roce(tree: Tree) -> None:
    """2 mlx5 HCAs on Ethernet: GIDs 0/1 link-local (RoCE v1/v2), 2/3 IPv4-mapped (v1/v2)."""
    for i in range(2):
        tree.device(f"mlx5_{i}", "mlx5_core", {1: {"link_layer": "Ethernet", "rate": "200 Gb/sec (4X HDR)",
                                                   "ndev": f"ens{i + 1}f0",
                                                   "gids": {0: (LINK_LOCAL, "IB/RoCE v1"), 1: (LINK_LOCAL, "RoCE v2"),
                                                            2: (V4.format(10 + i), "IB/RoCE v1"),
                                                            3: (V4.format(10 + i), "RoCE v2")}}})
    tree.route_via("ens1f0")


# -- the probe ------------------------------------------------------------------------------


def test_p5_with_32_efa_devices(tree: Tree):
    names = p5(tree)
    got = tree.probe(instance="p5.48xlarge")
    assert (got["kind"], got["interface"], got["instance_type"], got["gpudirect_rdma"]) == \
        ("efa", "ens32", "p5.48xlarge", True)
    assert [d["name"] for d in got["devices"]] == names and {d["driver"] for d in got["devices"]} == {"efa"}
    assert got["active_ports"] == [f"{n}:1" for n in names]
    assert got["fi_info"]["ok"] and got["fi_info"]["devices"] == names
    assert got["env"] == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
                          "NCCL_SOCKET_IFNAME": "ens32"}
    assert got["path_prepend"] == {"LD_LIBRARY_PATH": ["/opt/amazon/ofi-nccl/lib", "/opt/amazon/efa/lib"]}
    assert got["plugin_dir"] == "/opt/amazon/ofi-nccl/lib" and got["warnings"] == []


def test_efa_without_fi_info_is_fine(tree: Tree):
    p5(tree, fi_info=False)
    got = tree.probe(instance="p5.48xlarge")
    assert got["kind"] == "efa" and got["fi_info"] is None and got["warnings"] == []
    assert got["env"]["FI_PROVIDER"] == "efa" and got["active_ports"][0] == "rdmap79s0:1"


def test_efa_when_libfabric_sees_none_and_no_plugin(tmp_path: Path):
    tree = Tree(tmp_path / "n")
    p5(tree, fi_devices=0)
    (tree.fs / "opt" / "amazon" / "ofi-nccl" / "lib" / "libnccl-net-ofi.so").unlink()
    got = tree.probe(instance="p5.48xlarge")
    assert got["kind"] == "efa" and got["fi_info"]["ok"] is False
    assert "libfabric (fi_info -p efa) sees 0 of 32 EFA devices" in got["warnings"]
    assert any(w.startswith("aws-ofi-nccl not found") for w in got["warnings"])
    assert got["path_prepend"] == {"LD_LIBRARY_PATH": ["/opt/amazon/efa/lib"]}


@pytest.mark.parametrize("itype, gdr", [("p4d.24xlarge", True), ("p5en.48xlarge", True),
                                        ("p6-b200.48xlarge", True), ("g6e.48xlarge", False), ("", False)])
def test_device_rdma_only_where_the_type_has_gpudirect(tree: Tree, itype: str, gdr: bool):
    p5(tree, fi_info=False)
    got = tree.probe(instance=itype or None)
    assert ("FI_EFA_USE_DEVICE_RDMA" in got["env"]) is gdr and got["gpudirect_rdma"] is gdr


def test_instance_type_from_dmi_when_the_controller_gave_none(tree: Tree):
    p5(tree, fi_info=False)
    dmi = tree.sys / "devices" / "virtual" / "dmi" / "id"
    dmi.mkdir(parents=True)
    (dmi / "product_name").write_text("p5.48xlarge\n")
    assert tree.probe()["env"]["FI_EFA_USE_DEVICE_RDMA"] == "1"
    (dmi / "product_name").write_text("PowerEdge XE9680\n")  # not an EC2 type: nothing inferred
    assert tree.probe()["instance_type"] is None


def test_eight_mlx5_ib_ports_one_down(tree: Tree):
    names = mlx5_ib(tree, down=3)
    got = tree.probe()
    active = [f"{n}:1" for n in names if n != "mlx5_3"]
    assert (got["kind"], got["interface"], got["active_ports"]) == ("ib", "ib0", active)
    assert got["env"] == {"NCCL_IB_HCA": "=" + ",".join(active), "NCCL_SOCKET_IFNAME": "ib0"}
    assert got["warnings"] == ["port(s) not ACTIVE: mlx5_3:1 (DOWN)"]
    by_name = {d["name"]: d for d in got["devices"]}
    assert by_name["rxe0"]["kind"] == "software" and by_name["mlx5_0"]["kind"] == "ib"
    assert by_name["mlx5_3"]["ports"][0]["state"] == "DOWN" and by_name["mlx5_0"]["verbs"] == "uverbs0"


def test_hca_names_in_natural_order_and_matched_exactly(tree: Tree):
    for i in (10, 2, 1):
        tree.device(f"mlx5_{i}", "mlx5_core", {1: {"link_layer": "InfiniBand"}})
    tree.route_via("ib0")
    # "=": NCCL matches the names exactly (a prefix mlx5_1 would also take mlx5_10)
    assert tree.probe()["env"]["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_2:1,mlx5_10:1"


def test_roce_picks_the_roce_v2_ipv4_gid(tree: Tree):
    roce(tree)
    got = tree.probe()
    assert (got["kind"], got["active_ports"], got["gid_index"]) == ("roce", ["mlx5_0:1", "mlx5_1:1"], 3)
    assert got["env"] == {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "3",
                          "NCCL_SOCKET_IFNAME": "ens1f0"}
    gids = got["devices"][0]["ports"][0]["gids"]
    assert [(g["index"], g["type"]) for g in gids] == [(0, "IB/RoCE v1"), (1, "RoCE v2"), (2, "IB/RoCE v1"),
                                                       (3, "RoCE v2")]


def test_gid_index_agreed_across_ports():
    def dev(name: str, gids: dict[int, tuple[str, str]]) -> dict:
        return {"name": name, "kind": "roce", "ports": [{"port": 1, "gids": [
            {"index": i, "gid": g, "type": t} for i, (g, t) in gids.items()]}]}
    a = dev("mlx5_0", {1: (LINK_LOCAL, "RoCE v2"), 3: (V4.format(1), "RoCE v2")})
    b = dev("mlx5_1", {1: (LINK_LOCAL, "RoCE v2"), 3: (V4.format(2), "RoCE v2"), 5: (V4.format(3), "RoCE v2")})
    assert fabricprobe.choose_gid_index([a, b], ["mlx5_0:1", "mlx5_1:1"]) == 3
    c = dev("mlx5_2", {1: (LINK_LOCAL, "RoCE v2")})  # no IPv4 GID at all: v2 link-local is the best left
    assert fabricprobe.choose_gid_index([c], ["mlx5_2:1"]) == 1
    assert fabricprobe.choose_gid_index([c], []) is None


def test_ib_wins_over_roce_on_a_node_with_both(tree: Tree):
    tree.device("mlx5_0", "mlx5_core", {1: {"link_layer": "InfiniBand"}})
    tree.device("mlx5_1", "mlx5_core", {1: {"link_layer": "Ethernet", "gids": {3: (V4.format(5), "RoCE v2")}}})
    tree.route_via("eth0")
    got = tree.probe()
    assert (got["kind"], got["env"]["NCCL_IB_HCA"], "NCCL_IB_GID_INDEX" in got["env"]) == ("ib", "=mlx5_0:1", False)


def test_no_fabric_is_socket_with_only_the_interface(tree: Tree):
    # no `ip` on PATH: the route to the head from /proc/net/route (the longest match, not the default)
    (tree.proc / "net").mkdir()
    (tree.proc / "net" / "route").write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth1\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
    got = tree.probe()
    assert (got["kind"], got["interface"], got["interface_from"]) == ("socket", "eth1", "/proc/net/route")
    assert got["env"] == {"NCCL_SOCKET_IFNAME": "eth1"} and got["path_prepend"] == {}
    assert got["devices"] == [] and got["active_ports"] == [] and got["warnings"] == []


def test_rdma_devices_all_down_are_socket(tree: Tree):
    mlx5_ib(tree, down=None)
    for port in (tree.sys / "class" / "infiniband").glob("mlx5_*/ports/1"):
        (port / "state").write_text("1: DOWN\n")
    got = tree.probe()
    assert got["kind"] == "socket" and got["env"] == {"NCCL_SOCKET_IFNAME": "ib0"}
    assert got["warnings"] == ["RDMA device(s) " + ",".join(f"mlx5_{i}" for i in range(8))
                               + " present but no port ACTIVE: NCCL uses sockets"]


def test_the_head_finds_its_own_interface_not_lo(tree: Tree):
    # `ip route get` of the node's own address answers lo (the local table); the address is on eth0
    tree.command("ip", """case "$2 $3" in
  "route get") echo '[{"type":"local","dst":"10.0.0.2","dev":"lo","prefsrc":"10.0.0.2"}]' ;;
  *) echo '[{"ifname":"lo","addr_info":[{"local":"127.0.0.1"}]},'\
          '{"ifname":"eth0","addr_info":[{"local":"10.0.0.2"}]}]' ;;
esac
""")
    assert tree.probe()["interface"] == "eth0"
    assert tree.probe(head="127.0.0.3")["interface"] == "lo"  # a loopback cluster's nodes meet on lo


def test_unreadable_devices_fall_back_to_the_static_defaults(tree: Tree, monkeypatch: pytest.MonkeyPatch):
    tree.route_via("ens5")

    def broken(*_a):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(fabricprobe, "read_devices", broken)
    static = efa_fabric_env(efa=True, instance_type="p5.48xlarge")
    got = tree.probe(fallback_env=static)
    assert got["kind"] == "socket" and "Permission denied" in got["error"]
    assert got["env"] == {**static, "NCCL_SOCKET_IFNAME": "ens5"}


def test_static_cloud_defaults_table():
    aws, local, ssh = get_provider("aws"), get_provider("local"), get_provider("ssh")
    best = {"network_tier": "best", "instance_type": "p5.48xlarge"}
    assert aws.fabric_env(best) == efa_fabric_env(efa=True, instance_type="p5.48xlarge") == {
        "FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "^lo,docker", "FI_EFA_FORK_SAFE": "1",
        "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert "FI_EFA_USE_DEVICE_RDMA" not in aws.fabric_env({**best, "instance_type": "g6e.48xlarge"})
    assert aws.fabric_env({"network_tier": "standard"}) == {} and aws.fabric_env(None) == {}
    assert local.fabric_env(best) == {} and ssh.fabric_env(best) == {}


def test_the_controller_and_the_probe_agree_on_gpudirect_rdma_families():
    """The probe runs on the nodes (standard library only), so it carries its own copy."""
    assert fabricprobe.RDMA_FAMILIES == GPUDIRECT_RDMA_FAMILIES


def test_the_attached_fabric_is_the_providers_word():
    assert fabricrecord.expected_kind("aws", {"network_tier": "best"}) == "efa"
    assert fabricrecord.expected_kind("aws", {"network_tier": "standard"}) is None
    assert fabricrecord.expected_kind("local", {"network_tier": "best"}) is None
    assert fabricrecord.expected_kind("ssh", {"network_tier": "best"}) is None


# -- the file it writes, and the script prepare runs -------------------------------------------


def test_env_file_prepends_paths_and_is_rewritten_only_on_change(tree: Tree, tmp_path: Path):
    p5(tree, fi_info=False)
    got = tree.probe(instance="p5.48xlarge")
    out = tmp_path / "gpuctl"
    assert fabricprobe.write(got, str(out)) is True
    assert fabricprobe.write(got, str(out)) is False
    text = (out / "fabric.env").read_text()
    assert "export FI_PROVIDER=efa\n" in text and "NCCL_IB" not in text
    shown = subprocess.run(["bash", "-c", 'set -a; . "$1"; set +a; echo "$LD_LIBRARY_PATH|$NCCL_SOCKET_IFNAME"',
                            "-", str(out / "fabric.env")], capture_output=True, text=True, check=True,
                           env={"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}).stdout
    assert shown == "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:/usr/local/cuda/lib64|ens32\n"
    empty = subprocess.run(["bash", "-c", 'set -a; . "$1"; echo "$LD_LIBRARY_PATH"', "-", str(out / "fabric.env")],
                           capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]}).stdout
    assert empty == "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib\n"
    assert json.loads((out / "fabric.json").read_text())["kind"] == "efa"


def test_the_shipped_script_writes_the_node_files_and_prints_its_json(tree: Tree, tmp_path: Path):
    roce(tree)
    out = tmp_path / "home" / ".gpuctl"
    argv = [sys.executable, str(SHIPPED), "--head", HEAD, "--write", str(out), "--sys", str(tree.sys),
            "--dev", str(tree.dev), "--proc", str(tree.proc), "--root", str(tree.fs)]
    env = {"PATH": str(tree.bin)}
    first = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout)
    again = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout)
    assert (first["kind"], first["changed"], again["changed"]) == ("roce", True, False)
    assert (out / "fabric.env").read_text().splitlines()[2:] == [
        "export NCCL_IB_GID_INDEX=3", "export NCCL_IB_HCA==mlx5_0:1,mlx5_1:1", "export NCCL_SOCKET_IFNAME=ens1f0"]
    bad = subprocess.run(argv + ["--fallback-env", "[1]"], capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2 and "--fallback-env" in bad.stderr


def test_probe_is_stdlib_only_and_python36_syntax():
    source = SHIPPED.read_text()
    tree = ast.parse(source, feature_version=(3, 6))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "capture_output" not in source and "text=True" not in source  # 3.7+


# -- prepare: the fingerprint and what the play gets ---------------------------------------------


def _inv(n: int = 3, cloud: str = "aws") -> Inventory:
    return Inventory(cluster="c", cloud=cloud, nodes=tuple(
        Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=f"i-{r}", address=f"10.0.0.{r + 2}",
             ssh_host=f"h{r}") for r in range(n)))


def test_the_probe_is_part_of_the_prepare_fingerprint():
    names = dict(prepare._tree_bytes())
    assert names["lib/gpuctl-fabric-probe"] == Path(fabricprobe.__file__).read_bytes()
    settings = fabricrecord.probe_settings("aws", {"network_tier": "best", "instance_type": "p5.48xlarge"})
    assert settings == {"instance_type": "p5.48xlarge",
                        "fallback_env": efa_fabric_env(efa=True, instance_type="p5.48xlarge")}
    base = prepare.fingerprint(internal_public_key="k", fabric_env=settings)
    other = fabricrecord.probe_settings("aws", {"network_tier": "best", "instance_type": "p4d.24xlarge"})
    assert prepare.fingerprint(internal_public_key="k", fabric_env=other) != base


def test_run_prepare_passes_the_probe_its_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen = {}
    monkeypatch.setattr(playbooks, "run_playbook", lambda name, **kw: seen.update(name=name, **kw))
    settings = fabricrecord.probe_settings("aws", {"network_tier": "best", "instance_type": "p5.48xlarge"})
    prepare.run_prepare(tmp_path / "inventory.yml", private_data_dir=tmp_path, control_dir=tmp_path,
                        fingerprint_value="f", internal_key=tmp_path / "k", fabric_env=settings,
                        fabric_head="10.0.0.2")
    ev = seen["extravars"]
    assert (ev["gpuctl_fabric_head"], ev["gpuctl_fabric_instance_type"]) == ("10.0.0.2", "p5.48xlarge")
    assert ev["gpuctl_fabric_env"] == settings["fallback_env"]
    # the agent's files, read once for every node: what the role would read from its files/
    files = ev["gpuctl_agent_files"]
    assert agent.file_text(files["lib/gpuctl-fabric-probe"]) == Path(fabricprobe.__file__).read_text()
    assert agent.file_text(files["lib/gpuctl_node.py"]) == bundle.agent_text()


# -- the controller's record and status ---------------------------------------------------------


def _raw(tmp_path: Path) -> dict[str, dict]:
    """The install steps' results: {host: probe result} for an EFA head, an IB worker1, a socket worker2."""
    out = {}
    for host, build in (("head", lambda t: p5(t, fi_info=False)), ("worker1", mlx5_ib), ("worker2", None)):
        t = Tree(tmp_path / host)
        if build:
            build(t)
        else:
            t.route_via("eth0")
        out[host] = {**t.probe(instance="p5.48xlarge"), "changed": True, "hostname": f"ip-{host}"}
    return out


def test_record_writes_fabric_json_with_the_contract_keys(tmp_path: Path):
    cdir = tmp_path / "cluster"
    cdir.mkdir()
    doc = fabricrecord.record(cdir, _inv(), _raw(tmp_path))
    assert fabricrecord.load_fabric(cdir) == doc
    assert fabricrecord.hostnames(cdir) == {"head": "ip-head", "worker1": "ip-worker1", "worker2": "ip-worker2"}
    assert doc["kind"] == "socket"  # the weakest: one node has no fabric
    assert [(n["rank"], n["name"], n["kind"]) for n in doc["nodes"]] == [(0, "head", "efa"), (1, "worker1", "ib"),
                                                                         (2, "worker2", "socket")]
    for n in doc["nodes"]:
        assert {"rank", "name", "kind", "interface", "devices", "active_ports", "env"} <= set(n) and "changed" not in n
    assert doc["nodes"][1]["active_ports"][:2] == ["mlx5_0:1", "mlx5_1:1"]
    assert doc["nodes"][2]["env"] == {"NCCL_SOCKET_IFNAME": "eth0"}

    lines = fabricrecord.status_lines(cdir)
    assert lines == {0: "efa x32 (ens32) gdr",
                     1: "ib mlx5_0:1,mlx5_1:1,… (ib0) 7/8 ports active; port(s) not ACTIVE: mlx5_3:1 (DOWN)",
                     2: "socket (eth0)"}
    warned = fabricrecord.warnings(doc, expected="efa")
    assert warned[0] == ("worker1, worker2: no EFA device found although the cluster was provisioned with EFA: "
                         "NCCL will use TCP sockets there")
    assert warned[1].startswith("the nodes have different fabrics (efa: head, ib: worker1, socket: worker2)")
    assert "worker1: port(s) not ACTIVE: mlx5_3:1 (DOWN)" in warned


def test_a_limited_prepare_keeps_the_other_nodes_and_all_alike_is_their_kind(tmp_path: Path):
    cdir = tmp_path / "cluster"
    cdir.mkdir()
    raw = _raw(tmp_path)
    assert fabricrecord.record(cdir, _inv(2), {"head": raw["head"], "worker1": raw["head"]})["kind"] == "efa"
    doc = fabricrecord.record(cdir, _inv(3), {"worker1": "not json"})  # worker2 joined but was not probed: not listed
    assert [(n["name"], n["kind"]) for n in doc["nodes"]] == [("head", "efa"), ("worker1", "socket")]
    assert doc["nodes"][1]["warnings"] == ["the fabric probe gave no result"] and doc["kind"] == "socket"
    assert fabricrecord.record(cdir, _inv(3), {}) is None and fabricrecord.load_fabric(cdir) == doc  # none: kept


def test_status_before_any_prepare_and_with_a_broken_file(tmp_path: Path):
    assert fabricrecord.status_lines(tmp_path) == {} and fabricrecord.load_fabric(tmp_path) is None
    (tmp_path / fabricrecord.FABRIC_FILE).write_text("{")
    assert fabricrecord.status_lines(tmp_path) == {}
    roce_node = {"rank": 0, "kind": "roce", "interface": "ens1f0", "active_ports": ["mlx5_0:1", "mlx5_1:1"],
                 "gid_index": 3, "devices": [{"kind": "roce", "ports": [{}]}, {"kind": "roce", "ports": [{}]}]}
    assert fabricrecord.node_line(roce_node) == "roce mlx5_0:1,mlx5_1:1 (ens1f0) 2/2 ports active gid 3"
