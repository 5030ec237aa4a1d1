"""Fencing a managed job's attempts on its nodes, one ssh call per node, all at once.

`gpuctl-node fence TASK EPOCH` (through jobplane/agentcall.py, the door to the agent) raises the
newest epoch a node accepts for the task and stops whatever of an older attempt still runs there;
the same call with the current epoch changes nothing and tells whether the node got a spot
interruption notice. A node that does not answer cannot confirm: the supervisor treats it as
lost (after the grace), never as fenced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gpuctl.common.paths import cluster_dir
from gpuctl.jobplane import agentcall
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory

FENCE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Answer:
    ok: bool  # the node confirmed
    doomed: str | None = None  # its spot interruption notice, if any ("terminate at 2026-...")
    stopped: tuple[str, ...] = ()  # jobs of older attempts it stopped
    detail: str = ""


def fence_command(task: str, epoch: int, grace: float | None = None) -> agentcall.Command:
    """`gpuctl-node fence [--grace=S] -- TASK EPOCH`; ValueError for an epoch that is not a whole number >= 0."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch {epoch!r} must be a whole number >= 0")
    return agentcall.command(protocol.CMD_FENCE, str(task), epoch, grace=None if grace is None else float(grace))


def _answer(reply: agentcall.Reply) -> Answer:
    try:
        doc = reply.answer()
    except agentcall.AgentMissing:
        return Answer(ok=False, detail="its agent cannot fence (older than this gpuctl); it is prepared again")
    except agentcall.AgentError as exc:
        return Answer(ok=False, detail=exc.why)
    if not doc.get("fenced"):
        return Answer(ok=False, detail="its agent answered without fencing")
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
    command = fence_command(task, int(epoch))
    nodes = [n for n in inv.nodes if ranks is None or n.rank in ranks]
    replies = agentcall.call_all(nodes, command, control_dir=control_dir, timeout=FENCE_TIMEOUT_S)
    return {n.rank: _answer(replies[n.rank]) for n in nodes}


def fence(inv: Inventory, task: str, epoch: int, *, ranks: Sequence[int] | None = None) -> dict[int, bool]:
    """Raise the nodes (all, or `ranks`) to `epoch`: rank -> whether it confirmed."""
    return {rank: answer.ok for rank, answer in query(inv, task, epoch, ranks=ranks).items()}
