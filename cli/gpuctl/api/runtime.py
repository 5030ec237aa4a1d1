"""What a function sees on its node: instance_info(), shard(), output control.

Standard library only: this module is imported on every node, where the
Python that runs functions may have nothing but cloudpickle and what the
plugins and `packages=` installed. It reads the environment every gpuctl job
has (GPUCTL_NODE_RANK, GPUCTL_CLUSTER_INFO, MASTER_ADDR/PORT,
GPUCTL_NUM_GPUS_PER_NODE; jobenv.py), so `instance_info()` works the same in
a function broadcast with `fn(...) @ cluster` and in a YAML job's Python.
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

DEFAULT_HEAD_PORT = 29500


@dataclass(frozen=True)
class Peer:
    """One node of the job: its rank and the address the other nodes reach it at."""

    node: int
    addr: str


@dataclass(frozen=True)
class InstanceInfo:
    """This node's place in the job (rank 0 is the head)."""

    node: int
    total_nodes: int
    head_addr: str
    head_port: int
    accelerators: int  # GPUs on this node (resources.accelerators; 0 on CPU nodes)
    peers: tuple[Peer, ...]
    cluster: str = ""
    task_id: str = ""

    @property
    def is_head(self) -> bool:
        return self.node == 0

    @property
    def addr(self) -> str:
        """This node's own address."""
        return self.peers[self.node].addr if self.node < len(self.peers) else ""


def instance_info(environ: Any = None) -> InstanceInfo:
    """This node's InstanceInfo, from the job's environment.

    Raises RuntimeError outside a gpuctl job (no GPUCTL_NODE_RANK or GPUCTL_CLUSTER_INFO).
    """
    env = os.environ if environ is None else environ
    rank_text = env.get("GPUCTL_NODE_RANK", "")
    info_text = env.get("GPUCTL_CLUSTER_INFO", "")
    if not rank_text.isdigit() or not info_text:
        raise RuntimeError("gpuctl.instance_info(): not inside a gpuctl job (GPUCTL_NODE_RANK and "
                           "GPUCTL_CLUSTER_INFO are not set); call it in a function run with fn(...) @ cluster")
    try:
        data = json.loads(info_text)
    except ValueError:
        raise RuntimeError("gpuctl.instance_info(): GPUCTL_CLUSTER_INFO is not JSON") from None
    ips = [str(ip) for ip in data.get("ips") or []]
    total = int(data.get("num_nodes") or len(ips) or 1)
    head = env.get("MASTER_ADDR") or (ips[0] if ips else "127.0.0.1")
    port_text = env.get("MASTER_PORT", "")
    gpus_text = env.get("GPUCTL_NUM_GPUS_PER_NODE", "0")
    return InstanceInfo(
        node=int(rank_text), total_nodes=total, head_addr=head,
        head_port=int(port_text) if port_text.isdigit() else DEFAULT_HEAD_PORT,
        accelerators=int(gpus_text) if gpus_text.isdigit() else 0,
        peers=tuple(Peer(i, ip) for i, ip in enumerate(ips)),
        cluster=str(data.get("cluster_name") or ""), task_id=env.get("GPUCTL_TASK_ID", ""))


# -- shard ---------------------------------------------------------------------


def shard_indices(length: int, node: int, total_nodes: int, *, shuffle: bool = False, seed: int = 0,
                  drop_last: bool = False) -> list[int]:
    """The positions node `node` of `total_nodes` takes from `length` items: every
    total_nodes-th one starting at `node` (modulo striding), after a shuffle that
    is the same on every node for one seed; drop_last evens the counts out."""
    if total_nodes < 1 or not 0 <= node < total_nodes:
        raise ValueError(f"node {node} of {total_nodes}: node must be in 0..total_nodes-1")
    order = list(range(length))
    if shuffle:
        random.Random(seed).shuffle(order)  # the same permutation on every node: same seed, same Python
    if drop_last:
        order = order[:length - length % total_nodes]
    return order[node::total_nodes]


def _take(data: Any, idx: list[int]) -> Any:
    """`data` at positions `idx`, of the same type (list, tuple, numpy array, torch tensor, ...)."""
    if isinstance(data, list):
        return [data[i] for i in idx]
    if isinstance(data, tuple):
        return tuple(data[i] for i in idx)
    if isinstance(data, str):
        return "".join(data[i] for i in idx)
    if isinstance(data, (bytes, bytearray)):
        return type(data)(data[i] for i in idx)
    if isinstance(data, range):
        return [data[i] for i in idx]
    module = type(data).__module__.split(".")[0]
    if module == "torch":
        import torch  # the caller has it: the data is a tensor

        return data[torch.as_tensor(idx, dtype=torch.long)]
    if module == "pandas":
        return data.iloc[idx]
    if hasattr(data, "__array__") or module in ("numpy", "jax", "jaxlib", "cupy"):
        return data[idx] if idx else data[:0]
    try:
        return type(data)(data[i] for i in idx)
    except TypeError:
        return [data[i] for i in idx]


def shard(*arrays: Any, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
          node: int | None = None, total_nodes: int | None = None) -> Any:
    """This node's part of each array (one array: its part; several: a tuple, still aligned).

    Parts are taken by modulo striding (node k gets items k, k+N, k+2N, ...), keep the
    type (list, tuple, numpy array, torch tensor, pandas frame), and with `shuffle` are
    drawn from one permutation that every node computes alike from `seed`. `node` and
    `total_nodes` default to instance_info()'s.
    """
    if not arrays:
        raise TypeError("gpuctl.shard() needs at least one array")
    if node is None or total_nodes is None:
        info = instance_info()
        node = info.node if node is None else node
        total_nodes = info.total_nodes if total_nodes is None else total_nodes
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(f"gpuctl.shard(): the arrays differ in length ({', '.join(str(len(a)) for a in arrays)}); "
                         "arrays sharded together must stay aligned")
    idx = shard_indices(lengths.pop(), node, total_nodes, shuffle=shuffle, seed=seed, drop_last=drop_last)
    parts = tuple(_take(a, idx) for a in arrays)
    return parts[0] if len(parts) == 1 else parts


# -- output control ------------------------------------------------------------

Only = Union[str, Callable[[InstanceInfo], bool], None]


def _wants(only: Only, info: InstanceInfo) -> bool:
    """Whether this node keeps its output under `only` (None: every node, "head": rank 0)."""
    if only is None:
        return True
    if only == "head":
        return info.is_head
    if callable(only):
        return bool(only(info))
    raise ValueError(f"only={only!r}: use 'head' or a function of instance_info() returning True to print")


def _check_only(only: Only) -> None:
    if only is not None and only != "head" and not callable(only):
        raise ValueError(f"only={only!r}: use 'head' or a function of instance_info() returning True to print")


class OutputControl:
    """A function whose stdout and/or stderr go nowhere on the nodes `only` leaves out.

    A class rather than a closure, so it pickles by reference to gpuctl and the
    wrapped function travels with it; Python-level writes (print, logging to
    sys.stdout/sys.stderr) are silenced, not what C code writes to the file descriptors.
    """

    def __init__(self, fn: Callable[..., Any], streams: Sequence[str], only: Only) -> None:
        _check_only(only)
        functools.update_wrapper(self, fn, updated=())  # name and docs; not fn's __dict__ over ours
        self.fn = fn
        self.streams = tuple(streams)
        self.only = only

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _wants(self.only, instance_info()):
            return self.fn(*args, **kwargs)
        saved = {name: getattr(sys, name) for name in self.streams}
        try:
            for name in self.streams:
                setattr(sys, name, io.StringIO())
            return self.fn(*args, **kwargs)
        finally:
            for name, stream in saved.items():
                setattr(sys, name, stream)

    def __reduce__(self) -> tuple[Any, ...]:
        return (OutputControl, (self.fn, self.streams, self.only))


def stdout(only: Only = "head") -> Callable[[Callable[..., Any]], OutputControl]:
    """Decorator: keep stdout only where `only` says ("head", or a predicate on instance_info())."""
    _check_only(only)
    return lambda fn: OutputControl(fn, ("stdout",), only)


def stderr(only: Only = "head") -> Callable[[Callable[..., Any]], OutputControl]:
    """Decorator: keep stderr only where `only` says ("head", or a predicate on instance_info())."""
    _check_only(only)
    return lambda fn: OutputControl(fn, ("stderr",), only)


def silent(fn: Callable[..., Any]) -> OutputControl:
    """Decorator: no stdout and no stderr from the function on any node."""
    return OutputControl(fn, ("stdout", "stderr"), _nowhere)


def _nowhere(info: InstanceInfo) -> bool:
    return False
