#!/usr/bin/env python3
"""gpuctl-fabric-probe: the fabric one node has, and the NCCL/libfabric env for it.

The most expensive failure in multi-node training is silent: NCCL falls back
to TCP sockets and runs at a fraction of the fabric's speed. So prepare looks
at every node instead of trusting a table per cloud: this script, installed
with the node bundle as ~/.gpuctl/lib/gpuctl-fabric-probe, is run by the
install step on each node (node/install.py, loaded in its process), writes
that node's `~/.gpuctl/fabric.env` (sourced before every job's env, so the
task's `envs` still win) and `~/.gpuctl/fabric.json`, and gives the same JSON,
which the controller gathers into `clusters/<name>/fabric.json`
(configplane/fabricrecord.py).

Standard library only, Python >= 3.6, like the agent: nodes have nothing but
their system python3. The node writes its own env (rather than the controller
rendering one per node) because the values are the node's own: its HCA names
and active ports, its GID table, its interface to the head, where its
aws-ofi-nccl lives. One file, no round trip.

What it reads (every root is a parameter, so tests point it at fake trees):
  SYS/class/infiniband/DEV/                 RDMA devices
    device/driver -> .../efa | mlx5_core      EFA: driver efa (names rdmap*, efa_*); mlx5_* and the
                                              rest by their ports; rxe/siw (software) listed, never used
    ports/N/{state,phys_state,link_layer,rate}
    ports/N/gids/I, gid_attrs/{types,ndevs}/I  RoCE: the GID table
  SYS/class/infiniband_verbs/uverbsK/ibdev  which DEV/infiniband/uverbsK opens DEV (user space needs it)
  `fi_info -p efa` when on PATH             whether libfabric sees the EFA devices (10 s; absence is fine)
  `ip -j route get HEAD`, `ip -j addr`,     the interface that carries the route to the head
  PROC/net/route (without `ip`)
  ROOT/opt/amazon/ofi-nccl/lib, ...         the aws-ofi-nccl plugin (libnccl-net*.so) and libfabric
  SYS/devices/virtual/dmi/id/product_name   the EC2 instance type, when the controller gave none

The kind, strongest first: `efa` (any EFA device: on AWS it is the only RDMA
path), `ib` (an ACTIVE port whose link layer is InfiniBand), `roce` (an ACTIVE
RDMA port on Ethernet), else `socket`. IB wins over RoCE on a node with both
because there the IB ports are the compute fabric and the Ethernet RDMA NIC
is the front end; NCCL_IB_HCA then names the IB ports only.

The env, and why:
  NCCL_SOCKET_IFNAME   always: the interface of the route to the head, where the
                       nodes reach each other (NCCL's bootstrap and its socket
                       transport). The old "^lo,docker" let NCCL pick a second
                       NIC, a VPN or a bridge of another name. The plain name, not
                       NCCL's exact "=name" form, because people copy it into
                       GLOO_SOCKET_IFNAME, which takes a name only.
  FI_PROVIDER=efa, FI_EFA_FORK_SAFE=1     EFA (older aws-ofi-nccl needs the first;
                       the second matters on kernels < 5.15, harmless after)
  FI_EFA_USE_DEVICE_RDMA=1  EFA on instance types with GPUDirect RDMA (p4d, p4de,
                       p5, p5e, p5en, p6), from the controller or the DMI product name
  LD_LIBRARY_PATH      EFA: the aws-ofi-nccl and libfabric directories found,
                       prepended: without them NCCL silently uses sockets
  NCCL_IB_HCA          IB/RoCE: the active ports, "=mlx5_0:1,mlx5_1:1,...". The
                       leading "=" makes NCCL match names exactly; a prefix
                       "mlx5_1" would also take mlx5_10..mlx5_17, down ones included
  NCCL_IB_GID_INDEX    RoCE: the GID index of a RoCE v2 IPv4-mapped address on
                       the most active ports (NCCL's default 0 is RoCE v1, link-local)
On socket-only nodes only NCCL_SOCKET_IFNAME: NCCL_IB_* or FI_* there would
only mislead. The controller's static cloud defaults (`--fallback-env`) are
written only where detection could not see: when reading the devices failed.
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

VERSION = 1
KINDS = ("efa", "ib", "roce", "socket")
# Instance families whose GPUs do GPUDirect RDMA over EFA (fabric.md); jobenv.py uses the same table.
RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6")
# Where the DLAMI and the EFA installer put aws-ofi-nccl (new layout first) and libfabric.
PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib",
               "/opt/aws-ofi-nccl/lib64")
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
FI_INFO_DIRS = ("/opt/amazon/efa/bin",)  # the EFA installer's fi_info, often not on a non-login PATH
SOFTWARE_DRIVERS = ("rdma_rxe", "rxe", "siw")
DEFAULT_IFNAME = "^lo,docker"  # only when no interface to the head could be found
COMMAND_TIMEOUT_S = 10
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")


def _read(path):
    """A sysfs attribute's text, or None (absent; some, like an empty GID's type, raise EINVAL)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace").strip()
    except (OSError, IOError, ValueError):
        return None


def _natural(name):
    """mlx5_2 before mlx5_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _listdir(path):
    try:
        return sorted(os.listdir(path), key=_natural)
    except OSError:
        return []


def _value(text):
    """'4: ACTIVE' -> 'ACTIVE' (sysfs prefixes states with their number)."""
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text


def _run(argv, path, timeout=COMMAND_TIMEOUT_S):
    """(returncode, stdout) of a command found on `path`, or None when it is absent or hangs."""
    exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=path)
    if not exe:
        return None
    try:
        proc = subprocess.run([exe] + list(argv[1:]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, universal_newlines=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.returncode, proc.stdout


# -- RDMA devices -------------------------------------------------------------------


def _gid_score(gid, gid_type):
    """Lower is better: RoCE v2 with an IPv4-mapped address (routable, what NCCL wants),
    then RoCE v2 IPv6 (global before link-local), then RoCE v1."""
    flat = gid.replace(":", "").lower()
    v2 = (gid_type or "").lower().endswith("v2")
    if v2 and flat.startswith("0" * 20 + "ffff"):
        return 0
    if v2 and not flat.startswith("fe80"):
        return 1
    if v2:
        return 2
    return 3


def _gids(port_dir):
    """The port's non-zero GIDs: [{index, gid, type, ndev}]."""
    out = []
    for entry in _listdir(os.path.join(port_dir, "gids")):
        if not entry.isdigit():
            continue
        gid = _read(os.path.join(port_dir, "gids", entry))
        if not gid or not gid.replace(":", "").strip("0"):
            continue
        item = {"index": int(entry), "gid": gid,
                "type": _read(os.path.join(port_dir, "gid_attrs", "types", entry))}
        ndev = _read(os.path.join(port_dir, "gid_attrs", "ndevs", entry))
        if ndev:
            item["ndev"] = ndev
        out.append(item)
    return sorted(out, key=lambda g: g["index"])


def _verbs(sys_root, dev_root):
    """RDMA device name -> its uverbs char device, where DEV/infiniband/uverbsK exists."""
    found = {}
    base = os.path.join(sys_root, "class", "infiniband_verbs")
    for entry in _listdir(base):
        ibdev = _read(os.path.join(base, entry, "ibdev"))
        if ibdev and os.path.exists(os.path.join(dev_root, "infiniband", entry)):
            found[ibdev] = entry
    return found


def _device_kind(name, driver, real):
    if driver in SOFTWARE_DRIVERS or name.startswith(("rxe", "siw")) or "/devices/virtual/" in real:
        return "software"
    if driver == "efa" or (driver is None and name.startswith(("rdmap", "efa_"))):
        return "efa"
    return None  # by its ports' link layer


def read_devices(sys_root="/sys", dev_root="/dev"):
    """Every RDMA device under SYS/class/infiniband with its ports (natural name order)."""
    base = os.path.join(sys_root, "class", "infiniband")
    verbs = _verbs(sys_root, dev_root)
    devices = []
    for name in _listdir(base):
        path = os.path.join(base, name)
        link = os.path.join(path, "device", "driver")
        driver = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
        kind = _device_kind(name, driver, os.path.realpath(path))
        ports = []
        for number in _listdir(os.path.join(path, "ports")):
            if not number.isdigit():
                continue
            pdir = os.path.join(path, "ports", number)
            port = {"port": int(number), "state": _value(_read(os.path.join(pdir, "state"))),
                    "phys_state": _value(_read(os.path.join(pdir, "phys_state"))),
                    "link_layer": _read(os.path.join(pdir, "link_layer")),
                    "rate": _read(os.path.join(pdir, "rate"))}
            if port["link_layer"] == "Ethernet" and kind is None:
                port["gids"] = _gids(pdir)
            ports.append(port)
        if kind is None:
            layers = {p["link_layer"] for p in ports}
            kind = "ib" if "InfiniBand" in layers else "roce" if "Ethernet" in layers else "rdma"
        devices.append({"name": name, "driver": driver, "kind": kind, "ports": ports,
                        "verbs": verbs.get(name)})
    return devices


def _active(devices, kind):
    """["DEV:PORT", ...] of the ACTIVE ports of devices of `kind` (their link layer for ib/roce)."""
    layer = {"ib": "InfiniBand", "roce": "Ethernet"}.get(kind)
    out = []
    for dev in devices:
        if dev["kind"] == "software":
            continue
        for port in dev["ports"]:
            if port["state"] != "ACTIVE":
                continue
            if (dev["kind"] == "efa") if kind == "efa" else (dev["kind"] != "efa" and port["link_layer"] == layer):
                out.append("%s:%d" % (dev["name"], port["port"]))
    return out


def choose_gid_index(devices, active):
    """The one NCCL_IB_GID_INDEX for the node (NCCL takes one index for every HCA): the index whose
    GIDs score best summed over the active RoCE ports (a port without it counts worst), lowest on a tie."""
    tables = []
    for dev in devices:
        for port in dev["ports"]:
            if "%s:%d" % (dev["name"], port["port"]) in active:
                tables.append({g["index"]: _gid_score(g["gid"], g["type"]) for g in port.get("gids") or []})
    candidates = sorted({i for table in tables for i in table})
    if not candidates:
        return None
    return min(candidates, key=lambda i: (sum(table.get(i, 9) for table in tables), i))


# -- libfabric, the plugin, the instance type ------------------------------------------


def fi_info(path, root="/"):
    """What `fi_info -p efa` reports: {path, ok, devices} (devices from its domains, rdmap16s27-rdm
    -> rdmap16s27), or None when fi_info is not installed."""
    exe = shutil.which("fi_info", path=path)
    if not exe:
        for d in FI_INFO_DIRS:
            candidate = os.path.join(root, d.lstrip("/"), "fi_info")
            if os.access(candidate, os.X_OK):
                exe = candidate
                break
    if not exe:
        return None
    got = _run([exe, "-p", "efa"], path)
    if got is None:
        return {"path": exe, "ok": False, "devices": [], "error": "did not answer in %d s" % COMMAND_TIMEOUT_S}
    code, out = got
    domains = re.findall(r"^\s*domain:\s*(\S+)", out, re.M)
    names = sorted({re.sub(r"-(rdm|dgrm)$", "", d) for d in domains}, key=_natural)
    return {"path": exe, "ok": code == 0 and bool(names), "devices": names}


def _display(root, path):
    """A path found under `root` as the node sees it (root is / except in tests)."""
    rel = os.path.relpath(path, root)
    return "/" + rel if rel != "." else "/"


def _first_dir_with(root, dirs, pattern):
    """The first of `dirs` (as the node sees it) holding a file matching `pattern`, or None."""
    for d in dirs:
        full = os.path.join(root, d.lstrip("/"))
        if glob.glob(os.path.join(full, pattern)):
            return _display(root, full)
    return None


def find_plugin(root="/"):
    """The aws-ofi-nccl directory (one with libnccl-net*.so), or None."""
    return _first_dir_with(root, PLUGIN_DIRS, "libnccl-net*.so*")


def find_libfabric(root="/"):
    """The libfabric directory (one with libfabric.so), or None."""
    return _first_dir_with(root, LIBFABRIC_DIRS, "libfabric.so*")


def instance_type(given, sys_root="/sys"):
    """The controller's instance type, else the DMI product name when it looks like one (on EC2
    Nitro instances it is the type, p5.48xlarge); None elsewhere."""
    if given:
        return given
    product = _read(os.path.join(sys_root, "devices", "virtual", "dmi", "id", "product_name")) or ""
    return product if _INSTANCE_TYPE_RE.match(product) else None


def gpudirect_rdma(itype):
    family = (itype or "").split(".", 1)[0]
    return bool(family) and family.startswith(RDMA_FAMILIES)


# -- the interface to the head ----------------------------------------------------------


def _proc_route(proc_root, address):
    """The interface of the longest matching IPv4 route in PROC/net/route (metric breaks ties)."""
    try:
        with open(os.path.join(proc_root, "net", "route")) as fh:
            lines = fh.read().splitlines()[1:]
    except (OSError, IOError):
        return None
    try:
        target = struct.unpack("<I", socket.inet_aton(address))[0] if address else 0
    except (OSError, ValueError):
        return None
    best = None
    for line in lines:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dest, flags, metric, mask = int(f[1], 16), int(f[3], 16), int(f[6]), int(f[7], 16)
        except ValueError:
            continue
        if not flags & 1 or (target & mask) != dest or (not address and mask):
            continue
        key = (bin(mask).count("1"), -metric)
        if best is None or key > best[0]:
            best = (key, f[0])
    return best[1] if best else None


def _own_interface(address, path):
    """The interface holding `address` itself (the head asking for its own address gets `lo`
    from `ip route get`: the local table)."""
    got = _run(["ip", "-j", "addr", "show"], path)
    if not got or got[0] != 0:
        return None
    try:
        links = json.loads(got[1] or "[]")
    except ValueError:
        return None
    for link in links:
        for addr in link.get("addr_info") or []:
            if addr.get("local") == address and link.get("ifname") != "lo":
                return link.get("ifname")
    return None


def route_interface(head, path=None, proc_root="/proc"):
    """(interface, how) of the route to `head` (the default route when None): `ip -j route get`,
    then the interface holding the head's own address (the head itself: `ip` says `lo`, the
    local table), `lo` for a loopback head (a loopback cluster's nodes do reach each other
    there), and PROC/net/route's longest match where `ip` is missing."""
    address = head
    if head:
        try:
            address = socket.gethostbyname(head)  # an address stays itself; a name is resolved once
        except (OSError, UnicodeError):
            address = head
    loopback = None
    got = _run(["ip", "-j", "route", "get", address or "0.0.0.0"], path)
    if got and got[0] == 0:
        try:
            routes = json.loads(got[1] or "[]")
        except ValueError:
            routes = []
        dev = routes[0].get("dev") if routes and isinstance(routes[0], dict) else None
        if dev and dev != "lo":
            return dev, "ip route get"
        loopback = dev
    if address:
        own = _own_interface(address, path)
        if own:
            return own, "ip addr"
    if loopback:  # the local table, which PROC/net/route does not show
        return loopback, "ip route get"
    if address and address.startswith("127."):
        return "lo", "loopback address"
    dev = _proc_route(proc_root, address)
    if dev:
        return dev, "/proc/net/route"
    return None, None


# -- putting it together ----------------------------------------------------------------


def build_env(kind, interface, active, gid_index, gdr, plugin_dir, libfabric_dir):
    """(env, path_prepend) for the kind (see the module's docstring for why each)."""
    env = {"NCCL_SOCKET_IFNAME": interface or DEFAULT_IFNAME}
    prepend = {}
    if kind == "efa":
        env.update({"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"})
        if gdr:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        dirs = [d for d in (plugin_dir, libfabric_dir) if d]
        if dirs:
            prepend["LD_LIBRARY_PATH"] = dirs
    elif kind in ("ib", "roce"):
        env["NCCL_IB_HCA"] = "=" + ",".join(active)
        if kind == "roce" and gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(gid_index)
    return env, prepend


def probe(head=None, instance=None, fallback_env=None, sys_root="/sys", dev_root="/dev", proc_root="/proc",
          root="/", path=None):
    """The node's fabric as a JSON-able dict (no side effects)."""
    path = os.environ.get("PATH", os.defpath) if path is None else path
    warnings = []
    error = None
    try:
        devices = read_devices(sys_root, dev_root)
    except Exception as exc:  # noqa: BLE001 - an unexpected sysfs layout must not stop prepare: recorded, defaults used
        devices, error = [], "reading %s/class/infiniband: %s: %s" % (sys_root, type(exc).__name__, exc)
    interface, how = route_interface(head, path, proc_root)
    if interface is None:
        warnings.append("no route to %s found: NCCL_SOCKET_IFNAME=%s" % (head or "a default gateway",
                                                                          DEFAULT_IFNAME))
    hardware = [d for d in devices if d["kind"] != "software"]
    efa = [d for d in hardware if d["kind"] == "efa"]
    kind = "socket"
    active = []
    for candidate in ("efa", "ib", "roce"):
        if candidate == "efa" and not efa:
            continue
        active = _active(hardware, candidate)
        if candidate == "efa" or active:
            kind = candidate
            break
    itype = instance_type(instance, sys_root)
    gdr = kind == "efa" and gpudirect_rdma(itype)
    gid_index = choose_gid_index(hardware, active) if kind == "roce" else None
    fi = fi_info(path, root) if efa else None
    plugin_dir = find_plugin(root) if kind == "efa" else None
    libfabric_dir = find_libfabric(root) if kind == "efa" else None

    if kind in ("efa", "ib", "roce"):
        down = ["%s:%d (%s)" % (d["name"], p["port"], p["state"] or "state unknown")
                for d in hardware if d["kind"] == kind for p in d["ports"] if p["state"] != "ACTIVE"]
        if down:
            warnings.append("port(s) not ACTIVE: %s%s" % (", ".join(down[:4]), ", …" if len(down) > 4 else ""))
    if kind == "efa":
        if not active:
            warnings.append("no EFA port is ACTIVE")
        if fi is not None and len(fi["devices"]) < len(efa):
            warnings.append("libfabric (fi_info -p efa) sees %d of %d EFA devices" % (len(fi["devices"]), len(efa)))
        if plugin_dir is None:
            warnings.append("aws-ofi-nccl not found in %s: NCCL uses sockets unless the job brings it"
                            % ", ".join(PLUGIN_DIRS[::2]))
    elif kind == "roce":
        if gid_index is None:
            warnings.append("no RoCE GID found: NCCL_IB_GID_INDEX left to NCCL")
    elif kind == "socket" and hardware:
        warnings.append("RDMA device(s) %s present but no port ACTIVE: NCCL uses sockets"
                        % ",".join(d["name"] for d in hardware))
    used = {a.split(":", 1)[0] for a in active}
    no_verbs = [d["name"] for d in hardware if d["name"] in used and not d.get("verbs")]
    if no_verbs and os.path.isdir(os.path.join(sys_root, "class", "infiniband_verbs")):
        warnings.append("no %s/infiniband/uverbs* for %s: user space cannot open it (is ib_uverbs loaded?)"
                        % (dev_root, ",".join(no_verbs)))

    env, prepend = build_env(kind, interface, active, gid_index, gdr, plugin_dir, libfabric_dir)
    if error is not None:  # detection could not see: the controller's static defaults, and the interface
        env = dict(fallback_env or {})
        env["NCCL_SOCKET_IFNAME"] = interface or env.get("NCCL_SOCKET_IFNAME") or DEFAULT_IFNAME
        prepend = {}
    result = {"version": VERSION, "kind": kind, "head": head or None, "interface": interface,
              "interface_from": how, "devices": devices, "active_ports": active, "gid_index": gid_index,
              "instance_type": itype, "gpudirect_rdma": gdr, "fi_info": fi, "plugin_dir": plugin_dir,
              "libfabric_dir": libfabric_dir, "env": env, "path_prepend": prepend, "warnings": warnings}
    if error is not None:
        result["error"] = error
    return result


def env_text(result):
    """~/.gpuctl/fabric.env: `export NAME='value'` lines (sourced with `set -a`), PATH-like
    variables prepended to what the job's shell already has."""
    lines = ["# Managed by gpuctl (gpuctl-fabric-probe): this node's fabric is %s." % result["kind"],
             "# Sourced before each job's environment, so the task's envs override these."]
    for name, value in sorted(result["env"].items()):
        lines.append("export %s=%s" % (name, shlex.quote(str(value))))
    for name, dirs in sorted(result.get("path_prepend", {}).items()):
        lines.append('export %s=%s"${%s:+:$%s}"' % (name, shlex.quote(":".join(dirs)), name, name))
    return "\n".join(lines) + "\n"


def _write(path, text, mode=0o644):
    """Atomically; whether the content changed."""
    try:
        with open(path) as fh:
            if fh.read() == text:
                return False
    except (OSError, IOError):
        pass
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fabric-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def write(result, directory):
    """fabric.env and fabric.json in `directory` (~ expanded); whether fabric.env changed."""
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700)
    changed = _write(os.path.join(directory, "fabric.env"), env_text(result))
    _write(os.path.join(directory, "fabric.json"), json.dumps(result, sort_keys=True, indent=1) + "\n")
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser(prog="gpuctl-fabric-probe", description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="", help="the head's address (default: the default route)")
    ap.add_argument("--instance-type", default="", help="the node's instance type (default: DMI product name)")
    ap.add_argument("--fallback-env", default="{}",
                    help="JSON {NAME: value}: the env to write when the devices cannot be read")
    ap.add_argument("--write", metavar="DIR", help="write DIR/fabric.env and DIR/fabric.json")
    ap.add_argument("--sys", default="/sys")
    ap.add_argument("--dev", default="/dev")
    ap.add_argument("--proc", default="/proc")
    ap.add_argument("--root", default="/", help="where /opt is looked for (tests)")
    args = ap.parse_args(argv)
    try:
        fallback = json.loads(args.fallback_env or "{}")
        if not isinstance(fallback, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        ap.error("--fallback-env: %s" % exc)
    result = probe(head=args.head or None, instance=args.instance_type or None,
                   fallback_env={str(k): str(v) for k, v in fallback.items()}, sys_root=args.sys,
                   dev_root=args.dev, proc_root=args.proc, root=args.root)
    changed = False
    if args.write:
        try:
            changed = write(result, args.write)
        except (OSError, IOError) as exc:
            sys.stderr.write("gpuctl-fabric-probe: writing %s: %s\n" % (args.write, exc))
            return 1
    result["changed"] = changed
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
