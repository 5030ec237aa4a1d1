"""How a broadcast travels: the call file out, marker lines back (pure, both sides).

Out: one file per call (`write_call`), shipped to every node as a file_mount of
the job: a header line, a JSON line (the call's nonce, the Python and
cloudpickle versions that wrote it), then the cloudpickle of the function, its
arguments and the plugins' node-side parts. Nothing of it is in an argv or the
job's payload; secrets (a plugin's token) are not in it at all.

Back: each rank prints its outcome on its own stdout, which the job plane
already streams to the controller, as marker lines

    __GPUCTL_CALL__ NONCE KIND SEQ COUNT CHUNK

KIND is R (the cloudpickled return value) or E (a JSON error record), CHUNK
the SEQ-th of COUNT base64 pieces (short lines, so no hop ever splits one).
The controller takes every line carrying its nonce out of the output before
it is printed or saved (`Collector`); a marker may follow output the function
left without a newline on the same line.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

MAGIC = b"GPUCTL-CALL 1\n"
MARK = "__GPUCTL_CALL__"
CHUNK = 48 * 1024  # raw bytes per marker line (64 KiB of base64)
RESULT, ERROR = "R", "E"


@dataclass(frozen=True)
class CallHeader:
    nonce: str
    python: str  # "3.11": cloudpickle's bytes load only in the same minor version
    name: str
    cloudpickle: str = ""


def python_version() -> str:
    return "%d.%d" % sys.version_info[:2]


def encode_call(header: CallHeader, body: bytes) -> bytes:
    meta = {"nonce": header.nonce, "python": header.python, "name": header.name, "cloudpickle": header.cloudpickle}
    return MAGIC + json.dumps(meta).encode() + b"\n" + body


def decode_call(data: bytes) -> tuple[CallHeader, bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not a gpuctl call file")
    meta_line, _, body = data[len(MAGIC):].partition(b"\n")
    meta = json.loads(meta_line.decode())
    return CallHeader(str(meta["nonce"]), str(meta["python"]), str(meta.get("name") or ""),
                      str(meta.get("cloudpickle") or "")), body


def marker_lines(nonce: str, kind: str, data: bytes) -> Iterator[str]:
    """The lines that carry `data` back (at least one, also for empty data)."""
    pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for seq, piece in enumerate(pieces):
        yield f"{MARK} {nonce} {kind} {seq} {len(pieces)} {base64.b64encode(piece).decode('ascii')}"


def write_markers(fd: int, nonce: str, kind: str, data: bytes) -> None:
    for line in marker_lines(nonce, kind, data):
        raw = (line + "\n").encode("ascii")
        while raw:
            raw = raw[os.write(fd, raw):]


@dataclass
class RankOutcome:
    """What one rank sent back: the result's bytes, or an error record."""

    parts: dict[str, dict[int, bytes]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def complete(self, kind: str) -> bytes | None:
        count = self.counts.get(kind)
        got = self.parts.get(kind) or {}
        if count is None or len(got) != count:
            return None
        return b"".join(got[i] for i in range(count))


class Collector:
    """Takes one call's marker lines out of the job's output, rank by rank."""

    def __init__(self, nonce: str) -> None:
        self.tag = f"{MARK} {nonce} "
        self.ranks: dict[int, RankOutcome] = {}
        self.tail: dict[int, list[str]] = {}  # each rank's last output lines, for errors without a record
        self.order: list[int] = []  # ranks in the order their error records arrived

    def take(self, rank: int, text: str) -> str | None:
        """The part of an output line to show: all of it, what came before a marker, or None."""
        at = text.find(self.tag)
        if at < 0:
            self._remember(rank, text)
            return text
        fields = text[at + len(self.tag):].split(" ")
        if len(fields) == 4 and fields[1].isdigit() and fields[2].isdigit():
            kind, seq, count, chunk = fields[0], int(fields[1]), int(fields[2]), fields[3]
            try:
                piece = base64.b64decode(chunk, validate=True)
            except ValueError:
                piece = None
            if piece is not None:
                outcome = self.ranks.setdefault(rank, RankOutcome())
                outcome.parts.setdefault(kind, {})[seq] = piece
                outcome.counts[kind] = count
                if kind == ERROR and rank not in self.order and outcome.complete(ERROR) is not None:
                    self.order.append(rank)
        before = text[:at]
        if before:
            self._remember(rank, before)
        return before or None

    def _remember(self, rank: int, text: str) -> None:
        lines = self.tail.setdefault(rank, [])
        lines.append(text)
        del lines[:-20]

    def result(self, rank: int) -> bytes | None:
        outcome = self.ranks.get(rank)
        return outcome.complete(RESULT) if outcome else None

    def error(self, rank: int) -> dict[str, Any] | None:
        outcome = self.ranks.get(rank)
        data = outcome.complete(ERROR) if outcome else None
        if data is None:
            return None
        try:
            record = json.loads(data.decode("utf-8", "replace"))
        except ValueError:
            return None
        return record if isinstance(record, dict) else None


def error_record(stage: str, exc: BaseException, traceback_text: str,
                 dumps: Callable[[Any], bytes] | None = None) -> dict[str, Any]:
    """What a rank sends back about an exception: where it happened (`load`: unpickling the
    function; `call`: in it; `result`: pickling what it returned), its type, message and
    traceback, the module missing on the node, and the exception itself when it pickles."""
    record: dict[str, Any] = {
        "stage": stage,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".replace("builtins.", ""),
        "message": str(exc),
        "traceback": traceback_text,
        "python": python_version(),
        "executable": sys.executable,
    }
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        record["missing_module"] = exc.name
    if dumps is not None:
        try:
            record["exception"] = base64.b64encode(dumps(exc)).decode("ascii")
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text only
            pass
    return record
