"""`gpuctl check` without a cluster: sizes and bandwidth math, NCCL_DEBUG=INFO parsing (EFA over
aws-ofi-nccl, InfiniBand, RoCE, the socket fallback, OFI over TCP), all_reduce_perf output and its
mpirun line, the expected fabric, the run stage, the node-side probe (gloo, one rank), and the
verdict `analyze` draws from the lines every rank printed.

The NCCL excerpts are written here after NCCL's and aws-ofi-nccl's format strings
(src/init.cc "Using network %s", src/transport/net.cc "Channel %02d/%d : %d[%d] -> %d[%d] [send]
via NET/%s/%d%s", net_ib "NET/IB : Using ... ; OOB ...", aws-ofi-nccl "Selected Provider is %s
(found %d nics)"); host names, pids and addresses are made up. No GPU was lent to this work, so
none of them was captured from a real run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuctl.common.errors import UserError
from gpuctl.configplane import bundle
from gpuctl.healthcheck import bandwidth, command, fabriccheck, nccllog
from gpuctl.node import allreduceprobe, ncclperf
from gpuctl.provision.inventory import Inventory, Node

PROBE = Path(allreduceprobe.__file__)

# -- NCCL log excerpts ---------------------------------------------------------------------

# Two p5-like nodes, 2 GPUs each shown, aws-ofi-nccl >= 1.8 ("Libfabric"), EFA with GPUDirect RDMA.
EFA_NODE0 = """\
nodeA:4101:4101 [0] NCCL INFO Bootstrap : Using enp71s0:10.1.0.11<0>
nodeA:4101:4101 [0] NCCL INFO NCCL version 2.23.4+cuda12.4
nodeA:4101:4160 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2
nodeA:4101:4160 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
nodeA:4101:4160 [0] NCCL INFO Using network Libfabric
nodeA:4101:4160 [0] NCCL INFO ncclCommInitRank comm 0x5581 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 53000 commId 0x9f - Init START
nodeA:4101:4160 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
nodeA:4101:4160 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
nodeA:4101:4160 [0] NCCL INFO Channel 01/0 : 0[0] -> 2[0] [send] via NET/Libfabric/1/GDRDMA
nodeA:4102:4161 [1] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
nodeA:4102:4161 [1] NCCL INFO Using network Libfabric
nodeA:4102:4161 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Libfabric/2/GDRDMA
nodeA:4102:4161 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/IPC/read
"""
EFA_NODE1 = """\
nodeB:5201:5260 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
nodeB:5201:5260 [0] NCCL INFO Using network Libfabric
nodeB:5201:5260 [0] NCCL INFO ncclCommInitRank comm 0x7a1 rank 2 nranks 4 cudaDev 0 nvmlDev 0 busId 53000 commId 0x9f - Init START
nodeB:5201:5260 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via SHM/direct/direct
nodeB:5201:5260 [0] NCCL INFO Channel 01/0 : 2[0] -> 0[0] [send] via NET/Libfabric/0/GDRDMA
nodeB:5202:5261 [1] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
nodeB:5202:5261 [1] NCCL INFO Using network Libfabric
nodeB:5202:5261 [1] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [send] via NET/Libfabric/1/GDRDMA
"""

# The same cluster where aws-ofi-nccl was not on LD_LIBRARY_PATH: NCCL fell back to sockets.
SOCKET_NODE = """\
{host}:7{r}01:7{r}01 [0] NCCL INFO Bootstrap : Using enp71s0:10.1.0.1{r}<0>
{host}:7{r}01:7{r}01 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
{host}:7{r}01:7{r}40 [0] NCCL INFO NET/IB : No device found.
{host}:7{r}01:7{r}40 [0] NCCL INFO NET/Socket : Using [0]enp71s0:10.1.0.1{r}<0>
{host}:7{r}01:7{r}40 [0] NCCL INFO Using network Socket
{host}:7{r}01:7{r}40 [0] NCCL INFO ncclCommInitRank comm 0x51 rank {r} nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0x42 - Init START
{host}:7{r}01:7{r}40 [0] NCCL INFO Channel 00/0 : {r}[0] -> {o}[0] [send] via NET/Socket/0
{host}:7{r}01:7{r}40 [0] NCCL INFO Channel 00/0 : {o}[0] -> {r}[0] [receive] via NET/Socket/0
"""

# An InfiniBand cluster, and one whose HCAs run RoCE.
IB_NODE = """\
gpu07:901:901 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:192.168.50.7<0>
gpu07:901:901 [0] NCCL INFO Using network IB
gpu07:901:950 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA
"""
ROCE_NODE = """\
dgx3:77:120 [0] NCCL INFO NET/IB : Using [0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; OOB bond0:172.20.1.3<0>
dgx3:77:120 [0] NCCL INFO Using network IB
dgx3:77:120 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/IB/1
"""

# aws-ofi-nccl loaded, but libfabric picked its TCP provider (no EFA device): not EFA.
OFI_TCP = """\
ip-10-0-0-5:300:300 [0] NCCL INFO NET/OFI Selected Provider is tcp;ofi_rxm
ip-10-0-0-5:300:300 [0] NCCL INFO Using network AWS Libfabric
ip-10-0-0-5:300:340 [0] NCCL INFO Ring 00 : 1 -> 0 [receive] via NET/AWS Libfabric/0
"""

# all_reduce_perf over mpirun --tag-output on 2 nodes x 2 GPUs, NCCL's lines interleaved.
PERF_OUTPUT = """\
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
[1,0]<stdout>:#
[1,0]<stdout>:# Using devices
[1,0]<stdout>:#  Rank  0 Group  0 Pid   4101 on      nodeA device  0 [0x53] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  1 Group  0 Pid   4102 on      nodeA device  1 [0x64] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  2 Group  0 Pid   5201 on      nodeB device  0 [0x53] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  3 Group  0 Pid   5202 on      nodeB device  1 [0x64] NVIDIA H100 80GB HBM3
[1,0]<stdout>:nodeA:4101:4160 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
[1,0]<stdout>:nodeA:4101:4160 [0] NCCL INFO Using network Libfabric
[1,2]<stdout>:nodeB:5201:5260 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
[1,2]<stdout>:nodeB:5201:5260 [0] NCCL INFO Using network Libfabric
[1,2]<stdout>:nodeB:5201:5260 [0] NCCL INFO Channel 01/0 : 2[0] -> 0[0] [send] via NET/Libfabric/0/GDRDMA
[1,0]<stdout>:nodeA:4101:4160 [0] NCCL INFO Channel 01/0 : 0[0] -> 2[0] [send] via NET/Libfabric/1/GDRDMA
[1,0]<stdout>:#
[1,0]<stdout>:#                                                              out-of-place                       in-place
[1,0]<stdout>:#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
[1,0]<stdout>:#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:     1048576        262144     float     sum      -1    120.0    8.74   13.11      0    118.5    8.85   13.27      0
[1,0]<stdout>:# Out of bounds values : 0 OK
[1,0]<stdout>:# Avg bus bandwidth    : 13.11
[1,0]<stdout>:#     1073741824     268435456     float     sum      -1  (a commented row is no result)
[1,0]<stdout>:  1073741824     268435456     float     sum      -1    14000    76.70   115.05    N/A    13950    76.97   115.46    N/A
"""

# nccl-tests before the root column (and with `error` where #wrong is now).
OLD_PERF_OUTPUT = """\
#       size    count   type redop     time  algbw  busbw  error     time  algbw  busbw  error
#        (B) (elements)                 (us) (GB/s) (GB/s)            (us) (GB/s) (GB/s)
     1048576   262144  float   sum    303.2   3.46   3.46  2e-07    301.9   3.47   3.47  2e-07
"""


def lines(text: str) -> list[str]:
    return text.splitlines()


# -- sizes and bandwidth ----------------------------------------------------------------------


def test_sizes_parse_like_nccl_tests() -> None:
    assert bandwidth.parse_sizes("1M,64M,1G") == (1 << 20, 64 << 20, 1 << 30)
    assert bandwidth.parse_sizes(" 64K , 4096,1m,1M ") == (4096, 64 << 10, 1 << 20)  # sorted, once each
    assert bandwidth.parse_sizes("2GiB") == (2 << 30,)
    assert [bandwidth.human_size(s) for s in (1 << 20, 64 << 20, 1 << 30, 3000, 4096)] == \
        ["1M", "64M", "1G", "3000", "4K"]


@pytest.mark.parametrize("text, message", [
    ("", "give sizes such as 1M,64M,1G"),
    ("1M,lots", "'lots' is not a size"),
    ("1T", "'1T' is not a size"),
    ("6", "6 is 6 bytes; the buffers are float32"),
    ("128G", "128G is more than 64G"),
])
def test_bad_sizes_name_the_flag(text: str, message: str) -> None:
    with pytest.raises(UserError, match="^--sizes ") as err:
        bandwidth.parse_sizes(text)
    assert message in err.value.message


def test_busbw_is_algbw_times_two_n_minus_one_over_n() -> None:
    assert bandwidth.busbw_factor(2) == 1.0 and bandwidth.busbw_factor(8) == 1.75
    assert bandwidth.busbw_factor(1) == 0.0
    m = bandwidth.measurement(1 << 30, 14000.0, 16)
    assert m.algbw_gbps == pytest.approx((1 << 30) / 0.014 / 1e9)
    assert m.busbw_gbps == pytest.approx(m.algbw_gbps * 2 * 15 / 16)
    # all_reduce_perf's own figures (PERF_OUTPUT: 4 ranks) agree with the formula
    row = ncclperf.parse_output(lines(PERF_OUTPUT))[0]
    ours = bandwidth.measurement(row.size_bytes, row.time_us, 4)
    assert (round(ours.algbw_gbps, 2), round(ours.busbw_gbps, 2)) == (row.algbw_gbps, row.busbw_gbps)
    assert bandwidth.table([ours]) == [
        "    size     time (us)  algbw (GB/s)  busbw (GB/s)",
        "      1M         120.0          8.74         13.11"]


# -- NCCL_DEBUG=INFO -----------------------------------------------------------------------------


def test_efa_through_aws_ofi_nccl() -> None:
    procs = nccllog.parse(lines(EFA_NODE0) + lines(EFA_NODE1))
    assert [(p.host, p.rank) for p in procs] == [("nodeA", 0), ("nodeA", 1), ("nodeB", 2), ("nodeB", 3)]
    head = procs[0]
    assert (head.network, head.provider, head.kind, head.transport) == \
        ("Libfabric", "efa", "efa", "NET/OFI (efa) GDRDMA")
    assert head.inter_node and head.intra == ["P2P/IPC"] and head.version == "2.23.4+cuda12.4"
    assert procs[2].intra == ["SHM"] and procs[2].nranks == 4
    assert {p.kind for p in procs} == {"efa"}


def test_socket_fallback_infiniband_roce_and_ofi_over_tcp() -> None:
    sock = nccllog.parse(lines(SOCKET_NODE.format(host="nodeA", r=0, o=1)))
    assert [(p.rank, p.network, p.kind, p.transport) for p in sock] == [(0, "Socket", "socket", "NET/Socket")]
    ib = nccllog.parse(lines(IB_NODE))[0]
    assert (ib.kind, ib.transport, ib.rank) == ("ib", "NET/IB (mlx5_0:1/IB, mlx5_1:1/IB) GDRDMA", 0)
    roce = nccllog.parse(lines(ROCE_NODE))[0]
    assert (roce.kind, roce.ib_devices, roce.gdr, roce.rank) == ("roce", ["mlx5_10:1/RoCE", "mlx5_11:1/RoCE"], False, 1)
    tcp = nccllog.parse(lines(OFI_TCP))[0]
    assert (tcp.kind, tcp.transport, tcp.rank) == ("ofi-tcp;ofi_rxm", "NET/OFI (tcp;ofi_rxm)", 0)
    assert not fabriccheck.satisfies(tcp.kind, "efa")


def test_a_single_node_shows_the_network_nccl_picked_and_prefixes_are_skipped() -> None:
    text = ("[1,0]<stdout>:box:11:11 [0] NCCL INFO Using network Socket\n"
            "10.0.0.5: box:11:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
            "NCCL version 2.21.5+cuda12.4\n"
            "box:11:12 [0] NCCL WARN NET/OFI Couldn't open a libfabric endpoint\n"
            "unrelated line: 3:4 [0] nothing\n")
    (proc,) = nccllog.parse(lines(text))
    assert (proc.network, proc.inter_node, proc.kind, proc.intra, proc.rank) == \
        ("Socket", False, "socket", ["P2P/CUMEM"], 0)
    assert proc.version == "2.21.5+cuda12.4" and proc.warnings == ["NET/OFI Couldn't open a libfabric endpoint"]
    assert nccllog.parse(["no NCCL here"]) == []


# -- all_reduce_perf ---------------------------------------------------------------------------------


def test_all_reduce_perf_rows() -> None:
    rows = ncclperf.parse_output(lines(PERF_OUTPUT))
    assert [(r.size_bytes, r.count, r.time_us, r.algbw_gbps, r.busbw_gbps, r.wrong) for r in rows] == [
        (1 << 20, 262144, 120.0, 8.74, 13.11, "0"), (1 << 30, 268435456, 14000.0, 76.70, 115.05, "N/A")]
    assert rows[1].in_place_time_us == 13950.0 and rows[1].in_place_busbw_gbps == 115.46
    assert ncclperf.ranks_in_output(lines(PERF_OUTPUT)) == 4
    (old,) = ncclperf.parse_output(lines(OLD_PERF_OUTPUT))
    assert (old.size_bytes, old.time_us, old.busbw_gbps, old.wrong, old.in_place_time_us) == \
        (1 << 20, 303.2, 3.46, "2e-07", 301.9)


def test_mpirun_line_for_every_gpu_of_every_node() -> None:
    env = {"NCCL_DEBUG": "INFO", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "LD_LIBRARY_PATH": "/x",
           "PATH": "/usr/bin", "HOME": "/root", "OFI_NCCL_PROTOCOL": "RDMA", "AWS_SECRET_ACCESS_KEY": "no"}
    names = ncclperf.forwarded_env(env)
    assert names == ["FI_EFA_USE_DEVICE_RDMA", "FI_PROVIDER", "LD_LIBRARY_PATH", "NCCL_DEBUG",
                     "OFI_NCCL_PROTOCOL", "PATH"]
    argv = ncclperf.mpirun_argv(mpirun="/opt/amazon/openmpi/bin/mpirun", binary="/opt/nccl-tests/build/all_reduce_perf",
                                hostfile="/h", num_nodes=2, gpus_per_node=8, size_bytes=1 << 30, env_names=names,
                                as_root=True)
    assert argv[:5] == ["/opt/amazon/openmpi/bin/mpirun", "--prefix", "/opt/amazon/openmpi", "--allow-run-as-root",
                        "--hostfile"]
    text = " ".join(argv)
    assert "--hostfile /h -np 16 -N 8 --bind-to none --tag-output" in text
    assert "-x FI_PROVIDER -x LD_LIBRARY_PATH" in text and "AWS_SECRET" not in text
    assert argv[argv.index("/opt/nccl-tests/build/all_reduce_perf"):] == [
        "/opt/nccl-tests/build/all_reduce_perf", "-b", "1073741824", "-e", "1073741824", "-g", "1", "-n", "20",
        "-w", "5", "-c", "1"]
    plain = ncclperf.mpirun_argv(mpirun="mpirun", binary="all_reduce_perf", hostfile="/h", num_nodes=1,
                                 gpus_per_node=1, size_bytes=4096, env_names=[])
    assert plain[:2] == ["mpirun", "--hostfile"] and "-x" not in plain


# -- the expected fabric ---------------------------------------------------------------------------


def test_where_the_expected_fabric_comes_from(tmp_path: Path) -> None:
    best = {"network_tier": "best"}
    assert fabriccheck.expected_fabric(override="ib", fabric_file={"kind": "efa"}, cloud="aws", request=best) == \
        fabriccheck.Expected("ib", "--expect-fabric")
    (tmp_path / "fabric.json").write_text(json.dumps(
        {"kind": "efa", "nodes": [{"rank": 0, "kind": "efa", "devices": 32}, {"rank": 1, "kind": "socket"}]}))
    detected = fabriccheck.expected_fabric(override=None, fabric_file=fabriccheck.read_fabric_file(tmp_path), cloud="aws",
                                      request={})
    # a node that came up without its EFA devices does not lower the bar: every node must use efa
    assert (detected.kind, detected.source, detected.for_rank(1), detected.for_rank(0), detected.per_rank) == \
        ("efa", "detected by prepare", "efa", "efa", {0: "efa", 1: "socket"})
    provisioned = fabriccheck.expected_fabric(override=None, fabric_file={"nodes": [{"rank": 0, "kind": "socket"}]},
                                         cloud="aws", request=best)
    assert (provisioned.kind, provisioned.source) == ("efa", "provisioned with network_tier: best")
    nodes_only = fabriccheck.expected_fabric(override=None, fabric_file={"nodes": [{"rank": 0, "kind": "IB"}]},
                                        cloud="ssh", request=None)
    assert nodes_only.kind == "ib"
    assert fabriccheck.expected_fabric(override=None, fabric_file=None, cloud="aws", request=best).kind == "efa"
    assert fabriccheck.expected_fabric(override=None, fabric_file=None, cloud="aws", request={}).kind == "socket"
    assert fabriccheck.expected_fabric(override=None, fabric_file=None, cloud="local", request=None) == \
        fabriccheck.Expected("socket", "local nodes")
    (tmp_path / "fabric.json").write_text("{not json")
    assert fabriccheck.read_fabric_file(tmp_path) is None and fabriccheck.read_fabric_file(tmp_path / "none") is None
    assert fabriccheck.satisfies("efa", "socket") and fabriccheck.satisfies("socket", "socket")
    assert not fabriccheck.satisfies("socket", "efa") and not fabriccheck.satisfies("ib", "roce")
    with pytest.raises(UserError, match=r"^--expect-fabric nvlink: use one of efa, ib, roce, socket$"):
        fabriccheck.check_fabric_flag("nvlink")
    assert fabriccheck.check_fabric_flag(" EFA ") == "efa"


def test_options_are_checked_before_anything_runs() -> None:
    opts = command.parse_options(sizes="1M", expect_fabric="roce", min_busbw=40.0, envs={"NCCL_IB_HCA": "mlx5"})
    assert (opts.sizes, opts.expect_fabric, opts.min_busbw, opts.method) == ((1 << 20,), "roce", 40.0, "auto")
    with pytest.raises(UserError, match=r"^--min-busbw -1: give a bus bandwidth"):
        command.parse_options(sizes="1M", expect_fabric=None, min_busbw=-1.0)
    with pytest.raises(UserError, match=r"^--method mpi: use one of auto, nccl-tests, torch$"):
        command.parse_options(sizes="1M", expect_fabric=None, min_busbw=None, method="mpi")


# -- the run stage and the probe ------------------------------------------------------------------------


def test_run_stage_picks_a_python_with_torch() -> None:
    opts = command.parse_options(sizes="64K,1M", expect_fabric=None, min_busbw=None)
    local = command.run_script(opts, python="/opt/my venv/bin/python")
    assert "for c in '/opt/my venv/bin/python'; do" in local
    assert "--sizes 65536,1048576 --method auto --timeout 300" in local
    remote = command.run_script(opts, python=None)
    assert 'for c in "$HOME/.gpuctl/venv/bin/python" python3 /opt/conda/envs/pytorch/bin/python' in remote
    for script in (local, remote):
        assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
    assert 'probe="$HOME/.gpuctl/lib/allreduceprobe.py"' in remote  # the prepared bundle's, with ncclperf.py
    assert {"lib/allreduceprobe.py", "lib/ncclperf.py"} <= set(bundle.files())


def _probe_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCTL_", "MASTER_"))}
    env.update({"GPUCTL_NODE_RANK": "0", "GPUCTL_NUM_NODES": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(29700 + os.getpid() % 200), "TORCH_CPP_LOG_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"},
               **extra)
    return env


def test_probe_times_a_gloo_all_reduce_on_one_rank() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(PROBE), "--sizes", "4096,65536", "--max-iters", "3"],
                          env=_probe_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = command.markers(proc.stdout.splitlines())
    assert [r["kind"] for r in recs] == ["rank", "result", "result"]
    assert recs[0]["backend"] == "gloo" and recs[0]["world_size"] == 1
    assert [(r["size_bytes"], r["wrong"]) for r in recs[1:]] == [(4096, False), (65536, False)]
    assert all(r["time_us"] > 0 and 1 <= r["iters"] <= 3 for r in recs[1:])


def test_probe_says_in_one_line_when_nothing_can_run() -> None:
    proc = subprocess.run([sys.executable, str(PROBE), "--sizes", "4096", "--method", "nccl-tests"],
                          env=_probe_env(), capture_output=True, text=True, timeout=60)
    (rec,) = command.markers(proc.stdout.splitlines())
    assert proc.returncode == 3 and rec["kind"] == "problem"
    assert "--method nccl-tests needs NVIDIA GPUs (found 0), all_reduce_perf and mpirun" in rec["text"]


# -- the verdict ---------------------------------------------------------------------------------------------


def inventory(cloud: str = "aws", gpus: int = 2) -> Inventory:
    return Inventory(cluster="train", cloud=cloud, region="us-east-1", zone=None, nodes=(
        Node("head", 0, "i-0", "10.1.0.10", "10.1.0.10", gpus=gpus),
        Node("worker1", 1, "i-1", "10.1.0.11", "10.1.0.11", gpus=gpus)))


def mark(kind: str, **fields: object) -> str:
    return f"{command.MARK} " + json.dumps({"kind": kind, **fields})


def torch_lines(backend: str, world: int, sizes: dict[int, float], per_node: int = 1) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {0: [], 1: []}
    for node in (0, 1):
        for local in range(per_node):
            out[node].append(mark("rank", rank=node * per_node + local, world_size=world, node_rank=node,
                                  local_rank=local, backend=backend, host=f"node{node}"))
    out[0] += [mark("result", size_bytes=s, time_us=t, iters=20, wrong=False) for s, t in sizes.items()]
    return out


EFA_EXPECTED = fabriccheck.Expected("efa", "detected by prepare")
DOC_KEYS = {"ok", "cluster", "job_id", "nodes", "ranks", "method", "backend", "transport", "transport_kind",
            "expected_fabric", "expected_source", "per_rank", "results", "min_busbw_gbps", "nccl_version", "problem",
            "pairs", "slow_nodes"}


def test_efa_cluster_that_uses_efa_passes_and_its_document_keeps_its_keys() -> None:
    opts = command.parse_options(sizes="1M,1G", expect_fabric=None, min_busbw=50.0)
    got = torch_lines("nccl", 4, {1 << 20: 150.0, 1 << 30: 14000.0}, per_node=2)
    got[0] += lines(EFA_NODE0)
    got[1] += lines(EFA_NODE1)
    report = command.analyze(inventory(), got, EFA_EXPECTED, opts, job_id=7)
    assert report.ok, report.problem
    assert (report.method, report.backend, report.ranks, report.transport, report.transport_kind) == \
        ("torch", "nccl", 4, "NET/OFI (efa) GDRDMA", "efa")
    assert [(e["node"], e["nccl_rank"], e["kind"]) for e in report.per_rank] == \
        [("head", 0, "efa"), ("head", 1, "efa"), ("worker1", 2, "efa"), ("worker1", 3, "efa")]
    doc = report.document()
    assert set(doc) == DOC_KEYS and doc["ok"] is True and doc["nccl_version"] == "2.23.4+cuda12.4"
    assert set(doc["results"][0]) == {"size_bytes", "time_us", "algbw_gbps", "busbw_gbps"}
    assert doc["results"][1]["busbw_gbps"] == pytest.approx((1 << 30) / 0.014 / 1e9 * 1.5, rel=1e-4)
    text = report.text()
    assert text[0] == "Cluster 'train': all_reduce across 4 rank(s) on 2 node(s) with torch.distributed nccl, job 7"
    assert "  rank 2 (worker1): NET/OFI (efa) GDRDMA; inside the node: SHM" in text
    assert text[-1] == "OK: NET/OFI (efa) GDRDMA meets the expected fabric (efa), busbw at or above 50 GB/s"


def test_socket_fallback_on_an_efa_cluster_fails_with_one_line() -> None:
    opts = command.parse_options(sizes="1M", expect_fabric=None, min_busbw=None)
    got = torch_lines("nccl", 2, {1 << 20: 2000.0})
    got[0] += lines(SOCKET_NODE.format(host="nodeA", r=0, o=1))
    got[1] += lines(SOCKET_NODE.format(host="nodeB", r=1, o=0))
    report = command.analyze(inventory(), got, EFA_EXPECTED, opts, job_id=3)
    assert report.transport == "NET/Socket" and report.transport_kind == "socket"
    assert report.problem is not None and report.problem.startswith(
        "check: NCCL used NET/Socket but cluster 'train' should use efa (detected by prepare); NCCL falls back to "
        "sockets when it cannot load aws-ofi-nccl: put it and libfabric on LD_LIBRARY_PATH")
    assert report.problem.endswith("NCCL's lines: `gpuctl logs train 3`") and "\n" not in report.problem


def test_one_node_falling_back_is_named() -> None:
    opts = command.parse_options(sizes="1M", expect_fabric=None, min_busbw=None)
    got = torch_lines("nccl", 2, {1 << 20: 2000.0})
    got[0] += lines(EFA_NODE0)[:5]
    got[1] += lines(SOCKET_NODE.format(host="nodeB", r=1, o=0))
    report = command.analyze(inventory(), got, EFA_EXPECTED, opts, job_id=3)
    assert report.transport == "mixed: NET/OFI (efa), NET/Socket" and report.transport_kind == "mixed"
    assert report.problem is not None and report.problem.startswith(
        "check: NCCL used NET/Socket on worker1 but cluster 'train' should use efa")


def test_ib_and_roce_expectations() -> None:
    opts = command.parse_options(sizes="1M", expect_fabric="ib", min_busbw=None)
    got = torch_lines("nccl", 2, {1 << 20: 100.0})
    got[0] += lines(IB_NODE)
    got[1] += lines(ROCE_NODE)
    report = command.analyze(inventory(cloud="ssh"), got, fabriccheck.Expected("ib", "--expect-fabric"), opts, job_id=1)
    assert report.problem is not None and report.problem.startswith(
        "check: NCCL used NET/IB (mlx5_10:1/RoCE, mlx5_11:1/RoCE) on worker1 but cluster 'train' should use ib "
        "(--expect-fabric); NCCL found no usable HCA")


def test_gloo_on_cpu_nodes_is_socket() -> None:
    opts = command.parse_options(sizes="64K,1M", expect_fabric=None, min_busbw=None)
    got = torch_lines("gloo", 2, {65536: 500.0, 1 << 20: 2500.0})
    ok = command.analyze(inventory(cloud="local", gpus=0), got, fabriccheck.Expected("socket", "local nodes"), opts,
                         job_id=2)
    assert ok.ok and (ok.transport, ok.transport_kind, ok.ranks) == ("socket (gloo)", "socket", 2)
    assert [e["transport"] for e in ok.per_rank] == ["socket (gloo)"] * 2
    bad = command.analyze(inventory(cloud="local", gpus=0), got, fabriccheck.Expected("efa", "--expect-fabric"), opts,
                          job_id=2)
    assert bad.problem == ("check: torch.distributed used gloo over sockets (no CUDA GPU for NCCL) but cluster "
                           "'train' should use efa (--expect-fabric); gloo has no efa transport, only NCCL on GPU "
                           "nodes can use it")


def test_busbw_floor_is_checked_at_the_largest_size() -> None:
    opts = command.parse_options(sizes="1M,1G", expect_fabric=None, min_busbw=50.0)
    got = torch_lines("gloo", 2, {1 << 20: 50.0, 1 << 30: 346_000.0})  # 1M fast, 1G at 3.1 GB/s
    report = command.analyze(inventory(cloud="local"), got, fabriccheck.Expected("socket", "local nodes"), opts, job_id=1)
    assert report.problem == "check: busbw 3.1 GB/s at 1G is below --min-busbw 50"


def test_nccl_tests_output_on_the_head() -> None:
    opts = command.parse_options(sizes="1M,1G", expect_fabric=None, min_busbw=None)
    got = {0: [mark("method", method="nccl-tests", binary="/opt/nccl-tests/build/all_reduce_perf"),
               *lines(PERF_OUTPUT)], 1: [mark("mpi-worker", node_rank=1)]}
    report = command.analyze(inventory(), got, EFA_EXPECTED, opts, job_id=4)
    assert report.ok, report.problem
    assert (report.method, report.ranks, report.transport) == ("nccl-tests", 4, "NET/OFI (efa) GDRDMA")
    assert [(r.size_bytes, r.busbw_gbps) for r in report.results] == [(1 << 20, 13.11), (1 << 30, 115.05)]
    assert [(e["host"], e["nccl_rank"]) for e in report.per_rank] == [("nodeA", 0), ("nodeB", 2)]


def test_what_stops_a_check_before_any_fabric_question() -> None:
    opts = command.parse_options(sizes="1M,64M", expect_fabric=None, min_busbw=None)
    socket_ok = fabriccheck.Expected("socket", "local nodes")
    problem = {0: [mark("problem", text="node0 has neither a Python with torch nor all_reduce_perf")], 1: []}
    report = command.analyze(inventory(), problem, socket_ok, opts, job_id=5, failure="job 5 failed: rank 0 ...")
    assert report.problem == "check: rank 0 (head): node0 has neither a Python with torch nor all_reduce_perf"
    failed = command.analyze(inventory(), {0: [], 1: []}, socket_ok, opts, job_id=5, failure="job 5 failed: x")
    assert failed.problem == "check: the all_reduce job failed: job 5 failed: x; its output: `gpuctl logs train 5`"
    short = command.analyze(inventory(cloud="local"), torch_lines("gloo", 2, {1 << 20: 10.0}), socket_ok, opts,
                            job_id=5)
    assert short.problem == "check: 1 of 2 size(s) measured; its output: `gpuctl logs train 5`"
    silent = torch_lines("nccl", 2, {1 << 20: 10.0, 64 << 20: 100.0})
    unknown = command.analyze(inventory(), silent, EFA_EXPECTED, opts, job_id=5)
    assert unknown.transport.startswith("unknown") and unknown.problem is not None
    assert unknown.problem.startswith("check: NCCL printed no NCCL INFO lines")
    wrong = torch_lines("gloo", 2, {1 << 20: 10.0, 64 << 20: 100.0})
    wrong[0][-1] = mark("result", size_bytes=64 << 20, time_us=100.0, iters=20, wrong=True)
    assert command.analyze(inventory(), wrong, socket_ok, opts, job_id=5).problem.startswith(  # type: ignore[union-attr]
        "check: the all_reduce returned wrong sums")


def test_what_nodes_print_reaches_the_verdict_printable_and_numbers_only_as_numbers() -> None:
    """A broken or hostile node (issue 34, item 14): escapes in NCCL's lines and in the probe's
    records, sizes and times that are no numbers. The lines pass the job plane's border (the
    CollectingRunner keeps them printable, and every record's strings), the non-numbers are not
    measured, and nothing gpuctl prints or writes of it holds a control character."""
    import re

    from gpuctl.healthcheck import collect, pairs
    from gpuctl.jobplane.events import Event

    control = re.compile("[\x00-\x1f\x7f-\x9f]")
    opts = command.parse_options(sizes="1M,64M", expect_fabric=None, min_busbw=None)
    got = torch_lines("nccl", 2, {1 << 20: 10.0})
    got[0] += [mark("result", size_bytes="64M\x1b[2J", time_us=5.0), mark("result", size_bytes=64 << 20, time_us="nan")]
    got[1][0] = mark("rank", rank="1\x1b", world_size="two", node_rank=[1], backend="nccl", host="\x1b]0;T\x07nodeB")
    got[0] += SOCKET_NODE.format(host="nodeA", r=0, o=1).replace("Socket", "Sock\x1b]0;T\x07et\r").split("\n")
    got[1] += lines(SOCKET_NODE.format(host="node\x1b[31mB", r=1, o=0))
    runner = collect.CollectingRunner.__new__(collect.CollectingRunner)
    runner.lines = {0: [], 1: []}
    for rank, texts in got.items():
        for text in texts:
            assert runner.output_text(Event("O", rank, stage="run", text=text)) == text  # shown and logged as is
    report = command.analyze(inventory(), runner.lines, EFA_EXPECTED, opts, job_id=6)
    assert report.ranks == 2 and [r.size_bytes for r in report.results] == [1 << 20]
    assert report.problem == "check: 1 of 2 size(s) measured; its output: `gpuctl logs train 6`"
    assert report.transport.startswith("mixed: NET/Sock\\x1b]0;T\\x07et\\r"), report.transport
    said = [*report.text(), report.problem, json.dumps(report.document(), ensure_ascii=False)]
    assert not [s for s in said if control.search(s)], said
    # a problem the probe reports, in the line `check` fails with
    bad = {0: [mark("problem", text="no torch \x1b]0;owned\x07here")], 1: []}
    runner.lines = {0: [], 1: []}
    runner.output_text(Event("O", 0, stage="run", text=bad[0][0]))
    assert command.analyze(inventory(), runner.lines, EFA_EXPECTED, opts, job_id=7).problem == \
        "check: rank 0 (head): no torch \\x1b]0;owned\\x07here"
    # --pairs: a record whose numbers are none is no result, never a crash
    recs = [{"kind": "pair", "nodes": [0, 1], "ranks": "2\x1b", "size_bytes": 1 << 26, "time_us": 10.0},
            {"kind": "pair", "nodes": ["1", "x"], "size_bytes": 1 << 26, "time_us": 10.0},
            {"kind": "pair", "nodes": [1, 2], "size_bytes": 1 << 26, "time_us": float("inf")},
            {"kind": "pair", "nodes": [2, 0], "size_bytes": 1 << 26, "time_us": "12.5"}]
    assert [p.busbw_gbps > 0 for p in pairs.results(3, recs)] == [False, False, True]


def test_a_failed_probe_job_says_what_its_failing_rank_said() -> None:
    """`check` on nodes that cannot run its probe (exit code 126: a Python they may not execute) names
    the reason the failing rank printed, not only its exit code."""
    from types import SimpleNamespace

    from gpuctl.common.errors import JobFailed
    from gpuctl.healthcheck import collect

    job = SimpleNamespace(job_id=4, name="check", failed_rank=1)

    class Runner:
        inv = SimpleNamespace(cluster="c")
        lines = {0: ["ok"], 1: ["starting", "bash: line 1: /home/me/.venv/bin/python3: Permission denied", "  "]}

        def run(self, spec, **kw):
            raise JobFailed("job 4 failed: rank 1 (worker1, 10.0.0.3) failed first with exit code 126", job_id=4)

    registry = SimpleNamespace(job=lambda cluster, job_id: job if job_id == 4 else None)
    job_id, failure = collect.run_probe_job(Runner(), SimpleNamespace(name="check"), registry)  # type: ignore[arg-type]
    assert job_id == 4 and failure == ("job 4 failed: rank 1 (worker1, 10.0.0.3) failed first with exit code 126; "
                                       "rank 1 said: bash: line 1: /home/me/.venv/bin/python3: Permission denied")
    Runner.lines = {1: []}
    assert collect.run_probe_job(Runner(), SimpleNamespace(name="check"), registry)[1].endswith(  # type: ignore[arg-type]
        "exit code 126")
