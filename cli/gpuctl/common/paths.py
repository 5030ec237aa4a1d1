"""Where gpuctl keeps state, and where its Terraform and Ansible trees are.

State lives under `$GPUCTL_STATE_DIR` (default `~/.gpuctl`) so tests can point
it at a temp dir. Each cluster gets `clusters/<name>/` holding its rendered
Terraform root, state, SSH key, inventory and job logs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STATE_DIR_ENV = "GPUCTL_STATE_DIR"
CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$|^[a-z]$")


def state_root() -> Path:
    """The user's gpuctl state directory (created on first use, 0700)."""
    root = Path(os.environ.get(STATE_DIR_ENV) or Path.home() / ".gpuctl").expanduser()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = root.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(root, 0o700)  # keys, Terraform state and logs: this user's only
    return root


def cluster_dir(name: str) -> Path:
    """State directory of one cluster (not created here)."""
    return state_root() / "clusters" / name


def _asset_dir(name: str) -> Path:
    """A tree shipped in the wheel (`gpuctl/<name>`), or the repo's top-level copy
    when running from a source checkout or an editable install."""
    here = Path(__file__).resolve().parent.parent  # the gpuctl package
    for candidate in (here / name, here.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"gpuctl installation is missing its {name}/ tree")


def terraform_dir() -> Path:
    return _asset_dir("terraform")


def ansible_dir() -> Path:
    return _asset_dir("ansible")


# A Terraform root's state: the local file, and the read-only copy of a remote
# backend's state (provision/terraform.py TerraformRoot.snapshot_state writes it).
LOCAL_STATE_FILE = "terraform.tfstate"
STATE_SNAPSHOT_FILE = "state-snapshot.json"


def cluster_terraform_dir(name: str) -> Path:
    """The cluster's Terraform root (clusters/<name>/terraform)."""
    return cluster_dir(name) / "terraform"


def readable_state_file(workdir: Path) -> Path:
    """The state of the Terraform root in `workdir` to read: the local state, else the last
    snapshot of the remote one (so providers read state without running Terraform)."""
    local = workdir / LOCAL_STATE_FILE
    snapshot = workdir / STATE_SNAPSHOT_FILE
    return local if local.is_file() or not snapshot.is_file() else snapshot


CACHE_ENV = "GPUCTL_CACHE_DIR"


def cache_dir() -> Path:
    """What gpuctl keeps to go faster and can always make again (the built node agent, rendered
    help): $GPUCTL_CACHE_DIR, else $XDG_CACHE_HOME/gpuctl or ~/.cache/gpuctl."""
    given = os.environ.get(CACHE_ENV) or ""
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuctl"


def keep_in_cache(path: Path, text: str) -> None:
    """Write `path` (in cache_dir) whole or not at all, private (0600 in a 0700 folder). A cache
    only: where it cannot be written, nothing is said, and the next process makes it again."""
    import tempfile

    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")  # 0600
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
