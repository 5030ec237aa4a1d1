"""Controller -> head: the workdir and file_mounts, once, over the head's ControlMaster.

Bytes leave the controller once whatever the cluster size: the head's agent
copies them on to the workers (agent/relay.py, `sync`). The workdir keeps its
rsync rules (payload.workdir_rsync_args) on this hop too, and on this hop
only also leaves out every path git itself reports ignored (gitignore.py),
read by rsync from its stdin: what leaves this machine is git's answer.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from gpuctl.common.safetext import printable
from gpuctl.jobplane import agentcall
from gpuctl.jobplane.gitignore import WorkdirFilter
from gpuctl.jobplane.payload import WORKDIR_DEST, workdir_rsync_args
from gpuctl.node.protocol import CLAIM_PREFIX, CMD_CHECK_DEST, MESSAGE_PREFIX, SUDO_MKDIR
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Node

CLAIM_EXCLUDE = f"--exclude=/{CLAIM_PREFIX}*"
# rsync's quick check compares whole seconds: a same-size edit within the second of the
# last copy would be skipped. -1 compares nanoseconds (receiver rsync >= 3.1.3).
NANOSECOND_MTIMES = "--modify-window=-1"
REFUSED = MESSAGE_PREFIX  # the head's check-dest refused the destination (agent/destinations.py)


class UploadError(Exception):
    pass


@dataclass(frozen=True)
class Item:
    src: Path
    dest: str  # "~/..." or absolute, as the task wrote it
    is_dir: bool
    changed: int = 0  # files rsync sent or deleted on the head this time (0: the head had it all)


def remote_path(dest: str) -> str:
    """rsync's remote side: paths under ~ are relative to the login's home."""
    path = dest.rstrip("/") or "/"
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def make_dir_command(path: str) -> str:
    """Shell that makes the destination's directory on the head. Where the login user may not write
    (/data for a user other than root) it is made through `sudo -n` and given to that user, as
    SkyPilot makes absolute destinations; the last mkdir says why when neither works."""
    q = shlex.quote(path)
    # umask 022 under sudo: the directories made above it (/opt/x of /opt/x/data) are root's, and the
    # login user must pass them (sudo keeps the session's umask, 077 on hardened images)
    via_sudo = (f"sudo -n sh -c {shlex.quote(SUDO_MKDIR)} gpuctl-mkdir {q} "
                f'"$(id -u):$(id -g)" 2>/dev/null')
    return f"{{ mkdir -p -- {q} 2>/dev/null || {via_sudo} || mkdir -p -- {q}; }}"


def rsync_argv(head: Node, item: Item, control_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    rsh = shlex.join(["ssh", *ssh.ssh_options(head, control_dir)])
    remote = remote_path(item.dest)
    parent = str(Path(remote).parent) if not item.is_dir else remote
    # The head's agent first checks the real path (a symlink into ~/.ssh, a mount in the workdir:
    # node/destinations.py, check-dest); one that is missing or cannot load is installed again at submit,
    # so it is skipped (Command.if_installed).
    check = agentcall.command(CMD_CHECK_DEST, item.dest).if_installed
    rsync_path = f"{check} && {make_dir_command(parent)} && rsync"
    host = f"[{head.ssh_host}]" if ":" in head.ssh_host else head.ssh_host
    src = str(item.src).rstrip("/") + ("/" if item.is_dir else "")
    dst = f"{host}:{remote}" + ("/" if item.is_dir else "")
    # --out-format: one line per file sent or deleted, so the copy says how much changed
    return ["rsync", "--archive", "--compress", NANOSECOND_MTIMES, CLAIM_EXCLUDE, "--out-format=%i", *extra,
            "--rsync-path", rsync_path, "-e", rsh, "--", src, dst]


def workdir_args(rules: WorkdirFilter) -> tuple[tuple[str, ...], bytes | None]:
    """(rsync's options, its stdin) for the workdir: git's own list of ignored paths first, NUL-separated
    on stdin (any file name, and no argv length limit), then the rules every hop applies."""
    if not rules.ignored:
        return tuple(workdir_rsync_args(rules)), None
    listed = b"".join(os.fsencode(p) + b"\0" for p in rules.ignored)
    return ("--from0", "--exclude-from=-", *workdir_rsync_args(rules)), listed


def upload(head: Node, *, workdir: Path | None, file_mounts: Mapping[str, Path], control_dir: Path,
           timeout: float = 3600, workdir_rules: WorkdirFilter | None = None) -> list[Item]:
    """Copy the workdir and file_mounts to the head; the items copied, in payload order."""
    items: list[tuple[Item, tuple[str, ...], bytes | None]] = []
    if workdir is not None:
        items.append((Item(Path(workdir), WORKDIR_DEST, True), *workdir_args(workdir_rules or WorkdirFilter())))
    for dest, src in file_mounts.items():
        items.append((Item(Path(src).expanduser(), dest, Path(src).expanduser().is_dir()), (), None))
    done: list[Item] = []
    for item, extra, stdin in items:
        argv = rsync_argv(head, item, control_dir, extra)
        feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, **feed)
        if proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace")
            refused = [line for line in err.splitlines() if line.startswith(REFUSED)]
            if refused:  # the head's agent said why, in one line naming the field
                raise UploadError(printable(refused[-1][len(REFUSED):]))
            why = printable((err.strip().splitlines() or [f"rsync exit code {proc.returncode}"])[-1])
            raise UploadError(f"copying {item.src} to the head ({head.ssh_host}:{item.dest}) failed: {why}")
        done.append(replace(item, changed=changed_files(proc.stdout)))
    return done


def changed_files(out: bytes) -> int:
    """The files rsync's `%i` lines say it sent (`>f`, `<f`) or deleted (`*deleting`)."""
    lines = out.decode("utf-8", "replace").splitlines()
    return sum(1 for line in lines if line.startswith(("<f", ">f", "*deleting")))
