"""nccl-tests' all_reduce_perf: where a node has it, how to start it, what it prints (pure).

all_reduce_perf needs MPI to span nodes: the head runs `mpirun` over a
hostfile of the job's nodes (`IP slots=GPUS`), one process per GPU (`-g 1`),
reaching the workers over the cluster's internal ssh key (prepare's Host
entries name every node's address). One mpirun per size: all_reduce_perf
takes a range (-b/-e with a factor), and `--sizes` need not be one.
This module is also copied to the nodes beside probe.py, which imports it:
standard library only.

Its result lines (nccl-tests >= 2.10; older ones have no `root` column and
call `#wrong` `error`; mpirun --tag-output puts `[1,0]<stdout>:` first):

    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         1048576        262144     float     sum      -1    181.3    5.79    5.79      0    180.7    5.80    5.80      0

The first group is out-of-place, the second in-place; gpuctl reports out-of-place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

# Where images ship the binary: AWS's Deep Learning AMIs and awsome-distributed-training
# images build nccl-tests in /opt/nccl-tests; NVIDIA's containers and hand builds put it on PATH.
BINARY_CANDIDATES = ("/opt/nccl-tests/build/all_reduce_perf", "/usr/local/nccl-tests/build/all_reduce_perf",
                     "/opt/nccl_tests/build/all_reduce_perf")
MPIRUN_CANDIDATES = ("/opt/amazon/openmpi/bin/mpirun", "/usr/local/mpi/bin/mpirun", "/opt/hpcx/ompi/bin/mpirun")
# Environment the ranks on other nodes need (mpirun -x): NCCL's and libfabric's own settings.
FORWARDED_PREFIXES = ("NCCL_", "FI_", "OFI_NCCL_", "RDMAV_", "UCX_")
FORWARDED_NAMES = ("LD_LIBRARY_PATH", "PATH", "CUDA_VISIBLE_DEVICES")

_TAG = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:)?")
_NUM = r"[0-9.]+(?:e[-+]?\d+)?"


@dataclass(frozen=True)
class PerfRow:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: str  # "0", "N/A", or an error figure in older versions
    in_place_time_us: float | None = None
    in_place_busbw_gbps: float | None = None


def _float(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def parse_output(lines: Iterable[str]) -> list[PerfRow]:
    """The result rows of all_reduce_perf's output (anything else, NCCL INFO lines included, skipped)."""
    rows = []
    for raw in lines:
        line = _TAG.sub("", raw, count=1).strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if len(words) < 8 or not words[0].isdigit() or not words[1].isdigit() or words[2].isdigit():
            continue
        rest = words[4:]
        if re.fullmatch(r"-?\d+", rest[0]) and len(rest) >= 5 and _float(rest[1]) is not None and \
                "." in rest[1] + rest[2]:
            rest = rest[1:]  # the root column (-1 for all_reduce)
        values = [_float(w) for w in rest[:3]]
        if any(v is None for v in values):
            continue
        time_us, algbw, busbw = values  # type: ignore[misc]
        wrong = rest[3] if len(rest) > 3 else ""
        in_time = _float(rest[4]) if len(rest) > 4 else None
        in_busbw = _float(rest[6]) if len(rest) > 6 else None
        rows.append(PerfRow(int(words[0]), int(words[1]), words[2], words[3], time_us, algbw, busbw,  # type: ignore[arg-type]
                            wrong, in_time, in_busbw))
    return rows


def ranks_in_output(lines: Iterable[str]) -> int:
    """How many ranks all_reduce_perf listed under `# Using devices` (0 if none)."""
    seen = set()
    for raw in lines:
        m = re.search(r"#\s+Rank\s+(\d+)\s", _TAG.sub("", raw, count=1))
        if m:
            seen.add(int(m.group(1)))
    return len(seen)


def forwarded_env(env: Mapping[str, str]) -> list[str]:
    """The names to pass on with `-x`, sorted: NCCL/libfabric settings and the library path."""
    return sorted(k for k in env if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES)


def mpirun_argv(*, mpirun: str, binary: str, hostfile: str, num_nodes: int, gpus_per_node: int, size_bytes: int,
                env_names: Sequence[str], as_root: bool = False, iters: int = 20, warmup: int = 5) -> list[str]:
    """One all_reduce_perf run of one size on every GPU of every node, from the head."""
    argv = [mpirun]
    if mpirun.endswith("/bin/mpirun"):
        argv += ["--prefix", mpirun[: -len("/bin/mpirun")]]  # the workers' orted, whatever their PATH
    if as_root:
        argv.append("--allow-run-as-root")
    argv += ["--hostfile", hostfile, "-np", str(num_nodes * gpus_per_node), "-N", str(gpus_per_node),
             "--bind-to", "none", "--tag-output",
             # Open MPI's own traffic over TCP, off the loopback and docker bridges; the cm PML
             # would claim the EFA/IB devices NCCL is there to test.
             "--mca", "pml", "^cm", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_exclude", "lo,docker0"]
    for name in env_names:
        argv += ["-x", name]
    argv += [binary, "-b", str(size_bytes), "-e", str(size_bytes), "-g", "1", "-n", str(iters), "-w", str(warmup),
             "-c", "1"]
    return argv
