"""Message sizes, bus bandwidth and the table `gpuctl check` prints (pure).

Sizes follow nccl-tests: K, M and G are powers of 1024 (`1M` = 1048576 bytes).
Bandwidths follow nccl-tests' PERFORMANCE.md, in GB/s of 10^9 bytes:
algbw = size / time, and for all_reduce busbw = algbw * 2(n-1)/n with n ranks,
the figure to compare with the hardware's link speed whatever n is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from gpuctl.common.errors import UserError

DEFAULT_SIZES = "1M,64M,1G"
ELEMENT_BYTES = 4  # float32 buffers, as all_reduce_perf's default type
MAX_SIZE = 64 << 30  # beyond a GPU's memory: a typo rather than a test
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_sizes(text: str, *, flag: str = "--sizes") -> tuple[int, ...]:
    """`1M,64M,1G` -> bytes, sorted and without repeats; UserError naming the flag otherwise."""
    words = [w for w in (text or "").split(",") if w.strip()]
    if not words:
        raise UserError(f"{flag} {text!r}: give sizes such as {DEFAULT_SIZES} (bytes, K, M or G)")
    sizes = set()
    for word in words:
        m = _SIZE_RE.match(word)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise UserError(f"{flag} {text}: {word.strip()!r} is not a size; use bytes or K, M, G "
                            f"(powers of 1024), e.g. {DEFAULT_SIZES}")
        size = int(m.group(1)) * _UNITS[unit]  # type: ignore[index]
        if size < ELEMENT_BYTES or size % ELEMENT_BYTES:
            raise UserError(f"{flag} {text}: {word.strip()} is {size} bytes; the buffers are float32, so a size "
                            f"is a multiple of {ELEMENT_BYTES} bytes")
        if size > MAX_SIZE:
            raise UserError(f"{flag} {text}: {word.strip()} is more than {human_size(MAX_SIZE)}")
        sizes.add(size)
    return tuple(sorted(sizes))


def human_size(size: int) -> str:
    """1048576 -> "1M", 3000 -> "3000" (exact units only, as --sizes takes them back)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def algbw_gbps(size_bytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second)."""
    return size_bytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0


def busbw_factor(ranks: int) -> float:
    """all_reduce: 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    return 2.0 * (ranks - 1) / ranks if ranks > 0 else 0.0


@dataclass(frozen=True)
class Measurement:
    """One size: the time of one all_reduce (the slowest rank's average) and its bandwidths."""

    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float

    def doc(self) -> dict:
        return {"size_bytes": self.size_bytes, "time_us": round(self.time_us, 3),
                "algbw_gbps": round(self.algbw_gbps, 4), "busbw_gbps": round(self.busbw_gbps, 4)}


def measurement(size_bytes: int, time_us: float, ranks: int) -> Measurement:
    alg = algbw_gbps(size_bytes, time_us)
    return Measurement(size_bytes, time_us, alg, alg * busbw_factor(ranks))


def table(rows: Sequence[Measurement]) -> list[str]:
    """The lines of the size / time / algbw / busbw table."""
    lines = [f"{'size':>8}  {'time (us)':>12}  {'algbw (GB/s)':>12}  {'busbw (GB/s)':>12}"]
    for r in rows:
        lines.append(f"{human_size(r.size_bytes):>8}  {r.time_us:>12.1f}  {r.algbw_gbps:>12.2f}  {r.busbw_gbps:>12.2f}")
    return lines


def largest(rows: Iterable[Measurement]) -> Measurement | None:
    """The largest size measured: the one a bandwidth floor is checked at (small sizes are latency)."""
    return max(rows, key=lambda r: r.size_bytes, default=None)
