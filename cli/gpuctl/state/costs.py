"""What clusters cost: a cluster's age and cost so far, and each stretch of its life as `cost-report`
lists it, from the registry's history (Segment). Read by `status`, `cost-report` and the dashboard.
"""

from __future__ import annotations

import time
from typing import Any, Collection, Sequence

from gpuctl.state.registry import Registry, Segment


def cluster_cost(name: str, registry: Registry, since: float, now: float | None = None, *,
                 history: Sequence[Segment] | None = None) -> dict[str, Any]:
    """Age and estimated cost of a cluster's current life (its segments since `since`). `history`:
    the cluster's segments when the caller read them already (the dashboard reads all at once)."""
    now = time.time() if now is None else now
    segments = [s for s in (registry.history(name) if history is None else history) if s.started_at >= since - 1]
    costs = [s.cost(now) for s in segments]
    free = bool(segments) and all(s.node_price == 0.0 for s in segments)  # no cloud bill (local nodes)
    known = None if free or not segments or any(c is None for c in costs) else round(sum(c for c in costs if c), 4)
    running = [s for s in segments if s.ended_at is None]
    per_hour = None if not running or running[-1].node_price is None else running[-1].node_price * running[-1].num_nodes
    # a cluster that took itself down is as old as it was then
    end = now if running or not segments else max(s.ended_at or now for s in segments)
    return {"age_s": round(max(0.0, end - since), 1), "cost_so_far": known, "per_hour": per_hour,
            "price_source": segments[-1].price_source if segments else None, "no_cloud_bill": free}



def segment_row(seg: Segment, records: Collection[str], now: float) -> dict[str, Any]:
    """A segment as `cost-report` lists it: how it ended (GONE: another runner took it down unseen),
    how long it ran and what it cost."""
    status = {"down": "DOWN", "autodown": "AUTODOWNED", "stopped": "STOPPED", "stop": "STOPPED",
              "resized": "RESIZED"}.get(
        seg.ended_how or "", "UP")
    if status == "UP" and seg.cluster not in records:
        status = "GONE"  # taken down by another state dir or runner: its end was not seen here
    end = seg.ended_at if seg.ended_at is not None else (None if status == "GONE" else now)
    return {"name": seg.cluster, "cloud": seg.cloud, "region": seg.region, "instance_type": seg.instance_type,
            "num_nodes": seg.num_nodes, "use_spot": seg.use_spot, "launched_at": seg.started_at,
            "ended_at": seg.ended_at, "status": status,
            "duration_s": None if end is None else round(end - seg.started_at, 1),
            "per_hour": None if seg.node_price is None else round(seg.node_price * seg.num_nodes, 4),
            "cost": None if end is None else seg.cost(end), "no_cloud_bill": seg.node_price == 0.0,
            "price_source": seg.price_source}
