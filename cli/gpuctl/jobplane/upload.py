"""Controller -> head: the workdir and file_mounts, once, over the head's ControlMaster.

Bytes leave the controller once whatever the cluster size: the head's agent
copies them on to the workers (agent.py, `sync`). The workdir keeps its
rsync rules (payload.WORKDIR_RSYNC_ARGS) on this hop too.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from gpuctl import ssh
from gpuctl.inventory import Node
from gpuctl.jobplane.payload import WORKDIR_DEST, WORKDIR_RSYNC_ARGS

CLAIM_EXCLUDE = "--exclude=/.gpuctl-claim-*"
# rsync's quick check compares whole seconds: a same-size edit within the second of the
# last copy would be skipped. -1 compares nanoseconds (receiver rsync >= 3.1.3).
NANOSECOND_MTIMES = "--modify-window=-1"
REFUSED = "gpuctl-node: "  # the head's check-dest refused the destination (agent.py)


class UploadError(Exception):
    pass


@dataclass(frozen=True)
class Item:
    src: Path
    dest: str  # "~/..." or absolute, as the task wrote it
    is_dir: bool


def remote_path(dest: str) -> str:
    """rsync's remote side: paths under ~ are relative to the login's home."""
    path = dest.rstrip("/") or "/"
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def rsync_argv(head: Node, item: Item, control_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    rsh = shlex.join(["ssh", *ssh.ssh_options(head, control_dir)])
    remote = remote_path(item.dest)
    parent = str(Path(remote).parent) if not item.is_dir else remote
    # The head's agent first checks the real path (a symlink into ~/.ssh, a mount in the workdir:
    # agent.py, check-dest); one that is missing is installed again at submit, so it is skipped.
    # The destination's directory may not exist on the head yet: make it then.
    check = f"{{ test ! -x {ssh.AGENT} || {ssh.AGENT} check-dest -- {shlex.quote(item.dest)}; }}"
    rsync_path = f"{check} && mkdir -p -- {shlex.quote(parent)} && rsync"
    host = f"[{head.ssh_host}]" if ":" in head.ssh_host else head.ssh_host
    src = str(item.src).rstrip("/") + ("/" if item.is_dir else "")
    dst = f"{host}:{remote}" + ("/" if item.is_dir else "")
    return ["rsync", "--archive", "--compress", NANOSECOND_MTIMES, CLAIM_EXCLUDE, *extra, "--rsync-path", rsync_path,
            "-e", rsh, "--", src, dst]


def upload(head: Node, *, workdir: Path | None, file_mounts: Mapping[str, Path], control_dir: Path,
           timeout: float = 3600) -> list[Item]:
    """Copy the workdir and file_mounts to the head; the items copied, in payload order."""
    items: list[tuple[Item, tuple[str, ...]]] = []
    if workdir is not None:
        items.append((Item(Path(workdir), WORKDIR_DEST, True), WORKDIR_RSYNC_ARGS))
    for dest, src in file_mounts.items():
        items.append((Item(Path(src).expanduser(), dest, Path(src).expanduser().is_dir()), ()))
    for item, extra in items:
        argv = rsync_argv(head, item, control_dir, extra)
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            refused = [line for line in proc.stderr.splitlines() if line.startswith(REFUSED)]
            if refused:  # the head's agent said why, in one line naming the field
                raise UploadError(refused[-1][len(REFUSED):])
            why = (proc.stderr.strip().splitlines() or [f"rsync exit code {proc.returncode}"])[-1]
            raise UploadError(f"copying {item.src} to the head ({head.ssh_host}:{item.dest}) failed: {why}")
    return [i for i, _ in items]
