"""gpuctl check, node side: one all_reduce across every node and GPU, timed.

Installed on every node as ~/.gpuctl/lib/allreduceprobe.py (with ncclperf.py beside
it: the prepared bundle) and run by the check job's run stage on each node, with the job's env
(GPUCTL_NODE_RANK, GPUCTL_NUM_NODES, GPUCTL_NODE_IPS, MASTER_ADDR,
MASTER_PORT, GPUCTL_NUM_GPUS_PER_NODE) and NCCL_DEBUG=INFO. Standard library,
plus torch for the torch path, imported only when it runs: the controller reads its MARK.

- nccl-tests (method auto or nccl-tests): where the node has NVIDIA GPUs,
  all_reduce_perf and mpirun, the head runs one mpirun per size over every
  GPU of every node (ncclperf.mpirun_argv); the other nodes' ranks end at once
  (mpirun reaches them over ssh).
- torch (else): torch.distributed all_reduce of float32 buffers, NCCL on
  CUDA GPUs (one process per GPU, started here) or gloo on CPU (one per
  node). Per size: a correctness round, one timed round that sets how many
  more to run (the slowest rank's time, so every rank runs the same number),
  a few warm-ups, then `iters` rounds back to back; the time is the slowest
  rank's average.

- pairs (`--pairs`, torch only): the same rounds on each pair of ring
  neighbours (i, i+1) alone, in rounds of pairs that share no node (ring_rounds),
  each pair with its first node as master; the controller names the node whose
  pairs are all slow (healthcheck/pairs.py).

What the controller reads is one line per fact on stdout, `__GPUCTL_CHECK__ {json}`:
kind rank (each process), result (rank 0, one per size), pair (a pair's first
rank, one per size), method, mpirun, mpi-worker, problem (text: what went wrong,
in one line). Exit status 0 when every size was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time

MARK = "__GPUCTL_CHECK__"
PAIR_PASSES = 2  # --pairs: each pair measured this many times; the controller keeps its best
ELEMENT_BYTES = 4


def say(kind: str, **fields: object) -> None:
    print(MARK + " " + json.dumps({"kind": kind, **fields}, sort_keys=True), flush=True)


def env_int(name: str, default: int = 0) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def host() -> str:
    return socket.gethostname()


def nvidia_gpus() -> int:
    """NVIDIA GPUs on this node (nvidia-smi -L), 0 without the driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def find_nccl_tests() -> tuple[str, str] | None:
    """(all_reduce_perf, mpirun) where both are on this node."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ncclperf  # beside this file on the node

    def first(candidates: tuple[str, ...], name: str) -> str | None:
        for path in (*candidates, shutil.which(name)):
            if path and os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        return None

    binary = first(ncclperf.BINARY_CANDIDATES, "all_reduce_perf")
    mpirun = first(ncclperf.MPIRUN_CANDIDATES, "mpirun")
    return (binary, mpirun) if binary and mpirun else None


# -- nccl-tests ----------------------------------------------------------------


def run_nccl_tests(args: argparse.Namespace, binary: str, mpirun: str, gpus: int) -> int:
    import ncclperf

    node_rank, nnodes = env_int("GPUCTL_NODE_RANK"), env_int("GPUCTL_NUM_NODES", 1)
    if node_rank != 0:
        say("mpi-worker", host=host(), node_rank=node_rank)
        return 0  # the head's mpirun starts this node's ranks over ssh
    ips = [ip for ip in os.environ.get("GPUCTL_NODE_IPS", "").split() if ip] or ["localhost"]
    hostfile = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "hostfile-" + (os.environ.get("GPUCTL_TASK_ID") or str(os.getpid())))
    with open(hostfile, "w") as fh:  # the cluster's GPUs per node may be undeclared (slots=0 in GPUCTL_HOSTFILE)
        fh.write("".join(f"{ip} slots={gpus}\n" for ip in ips))
    say("method", method="nccl-tests", binary=binary, mpirun=mpirun, gpus_per_node=gpus, nodes=nnodes, host=host())
    names = ncclperf.forwarded_env(os.environ)
    try:
        for size in args.sizes:
            argv = ncclperf.mpirun_argv(mpirun=mpirun, binary=binary, hostfile=hostfile, num_nodes=len(ips),
                                        gpus_per_node=gpus, size_bytes=size, env_names=names,
                                        as_root=os.geteuid() == 0)
            say("mpirun", argv=argv)
            code = subprocess.call(argv)
            if code != 0:
                say("problem", text=f"mpirun of {binary} at {size} bytes exited with code {code} on {host()}")
                return code
    finally:
        os.unlink(hostfile)
    return 0


# -- torch.distributed -----------------------------------------------------------


def run_torch(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError as exc:
        say("problem", text=f"{host()} has neither a Python with torch (tried {args.tried or sys.executable}: {exc}) "
                            "nor nccl-tests' all_reduce_perf with mpirun; install torch for python3 there, "
                            "or use an image that ships them (the Deep Learning AMI)")
        return 3
    cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        say("problem", text=f"{host()}: --backend nccl but torch {torch.__version__} sees no CUDA GPU")
        return 3
    nproc = 1
    if backend == "nccl":
        count = torch.cuda.device_count()
        declared = env_int("GPUCTL_NUM_GPUS_PER_NODE")
        if declared > count:
            say("problem", text=f"{host()}: the cluster has {declared} GPU(s) per node, torch sees {count}")
            return 3
        nproc = declared or count
    if args.local_rank is not None or nproc == 1:
        if args.pairs:
            return run_pairs(args, torch, backend, args.local_rank or 0, nproc)
        return worker(args, torch, backend, args.local_rank or 0, nproc)
    return spawn(args, nproc)


def spawn(args: argparse.Namespace, nproc: int) -> int:
    """One process per GPU, each this script with --local-rank; the first failure stops the others."""
    argv = [sys.executable, "-u", os.path.abspath(__file__), *sys.argv[1:]]
    procs = [subprocess.Popen([*argv, "--local-rank", str(i)]) for i in range(nproc)]
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for other in procs:
                        other.terminate()
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
    return code


def ring_rounds(nnodes: int) -> list[list[tuple[int, int]]]:
    """The ring's node pairs (i, i+1), in rounds of pairs that share no node (2 rounds for an even
    ring, 3 for an odd one): every node meets both its neighbours, one pair at a time."""
    edges = [(0, 1)] if nnodes == 2 else [(i, (i + 1) % nnodes) for i in range(nnodes)] if nnodes > 2 else []
    rounds: list[list[tuple[int, int]]] = []
    for edge in edges:
        for members in rounds:
            if not {n for e in members for n in e} & set(edge):
                members.append(edge)
                break
        else:
            rounds.append([edge])
    return rounds


def run_pairs(args: argparse.Namespace, torch, backend: str, local_rank: int, nproc: int) -> int:
    """The all_reduce on each pair of ring neighbours this node belongs to, round by round; the
    pair's first rank says its time (`pair`)."""
    node_rank, nnodes = env_int("GPUCTL_NODE_RANK"), env_int("GPUCTL_NUM_NODES", 1)
    ips = [ip for ip in os.environ.get("GPUCTL_NODE_IPS", "").split() if ip]
    rounds = ring_rounds(nnodes)
    edges = [e for members in rounds for e in members]
    # every round twice: a pair slowed once by what ran beside it is fast the other time; a slow node is slow both
    for number, members in enumerate(rounds * PAIR_PASSES):
        edge = next((e for e in members if node_rank in e), None)
        if edge is None:
            continue  # this round pairs the other nodes
        # a port of its own per pair: loopback nodes share one address
        group = {"node_rank": edge.index(node_rank), "nnodes": 2, "master": ips[edge[0]],
                 "port": args.port + 1 + len(edges) * (number // len(rounds)) + edges.index(edge), "pair": list(edge),
                 "round": number}
        code = worker(args, torch, backend, local_rank, nproc, group)
        if code != 0:
            return code
    return 0


def worker(args: argparse.Namespace, torch, backend: str, local_rank: int, nproc: int,
           group: dict | None = None) -> int:
    """One process's all_reduce rounds over every node, or with `group` (run_pairs) over one pair."""
    import torch.distributed as dist

    if group is None:
        node_rank, nnodes = env_int("GPUCTL_NODE_RANK"), env_int("GPUCTL_NUM_NODES", 1)
        master, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), args.port
    else:
        node_rank, nnodes, master, port = group["node_rank"], group["nnodes"], group["master"], group["port"]
    rank, world = node_rank * nproc + local_rank, nnodes * nproc
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    address = f"[{master}]" if ":" in master else master
    try:
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as exc:  # noqa: BLE001 - one line for the controller
        say("problem", text=f"{host()} rank {rank}: torch.distributed could not start {backend} with "
                            f"{master}:{port} within {args.timeout}s: {type(exc).__name__}: {exc}")
        return 4
    if group is not None:
        try:
            for size in args.sizes:
                time_us, iters, wrong = bench(torch, dist, device, size, rank, world, args)
                if rank == 0:
                    say("pair", nodes=group["pair"], round=group["round"], ranks=world, size_bytes=size,
                        time_us=time_us, iters=iters, wrong=wrong, backend=backend)
        finally:
            dist.destroy_process_group()
        return 0
    info = {"rank": rank, "world_size": world, "node_rank": node_rank, "local_rank": local_rank,
            "backend": backend, "device": str(device), "host": host(), "torch": torch.__version__,
            "python": sys.executable}
    if backend == "nccl":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - the version is a nicety
            pass
    say("rank", **info)
    try:
        for size in args.sizes:
            time_us, iters, wrong = bench(torch, dist, device, size, rank, world, args)
            if rank == 0:
                say("result", size_bytes=size, time_us=time_us, iters=iters, wrong=wrong)
    finally:
        dist.destroy_process_group()
    return 0


def bench(torch, dist, device, size: int, rank: int, world: int, args: argparse.Namespace):
    """(average µs per all_reduce on the slowest rank, rounds timed, whether a sum came out wrong)."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    buf = torch.empty(size // ELEMENT_BYTES, dtype=torch.float32, device=device)
    buf.fill_(float(rank + 1))  # round 1: correctness, and the connections
    dist.all_reduce(buf)
    sync()
    want = world * (world + 1) / 2
    wrong = slowest(0.0 if float(buf[0].item()) == want and float(buf[-1].item()) == want else 1.0) > 0
    buf.zero_()
    sync()
    start = time.perf_counter()
    dist.all_reduce(buf)
    sync()
    one = slowest(time.perf_counter() - start)
    for _ in range(min(args.warmup, int(args.target / 10 / one) if one > 0 else args.warmup)):
        dist.all_reduce(buf)
    iters = max(1, min(args.max_iters, int(args.target / one) if one > 0 else args.max_iters))
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    elapsed = slowest(time.perf_counter() - start)
    return elapsed / iters * 1e6, iters, wrong


# -- entry -------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="probe.py")
    p.add_argument("--sizes", required=True, help="bytes, comma-separated")
    p.add_argument("--method", choices=("auto", "torch", "nccl-tests"), default="auto")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--port", type=int, default=0, help="rendezvous port on MASTER_ADDR (default MASTER_PORT + 2)")
    p.add_argument("--timeout", type=int, default=300, help="seconds to wait for every rank")
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--target", type=float, default=0.5, help="seconds of timed rounds per size, about")
    p.add_argument("--tried", default="", help="the interpreters the run stage tried for torch")
    p.add_argument("--pairs", action="store_true", help="each pair of ring neighbours alone, round by round")
    p.add_argument("--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.port = args.port or env_int("MASTER_PORT", 29500) + 2
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.local_rank is None and args.method in ("auto", "nccl-tests") and not args.pairs:
        detected = nvidia_gpus()
        gpus = env_int("GPUCTL_NUM_GPUS_PER_NODE") or detected
        found = find_nccl_tests() if detected else None
        if found:
            return run_nccl_tests(args, found[0], found[1], gpus)
        if args.method == "nccl-tests":
            say("problem", text=f"{host()}: --method nccl-tests needs NVIDIA GPUs (found {detected}), all_reduce_perf "
                                "and mpirun on the node")
            return 3
    return run_torch(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
