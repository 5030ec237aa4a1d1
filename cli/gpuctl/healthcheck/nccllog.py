"""Which network NCCL used, read from its NCCL_DEBUG=INFO lines (pure).

NCCL prefixes every line with `HOST:PID:TID [DEV] NCCL INFO ...`; launchers
may put their own prefix before it (`[1,3]<stdout>:` from mpirun
--tag-output, `10.0.0.5: ` from pdsh), so lines are searched, not matched.
One process is one (host, pid); what it says, with NCCL_DEBUG_SUBSYS=INIT,NET:

    Using network Socket | IB | AWS Libfabric | Libfabric      the net plugin (src/init.cc)
    NET/OFI Selected Provider is efa (found 4 nics)            aws-ofi-nccl's libfabric provider
    NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ...   the HCAs and their link layer
    NET/Socket : Using [0]eth0:10.0.0.1<0>                     the sockets transport's interfaces
    Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0        a connection to another node
    Channel 00/0 : 0[0] -> 1[1] via P2P/IPC                    inside a node (also SHM, P2P/CUMEM)
    Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0            NCCL 2.4's form of the same
    ncclCommInitRank comm 0x.. rank 3 nranks 16 cudaDev 3 ...  the process's rank

The connections (`via NET/NAME/...`) say what was used; `Using network`
is what would be used (all a single node shows). aws-ofi-nccl names itself
"AWS Libfabric" (up to 1.7) or "Libfabric"; gpuctl calls both NET/OFI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

_LINE = re.compile(r"(?P<host>[^\s:]*)\s*:(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+NCCL (?P<level>INFO|WARN) "
                   r"(?P<msg>.*)$")
_USING_NETWORK = re.compile(r"^Using network (?P<name>.+?)\s*$")
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (?P<prov>[^\s,(]+)")
_IB_USING = re.compile(r"^NET/IB ?: Using (?P<devs>.*?)(?:;\s*OOB.*)?$")
_IB_DEV = re.compile(r"\[\d+\](?P<dev>[^\s\[;]+)")
_VIA_NET = re.compile(r"via NET/(?P<name>[^/]+)/(?P<dev>\d+)(?P<rest>\S*)")
_VIA_OTHER = re.compile(r"via (?P<what>(?:P2P|SHM|NVLS|CollNet|COLLNET)[^\s]*)")
_CHANNEL = re.compile(r"^(?:Channel|Ring) \d+(?:/\d+)? : (?P<src>\d+)(?:\[[0-9a-fx]+\])? -> (?P<dst>\d+)"
                      r"(?:\[[0-9a-fx]+\])?(?: \[(?P<dir>send|receive)\])?")
_INIT_RANK = re.compile(r"ncclCommInitRank.* rank (?P<rank>\d+) nranks (?P<nranks>\d+)")
_VERSION = re.compile(r"NCCL version (?P<v>\S+)")

OFI_NAMES = ("AWS Libfabric", "Libfabric", "OFI")


def net_label(name: str) -> str:
    """A net plugin's name as gpuctl shows it: NET/OFI, NET/IB, NET/Socket, NET/<other>."""
    return "NET/OFI" if name in OFI_NAMES else f"NET/{name}"


@dataclass
class ProcessNet:
    """What one NCCL process (host, pid) said about its network."""

    host: str
    pid: int
    rank: int | None = None
    nranks: int | None = None
    device: int | None = None
    network: str | None = None  # `Using network NAME`
    provider: str | None = None  # aws-ofi-nccl's libfabric provider
    ib_devices: list[str] = field(default_factory=list)  # mlx5_0:1/IB, mlx5_10:1/RoCE
    used_nets: list[str] = field(default_factory=list)  # NAME of every `via NET/NAME/..` connection, first seen first
    gdr: bool = False  # a connection was GPUDirect RDMA
    intra: list[str] = field(default_factory=list)  # P2P/IPC, SHM, ... (inside a node)
    version: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def net(self) -> str | None:
        """The network that carried traffic to other nodes (else the one NCCL picked)."""
        return self.used_nets[0] if self.used_nets else self.network

    @property
    def inter_node(self) -> bool:
        return bool(self.used_nets)

    @property
    def kind(self) -> str | None:
        """efa, ib, roce, socket, ofi (provider unknown), ofi-<provider>, or the plugin's name."""
        return kind_of(self.net, self.provider, self.ib_devices)

    @property
    def transport(self) -> str:
        """What a person reads: `NET/OFI (efa)`, `NET/IB (mlx5_0:1/IB)`, `NET/Socket`."""
        if self.net is None:
            return "unknown"
        label = net_label(self.net)
        if self.net in OFI_NAMES and self.provider:
            label += f" ({self.provider})"
        elif self.net == "IB" and self.ib_devices:
            label += f" ({', '.join(self.ib_devices)})"
        if self.gdr:
            label += " GDRDMA"
        return label

    def doc(self) -> dict:
        return {"host": self.host, "pid": self.pid, "nccl_rank": self.rank, "device": self.device,
                "network": self.network, "transport": self.transport, "kind": self.kind,
                "provider": self.provider, "ib_devices": list(self.ib_devices), "inter_node": self.inter_node,
                "intra_node": list(self.intra), "gdr": self.gdr}


def kind_of(net: str | None, provider: str | None, ib_devices: Iterable[str] = ()) -> str | None:
    if net is None:
        return None
    if net in OFI_NAMES:
        if provider is None:
            return "ofi"
        return "efa" if provider.split(";")[0].lower() in ("efa", "efa-direct") else f"ofi-{provider}"
    if net == "IB":
        layers = {d.rsplit("/", 1)[-1].lower() for d in ib_devices if "/" in d}
        return "roce" if layers == {"roce"} else "ib"
    if net == "Socket":
        return "socket"
    return net.lower()


def _intra(what: str) -> str:
    """P2P/IPC/read -> P2P/IPC; SHM/direct/direct -> SHM."""
    parts = what.split("/")
    return parts[0] if parts[0] in ("SHM", "NVLS") else "/".join(parts[:2])


def parse(lines: Iterable[str]) -> list[ProcessNet]:
    """Every NCCL process in `lines`, by NCCL rank where known, else by host and pid."""
    procs: dict[tuple[str, int], ProcessNet] = {}
    plain_version = None
    for raw in lines:
        m = _LINE.search(raw)
        if m is None:
            v = _VERSION.search(raw)
            if v and raw.lstrip().startswith("NCCL version"):
                plain_version = v.group("v")
            continue
        key = (m.group("host"), int(m.group("pid")))
        proc = procs.get(key)
        if proc is None:
            proc = procs[key] = ProcessNet(host=key[0], pid=key[1], device=int(m.group("dev")))
        msg = m.group("msg").strip()
        if m.group("level") == "WARN":
            proc.warnings.append(msg)
            continue
        if (u := _USING_NETWORK.match(msg)) is not None:
            proc.network = u.group("name")
        elif (p := _PROVIDER.search(msg)) is not None:
            proc.provider = p.group("prov")
        elif (ib := _IB_USING.match(msg)) is not None:
            proc.ib_devices = _IB_DEV.findall(ib.group("devs"))
        elif (r := _INIT_RANK.search(msg)) is not None:
            proc.rank, proc.nranks = int(r.group("rank")), int(r.group("nranks"))
        elif (v := _VERSION.search(msg)) is not None:
            proc.version = v.group("v")
        if "via " in msg:
            ch = _CHANNEL.match(msg)
            if ch is not None and proc.rank is None:  # send lines start with the process's own rank
                proc.rank = int(ch.group("dst" if ch.group("dir") == "receive" else "src"))
            if (net := _VIA_NET.search(msg)) is not None:
                if net.group("name") not in proc.used_nets:
                    proc.used_nets.append(net.group("name"))
                proc.gdr = proc.gdr or "GDRDMA" in net.group("rest")
            elif (other := _VIA_OTHER.search(msg)) is not None:
                what = _intra(other.group("what"))
                if what not in proc.intra:
                    proc.intra.append(what)
    for proc in procs.values():
        proc.version = proc.version or plain_version
    return sorted(procs.values(), key=lambda p: (p.rank is None, p.rank or 0, p.host, p.pid))
