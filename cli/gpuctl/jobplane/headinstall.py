"""The controller's end of prepare through the cluster: one ssh call asks the head to install workers.

Once the head is prepared, the workers need the same bundle the Ansible module gives each node.
Sending it from here costs the controller an ssh session and a module run per node; the head
already holds the cluster's internal key and the workers' host keys, so it installs them itself
(agent/peerinstall.py) and streams one result line per worker back (agentcall.start: one ssh call,
read as each line comes). The controller's cost is one call, whatever the number of workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gpuctl.common.safetext import printable
from gpuctl.jobplane import agentcall, payload
from gpuctl.node import protocol
from gpuctl.provision.inventory import Node


@dataclass(frozen=True)
class PeerResult:
    """One worker's outcome: its install step's result (ok), or why not (`unreachable`: the head
    did not reach it, so it may be prepared directly)."""

    ok: bool
    result: Mapping[str, Any]
    error: str = ""
    unreachable: bool = False


def install_through_head(head: Node, workers: Sequence[Node], *, bundle: Mapping[str, Any], bootstrap: str,
                         python: str | None, view: Mapping[str, Any], control_dir: Path,
                         on_result: Callable[[Node, PeerResult], None] | None = None,
                         parallel: int | None = None) -> dict[str, PeerResult]:
    """Install `workers` from the head; {worker name: outcome}. A worker the head never reported
    on (the call to the head failed) is `unreachable` with the head's reason."""
    by_name = {n.name: n for n in workers}
    request = {
        "bundle": dict(bundle),  # without the private key: the head adds its own copy
        "bootstrap": bootstrap,
        "python": python or "python3",
        "view": dict(view),
        "targets": [payload.peer_entry(n) for n in workers],
        "parallel": parallel or payload.fanout(),
    }
    outcomes: dict[str, PeerResult] = {}
    # A head that stops answering holds nothing up for good: each worker has its own limit there.
    rounds = -(-len(workers) // int(request["parallel"]))
    proc = agentcall.start(head, agentcall.command(protocol.CMD_INSTALL_PEERS), control_dir=control_dir,
                           input=json.dumps(request), text=True,
                           kill_after=protocol.PEER_INSTALL_TIMEOUT * rounds + 60)
    assert proc.stdout is not None and proc.stderr is not None
    for data in agentcall.json_lines(proc.stdout):  # a line that is not a result (a login banner) is skipped
        name = data.get("node")
        node = by_name.get(name) if isinstance(name, str) else None
        if node is None:
            continue  # not a worker of this request: it stays unreported
        outcome = PeerResult(ok=bool(data.get("ok")), result=dict(data.get("result") or {}),
                             error=printable(str(data.get("error") or "")), unreachable=bool(data.get("unreachable")))
        outcomes[node.name] = outcome
        if on_result is not None:
            on_result(node, outcome)
    err = proc.stderr.read()
    code = proc.wait()
    missing = [n for n in workers if n.name not in outcomes]
    if missing:
        error = agentcall.failure(code, err)
        why = f"the head ({head.name}) did not install it: " + (error.why if error is not None else "no result")
        for node in missing:
            outcomes[node.name] = PeerResult(ok=False, result={}, error=why, unreachable=True)
    return outcomes
