"""What EC2 says of a cluster's own instances, asked by id: their states and which are lost.

Autostop reads the states (did the cluster stop itself?), managed jobs the losses (replace a
node rather than wait out ssh timeouts on it). Both are one DescribeInstances by instance-id
filter, which, unlike InstanceIds=, answers for ids EC2 no longer knows instead of refusing
the call: an id it does not list was terminated and purged.
"""

from __future__ import annotations

import calendar
import re
import time
from typing import Any, Mapping

RUNNING = ("pending", "running")  # every other state (stopping, stopped, shutting-down, terminated) is lost
# EC2's StateReason codes of an instance the spot market took back (interrupted: terminated or stopped)
SPOT_REASONS = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")
# A watcher deciding whether to replace nodes must not hang on EC2: no answer soon means "ask the nodes".
LOSS_READ_TIMEOUT = 10
LOSS_ATTEMPTS = 2


def describe(node_ids: list[str], region: str | None, *, read_timeout: int = 60,
             attempts: int = 3) -> list[dict[str, Any]] | None:
    """EC2's description of each of these instances it still lists; None when EC2 cannot be asked
    (no credentials, no network, an error or a timeout)."""
    from gpuctl.common.config import aws_settings
    from gpuctl.providers.aws.preflight import client, session

    if not node_ids:
        return []
    settings = aws_settings()
    try:
        ec2 = client(session(settings), "ec2", region or "us-east-1", settings, read_timeout=read_timeout,
                     attempts=attempts)
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-id", "Values": list(node_ids)}])
        return [i for page in pages for r in page.get("Reservations", []) for i in r.get("Instances", [])]
    except Exception:  # noqa: BLE001 - no answer concludes nothing
        return None


def instance_states(node_ids: list[str], region: str | None) -> dict[str, tuple[str, float | None]]:
    """{instance id: (EC2 state name, when the state began if EC2 says)}; {} when EC2 cannot be asked."""
    found = describe(node_ids, region)
    if not node_ids or found is None:
        return {}
    states: dict[str, tuple[str, float | None]] = {n: ("terminated", None) for n in node_ids}  # purged by EC2
    for inst in found:
        when = None
        stamp = re.search(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) GMT\)", inst.get("StateTransitionReason") or "")
        if stamp:
            when = float(calendar.timegm(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")))
        states[inst["InstanceId"]] = (inst.get("State", {}).get("Name", "unknown"), when)
    return states


def lost_instances(node_ids: list[str], region: str | None) -> dict[str, str]:
    """{instance id: why} for each instance that is not running; {} when EC2 cannot be asked."""
    found = describe(node_ids, region, read_timeout=LOSS_READ_TIMEOUT, attempts=LOSS_ATTEMPTS)
    return {} if found is None else losses(node_ids, found)


def losses(node_ids: list[str], found: list[Mapping[str, Any]]) -> dict[str, str]:
    """{instance id: why} of `node_ids` given DescribeInstances' instances: the state, and
    "preempted (spot)" when the spot market took it back."""
    by_id = {str(i.get("InstanceId")): i for i in found}
    lost = {}
    for node_id in node_ids:
        inst = by_id.get(node_id)
        if inst is None:
            lost[node_id] = f"instance {node_id} is gone (EC2 no longer lists it: terminated)"
            continue
        state = str((inst.get("State") or {}).get("Name") or "unknown")
        if state in RUNNING:
            continue
        code = str((inst.get("StateReason") or {}).get("Code") or "")
        if code in SPOT_REASONS:
            lost[node_id] = f"preempted (spot): instance {node_id} is {state} ({code})"
        else:
            lost[node_id] = f"instance {node_id} is {state}" + (f" ({code})" if code else "")
    return lost
