"""Where the job's copies and buckets land on this node: claims of shared places, and refusals.

Claims (`claim_destinations`): nodes that share a filesystem get the bytes
once; the first to create a marker owns the destination. Refusals
(`destinations_problem`, and `check-dest` for the controller's upload): no
copy or mount may land in a place gpuctl or the system needs, once the
home is expanded and symlinks resolved, with the lists of node/reserved.py
(the controller checks every spelling with the same objects, nodepaths.py);
no mount may hold the home, the workdir or a reserved tree, nor be in the
workdir.
"""

import errno
import json
import os
import re
import sys
import time

from gpuctl.node.jobdir import dest_paths, ensure_dir, read_int, read_text, remove
from gpuctl.node.protocol import CLAIM_PREFIX, MESSAGE_PREFIX
from gpuctl.node.reserved import RESERVED_DIRS, RESERVED_SSH_PREFIX, RESERVED_TREES, WORKDIR


def claim_destinations(token, dests, rank):
    """Create every destination, then claim it for this node unless a node sharing its
    filesystem already did; the owner's rank per destination.

    The claim is a marker created with O_EXCL in the destination directory (in
    the parent for a file), which NFS and local filesystems create atomically:
    of the nodes sharing a filesystem exactly one creates it, and the others
    read its rank. Only owners receive a copy, so nodes that share a filesystem
    get the bytes once and never race one another into one directory.
    """
    owners = []
    for dest in dests:
        path, _ = dest_paths(dest["path"])
        where = path if dest.get("dir") else (os.path.dirname(path) or "/")
        marker = os.path.join(where, CLAIM_PREFIX + token + ("" if dest.get("dir") else "-" + os.path.basename(path)))
        ensure_dir(where)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
            owner = None
            deadline = time.time() + 5
            while owner is None and time.time() < deadline:  # the winner writes right after creating
                owner = read_int(marker)
                if owner is None:
                    time.sleep(0.02)
            owners.append(owner if owner is not None else -1)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(str(rank))
        owners.append(rank)
    return owners


def release_claims(token, dests, owners, rank):
    for dest, owner in zip(dests, owners):
        if owner != rank:
            continue
        path, _ = dest_paths(dest["path"])
        where = path if dest.get("dir") else (os.path.dirname(path) or "/")
        remove(os.path.join(where, CLAIM_PREFIX + token + ("" if dest.get("dir") else "-" + os.path.basename(path))))


def cmd_claim(args):
    dests = [{"path": d, "dir": True} for d in args.dir] + [{"path": f, "dir": False} for f in args.file]
    owners = claim_destinations(args.token, dests, args.rank)
    if args.release:
        release_claims(args.token, dests, owners, args.rank)
    print(json.dumps(owners))
    return 0


# Where gpuctl itself copies into a reserved tree (the Python API's call files; the spec
# refuses these places to file_mounts, so only gpuctl's own JobSpecs name them).
GPUCTL_COPIES = ("~/.gpuctl/calls",)


def real_path(path):
    """`path` (absolute or ~/...) with the home expanded and every symlink that exists resolved."""
    return os.path.realpath(dest_paths(path)[0])


def path_within(path, top):
    """Whether real `path` is `top` or below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def dest_problem(dest, mode):
    """Why nothing may be copied (COPY: the workdir, a file_mount, a bucket) or mounted at
    `dest` on this node, once the home is expanded and symlinks resolved (a link to ~/.ssh,
    a workdir that is a link); None when it may."""
    path = real_path(dest)
    if mode == "COPY" and any(path_within(path, real_path(top)) and path != real_path(top) for top in GPUCTL_COPIES):
        return None
    shown = dest if path == os.path.normpath(dest_paths(dest)[0]) else "%s (here %s)" % (dest, path)
    for top in RESERVED_TREES:
        if path_within(path, real_path(top)):
            return ("%s is in %s, which gpuctl or the system needs on every node; choose another destination, "
                    "such as /data or ~/data" % (shown, top))
    if path.startswith(real_path(RESERVED_SSH_PREFIX)):  # ~/.ssh/gpuctl*: the internal key, its known hosts
        return ("%s is one of gpuctl's own files in ~/.ssh (%s*); give it another name (such as ~/.ssh/id_deploy) "
                "or another destination, such as /data or ~/data" % (shown, RESERVED_SSH_PREFIX))
    for top in RESERVED_DIRS:
        if path == real_path(top):
            return ("%s is %s, which the system or gpuctl needs as it is; give a directory of its own, such as "
                    "/data or ~/data" % (shown, {"~": "the home", "/": "the filesystem root"}.get(top, top)))
    if mode == "COPY":
        return None
    for top in ("~", WORKDIR) + RESERVED_TREES:
        real = real_path(top)
        if path_within(real, path) or (top == WORKDIR and path_within(path, real)):
            return ("a %s at %s would cover %s, which gpuctl %s; mount it elsewhere, such as /data or ~/data"
                    % (mode, shown, top, "rewrites on every job (the workdir copy would delete through the "
                                         "mount into the bucket)" if top == WORKDIR else "or the system needs"))
    return None


def workdir_mount_problem(table=None):
    """Why the workdir copy may not run here: something is mounted at the workdir or in it (a
    bucket an older gpuctl mounted there), and its --delete-after would delete through it."""
    real = real_path(WORKDIR)
    table = mount_table() if table is None else table
    inside = sorted(p for p in table if path_within(p, real))
    if not inside:
        return None
    fstype, source = table[inside[0]]
    return ("%s is a mount point (%s %s), and the workdir copy would delete through it whatever your workdir "
            "lacks; unmount it (fusermount -u %s) or mount it elsewhere" % (inside[0], fstype, source, inside[0]))


def workdir_copy_problem(dest):
    """Why a file_mount or bucket may not be copied to `dest`: it is the workdir itself (here,
    symlinks resolved), whose copy and the file_mount's would delete each other's files."""
    if real_path(dest) != real_path(WORKDIR):
        return None
    return ("%s is %s here, where gpuctl copies the workdir on every job: the two copies would delete each "
            "other's files; copy it into a directory below it, or elsewhere" % (dest, WORKDIR))


def destinations_problem(payload):
    """Why this node cannot take the job's copies or buckets where they go (a place gpuctl or
    the system needs, once the real paths are known), as one line naming the field, or None:
    checked in the hello, before anything is copied to, fetched to or mounted on this node."""
    for dest in payload.get("sync") or ():
        why = dest_problem(dest["path"], "COPY") or (dest["path"] == WORKDIR and workdir_mount_problem()) or (
            dest["path"] != WORKDIR and workdir_copy_problem(dest["path"]))
        if why:
            return "%s: %s" % ("workdir" if dest["path"] == WORKDIR else "file_mounts." + dest["path"], why)
    for b in payload.get("buckets") or ():
        why = dest_problem(b["dest"], b.get("mode")) or (b.get("mode") == "COPY" and workdir_copy_problem(b["dest"]))
        if why:
            return "file_mounts.%s: %s" % (b["dest"], why)
    return None


def cmd_check_dest(args):
    """Before the controller's copy lands here (upload.py runs it ahead of rsync on the head):
    exit 2 with one line when the workdir or a file_mount may not be copied to DEST."""
    why = destinations_problem({"sync": [{"path": args.dest}]})
    if why:
        sys.stderr.write("%s%s\n" % (MESSAGE_PREFIX, why))
        return 2
    return 0


def mount_table(text=None):
    """{mount point: (fstype, source)} from /proc/self/mountinfo (this node's mount namespace)."""
    if text is None:
        text = read_text("/proc/self/mountinfo") or ""
    out = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        rest = right.split()
        out[point] = (rest[0] if rest else "", rest[1] if len(rest) > 1 else "")
    return out
