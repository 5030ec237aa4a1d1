"""The `local` provider: nodes are sshd processes on this machine
(terraform/modules/local-nodes), for tests, demos and laptops.

Mode `netns` (root with iproute2): each node gets its own network namespace on
a private bridge and its own home; mode `loopback` (anyone else): sshd
processes on 127.0.0.1, one port each. `GPUCTL_LOCAL_MODE` forces a mode.

Every choice that ends up in the rendered root -- mode, the cluster's /24 or
port block, the nodes' PATH and the paths they must still see -- is made once,
at the cluster's first apply, and kept in `clusters/<name>/local.json`: a
re-apply renders the same root, so Terraform reports no changes (and nodes are
not rebuilt because gpuctl ran from another shell or virtualenv).

Subnets come from 10.213.0.0/16 (`GPUCTL_LOCAL_SUBNET_POOL`), skipping any that
overlap an address or route on this machine. Each pick is also reserved in a
machine-wide directory (a file per subnet or port block naming its owner), so
two clusters in different state directories -- parallel test runs -- never
pick the same one; a reservation whose owner's local.json is gone is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import cluster_dir as cluster_dir_of
from gpuctl.providers import render_root
from gpuctl.providers.base import BaseProvider, ClusterRef, PowerOff, Price
from gpuctl.providers.local import nodestate
from gpuctl.spec.accelerators import unknown_accelerator_message, unknown_accelerators
from gpuctl.spec.request import ClusterRequest

if TYPE_CHECKING:
    from gpuctl.spec import Resources, Task

MODE_ENV = "GPUCTL_LOCAL_MODE"
USER_ENV = "GPUCTL_LOCAL_USER"
DEFAULT_USER = "gpuctl"
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
POOL_ENV = "GPUCTL_LOCAL_SUBNET_POOL"
REGISTRY_ENV = "GPUCTL_LOCAL_REGISTRY"
DEFAULT_POOL = "10.213.0.0/16"
PORT_BLOCK = 256  # ports per loopback cluster: room to grow to 253 nodes
PORT_RANGE = (20000, 32768)  # below Linux's default ephemeral port range
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ALLOCATION_FILE = "local.json"
AUTODOWN_FILE = "autodown"  # in the nodes' state directory: when the head began removing the cluster
AUTODOWN_LOG = "autodown.log"  # beside it: the head's autostop log, as it was before the head went
AUTODOWN_JOBS = "autodown-jobs"  # and its jobs' outcomes (job.json, by the head's job name)
# A netns cluster gets a /23 (the bridge and 509 nodes; clusters made before kept their /24: 253);
# a loopback cluster a block of PORT_BLOCK ports.
SUBNET_PREFIX = 23
MAX_NODES = {"netns": 509, "loopback": 253}
# What the module's variable validations accept for paths (no spaces, quotes or ':').
_SAFE_PATH = re.compile(r"^(/[A-Za-z0-9._+@-]+)+$")


@dataclass(frozen=True)
class Allocation:
    """A local cluster's fixed choices (clusters/<name>/local.json)."""

    mode: str  # "netns" | "loopback"
    ssh_user: str
    node_path: str
    keep_visible_paths: tuple[str, ...] = field(default_factory=tuple)
    subnet_cidr: str | None = None  # netns
    base_port: int | None = None  # loopback
    create_user: bool = False  # netns: the module makes ssh_user (with passwordless sudo) when missing

    @property
    def reservation(self) -> str:
        """The registry file name that reserves this cluster's subnet or port block."""
        if self.mode == "netns":
            return "subnet-" + str(self.subnet_cidr).replace("/", "_")
        return f"ports-{self.base_port}"

    def to_json(self) -> str:
        data = asdict(self)
        data["keep_visible_paths"] = list(self.keep_visible_paths)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Allocation":
        data = json.loads(text)
        data["keep_visible_paths"] = tuple(data.get("keep_visible_paths") or ())
        return cls(**data)


# -- decisions ---------------------------------------------------------------


def local_gpus_present() -> bool:
    """Whether the local nodes (processes on this machine) can see an NVIDIA GPU."""
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


def detect_mode() -> str:
    """netns when running as root with iproute2 and util-linux, else loopback."""
    forced = os.environ.get(MODE_ENV, "").strip()
    if forced:
        if forced not in ("netns", "loopback"):
            raise UserError(f"{MODE_ENV}={forced}: use netns or loopback")
        if forced == "netns" and os.geteuid() != 0:
            raise UserError(f"{MODE_ENV}=netns needs root (network namespaces); unset it to use loopback nodes")
        return forced
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("unshare") and shutil.which("setsid"):
        return "netns"
    return "loopback"


def used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks this machine already uses: interface addresses and routes (all tables)."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    nets: list[ipaddress.IPv4Network] = []
    route_types = {"local", "broadcast", "unicast", "anycast", "multicast", "blackhole", "unreachable", "prohibit", "throw", "nat"}
    for args in (["-o", "-4", "addr", "show"], ["-4", "route", "show", "table", "all"]):
        proc = subprocess.run([ip, *args], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            tokens = line.split()
            if args[2] == "addr":
                cidrs = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == "inet"]
            else:
                if tokens and tokens[0] in route_types:
                    tokens = tokens[1:]
                cidrs = tokens[:1]
            for cidr in cidrs:
                if cidr == "default":
                    continue
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(cidr, strict=False))  # type: ignore[arg-type]
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def subnet_pool() -> ipaddress.IPv4Network:
    text = os.environ.get(POOL_ENV, DEFAULT_POOL).strip()
    try:
        pool = ipaddress.ip_network(text)
    except ValueError:
        raise UserError(f"{POOL_ENV}={text}: not a network such as 10.213.0.0/16") from None
    if not isinstance(pool, ipaddress.IPv4Network) or not pool.is_private or pool.prefixlen > SUBNET_PREFIX:
        raise UserError(f"{POOL_ENV}={text}: use a private IPv4 range of /{SUBNET_PREFIX} or larger, "
                        "e.g. 10.213.0.0/16")
    return pool


def local_user(mode: str) -> str:
    """netns: GPUCTL_LOCAL_USER, by default `gpuctl`, a normal user with passwordless sudo as on a
    cloud image (SkyPilot's examples run `sudo apt-get`, mpirun refuses root); root by choice.
    loopback: sshd can only admit its own user."""
    if mode != "netns":
        return pwd.getpwuid(os.getuid()).pw_name
    user = os.environ.get(USER_ENV, "").strip() or DEFAULT_USER
    if not _USER_NAME.fullmatch(user):
        raise UserError(f"{USER_ENV}={user!r}: give a user name such as {DEFAULT_USER} or root")
    return user


def user_home(user: str) -> Path:
    """The user's home; for one the module will make, where useradd puts it."""
    try:
        return Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        return Path("/home") / user


def _mode_of(alloc: Allocation | None) -> str:
    """The cluster's mode: its allocation's, or what a new one would get."""
    return alloc.mode if alloc is not None else detect_mode()


def _user_of(alloc: Allocation | None, mode: str) -> str:
    """The cluster's login user: its allocation's, or what a new one would get."""
    return alloc.ssh_user if alloc is not None else local_user(mode)


def _account_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def _may_sudo(user: str) -> bool:
    """Whether sudo lists any rule for `user` (asked as root, who may ask about anyone; otherwise
    assumed yes: only root makes netns nodes)."""
    sudo = shutil.which("sudo")
    if sudo is None or os.geteuid() != 0:
        return sudo is not None
    proc = subprocess.run([sudo, "-n", "-l", "-U", user], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return proc.returncode == 0 and "not allowed" not in proc.stdout


def account_locked(user: str, shadow: Path = Path("/etc/shadow")) -> bool:
    """Whether `user` exists with a locked password ('!...'); False where the file is unreadable."""
    try:
        lines = shadow.read_text(errors="replace").splitlines()
    except OSError:
        return False
    return any(f[0] == user and f[1].startswith("!") for f in (line.split(":") for line in lines) if len(f) > 1)


def node_keep_paths(user: str) -> list[str]:
    """The Python installation's paths the nodes must still see: those under the user's home (which
    the node's own home covers) and, for a user other than root, those behind a directory others
    cannot pass (root's 0700 home holding pyenv, a private home holding the clone): the module's
    node.sh decides for that user exactly, and covers such a directory in the node with one holding
    just these paths."""
    paths = keep_visible_paths(user_home(user))
    if user != "root":
        paths += [p for p in keep_visible_paths(None) if p not in paths]
    return paths


def node_path() -> str:
    """PATH on the nodes: the interpreter's bin directory (the venv gpuctl runs
    from, not resolved through its symlink) first, then the system's."""
    parts = [os.path.dirname(os.path.abspath(sys.executable)), *SYSTEM_PATH.split(":")]
    seen: list[str] = []
    for p in parts:
        if p not in seen and _SAFE_PATH.fullmatch(p):
            seen.append(p)
    return ":".join(seen)


def keep_visible_paths(home: Path | None) -> list[str]:
    """The Python installation (base prefix, venv, gpuctl's source for editable installs) where it
    lies under `home` (netns nodes get a home of their own, which would otherwise hide it; pyenv puts
    Python under ~/.pyenv), or, with `home` None, where a directory above it is closed to others."""
    import gpuctl

    candidates = [sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                  os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
                  str(Path(gpuctl.__file__).resolve().parent.parent)]
    real = {Path(os.path.realpath(c)) for c in candidates if c}
    if home is None:
        under = [p for p in real if any(_closed_to_others(a) for a in p.parents)]
    else:
        home = Path(os.path.realpath(home))
        under = [p for p in real if home in p.parents]
    outermost = sorted(p for p in under if not any(q in p.parents for q in under))
    return [str(p) for p in outermost if _SAFE_PATH.fullmatch(str(p))]


def _closed_paths(paths: Sequence[str]) -> list[str]:
    """Those of `paths` whose own mode lets others neither read nor pass them (a clone made under
    umask 077): a node's login user sees them, but cannot use them."""
    closed = []
    for path in paths:
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o005 != 0o005:
                closed.append(path)
    return closed


def _closed_to_others(directory: Path) -> bool:
    """Whether a user who neither owns `directory` nor is in its group cannot pass it."""
    try:
        return not os.stat(directory).st_mode & stat.S_IXOTH
    except OSError:
        return False


# -- allocation ----------------------------------------------------------------


def registry_dir() -> Path:
    """Machine-wide reservations (not per state dir: parallel runs share the machine)."""
    override = os.environ.get(REGISTRY_ENV)
    if override:
        return Path(override)
    if os.geteuid() == 0 and os.path.isdir("/run"):
        return Path("/run/gpuctl-alloc")
    return Path(tempfile.gettempdir()) / f"gpuctl-alloc-{os.getuid()}"


def _private_dir(path: Path) -> None:
    """Make `path` a directory only this user can write, refusing one somebody else planted.

    Without root the registry lives in the shared temp dir, where another user
    could create it first, or leave a symlink there pointing at a file of ours.
    """
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path}: is not a directory (a symlink or file is there); remove it, or set "
                        f"{REGISTRY_ENV} to a directory of your own")
    if st.st_uid != os.geteuid():
        raise UserError(f"{path}: belongs to another user (uid {st.st_uid}); remove it, or set {REGISTRY_ENV} "
                        "to a directory of your own")
    if st.st_mode & 0o022:
        os.chmod(path, 0o700)


@contextlib.contextmanager
def _locked(registry: Path) -> Iterator[None]:
    _private_dir(registry)
    fd = os.open(registry / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _read_allocation(path: Path) -> Allocation | None:
    try:
        return Allocation.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None


def _held_by_other(registry: Path, alloc: Allocation, owner: Path) -> bool:
    """Is `alloc`'s subnet/port block reserved by a cluster other than `owner` that still has it?"""
    try:
        holder = Path((registry / alloc.reservation).read_text().strip())
    except OSError:
        return False
    if holder == owner:
        return False
    theirs = _read_allocation(holder)
    return theirs is not None and theirs.reservation == alloc.reservation


def _reserve(registry: Path, alloc: Allocation, owner: Path) -> None:
    tmp = registry / f".{alloc.reservation}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{owner}\n")
    tmp.replace(registry / alloc.reservation)


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def allocate(
    cluster_dir: Path,
    *,
    num_nodes: int,
    mode: str | None = None,
    registry: Path | None = None,
    used: Sequence[ipaddress.IPv4Network] | None = None,
) -> Allocation:
    """The cluster's Allocation: read from its local.json, or chosen now and stored there.

    `registry` (reservations) and `used` (networks in use) default to this
    machine's; tests pass their own.
    """
    cluster_dir = Path(cluster_dir).resolve()
    path = cluster_dir / ALLOCATION_FILE
    registry = registry or registry_dir()
    with _locked(registry):
        existing = _read_allocation(path)
        if existing is not None:
            if not _held_by_other(registry, existing, path):
                _reserve(registry, existing, path)
            return existing
        mode = mode or detect_mode()
        user = local_user(mode)
        keep = tuple(node_keep_paths(user)) if mode == "netns" else ()
        create = mode == "netns" and user == DEFAULT_USER  # only its own user: never an account you named
        chosen: Allocation | None = None
        if mode == "netns":
            taken = list(used_networks() if used is None else used)
            pool = subnet_pool()
            for net in pool.subnets(new_prefix=SUBNET_PREFIX):
                if any(net.overlaps(u) for u in taken):
                    continue
                candidate = Allocation("netns", user, node_path(), keep, subnet_cidr=str(net), create_user=create)
                if not _held_by_other(registry, candidate, path):
                    chosen = candidate
                    break
            if chosen is None:
                raise UserError(f"no free /{SUBNET_PREFIX} left in {pool} for local nodes; tear down clusters you "
                                f"no longer need (gpuctl down NAME) or set {POOL_ENV} to another private range")
        else:
            for base in range(PORT_RANGE[0], PORT_RANGE[1], PORT_BLOCK):
                candidate = Allocation("loopback", user, node_path(), keep, base_port=base)
                if not _held_by_other(registry, candidate, path) and _ports_free(base, num_nodes):
                    chosen = candidate
                    break
            if chosen is None:
                raise UserError(f"no free block of {PORT_BLOCK} ports in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} "
                                "for local nodes; tear down clusters you no longer need (gpuctl down NAME)")
        cluster_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(ALLOCATION_FILE + ".tmp")
        tmp.write_text(chosen.to_json())
        tmp.replace(path)
        _reserve(registry, chosen, path)
        return chosen


def release(cluster_dir: Path, *, registry: Path | None = None) -> None:
    """Drop the cluster's reservation (after its nodes are gone)."""
    path = Path(cluster_dir).resolve() / ALLOCATION_FILE
    alloc = _read_allocation(path)
    if alloc is None:
        return
    registry = registry or registry_dir()
    with _locked(registry):
        entry = registry / alloc.reservation
        with contextlib.suppress(OSError):
            if Path(entry.read_text().strip()) == path:
                entry.unlink()


def nodes_dir(cluster_dir: Path) -> Path:
    """Where the cluster's nodes live: `<cluster_dir>/nodes`, or where its rendered root already put them.

    A cluster adopted from shared state by another state dir on this machine
    keeps its nodes where they are (a new path would make Terraform replace them).
    """
    try:
        module = json.loads((cluster_dir / "terraform" / "main.tf.json").read_text())["module"]
        recorded = Path(next(iter(module.values()))["state_dir"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return cluster_dir / "nodes"
    return recorded if recorded.is_dir() else cluster_dir / "nodes"


# -- the provider ----------------------------------------------------------------


# The PATH sshd gives a login (OpenSSH's default for root): where a node's commands find python3.
NODE_LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LocalProvider(BaseProvider):
    name = "local"
    module_name = "local-nodes"
    local = True  # sshd processes on this machine: its filesystem, Python and container store
    containers_outlive_cluster = True
    authorizes_internal_key_at_boot = True  # netns: node.sh writes it to the node's ~/.ssh/authorized_keys
    node_resource = "terraform_data.node"  # its destroy runs node.sh down, its create node.sh up

    def node_python(self) -> str | None:
        """This machine's python3, as a node's login shell finds it (sshd's default PATH): the nodes
        are processes here, so discovery would find the same one."""
        return shutil.which("python3", path=NODE_LOGIN_PATH)

    def boot_host_keys(self, cluster_dir: Path, node_count: int) -> dict[int, str]:
        """Each node's host key as node.sh generated it on this machine (<node>/sshd/*.pub)."""
        state_dir = nodes_dir(Path(cluster_dir).resolve())
        keys = {}
        for rank in range(node_count):
            try:
                line = (state_dir / f"node{rank}" / "sshd" / "ssh_host_ed25519_key.pub").read_text().strip()
            except OSError:
                continue
            if len(line.split()) >= 2:
                keys[rank] = line
        return keys

    def lost_nodes(self, cluster_dir: Path, inv: ClusterRef, request: Mapping[str, Any] | None) -> dict[int, str]:
        """Nodes whose sshd (and, netns, namespace) is gone from this machine, read from /proc
        (nodestate.py); <node>/ is node<rank>, as boot_host_keys reads it."""
        state_dir = nodes_dir(Path(cluster_dir).resolve())
        lost = {}
        for node in inv.nodes:
            why = nodestate.why_lost(state_dir / f"node{node.rank}", node.ssh_port)
            if why is not None:
                lost[node.rank] = why
        return lost

    def resources_problem(self, resources: "Resources") -> tuple[str, str] | None:
        """An accelerator name not in the catalogue: local nodes only name their GPUs, so a typo
        (`H1000:8`) would otherwise pass silently."""
        unknown = unknown_accelerators(resources.accelerators or {})
        return ("accelerators", unknown_accelerator_message(unknown[0])) if unknown else None

    def expected_gpus(self, gpus_per_node: int) -> int:
        """Local nodes only name their GPUs, unless this machine has NVIDIA devices (which they share)."""
        return gpus_per_node if local_gpus_present() else 0

    def task_warnings(self, task: "Task", req: ClusterRequest) -> list[str]:
        """The local nodes have no GPU of their own, and no instance type, market, disk or fabric."""
        lines = []
        res = task.resources
        if req.accelerator and not local_gpus_present():
            lines.append(f"{task.where('resources', 'accelerators')}: resources.accelerators: the local "
                         f"nodes have no GPU (no NVIDIA device on this machine); jobs still see "
                         f"SKYPILOT_NUM_GPUS_PER_NODE={req.gpus_per_node}")
        unused = [k for k in ("instance_type", "use_spot", "disk_size", "network_tier") if getattr(res, k)]
        unused += ["image_id"] if res.image_id and not task.container_image else []
        for key in unused:
            lines.append(f"{task.where('resources', key)}: resources.{key}: ignored on infra local "
                         "(nodes on this machine)")
        alloc = _read_allocation(cluster_dir_of(req.name).resolve() / ALLOCATION_FILE)
        mode = _mode_of(alloc)
        user = _user_of(alloc, mode)
        if mode == "netns" and user != "root" and shutil.which("sudo") is None:
            lines.append(f"{task.where()}: the local nodes log in as {user}, whose passwordless sudo needs sudo on "
                         "this machine (apt-get install sudo; `make deps` installs it)")
        if mode == "netns" and user not in ("root", DEFAULT_USER) and _account_exists(user) and not _may_sudo(user):
            lines.append(f"{task.where()}: the local nodes log in as {user}, an account of this machine, which gpuctl "
                         "grants no sudo: a setup or run that calls sudo fails there")
        if mode == "netns" and user != "root":
            keep = alloc.keep_visible_paths if alloc is not None else node_keep_paths(user)
            for path in _closed_paths(keep):
                lines.append(f"{task.where()}: the local nodes log in as {user}, who cannot read {path} (mode "
                             f"{stat.S_IMODE(os.stat(path).st_mode):04o}), so jobs there will not find this Python; "
                             f"chmod -R go+rX {path}, or set {USER_ENV}=root")
        cpus, gib = os.cpu_count() or 1, _memory_gib()
        for key, have in (("cpus", f"{cpus} CPU(s)"), ("memory", f"{gib:g} GiB" if gib else "its memory")):
            if getattr(res, key):
                lines.append(f"{task.where('resources', key)}: resources.{key}: not reserved on infra local: "
                             f"every node shares this machine's {have}")
        return lines

    def check(self, req: ClusterRequest) -> None:
        cdir = cluster_dir_of(req.name).resolve()
        alloc = _read_allocation(cdir / ALLOCATION_FILE)
        mode = _mode_of(alloc)
        most, why = MAX_NODES[mode], ("its ports: a block of 256 per cluster" if mode == "loopback" else
                                       f"its subnet: a /{SUBNET_PREFIX} holds the bridge and 509 nodes")
        if mode == "netns" and alloc is not None and alloc.subnet_cidr:
            net = ipaddress.ip_network(alloc.subnet_cidr)
            most = net.num_addresses - 3
            why = f"its subnet {net} holds the bridge and {most} nodes"
        if not 1 <= req.num_nodes <= most:
            grow = (f"; a cluster made before holds fewer: make a new one (gpuctl down {req.name}, or -c NAME) "
                    "for more" if most < MAX_NODES[mode] else "; lower num_nodes or use infra aws")
            raise UserError(f"num_nodes {req.num_nodes}: infra local supports 1 to {most} nodes in "
                            f"{'this cluster' if alloc is not None else f'{mode} mode'} ({why}){grow}")
        _check_state_dir(nodes_dir(cdir))
        if mode == "netns":
            user = _user_of(alloc, mode)
            if alloc is None and user not in ("root", DEFAULT_USER) and not _account_exists(user):
                raise UserError(f"{USER_ENV}={user}: no such user on this machine; gpuctl makes only its own login "
                                f"user {DEFAULT_USER} (with passwordless sudo, removed with the last cluster using it): "
                                f"create {user} yourself, or unset {USER_ENV}")
            if account_locked(user):
                raise UserError(f"{USER_ENV}: the local nodes' user {user} is locked (its password starts with '!', "
                                "as useradd leaves a user made without one), and sshd refuses a locked account even "
                                f"with a key; unlock it for key logins (usermod -p '*' {user}) or set {USER_ENV} "
                                "to another user")

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str,
                    internal_public_key: str = "") -> dict[str, Any]:
        cluster_dir = Path(cluster_dir).resolve()
        state_dir = nodes_dir(cluster_dir)
        _check_state_dir(state_dir)
        alloc = allocate(cluster_dir, num_nodes=req.num_nodes)
        inputs: dict[str, Any] = {
            "name": req.name,
            "node_count": req.num_nodes,
            "ssh_public_key": ssh_public_key.strip(),
            "internal_public_key": internal_public_key.strip(),
            "mode": alloc.mode,
            "state_dir": str(state_dir),
            "ssh_user": alloc.ssh_user,
            "node_path": alloc.node_path,
            "keep_visible_paths": list(alloc.keep_visible_paths),
            "create_user": alloc.create_user,
        }
        if alloc.mode == "netns":
            inputs["subnet_cidr"] = alloc.subnet_cidr
        else:
            inputs["base_port"] = alloc.base_port
        return render_root(self.module_dir(), inputs)

    def autostop_problem(self, request: Mapping[str, Any], *, down: bool) -> str | None:
        return None

    def stop_problem(self, request: Mapping[str, Any]) -> str | None:
        """Local nodes are processes and namespaces on this machine: stopped, nothing of them is kept
        that a start could bring back (autostop removes them for that reason)."""
        name = request.get("name") or "NAME"
        return (f"local nodes cannot be stopped and kept (they are processes on this machine); "
                f"`gpuctl down {name}` removes them and `gpuctl apply` makes them again")

    def price(self, request: Mapping[str, Any]) -> Price:
        return Price(source="local nodes: no cloud bill", free=True)

    def power_off(self, cluster_dir: Path, ranks: list[int], ssh_user: str, request: Mapping[str, Any],
                  *, down: bool) -> PowerOff:
        """Every node is on this machine, so the head removes them all itself, with the module's own
        scripts (as `gpuctl down` would), in this machine's namespaces (netns: entered through the
        cluster's anchor process, scripts/hostns.sh, as root through the login user's sudo): the
        workers, then itself, then the bridge. It leaves word (AUTODOWN_FILE) of when it began and
        when it was done, which tells the controller what happened."""
        cdir = Path(cluster_dir).resolve()
        state_dir = nodes_dir(cdir)
        scripts = self.module_dir() / "scripts"
        netns = _mode_of(_read_allocation(cdir / ALLOCATION_FILE)) == "netns"
        enter: list[str] = []
        if netns:
            try:
                bridge = nodestate.read_env(state_dir / "bridge.env")
            except OSError:
                bridge = {}
            if not bridge.get("LN_ANCHOR") or not bridge.get("LN_ANCHOR_START"):
                raise UserError(f"cluster at {cdir}: its nodes were made by an older gpuctl, without the anchor "
                                "autostop needs; run gpuctl down and apply it again")
            # hostns.sh goes as text: from a clone in a private home the node sees the module's files
            # only through its own cover, which goes with the head before the bridge's last step
            enter = (["sudo", "-n"] if ssh_user != "root" else []) + [
                "bash", "-c", (scripts / "hostns.sh").read_text(), "hostns.sh", bridge["LN_ANCHOR"],
                bridge["LN_ANCHOR_START"]]

        def run_down(script: str, env_file: Path, then: str = "") -> list[str]:
            return enter + ["bash", "-c", 'set -a; . "$1"; set +a; bash "$2" down' + then, "gpuctl-autodown",
                            str(env_file), str(scripts / script), str(state_dir / AUTODOWN_FILE)]

        # AUTODOWN_FILE: when it began, then when it was done (the last step, with the bridge, whose
        # removal ends the anchor that lets the head into this machine's namespaces)
        done = '; rc=$?; date +%s >>"$3"; exit $rc'
        head = [enter + ["bash", "-c", 'umask 077; date +%s >"$1"', "gpuctl-autodown", str(state_dir / AUTODOWN_FILE)]]
        head += [run_down("node.sh", state_dir / f"node{rank}" / "node.env") for rank in ranks if rank != 0]
        # the watcher's log goes with the head's home: keep it beside the word it leaves
        head.append(enter + ["bash", "-c", 'umask 077; cp -- "$1" "$2" 2>/dev/null || true', "gpuctl-autodown",
                             str(state_dir / "node0" / "home" / ".gpuctl" / "autostop.log"),
                             str(state_dir / AUTODOWN_LOG)])
        # and so do its jobs' outcomes (job.json): a job that ended while no gpuctl watched is recorded
        head.append(enter + ["bash", "-c", 'umask 077; mkdir -p -- "$2" && for d in "$1"/*/; do '
                             'n=${d%/}; n=${n##*/}; [ -f "$d/job.json" ] && cp -- "$d/job.json" "$2/$n.json"; '
                             'done; true', "gpuctl-autodown", str(state_dir / "node0" / "home" / ".gpuctl" / "jobs"),
                             str(state_dir / AUTODOWN_JOBS)])
        head.append(run_down("node.sh", state_dir / "node0" / "node.env", "" if netns else done))
        if netns:
            head.append(run_down("bridge.sh", state_dir / "bridge.env", done))
        notes = [] if down else ["local nodes cannot be stopped and kept: autostop removes them, as autodown does"]
        return PowerOff(head=head, removes=True, notes=notes)

    def removed_itself(self, cluster_dir: Path, *, finished: bool = True) -> float | None:
        """AUTODOWN_FILE's second line (when the last step ended), or its first (when the head began)
        where `finished` is False."""
        try:
            lines = (nodes_dir(Path(cluster_dir).resolve()) / AUTODOWN_FILE).read_text().split()
            return float(lines[1] if finished else lines[0])
        except (OSError, ValueError, IndexError):
            return None

    def outcomes_left(self, cluster_dir: Path) -> dict[str, dict[str, Any]]:
        """The head's job.json files, copied beside AUTODOWN_FILE before it removed itself."""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted((nodes_dir(Path(cluster_dir).resolve()) / AUTODOWN_JOBS).glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("status"), str):
                found[path.stem] = doc
        return found

    def cleanup(self, cluster_dir: Path) -> None:
        """Remove nodes and a bridge Terraform never recorded (an apply that was
        interrupted mid-way): each wrote its teardown parameters first
        (node.env, bridge.env), so the module's own scripts can remove them.
        Then give back the cluster's subnet or port block."""
        cluster_dir = Path(cluster_dir).resolve()
        state_dir = nodes_dir(cluster_dir)
        scripts = self.module_dir() / "scripts"
        for env_file in sorted(state_dir.glob("node*/node.env")):
            _run_script(scripts / "node.sh", "down", nodestate.read_env(env_file))
        bridge_env = state_dir / "bridge.env"
        if bridge_env.exists():
            _run_script(scripts / "bridge.sh", "down", nodestate.read_env(bridge_env))
        with contextlib.suppress(OSError):
            (state_dir / AUTODOWN_LOG).unlink(missing_ok=True)
            shutil.rmtree(state_dir / AUTODOWN_JOBS, ignore_errors=True)
            (state_dir / AUTODOWN_FILE).unlink()
            state_dir.rmdir()
        release(cluster_dir)


def _memory_gib() -> float:
    """This machine's memory in GiB (0 when /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _check_state_dir(state_dir: Path) -> None:
    """The node scripts take the path unquoted in places: only a plain path is safe."""
    if not _SAFE_PATH.fullmatch(str(state_dir)):
        raise UserError(f"{state_dir}: local nodes need a state directory path made of letters, digits and "
                        "._+@- only; set GPUCTL_STATE_DIR to such a directory")


def _run_script(script: Path, action: str, env: dict[str, str]) -> None:
    proc = subprocess.run(["bash", str(script), action], env={**os.environ, **env},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ProvisionError(f"{script.name} {action} failed: " + " ".join(reason))


PROVIDER = LocalProvider()
