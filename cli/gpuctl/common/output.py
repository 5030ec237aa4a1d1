"""`--output json`: one JSON document on stdout for scripts and CI.

With `--output json` stdout carries exactly one JSON object (printed once the
command is done, also when it fails with exit code 1 where the command has a
result to report, such as a failed job); progress lines, rank output and
errors go to stderr, so `gpuctl apply ... --output json | jq` always parses.
Every document has `"schema": SCHEMA` (bumped only on an incompatible change),
`"command"` and `"ok"`; the per-command keys are listed in the README
("Machine-readable output"). Keys are never removed within one schema version.
A command that fails before it has a result prints `{"ok": false, "error":
LINE, "exit_code": N}` (and the same `error:` line on stderr).
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
    from gpuctl.common.errors import UserError

    value = (fmt or "text").strip().lower()
    if value not in FORMATS:
        raise UserError(f"--output {fmt}: use text or json")
    return value == "json"


def emit(command: str, document: dict[str, Any]) -> None:
    """Print the command's JSON document on stdout (keys sorted, one line per key)."""
    global _emitted
    _emitted = True
    sys.stdout.write(json.dumps({"schema": SCHEMA, "command": command, **document}, indent=2, sort_keys=True,
                                default=str) + "\n")
    sys.stdout.flush()


# -- the documents' parts (README: "Machine-readable output") --------------------------


def _iso(ts: float | None) -> str | None:
    import datetime as _dt

    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else None


def node_doc(node: Any) -> dict[str, Any]:
    """One node: name, rank, private address, how to reach it."""
    return {"name": node.name, "rank": node.rank, "address": node.address, "ssh_user": node.ssh_user,
            "ssh_host": node.ssh_host, "ssh_port": node.ssh_port, "gpus": node.gpus, "node_id": node.node_id}


def job_doc(job: Any) -> dict[str, Any]:
    """One job row: times as ISO-8601 UTC and epoch seconds, exit codes keyed by rank (strings: JSON keys)."""
    return {"id": job.job_id, "name": job.name, "status": job.status, "num_nodes": job.num_nodes,
            "submitted_at": _iso(job.submitted_at), "started_at": _iso(job.started_at),
            "ended_at": _iso(job.ended_at), "submitted_epoch": job.submitted_at, "started_epoch": job.started_at,
            "ended_epoch": job.ended_at,
            "returncodes": {str(rank): code for rank, code in sorted(job.returncodes.items())},
            "failed_rank": job.failed_rank, "detail": job.detail, "user": job.user}


def cluster_doc(record: Any, inventory: Any | None, last_job: Any | None) -> dict[str, Any]:
    """One cluster as `status` and `apply` report it."""
    return {"name": record.name, "status": record.status, "cloud": record.cloud, "region": record.region,
            "zone": record.zone, "num_nodes": record.num_nodes,
            "nodes": [node_doc(n) for n in inventory.nodes] if inventory is not None else [],
            "last_job": job_doc(last_job) if last_job is not None else None}


def json_requested(argv: list[str]) -> bool:
    """Whether the command line asks for `--output json` (for errors raised before the command runs)."""
    for i, word in enumerate(argv):
        if word == "--":  # what follows is exec's command, not gpuctl's options
            return False
        if word in ("--output", "-o") and i + 1 < len(argv) and argv[i + 1].strip().lower() == "json":
            return True
        if word.lower() in ("--output=json", "-ojson"):
            return True
    return False


_emitted = False


def emitted() -> bool:
    """Whether this process already printed its JSON document (an error then adds none)."""
    return _emitted


def emit_error(command: str | None, message: str, exit_code: int) -> None:
    """The JSON document of a command that failed before it had a result."""
    emit(command or "gpuctl", {"ok": False, "error": message, "exit_code": exit_code})
