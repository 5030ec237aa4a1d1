"""Text and numbers that came from nodes, made safe for gpuctl's own lines and files.

A node's tools print what they like: nvidia-smi, an NCCL log line, ssh's, rsync's or
Ansible's stderr may hold escape sequences (`ESC]0;TITLE BEL` retitles the reader's
terminal, `ESC[31m` colours all that follows), a carriage return that hides what came
before it, or bytes that are not UTF-8. Copied into a table, an error line, health.json or
`gpuctl status`, they would act on whoever reads them. `printable` shows each such
character as an escape, as `cat -v` and `ls` do, so the text stays readable and inert;
`clean` does it to every string of a parsed document, at the border where node data is
read, so every later reader gets clean data. `whole_number` and `finite_number` take a
node's numbers only when they are numbers.

The ranks' own output is the job's, shown as a terminal would (ranklines.py): not here.
"""

from __future__ import annotations

import math
import re
from typing import Any

# C0 controls and DEL, C1 controls, lone surrogates (bytes that were not UTF-8, surrogate-escaped),
# and the bidirectional overrides that reorder what a terminal shows (U+200E/F, U+202A-E, U+2066-9).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\t": " ", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as surrogateescape keeps it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character shown as an escape (`\\x1b`, `\\r`, `\\n`, `\\x07`) and a
    tab as a space: one line that does nothing to a terminal."""
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text


def clean(value: Any) -> Any:
    """A parsed document (JSON: dicts, lists, strings, numbers) with `printable` strings, keys too."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def whole_number(value: Any, *, minimum: int = 0) -> int | None:
    """`value` as a whole number >= `minimum` (an int, an integral float, or ASCII digits), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and value >= minimum else None


def finite_number(value: Any) -> float | None:
    """`value` as a finite number (an int, a float, or their ASCII text), else None (NaN and inf too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        if not value.isascii():
            return None
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None
