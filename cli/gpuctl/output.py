"""`--output json`: one JSON document on stdout for scripts and CI.

With `--output json` stdout carries exactly one JSON object (printed once the
command is done, also when it fails with exit code 1 where the command has a
result to report, such as a failed job); progress lines, rank output and
errors go to stderr, so `gpuctl apply ... --output json | jq` always parses.
Every document has `"schema": SCHEMA` (bumped only on an incompatible change)
and `"command"`; the per-command keys are listed in the README ("Machine-
readable output"). Keys are never removed within one schema version.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

SCHEMA = 1
FORMATS = ("text", "json")

OutputOption = typer.Option("text", "--output", "-o", metavar="FORMAT",
                            help="text (default) or json: one JSON object on stdout, progress on stderr.")


def wants_json(fmt: str) -> bool:
    """Whether `--output FORMAT` asks for JSON; UserError for anything but text/json."""
    from gpuctl.errors import UserError

    value = (fmt or "text").strip().lower()
    if value not in FORMATS:
        raise UserError(f"--output {fmt}: use text or json")
    return value == "json"


def emit(command: str, document: dict[str, Any]) -> None:
    """Print the command's JSON document on stdout (keys sorted, one line per key)."""
    sys.stdout.write(json.dumps({"schema": SCHEMA, "command": command, **document}, indent=2, sort_keys=True,
                                default=str) + "\n")
    sys.stdout.flush()
