"""The controller's end of prepare through the cluster: one ssh call asks the head to install workers.

Once the head is prepared, the workers need the same bundle the Ansible module gives each node.
Sending it from here costs the controller an ssh session and a module run per node; the head
already holds the cluster's internal key and the workers' host keys, so it installs them itself
(agent/peerinstall.py) and streams one result line per worker back. The controller's cost is one
call, whatever the number of workers.
"""

from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gpuctl.common.safetext import printable
from gpuctl.jobplane import payload
from gpuctl.node import protocol
from gpuctl.provision import ssh
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
    argv = ssh.ssh_argv(head, f"{protocol.AGENT} {protocol.CMD_INSTALL_PEERS}", control_dir=control_dir)
    outcomes: dict[str, PeerResult] = {}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    # A head that stops answering holds nothing up for good: each worker has its own limit there.
    rounds = -(-len(workers) // int(request["parallel"]))
    watchdog = threading.Timer(protocol.PEER_INSTALL_TIMEOUT * rounds + 60, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    try:
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    for line in proc.stdout:
        try:
            data = json.loads(line)
            node = by_name[data["node"]]
        except (ValueError, KeyError, TypeError):
            continue  # not a result line (a login banner): the worker stays unreported
        outcome = PeerResult(ok=bool(data.get("ok")), result=dict(data.get("result") or {}),
                             error=printable(str(data.get("error") or "")), unreachable=bool(data.get("unreachable")))
        outcomes[node.name] = outcome
        if on_result is not None:
            on_result(node, outcome)
    err = proc.stderr.read()
    code = proc.wait()
    watchdog.cancel()
    missing = [n for n in workers if n.name not in outcomes]
    if missing:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        why = f"the head ({head.name}) did not install it: " + (printable(lines[-1]) if lines else f"exit code {code}")
        for node in missing:
            outcomes[node.name] = PeerResult(ok=False, result={}, error=why, unreachable=True)
    return outcomes
