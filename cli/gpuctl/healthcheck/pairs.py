"""`gpuctl check --pairs`: the all_reduce on each pair of ring neighbours, and the node it points at.

Meta's "lemon node": one slow node drags every collective of a job to its pace, but an all_reduce
over the whole cluster cannot say which node it is. So probe.py (`--pairs`) runs the all_reduce
on each pair (i, i+1) of the ring alone, in rounds of pairs that share no node, and this module
judges them (each pair's fastest of its passes): a pair far below the best one (under SLOW_RATIO of its bus bandwidth at the largest
size) is slow, and a node whose every pair is slow is the one named. A node with one slow pair of
two is not named: its neighbour may be the cause, and that neighbour's other pair says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpuctl.common.safetext import finite_number, whole_number
from gpuctl.healthcheck import bandwidth

SLOW_RATIO = 0.5
MIN_NODES = 3  # two nodes make one pair: nothing to compare it with


@dataclass(frozen=True)
class Pair:
    nodes: tuple[int, int]
    size_bytes: int | None = None
    time_us: float | None = None
    busbw_gbps: float = 0.0  # 0: the pair gave no result
    wrong: bool = False

    def doc(self, names: Mapping[int, str]) -> dict[str, Any]:
        return {"nodes": [names.get(r, str(r)) for r in self.nodes], "ranks": list(self.nodes),
                "size_bytes": self.size_bytes, "time_us": self.time_us, "busbw_gbps": round(self.busbw_gbps, 3),
                "wrong": self.wrong}


def ring(nnodes: int) -> list[tuple[int, int]]:
    """The ring's pairs, as probe.ring_rounds makes them (flattened)."""
    return [(0, 1)] if nnodes == 2 else [(i, (i + 1) % nnodes) for i in range(nnodes)]


def results(nnodes: int, records: Sequence[Mapping[str, Any]]) -> list[Pair]:
    """One Pair per ring pair from the probe's `pair` records: at the largest size each measured,
    its fastest pass (what ran beside it can only slow a pair down); a pair without a record gave
    no result (bus bandwidth 0)."""
    best: dict[tuple[int, int], tuple[int, float, int, bool]] = {}
    for rec in records:  # a node's record: its numbers are taken only when they are numbers
        nodes = rec.get("nodes")
        first, second = (whole_number(n) for n in nodes[:2]) if isinstance(nodes, list) and len(nodes) >= 2 \
            else (None, None)
        size, time_us = whole_number(rec.get("size_bytes"), minimum=1), finite_number(rec.get("time_us"))
        ranks = whole_number(rec.get("ranks") or 2, minimum=1)
        if first is None or second is None or size is None or time_us is None or time_us < 0 or ranks is None:
            continue
        key = (first, second)
        if key not in best or (size, -time_us) > (best[key][0], -best[key][1]):
            best[key] = (size, time_us, ranks, bool(rec.get("wrong")))
    found = []
    for key in ring(nnodes):
        if key not in best:
            found.append(Pair(key))
            continue
        size, time_us, ranks, wrong = best[key]
        measured = bandwidth.measurement(size, time_us, ranks)
        found.append(Pair(key, measured.size_bytes, measured.time_us, measured.busbw_gbps, wrong))
    return found


def slow(pairs: Sequence[Pair], ratio: float = SLOW_RATIO) -> tuple[list[Pair], list[int]]:
    """(the slow pairs, the ranks every one of whose pairs is slow)."""
    top = max((p.busbw_gbps for p in pairs), default=0.0)
    slow_pairs = [p for p in pairs if p.busbw_gbps <= 0 or p.busbw_gbps < ratio * top or p.wrong]
    ranks = sorted({r for p in pairs for r in p.nodes})
    named = [r for r in ranks if all(p in slow_pairs for p in pairs if r in p.nodes)]
    return slow_pairs, named if len(named) < len(ranks) else []


def problem(cluster: str, pairs: Sequence[Pair], names: Mapping[int, str]) -> str | None:
    """The line `check --pairs` fails with: the node every slow pair points at, else the slow pairs."""
    slow_pairs, named = slow(pairs)
    if not slow_pairs:
        return None
    top = max(p.busbw_gbps for p in pairs)

    def shown(p: Pair) -> str:
        what = "no result" if not p.busbw_gbps else f"{p.busbw_gbps:.2f} GB/s" + (" (wrong sums)" if p.wrong else "")
        return f"{names.get(p.nodes[0])}-{names.get(p.nodes[1])} {what}"

    if not named:
        return (f"check --pairs: {', '.join(shown(p) for p in slow_pairs)}, under {SLOW_RATIO:g}x the best pair "
                f"({top:.2f} GB/s); no single node explains them")
    nodes = ", ".join(names.get(r, str(r)) for r in named)
    theirs = ", ".join(shown(p) for p in slow_pairs if set(p.nodes) & set(named))
    one = len(named) == 1
    return (f"check --pairs: {nodes} {'is' if one else 'are'} slow: {'its' if one else 'their'} pairs {theirs}, "
            f"the best pair {top:.2f} GB/s; replace {'it' if one else 'them'}: "
            f"gpuctl replace {cluster} {' '.join(names.get(r, str(r)) for r in named)}")


def table(pairs: Sequence[Pair], names: Mapping[int, str]) -> list[str]:
    slow_pairs, named = slow(pairs)
    lines = [f"  {'PAIR':<22} {'SIZE':>6} {'TIME ms':>9} {'BUSBW GB/s':>11}"]
    for p in pairs:
        label = f"{names.get(p.nodes[0])}-{names.get(p.nodes[1])}"
        size = bandwidth.human_size(p.size_bytes) if p.size_bytes else "-"
        time_ms = f"{p.time_us / 1000:.2f}" if p.time_us is not None else "-"
        mark = "  slow" if p in slow_pairs else ""
        lines.append(f"  {label:<22} {size:>6} {time_ms:>9} {p.busbw_gbps:>11.2f}{mark}")
    if named:
        lines.append("  slow node(s): " + ", ".join(names.get(r, str(r)) for r in named))
    return lines
