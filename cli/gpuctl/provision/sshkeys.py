"""The cluster's SSH keys: two ed25519 key pairs per cluster.

- the access key (`ssh/id_ed25519`): how the controller logs in to the nodes;
  its public half goes to Terraform (`ssh_public_key`).
- the internal key (`ssh/internal_ed25519`): how the nodes log in to each
  other (head-only launchers: DeepSpeed, mpirun, pdsh). The prepare play's
  install step (role gpuctl_node) puts it on every node as `~/.ssh/gpuctl_cluster`
  and authorizes it there. Every node holds it (any job there can read it),
  so it is kept apart from the access key: the access key never leaves the
  controller, and the internal one is authorized only on this cluster's nodes.

Made by `ssh-keygen` (not by Python crypto code) so the private keys are in the
format every OpenSSH client reads, and kept under `clusters/<name>/ssh/` with
mode 0600 because ssh refuses keys other users can read.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from gpuctl.common.errors import UserError

KEY_NAME = "id_ed25519"
INTERNAL_KEY_NAME = "internal_ed25519"


def ensure_cluster_key(cluster_dir: Path) -> tuple[Path, str]:
    """Create the cluster's access key pair if missing; return (private key path, public key line).

    Idempotent and safe against a concurrent caller: the pair is made under a
    lock, and an existing pair is reused as is (its public half is re-derived
    if only that was lost).
    """
    return _ensure_key(Path(cluster_dir), KEY_NAME, f"gpuctl-{Path(cluster_dir).name}")


def ensure_internal_key(cluster_dir: Path) -> tuple[Path, str]:
    """Create the key the cluster's nodes use to SSH to each other; (private key path, public key line).

    Distinct from the access key; same guarantees as `ensure_cluster_key`.
    The comment (`gpuctl-internal-<cluster>`) is how the role finds the line
    it manages in the nodes' authorized_keys.
    """
    return _ensure_key(Path(cluster_dir), INTERNAL_KEY_NAME, f"gpuctl-internal-{Path(cluster_dir).name}")


def _ensure_key(cluster_dir: Path, name: str, comment: str) -> tuple[Path, str]:
    ssh_dir = cluster_dir / "ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(ssh_dir, 0o700)
    key = ssh_dir / name
    pub = ssh_dir / f"{name}.pub"
    keygen = shutil.which("ssh-keygen")
    with open(ssh_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not key.exists():
            if keygen is None:
                raise UserError("ssh-keygen not found on PATH; install the OpenSSH client (apt-get install openssh-client)")
            pub.unlink(missing_ok=True)
            _run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])
        elif not pub.exists():
            if keygen is None:
                raise UserError("ssh-keygen not found on PATH; install the OpenSSH client (apt-get install openssh-client)")
            pub.write_text(_run([keygen, "-y", "-f", str(key)]))
        os.chmod(key, 0o600)
        return key, pub.read_text().strip()


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"{argv[-1]}: ssh-keygen failed ({reason[-1] if reason else f'exit {proc.returncode}'}); "
                        "remove the cluster's ssh/ directory and try again")
    return proc.stdout
