"""Fencing a managed job's attempts on its nodes, one ssh call per node, all at once.

`gpuctl-node fence TASK EPOCH` raises the newest epoch a node accepts for the task and stops
whatever of an older attempt still runs there; the same call with the current epoch changes
nothing and tells whether the node got a spot interruption notice. A node that does not answer
cannot confirm: the supervisor treats it as lost (after the grace), never as fenced.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gpuctl.common.paths import cluster_dir
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory, Node

FENCE_TIMEOUT_S = 30.0
MAX_PARALLEL = 64


@dataclass(frozen=True)
class Answer:
    ok: bool  # the node confirmed
    doomed: str | None = None  # its spot interruption notice, if any ("terminate at 2026-...")
    stopped: tuple[str, ...] = ()  # jobs of older attempts it stopped
    detail: str = ""


def _ask(node: Node, command: str, control_dir: Path) -> Answer:
    proc = ssh.run_ssh(node, command, control_dir, timeout=FENCE_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not doc.get("fenced"):
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        if proc.returncode == 2 or "invalid choice" in proc.stderr:
            why = "its agent cannot fence (older than this gpuctl); it is prepared again"
        return Answer(ok=False, detail=why)
    if doc.get("running"):
        return Answer(ok=False, detail=f"still running after the grace: {doc['running']}")
    notice = doc.get("doomed")
    doomed = None
    if isinstance(notice, dict):
        doomed = f"{notice.get('action', 'terminate')} at {notice.get('time', '?')}"
    return Answer(ok=True, doomed=doomed, stopped=tuple(doc.get("stopped") or ()))


def query(inv: Inventory, task: str, epoch: int, *, ranks: Sequence[int] | None = None) -> dict[int, Answer]:
    """Fence at `epoch` on the nodes (all, or `ranks`): rank -> what each answered."""
    control_dir = ssh.control_dir_for(cluster_dir(inv.cluster) / "cm")
    command = protocol.fence_command(task, int(epoch))
    nodes = [n for n in inv.nodes if ranks is None or n.rank in ranks]
    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(nodes))) as pool:
        answers = list(pool.map(lambda n: _ask(n, command, control_dir), nodes))
    return {n.rank: a for n, a in zip(nodes, answers)}


def fence(inv: Inventory, task: str, epoch: int, *, ranks: Sequence[int] | None = None) -> dict[int, bool]:
    """Raise the nodes (all, or `ranks`) to `epoch`: rank -> whether it confirmed."""
    return {rank: answer.ok for rank, answer in query(inv, task, epoch, ranks=ranks).items()}
