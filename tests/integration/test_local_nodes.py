"""Real local nodes through real Terraform: bring-up, isolation, reuse, teardown.

netns tests need root with iproute2 (as on CI); the loopback test runs anywhere
sshd is installed. Subnets and ports come from the machine-wide registry, so
these tests can run beside other test runs on the same machine.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from e2e import pids_with_env, running
from mototest import free_port

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.providers.local import provider as local_provider
from gpuctl.provision import provisioner
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.spec.request import ClusterRequest

pytestmark = pytest.mark.integration

HAVE_TOOLS = all(shutil.which(t) for t in ("terraform", "ssh", "ssh-keygen")) and (
    shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"))
needs_tools = pytest.mark.skipif(not HAVE_TOOLS, reason="needs terraform, ssh and sshd (apt-get install openssh-server)")
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="netns nodes need root and iproute2")


def ssh(node: Node, command: str, *, check: bool = True, timeout: int = 20) -> subprocess.CompletedProcess[str]:
    assert node.ssh_key
    argv = ["ssh", "-i", node.ssh_key, "-p", str(node.ssh_port), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "-o", "LogLevel=ERROR", f"{node.ssh_user}@{node.ssh_host}", command]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, f"ssh {node.name}: {command!r} -> {proc.returncode}: {proc.stderr}"
    return proc


def node_envs(name: str) -> list[dict[str, str]]:
    """Each node's teardown record (node.env), as the module wrote it."""
    envs = []
    for f in sorted((cluster_dir(name) / "nodes").glob("node*/node.env")):
        envs.append(dict(line.split("=", 1) for line in f.read_text().splitlines() if "=" in line))
    return envs


def recorded_sshd(name: str) -> list[tuple[int, str]]:
    pids = []
    for f in sorted((cluster_dir(name) / "nodes").glob("node*/sshd.pid")):
        pid, start = f.read_text().split()
        pids.append((int(pid), start))
    return pids


def tagged_pids(tag: str) -> list[int]:
    return pids_with_env(f"GPUCTL_NODE_TAG={tag}")


def netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def assert_gone(name: str, envs: list[dict[str, str]], sshd: list[tuple[int, str]], extra_pids: list[int]) -> None:
    """Nothing of the cluster is left: processes, namespaces, links, directories."""
    assert envs and sshd
    for pid, start in sshd:
        assert not running(pid, start), f"sshd {pid} survived destroy"
    for pid in extra_pids:
        assert not running(pid), f"detached process {pid} survived destroy"
    for env in envs:
        assert tagged_pids(env["LN_TAG"]) == []
        if env["LN_MODE"] == "netns":
            assert env["LN_NETNS"] not in netns_list()
            assert not link_exists(env["LN_VETH"])
        assert not Path(env["LN_DIR"]).exists()
    assert not cluster_dir(name).exists()


def ssh_base(node: Node) -> list[str]:
    assert node.ssh_key
    return ["ssh", "-i", node.ssh_key, "-p", str(node.ssh_port), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]


def many_sessions(node: Node, *, multiplexed: int = 60, direct: int = 25) -> None:
    """Ansible fans out over one ControlMaster connection, and jobs open many
    connections at once: both must work beyond sshd's defaults (10 each)."""
    # Socket paths are limited to ~100 bytes (ssh adds a suffix while binding): keep it short.
    control = Path(tempfile.mkdtemp(prefix="gpuctl-cm-", dir="/tmp")) / "s"
    base = ssh_base(node)
    master = subprocess.Popen([*base, "-o", "ControlMaster=yes", "-o", f"ControlPath={control}", "-N",
                               f"{node.ssh_user}@{node.ssh_host}"], stdin=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if control.exists():
                break
            subprocess.run(["sleep", "0.05"])
        assert control.exists(), "ControlMaster did not come up"
        procs = [subprocess.Popen([*base, "-o", f"ControlPath={control}", f"{node.ssh_user}@{node.ssh_host}",
                                   "sleep 1; echo mux"], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                 for _ in range(multiplexed)]
        procs += [subprocess.Popen([*base, "-o", "ControlMaster=no", "-o", "ControlPath=none",
                                    f"{node.ssh_user}@{node.ssh_host}", "sleep 1; echo direct"],
                                   stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                  for _ in range(direct)]
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert outs.count("mux") == multiplexed and outs.count("direct") == direct
    finally:
        master.terminate()
        master.wait(timeout=10)
        shutil.rmtree(control.parent, ignore_errors=True)


def private_venv(home: Path) -> Path:
    """A venv under `home`, made 0700, that imports what this one does (a .pth file)."""
    home.mkdir(parents=True)
    home.chmod(0o700)
    venv = home / "src" / "gpuctl" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "outer.pth").write_text("".join(p + "\n" for p in sys.path if p.endswith("-packages") or
                                            p.endswith("/cli")))
    os.chmod(site / "outer.pth", 0o644)
    return venv


@pytest.fixture
def cleanup_clusters():
    """Destroy whatever a failing test left behind (never leave nodes running)."""
    names: list[str] = []
    yield names
    for name in names:
        if provisioner.cluster_exists(name):
            provisioner.destroy(name)


@needs_tools
@needs_netns
def test_two_netns_nodes_isolated_reused_and_torn_down(cleanup_clusters: list[str], monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.delenv(local_provider.MODE_ENV, raising=False)
    # gpuctl runs from a venv in a private home (0700, as adduser makes them on Debian 12), which the
    # nodes' login user cannot pass on this machine
    venv = private_venv(tmp_path / "home" / "alice")
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    req = ClusterRequest(name="it-two", num_nodes=2, cloud="local")
    cleanup_clusters.append(req.name)
    progress: list[str] = []
    inv = provisioner.provision(req, on_progress=progress.append)
    head, worker = inv.nodes
    assert [n.rank for n in inv.nodes] == [0, 1] and [n.name for n in inv.nodes] == ["head", "worker1"]
    assert any("terraform apply" in p for p in progress)
    assert (cluster_dir(req.name) / "inventory.yml").is_file()
    assert provisioner.load_cluster(req.name)[0]["num_nodes"] == 2

    # Distinct addresses, each on the node's own eth0 in the cluster's /24.
    assert head.address != worker.address
    for node in inv.nodes:
        assert ssh(node, "ip -4 -o addr show dev eth0").stdout.split()[3].split("/")[0] == node.address

    # A normal login user with passwordless sudo, as on a cloud image (made here when missing).
    assert head.ssh_user == "gpuctl" and ssh(head, "id -un; sudo -n id -un").stdout.split() == ["gpuctl", "root"]
    home = Path(pwd.getpwnam("gpuctl").pw_dir)
    # Own home: a file written to ~ on the head is not in the worker's ~.
    assert ssh(head, "echo hello > ~/only-on-head && echo $HOME").stdout.strip() == str(home)
    assert ssh(worker, "test ! -e ~/only-on-head && echo absent").stdout.strip() == "absent"
    assert (cluster_dir(req.name) / "nodes" / "node0" / "home" / "only-on-head").read_text() == "hello\n"
    assert not (home / "only-on-head").exists()
    # The node's own hostname, this machine's cgroup filesystems (container runtimes need them) and
    # a FUSE device the login user may open (bucket mounts), however this machine's is set.
    assert ssh(head, "hostname").stdout.strip() != ssh(worker, "hostname").stdout.strip()
    cgroups = sorted(line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
                     if line.split()[1].startswith("/sys/fs/cgroup"))
    assert sorted(ssh(worker, "awk '$2 ~ \"^/sys/fs/cgroup\" {print $2}' /proc/self/mounts").stdout.split()) == cgroups
    if Path("/dev/fuse").exists():
        assert ssh(worker, "test -r /dev/fuse -a -w /dev/fuse && echo usable").stdout.strip() == "usable"
    # The Python gpuctl runs from stays visible (pyenv keeps it in root's private home; the venv is
    # in a private home), and so does nothing else of those homes
    assert ssh(head, f"{sys.executable} -c 'print(42)'").stdout.strip() == "42"
    (tmp_path / "home" / "alice" / "secret").write_text("mine")
    assert ssh(head, f"ls -A {tmp_path / 'home' / 'alice'}").stdout.split() == ["src"]
    assert ssh(head, f"ls -A {tmp_path / 'home' / 'alice' / 'src' / 'gpuctl'}").stdout.split() == [".venv"]
    assert (tmp_path / "home" / "alice").stat().st_mode & 0o777 == 0o700  # this machine's, as it was

    # The head reaches the worker's sshd over the bridge.
    probe = (f"python3 -c \"import socket; s = socket.create_connection(('{worker.address}', 22), 5); "
             "print(s.recv(8).decode())\"")
    assert ssh(head, probe).stdout.startswith("SSH-2.0")

    # This machine's Python and the venv gpuctl runs from work on the node (with this suite's own
    # packages, which the private venv imports through a .pth, unless they too lie behind a closed
    # directory: a suite run from a clone in a private home)
    outer = [Path(p) for p in sys.path if p.endswith("-packages")]
    shown = not any(local_provider._closed_to_others(d) for p in outer for d in p.parents)
    imports = "sys, yaml, gpuctl" if shown else "sys"
    out = ssh(worker, f"command -v python3; python3 -c 'import {imports}; print(sys.prefix)'").stdout.split()
    assert out == [os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "python3"), sys.prefix]

    # Re-apply: nothing to change, same nodes, same ranks.
    assert not provisioner.plan(req).changed
    again = provisioner.provision(req)
    assert [(n.rank, n.node_id, n.address) for n in again.nodes] == [(n.rank, n.node_id, n.address) for n in inv.nodes]

    # A rank that detached from its session (new session, parent gone) must die with the cluster.
    detached = int(ssh(worker, "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!").stdout.strip())
    escaped = int(ssh(head, "setsid nohup env -u GPUCTL_NODE_TAG sleep 1001 </dev/null >/dev/null 2>&1 & echo $!")
                  .stdout.strip())
    assert running(detached) and running(escaped)
    envs, sshd = node_envs(req.name), recorded_sshd(req.name)
    bridge = (cluster_dir(req.name) / "nodes" / "bridge.env").read_text().split("LN_BRIDGE=")[1].split()[0]
    assert link_exists(bridge)
    provisioner.destroy(req.name)
    assert_gone(req.name, envs, sshd, [detached, escaped])
    assert not link_exists(bridge)
    # Only the node's own directory under /run/gpuctl goes: other clusters'
    # nodes may be making theirs in the parent at this moment.
    assert not any(Path("/run/gpuctl", env["LN_NETNS"]).exists() for env in envs)
    assert Path("/run/gpuctl").is_dir()


@needs_tools
@needs_netns
def test_three_nodes_then_scale_down_keeps_ranks(cleanup_clusters: list[str]) -> None:
    req = ClusterRequest(name="it-three", num_nodes=3, cloud="local")
    cleanup_clusters.append(req.name)
    inv = provisioner.provision(req)
    assert len({n.address for n in inv.nodes}) == 3
    for node in inv.nodes:
        assert ssh(node, "echo $GPUCTL_NODE_TAG").stdout.strip().endswith(f"-{node.rank}")
    envs = node_envs(req.name)
    many_sessions(inv.nodes[2])

    # A smaller count never removes a node unasked: one line, and nothing changed (root, request, nodes)
    root_text = (cluster_dir(req.name) / "terraform" / "main.tf.json").read_text()
    request_text = (cluster_dir(req.name) / "cluster.json").read_text()
    with pytest.raises(UserError, match=r"^this apply would remove worker2 \(rank 2\) of cluster 'it-three', which "
                                        r"has 3 node\(s\) where the task asks for 2; keep them with --num-nodes 3, "
                                        r"agree with -y, .*nothing was changed$"):
        provisioner.provision(ClusterRequest(name="it-three", num_nodes=2, cloud="local"))
    assert (cluster_dir(req.name) / "terraform" / "main.tf.json").read_text() == root_text
    assert (cluster_dir(req.name) / "cluster.json").read_text() == request_text
    assert not list((cluster_dir(req.name) / "terraform").glob("*.tfplan"))
    ssh(inv.nodes[2], "true")
    told: list[provisioner.Doomed] = []
    smaller = provisioner.provision(ClusterRequest(name="it-three", num_nodes=2, cloud="local"),
                                    on_destroy=told.append)
    assert [(d.have, d.want, [n.name for n in d.removed], d.replaced) for d in told] == [(3, 2, ["worker2"], ())]
    assert [(n.rank, n.node_id) for n in smaller.nodes] == [(n.rank, n.node_id) for n in inv.nodes[:2]]
    assert envs[2]["LN_NETNS"] not in netns_list() and not Path(envs[2]["LN_DIR"]).exists()
    ssh(smaller.nodes[1], "true")

    sshd = recorded_sshd(req.name)
    provisioner.destroy(req.name)
    assert_gone(req.name, envs[:2], sshd, [])


@needs_tools
@needs_netns
def test_down_removes_nodes_terraform_lost_track_of(cleanup_clusters: list[str]) -> None:
    """An interrupted apply can leave a node running that the state does not
    record; `down` still removes it (from the node.env each node writes first)."""
    req = ClusterRequest(name="it-lost", num_nodes=1, cloud="local")
    cleanup_clusters.append(req.name)
    provisioner.provision(req)
    envs, sshd = node_envs(req.name), recorded_sshd(req.name)
    (cluster_dir(req.name) / "terraform" / "terraform.tfstate").unlink()  # Terraform forgets everything
    provisioner.destroy(req.name)
    assert_gone(req.name, envs, sshd, [])


@needs_tools
def test_loopback_nodes(cleanup_clusters: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_provider.MODE_ENV, "loopback")
    req = ClusterRequest(name="it-loop", num_nodes=2, cloud="local")
    cleanup_clusters.append(req.name)
    inv: Inventory = provisioner.provision(req)
    head, worker = inv.nodes
    assert head.ssh_host == worker.ssh_host == "127.0.0.1" and head.ssh_port + 1 == worker.ssh_port
    homes = [ssh(n, "echo $HOME; pwd").stdout.split() for n in inv.nodes]
    assert homes[0][0] == homes[0][1] == str(cluster_dir(req.name).resolve() / "nodes" / "node0" / "home")
    assert homes[0][0] != homes[1][0]
    ssh(head, "echo x > ~/mine")
    assert ssh(worker, "test ! -e ~/mine && echo absent").stdout.strip() == "absent"
    assert not provisioner.plan(req).changed

    detached = int(ssh(worker, "setsid nohup sleep 1002 </dev/null >/dev/null 2>&1 & echo $!").stdout.strip())
    envs, sshd = node_envs(req.name), recorded_sshd(req.name)
    provisioner.destroy(req.name)
    assert_gone(req.name, envs, sshd, [detached])


def run_node_script(command: str, env: dict[str, str], path_prefix: str = "") -> subprocess.CompletedProcess[str]:
    script = local_provider.LocalProvider().module_dir() / "scripts" / "node.sh"
    full = {**os.environ, **env, "PATH": path_prefix + os.environ["PATH"]}
    return subprocess.run(["bash", str(script), command], env=full, capture_output=True, text=True, timeout=60)


@needs_tools
def test_node_bring_up_never_loses_the_state_dir_to_a_sibling(tmp_path: Path) -> None:
    """Terraform brings a cluster's nodes up (and replaces them) in parallel, and
    they share one state directory. CI once saw node 1 fail with "mkdir: cannot
    create directory .../nodes/node1": node 0, clearing its own leftovers, removed
    the state directory node 1 had just made. Here: `up` leaves the directory in
    place (its mode would change if made anew), and a directory removed between
    mkdir -p's two steps is made again."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True)
    state = tmp_path / "nodes"
    state.mkdir()
    state.chmod(0o751)  # node.sh's umask would make it 0700

    def node_env(index: int) -> dict[str, str]:
        return {"LN_MODE": "loopback", "LN_INDEX": str(index), "LN_DIR": str(state / f"node{index}"),
                "LN_NETNS": "", "LN_VETH": "", "LN_BRIDGE": "", "LN_ADDR": "127.0.0.1", "LN_PREFIX_LEN": "24",
                "LN_PORT": str(free_port()), "LN_USER": pwd.getpwuid(os.getuid()).pw_name,
                "LN_PUBKEY": (tmp_path / "key.pub").read_text(), "LN_NODE_PATH": os.environ["PATH"],
                "LN_KEEP": "", "LN_TAG": f"gpuctl-test-{os.getpid()}-{index}", "LN_HOSTNAME": f"it-race-{index}",
                "LN_HOSTS": "", "LN_WAIT": "30"}

    # A sibling's teardown strikes between mkdir -p making the state dir and the
    # node's own: mkdir fails once with the error CI saw.
    shim = tmp_path / "bin"
    shim.mkdir()
    fired = tmp_path / "fired"
    (shim / "mkdir").write_text(f"""#!/bin/sh
case "$*" in
  *{state}/node1/home*)
    if [ ! -e {fired} ]; then
      : > {fired}
      rmdir {state} 2>/dev/null
      echo "mkdir: cannot create directory '{state}/node1': No such file or directory" >&2
      exit 1
    fi ;;
esac
exec /bin/mkdir "$@"
""")
    (shim / "mkdir").chmod(0o755)
    envs = [node_env(0), node_env(1)]
    try:
        up0 = run_node_script("up", envs[0])
        assert up0.returncode == 0, up0.stderr
        assert stat.S_IMODE(state.stat().st_mode) == 0o751, "bring-up removed the shared state directory"
        down0 = run_node_script("down", envs[0])
        assert down0.returncode == 0, down0.stderr
        assert not state.exists()  # the last node took it

        up1 = run_node_script("up", envs[1], path_prefix=f"{shim}:")
        assert up1.returncode == 0, up1.stderr
        assert fired.exists() and "node 1 up: ssh -p" in up1.stdout
        with socket.create_connection(("127.0.0.1", int(envs[1]["LN_PORT"])), timeout=10) as conn:
            assert conn.recv(64).startswith(b"SSH-2.0-")
    finally:
        for env in envs:
            run_node_script("down", env)
    assert not state.exists() and tagged_pids(envs[1]["LN_TAG"]) == []


@needs_tools
@needs_netns
def test_failed_destroy_keeps_host_files_and_can_be_rerun(cleanup_clusters: list[str], tmp_path: Path) -> None:
    """A mount under a node's directory makes teardown stop before rm -rf (it
    would delete through it); after unmounting, destroy runs again and finishes."""
    req = ClusterRequest(name="it-rerun", num_nodes=2, cloud="local")
    cleanup_clusters.append(req.name)
    provisioner.provision(req)
    envs, sshd = node_envs(req.name), recorded_sshd(req.name)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    target = Path(envs[1]["LN_DIR"]) / "home" / "mnt"
    target.mkdir()
    subprocess.run(["mount", "--bind", str(precious), str(target)], check=True)
    try:
        with pytest.raises(ProvisionError, match="is mounted on this machine; unmount it"):
            provisioner.destroy(req.name)
        assert (precious / "keep.txt").read_text() == "mine"
        assert provisioner.cluster_exists(req.name)
        assert not Path(envs[0]["LN_DIR"]).exists()  # the other node is already gone
    finally:
        subprocess.run(["umount", str(target)], check=True)
    provisioner.destroy(req.name)
    assert_gone(req.name, envs, sshd, [])
    assert (precious / "keep.txt").read_text() == "mine"


@needs_netns
def test_node_mount_table_keeps_odd_paths(tmp_path: Path) -> None:
    """A node's mounts go through fstab files (one `mount -a` instead of a process per mount): a kept
    path with a space, a tab, a backslash or a newline must still be bound where it belongs."""
    script = (local_provider.LocalProvider().module_dir() / "scripts" / "node.sh").read_text()
    function = script[script.index("fstab_add() {"):]
    function = function[:function.index("\n}\n") + 3]
    names = ["with space", "tab\there", "back\\slash", "new\nline"]
    for i, name in enumerate(names):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "marker").write_text(str(i))
        (tmp_path / "dst" / name).mkdir(parents=True)
    pairs = "".join(f'fstab_add table {shlex.quote(str(tmp_path / "src" / n))} '
                    f'{shlex.quote(str(tmp_path / "dst" / n))} none bind\n' for n in names)
    program = f'{function}\ntable=""\n{pairs}printf %s "$table" >{shlex.quote(str(tmp_path / "fstab"))}\n'
    subprocess.run(["bash", "-c", program], check=True, timeout=30)
    assert len((tmp_path / "fstab").read_text().splitlines()) == len(names)
    shown = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -a -T "$1" && cat "$2"/*/marker', "_", str(tmp_path / "fstab"), str(tmp_path / "dst")],
        capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert sorted(shown.stdout) == sorted("".join(str(i) for i in range(len(names))))


@needs_tools
@needs_netns
@pytest.mark.parametrize("fake, message", [
    ("echo 'fake sshd: bad configuration' >&2; exit 1", "fake sshd: bad configuration"),
    ("exec sleep 30", "did not accept connections on 10.254.77.2:22 within 2s"),
])
def test_netns_node_whose_sshd_never_listens_is_named_and_removed(tmp_path: Path, fake: str, message: str) -> None:
    """A netns node is up when its sshd listens in the node's namespace (read from /proc): an sshd
    that exits, or a process that never listens, fails the node with sshd's log, within LN_WAIT,
    and leaves no namespace, link or process behind."""
    tag = f"gpuctl-test-{os.getpid()}"
    bridge, netns, veth = f"gpbr{os.getpid() % 100000}", f"gptest{os.getpid()}", f"gpv{os.getpid() % 100000}"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sshd").write_text(f"#!/bin/sh\n{fake}\n")
    (shim / "sshd").chmod(0o755)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True)
    env = {"LN_MODE": "netns", "LN_INDEX": "0", "LN_DIR": str(tmp_path / "state" / "node0"), "LN_NETNS": netns,
           "LN_VETH": veth, "LN_BRIDGE": bridge, "LN_ADDR": "10.254.77.2", "LN_PREFIX_LEN": "24", "LN_PORT": "22",
           "LN_USER": "root", "LN_PUBKEY": (tmp_path / "key.pub").read_text(), "LN_NODE_PATH": os.environ["PATH"],
           "LN_KEEP": "", "LN_TAG": tag, "LN_HOSTNAME": "it-never", "LN_HOSTS": "", "LN_WAIT": "2"}
    subprocess.run(["ip", "link", "add", "name", bridge, "type", "bridge"], check=True)
    try:
        up = run_node_script("up", env, path_prefix=f"{shim}:")
        assert up.returncode != 0
        assert "its log says" in up.stderr and message in up.stderr, up.stderr
        assert not Path("/run/netns", netns).exists() and not link_exists(veth)
        assert tagged_pids(tag) == [] and not Path(env["LN_DIR"]).exists()
    finally:
        run_node_script("down", env)
        subprocess.run(["ip", "link", "del", bridge], check=False)


@needs_netns
def test_the_login_user_goes_with_the_last_node_using_it(tmp_path: Path) -> None:
    """users.sh: the user the module makes (with its sudo rule) stays while any node uses it and goes
    with the last; an account it did not make is never given sudo nor removed; a user whose own
    processes still run is left, and said."""
    script = local_provider.LocalProvider().module_dir() / "scripts" / "users.sh"
    name, theirs = f"gt{os.getpid() % 100000}", f"gu{os.getpid() % 100000}"
    rule = Path("/etc/sudoers.d") / f"gpuctl-local-{name}"

    def users(steps: str, user: str = name) -> subprocess.CompletedProcess[str]:
        program = f'set -euo pipefail\ndie() {{ echo "$*" >&2; exit 1; }}\n. {shlex.quote(str(script))}\n{steps}'
        return subprocess.run(["bash", "-c", program], env={**os.environ, "LN_USERS_DIR": str(tmp_path / "users"),
                                                            "LN_USER": user}, capture_output=True, text=True,
                              timeout=60)

    def exists(user: str) -> bool:
        return subprocess.run(["getent", "passwd", user], capture_output=True).returncode == 0

    try:
        made = users("LN_TAG=a ensure_user; LN_TAG=b ensure_user; echo \"$USER_ENTRY\"")
        assert made.returncode == 0, made.stderr
        assert made.stdout.split(":")[4] == "gpuctl local nodes" and "NOPASSWD: ALL" in rule.read_text()
        home = Path(made.stdout.split(":")[5])
        assert home.is_dir()
        assert users("LN_TAG=a release_user; tidy_users").returncode == 0
        assert exists(name) and rule.exists()  # node b still uses it
        # its own process (not a node's) keeps it, and is said
        sleeper = subprocess.Popen(["setpriv", f"--reuid={name}", f"--regid={name}", "--clear-groups", "sleep", "30"])
        try:
            kept = users("LN_TAG=b release_user; tidy_users")
            assert exists(name) and f"left user {name}, whose processes still run ({sleeper.pid})" in kept.stderr
        finally:
            sleeper.kill()
            sleeper.wait()
        assert users("tidy_users").returncode == 0
        assert not exists(name) and not rule.exists() and not home.exists()
        assert not (tmp_path / "users" / name).exists()

        # an account of this machine: no sudo rule, never removed
        subprocess.run(["useradd", "-M", "-s", "/bin/bash", "-p", "*", theirs], check=True)
        assert users("LN_TAG=a ensure_user; LN_TAG=a release_user; tidy_users", theirs).returncode == 0
        assert exists(theirs) and not (Path("/etc/sudoers.d") / f"gpuctl-local-{theirs}").exists()
    finally:
        for user in (name, theirs):
            subprocess.run(["userdel", "-r", "-f", user], capture_output=True)
        rule.unlink(missing_ok=True)
