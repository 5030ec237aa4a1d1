"""Real SSH test hosts on this machine, for testing the Ansible layer in isolation.

Each host is an `sshd` in its own network namespace (one veth end named eth0 on
a private bridge) and its own mount namespace, where a per-host directory is
bind-mounted over /root: files written to `~` over SSH land in that host's own
home. The nodes reach each other over the bridge. Needs root, iproute2,
openssh-server and rsync (see /work/shared/guide/test-hosts.md).

    with running_hosts(2, tmp_path) as hosts:
        hosts.inventory.nodes[0].ssh_host  # "10.214.X.10"

Teardown ends exactly the processes in the namespaces (by pid), then deletes
the namespaces, veths, the bridge and the directories.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from gpuctl.provision.inventory import Inventory, Node, node_name

SSHD = "/usr/sbin/sshd"
SUBNET_PREFIX = "10.214"  # 10.214.X.0/24, X picked free at start
FIRST_HOST = 10


def missing_requirements() -> str | None:
    """Why test hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    for tool in (SSHD, shutil.which("ip"), shutil.which("rsync"), shutil.which("unshare"), shutil.which("ssh-keygen")):
        if not tool or not Path(tool).exists():
            return "test hosts need iproute2, openssh-server, openssh-client and rsync installed"
    return None


@dataclass
class HostSet:
    inventory: Inventory
    key: Path
    root: Path
    bridge: str
    namespaces: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def home(self, rank: int) -> Path:
        """The directory that is `~` (/root) on the node of this rank."""
        return self.root / f"node{rank}" / "home"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _used_subnets() -> set[int]:
    used = set()
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines() + _ip("-4", "route").stdout.splitlines():
        for word in line.split():
            if word.startswith(SUBNET_PREFIX + "."):
                used.add(int(word.split(".")[2]))
    return used


def _claim_bridge() -> tuple[str, int]:
    """Create a bridge for the first free 10.214.X.0/24; creating it is the lock."""
    used = _used_subnets()
    for x in range(1, 250):
        name = f"gpt{x}br"
        if x in used or _ip("link", "add", name, "type", "bridge", check=False).returncode != 0:
            continue
        _ip("addr", "add", f"{SUBNET_PREFIX}.{x}.1/24", "dev", name)
        _ip("link", "set", name, "up")
        return name, x
    raise RuntimeError("no free 10.214.X.0/24 subnet for test hosts")


def _sshd_config(node_dir: Path, address: str, authorized_keys: Path) -> Path:
    host_key = node_dir / "ssh_host_ed25519_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    config = node_dir / "sshd_config"
    config.write_text(
        f"ListenAddress {address}\n"
        "Port 22\n"
        f"HostKey {host_key}\n"
        # The shared file holds the test's access key; the node's own file is
        # what a real node also reads (the cluster SSH role writes to it).
        f"AuthorizedKeysFile {authorized_keys} .ssh/authorized_keys\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PidFile none\n"
        "UseDNS no\n"
        "MaxStartups 200\n"
        "MaxSessions 64\n"
        "Subsystem sftp internal-sftp\n"
    )
    return config


def _wait_port(address: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address}:{port} did not come up") from None
            time.sleep(0.05)


def start_hosts(count: int, workdir: Path, *, cluster: str = "testhosts", gpus: int = 1) -> HostSet:
    """Bring up `count` hosts under `workdir`; call `stop_hosts` (or use `test_hosts`)."""
    why = missing_requirements()
    if why:
        raise RuntimeError(why)
    root = Path(workdir).resolve() / "testhosts"
    root.mkdir(parents=True)
    key = root / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuctl-test", "-f", str(key)], check=True)
    authorized = root / "authorized_keys"
    shutil.copy(key.with_suffix(".pub"), authorized)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)

    bridge, x = _claim_bridge()
    hosts = HostSet(inventory=Inventory(cluster=cluster, cloud="local", nodes=()), key=key, root=root, bridge=bridge)
    nodes = []
    try:
        for rank in range(count):
            ns = f"gpt{x}n{rank}"
            veth = f"gpt{x}v{rank}"
            address = f"{SUBNET_PREFIX}.{x}.{FIRST_HOST + rank}"
            _ip("netns", "add", ns)
            hosts.namespaces.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            node_dir = root / f"node{rank}"
            home = node_dir / "home"
            home.mkdir(parents=True, mode=0o700)
            config = _sshd_config(node_dir, address, authorized)
            inner = f"mount --bind {home} /root && exec {SSHD} -D -f {config} -E {node_dir / 'sshd.log'}"
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            hosts.pids.append(proc.pid)
            nodes.append(Node(name=node_name(rank), rank=rank, node_id=ns, address=address, ssh_host=address,
                              ssh_port=22, ssh_user="root", ssh_key=str(key), gpus=gpus))
        for node in nodes:
            _wait_port(node.ssh_host, node.ssh_port, timeout=15)
    except BaseException:
        stop_hosts(hosts)
        raise
    hosts.inventory = Inventory(cluster=cluster, cloud="local", nodes=tuple(nodes))
    return hosts


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def stop_hosts(hosts: HostSet) -> None:
    """End every process in the hosts' namespaces, then remove everything made."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = False
        for ns in hosts.namespaces:
            for pid in _netns_pids(ns):
                alive = True
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for pid in hosts.pids:  # reap our own children (the sshds)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not alive:
            break
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(_netns_pids(ns) for ns in hosts.namespaces):
            time.sleep(0.05)
    for pid in hosts.pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    for rank, ns in enumerate(hosts.namespaces):
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"{hosts.bridge[:-2]}v{rank}", check=False)  # gone with its peer, normally
    _ip("link", "del", hosts.bridge, check=False)
    shutil.rmtree(hosts.root, ignore_errors=True)


@contextmanager
def running_hosts(count: int, workdir: Path, **kwargs: object) -> Iterator[HostSet]:
    hosts = start_hosts(count, workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield hosts
    finally:
        stop_hosts(hosts)
