"""The internal (node-to-node) key: a second pair, distinct from the access key."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from gpuctl.provision.sshkeys import ensure_cluster_key, ensure_internal_key


def test_internal_key_is_a_second_private_pair_made_once(tmp_path: Path) -> None:
    cdir = tmp_path / "demo"
    access, access_pub = ensure_cluster_key(cdir)
    key, pub = ensure_internal_key(cdir)
    assert key == cdir / "ssh" / "internal_ed25519"
    assert pub.startswith("ssh-ed25519 ") and pub.endswith(" gpuctl-internal-demo") and "\n" not in pub
    assert pub.split()[1] != access_pub.split()[1]
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    before = key.stat()
    assert ensure_internal_key(cdir) == (key, pub)
    assert (key.stat().st_ino, key.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # The access key is untouched by the internal one, and the other way round.
    assert ensure_cluster_key(cdir) == (access, access_pub)
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, check=True).stdout
    assert derived.split()[:2] == pub.split()[:2]
    # Lost public half: derived again, not a new pair.
    key.with_name("internal_ed25519.pub").unlink()
    assert ensure_internal_key(cdir)[1].split()[:2] == pub.split()[:2]
