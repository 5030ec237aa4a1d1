"""Where a file_mount may land on a node: one spelling per path, and the places gpuctl or the system needs.

A destination reaches the nodes as the task wrote it, and the same place has
many spellings: `~/x`, `$HOME/x`, `/root/x` (the node user's home), `~/a/../x`,
`~//x/`. Every check here first turns a destination into its canonical form
(`normalize`), then asks of each place it may denote (`views`: an absolute path
under a home such as /root or /home/NAME is checked as `~/...` too, since the
controller does not know which user the nodes log in as) whether it is reserved.

Reserved (`destination_problem`), for every destination, copied or mounted:
- a place gpuctl needs, and anything in it: in ~/.ssh the files sshd and ssh
  read (authorized_keys, config, known_hosts, rc...: a copy there locks gpuctl
  out of its own nodes) and gpuctl's own (~/.ssh/gpuctl*: the cluster's internal
  key, its known hosts), while another file there (a deploy key such as
  ~/.ssh/id_rsa) is fine; ~/.gpuctl (the agent, the
  jobs' files and secrets), the login shell's startup files (~/.bashrc,
  ~/.profile...: sshd runs every gpuctl command through them), sshd's, the
  accounts', the name resolver's and the dynamic loader's configuration in /etc;
- a place the system needs, and anything in it: the programs and libraries
  (/bin, /usr/bin, /lib, /usr/lib...: python3, rsync, ssh and bash live
  there), /proc, /sys, /dev, /run, /var/run, /boot;
- a directory the system or the user needs whole, itself (a copy into a new
  directory below it is fine): /, the home, ~/.ssh, /etc, /usr, /tmp, /home, ...;
the workdir ~/gpuctl_workdir itself for a copy (the workdir copy and the
file_mount would delete each other's files; a directory below it is fine, and
the workdir copy leaves it alone), and for a MOUNT or MOUNT_CACHED the workdir,
below it or above it: gpuctl rewrites it on every job (rsync --delete-after),
which would delete through the mount into the bucket.

Symlinks can only be resolved on the node: the agent checks the real paths of
the workdir, the file_mounts and the buckets again in its hello, before anything
is copied, fetched or mounted there (node/destinations.py,
`destinations_problem`), with the same lists (reserved.py); on the head, before
each of the controller's copies lands too (upload.py runs `gpuctl-node
check-dest` ahead of rsync).
"""

from __future__ import annotations

import re

# The lists themselves are reserved.py's, which the node agent is built with (the same objects).
from gpuctl.node.reserved import (RESERVED_DIRS, RESERVED_SSH_PREFIX, RESERVED_TREES,  # noqa: F401 - nodepaths.WORKDIR
                                  SSH_DIR_ON_NODE, WORKDIR)

HOME = "~"
MOUNT_MODES = ("MOUNT", "MOUNT_CACHED")
# A home on the nodes: /root, or /home/NAME (the controller does not know the login user's).
_HOME_RE = re.compile(r"^(/root|/home/[^/]+)(/.*)?$")
_HOME_VAR_RE = re.compile(r"^\$(HOME|\{HOME\})(?=/|$)")


class BadPath(ValueError):
    """A destination that has no single meaning on a node."""


def normalize(dest: str) -> str:
    """The canonical spelling of a node destination: `~`, `~/a/b` or `/a/b`.

    `$HOME`/`${HOME}` become `~`; repeated slashes, `.` segments, trailing
    slashes and `..` segments go (`..` as the kernel reads it at `/`). BadPath
    for `~NAME` (another user's home) and for `..` that climbs out of `~`,
    whose meaning depends on where the home is.
    """
    text = _HOME_VAR_RE.sub("~", dest.strip())
    if text.startswith("~") and not (text == "~" or text.startswith("~/")):
        raise BadPath("~NAME (another user's home) is not supported; write ~/... (the node user's home) "
                      "or an absolute path")
    in_home = text.startswith("~")
    if not in_home and not text.startswith("/"):
        raise BadPath('must be an absolute path (start with "/" or "~")')
    parts: list[str] = []
    for part in text[1:].split("/"):
        if part in ("", "."):
            continue
        if part != "..":
            parts.append(part)
        elif parts:
            parts.pop()
        elif in_home:
            raise BadPath("'..' climbs out of the home; write the absolute path instead")
    return ("~" if in_home else "") + ("/" + "/".join(parts) if parts else ("" if in_home else "/"))


def on_node(dest: str, *, bucket: bool) -> str:
    """`dest` as the nodes take it. An absolute, `~/...` or `$HOME/...` one as written; a relative one
    (`data/x`, `./train.py`) as SkyPilot places it: a local file's below the workdir (SkyPilot's
    ~/sky_workdir, where setup and run start; here WORKDIR, where they start too), a bucket's below
    the home. The checks (`destination_problem`) then see the place it names, `..` included."""
    text = dest.strip()
    if not text or text.startswith(("/", "~")) or _HOME_VAR_RE.match(text):
        return text
    return f"{HOME if bucket else WORKDIR}/{text}"


def views(path: str) -> list[str]:
    """The canonical paths a canonical destination may denote: itself, and its `~` form where
    it is under a home the nodes may log in to (/root/x is ~/x for root)."""
    found = _HOME_RE.match(path)
    return [path, "~" + (found.group(2) or "")] if found else [path]


def within(path: str, top: str) -> bool:
    """Whether canonical `path` is `top` or below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def destination_problem(dest: str, mode: str | None = None) -> str | None:
    """Why a file_mount may not land at `dest` (copied: mode None or COPY; mounted: MOUNT,
    MOUNT_CACHED), as the end of a line naming the field; None when it may."""
    try:
        path = normalize(dest)
    except BadPath as exc:
        return f"{dest}: {exc}"
    spelled = "" if path == (dest.rstrip("/") or "/") else f" (that is {path})"
    for view in views(path):
        for top in RESERVED_TREES:
            if within(view, top):
                return (f"{dest}{spelled} is in {top}, which gpuctl or the system needs on every node; "
                        "choose another destination, such as /data or ~/data")
        if view.startswith(RESERVED_SSH_PREFIX):
            top = "/".join(view.split("/")[:3])
            return (f"{dest}{spelled} is {'in ' if view != top else ''}{top}, and {RESERVED_SSH_PREFIX}* are gpuctl's "
                    "own files (the cluster's internal key, its known hosts); give it another name (such as "
                    "~/.ssh/id_deploy) or another destination, such as /data or ~/data")
        if view in RESERVED_DIRS:
            what = {"~": "the home", "/": "the filesystem root"}.get(view, view)
            keys = "give each key its own file_mount (such as ~/.ssh/id_rsa: ~/.ssh/id_rsa), or "
            return (f"{dest}{spelled} is {what}, which the system or gpuctl needs as it is; "
                    f"{keys if view == SSH_DIR_ON_NODE else ''}give a directory of its own, such as /data or ~/data")
        if mode not in MOUNT_MODES and view == WORKDIR:
            return (f"{dest}{spelled} is {WORKDIR}, where gpuctl copies the workdir on every job: the two copies "
                    "would delete each other's files; copy it into a directory below it, such as "
                    f"{WORKDIR}/data, or elsewhere")
        if mode in MOUNT_MODES and (within(view, WORKDIR) or within(WORKDIR, view)):
            return (f"a {mode} at {dest}{spelled} would cover {WORKDIR}, which gpuctl rewrites on every job "
                    "(the workdir copy would delete through the mount into the bucket); mount it elsewhere, "
                    "such as /data or ~/data")
    return None
