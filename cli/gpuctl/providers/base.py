"""What a provider is: the `Provider` protocol and `BaseProvider`, its defaults.

Every question the layers above ask about a cloud is a hook here, so none of
them compares a cloud's name: a new provider subclasses BaseProvider and
overrides what differs (docs/architecture.md, "Adding a provider"). Callers
get the object from the registry (`gpuctl.providers.get_provider`) and call
hooks directly; every hook has a default, so nothing is probed with getattr.

Facts (class attributes):

- `provisions`: whether gpuctl creates the nodes (Terraform); False for
  `infra: ssh`, whose hosts exist already (provision/provisioner.py adopts
  the hand-written inventory instead).
- `local`: the nodes are processes on the controller's machine: they share
  its filesystem, its Python and its container store, and their sshd
  configuration is gpuctl's own.
- `containers_outlive_cluster`: the nodes outlive the cluster (local nodes
  share this machine's container store, ssh hosts stay), so `down` removes the
  job containers from them; cloud instances are destroyed, containers and all.
- `checks_console_host_keys`: the nodes print their SSH host keys to a
  console gpuctl can read, so the keys learned at first contact are checked
  against them (`console_host_keys`).
- `authorizes_internal_key_at_boot`: the module authorizes the cluster's
  internal key on every node as it boots (root_config's `internal_public_key`),
  so once the head is prepared it installs the workers whose host keys are
  known before contact (`boot_host_keys`) itself: one call from the controller.
- `node_resource`: the module's resource with one instance per node (its
  `count` index is the node's rank), e.g. `aws_instance.node`; what
  `node_addresses` names for `terraform apply -replace`. Empty: gpuctl cannot
  make a single node again (it did not make them).
- `power_resource`: the module's resource that holds the nodes' power state
  (`aws_ec2_instance_state.node`), empty where there is none. An apply that
  updates it started (or stopped) nodes, and the outputs that apply printed
  were read before: a node's public address is new once it started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from gpuctl.common.errors import UserError
from gpuctl.common.paths import terraform_dir
from gpuctl.spec.request import ClusterRequest

if TYPE_CHECKING:
    from gpuctl.spec import Resources, Task

# The root module's name for the provider's module: outputs read module.cluster.*, and a node's
# resource address starts module.cluster.
MODULE_NAME = "cluster"
# For tests: the metadata service nodes poll for spot notices (each node asks it in its own namespace).
SPOT_NOTICE_URL_ENV = "GPUCTL_TEST_SPOT_NOTICE_URL"


class NodeRef(Protocol):
    """What the nodes hooks read of an inventory's node (provision.inventory.Node, a layer above)."""

    @property
    def rank(self) -> int: ...

    @property
    def node_id(self) -> str: ...

    @property
    def ssh_port(self) -> int: ...


class ClusterRef(Protocol):
    """What the nodes hooks read of a cluster's inventory (provision.inventory.Inventory)."""

    @property
    def nodes(self) -> Sequence[NodeRef]: ...

    @property
    def region(self) -> str | None: ...


@dataclass(frozen=True)
class PowerOff:
    """How the cluster's head takes the cluster down by itself (autostop/autodown): a command run on
    each worker over the cluster's ssh, all at once, then the head's own commands, in order.
    `removes`: the nodes are gone afterwards (terminated, removed), not stopped."""

    workers: dict[int, list[str]] = field(default_factory=dict)  # rank -> argv
    head: list[list[str]] = field(default_factory=list)
    removes: bool = True
    notes: list[str] = field(default_factory=list)  # what the user should know (a warning each)


@dataclass(frozen=True)
class Price:
    """What one node costs per hour (USD), as far as gpuctl knows: an estimate, not a bill.
    `source` says where the numbers come from, or why there are none; `free`: no cloud bill."""

    on_demand: float | None = None
    spot: float | None = None
    source: str = ""
    free: bool = False

    def per_node_hour(self, spot: bool) -> float | None:
        return self.spot if spot else self.on_demand


@runtime_checkable
class Provider(Protocol):
    name: str
    module_name: str
    provisions: bool
    local: bool
    containers_outlive_cluster: bool
    checks_console_host_keys: bool
    authorizes_internal_key_at_boot: bool
    node_resource: str
    power_resource: str

    # -- provisioning (provision/provisioner.py) -------------------------------------------------

    def module_dir(self) -> Path:
        """The packaged Terraform module this provider calls."""
        ...

    def check(self, req: ClusterRequest) -> None:
        """Refuse (UserError) what needs no cloud call to know: node count, name length, type..."""
        ...

    def prepare(self, req: ClusterRequest) -> ClusterRequest:
        """Preflight before rendering (quota, zone choice...); may return an adjusted request."""
        ...

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str,
                    internal_public_key: str = "") -> dict[str, Any]:
        """The cluster's root module as Terraform JSON; `internal_public_key` is authorized at boot
        where `authorizes_internal_key_at_boot`."""
        ...

    def terraform_env(self) -> dict[str, str]:
        """What every terraform command on this provider's roots gets in its environment over
        gpuctl's own (an emulator's endpoints); {} for none."""
        ...

    def describe(self, req: ClusterRequest, outputs: Mapping[str, Any] | None = None) -> list[str]:
        """Lines shown before apply and with the plan (fabric, placement, reach)."""
        ...

    def retry_zone(self, req: ClusterRequest, error: BaseException) -> tuple[ClusterRequest | None, str | None]:
        """After a failed apply: the request to try next (or None) and a line to show (or None)."""
        ...

    def cleanup(self, cluster_dir: Path) -> None:
        """After `terraform destroy` succeeded: remove what Terraform could not know of."""
        ...

    def node_addresses(self, ranks: Sequence[int]) -> list[str]:
        """The root's resource addresses that make each rank's node, for `terraform apply -replace`
        (what depends on them is redone by Terraform's own graph); UserError where nodes cannot be."""
        ...

    # -- the task and the request (cli.py, api/cluster.py, provision/taskchecks.py) ---------------

    def resources_problem(self, resources: "Resources") -> tuple[str, str] | None:
        """(field, why) when these resources cannot be provisioned, known offline; spec.load_task
        refuses them with FILE:LINE and skips such any_of/ordered alternatives."""
        ...

    def pick_accelerator(self, req: ClusterRequest, accelerators: Mapping[str, float]) -> tuple[str, float]:
        """Of the task's accelerator choices (`{A100: 8, H100: 8}`), the one to provision."""
        ...

    def instance_type(self, req: ClusterRequest) -> str | None:
        """The instance type the request resolves to, offline (None: the provider has none)."""
        ...

    def task_warnings(self, task: "Task", req: ClusterRequest) -> list[str]:
        """`FILE:LINE: FIELD: ...` for what the task asks that this provider ignores."""
        ...

    def check_reach(self) -> None:
        """Refuse (UserError), before anything is created, nodes the controller could not reach
        over SSH to run a job (apply runs it unless --provision-only or nothing is to run)."""
        ...

    # -- the nodes (configplane/, jobplane/, healthcheck/) ---------------------------------------

    def node_python(self) -> str | None:
        """The nodes' python3 when the provider knows it (Ansible then skips its interpreter
        discovery: one module run less per node and play); None: Ansible finds it."""
        ...

    def expected_fabric(self, request: Mapping[str, Any] | None) -> str | None:
        """The fabric gpuctl attached to the nodes for this (recorded) request, e.g. "efa"; None: none."""
        ...

    def fabric_env(self, request: Mapping[str, Any] | None) -> dict[str, str]:
        """Static NCCL/libfabric env for the attached fabric, for nodes whose devices cannot be read."""
        ...

    def expected_efa(self, request: Mapping[str, Any] | None) -> int | None:
        """How many EFA devices each node was given for this (recorded) request; None: none or unknown."""
        ...

    def expected_gpus(self, gpus_per_node: int) -> int:
        """The GPUs each node really has when the task asked for `gpus_per_node` (what the health check
        counts, and whether apply's health gate is on)."""
        ...

    def bucket_region(self, region: str | None) -> str | None:
        """The region bucket mounts use when the task's envs name none (None: the store's default)."""
        ...

    def console_host_keys(self, node_id: str, region: str | None, known_hosts: Path,
                          alias: str) -> tuple[set[str], list[str]]:
        """(the SSH host-key fingerprints the node printed to its console, empty when none yet;
        those learned for `alias` in `known_hosts` that are not among them)."""
        ...

    def boot_host_keys(self, cluster_dir: Path, node_count: int) -> dict[int, str]:
        """{rank: "TYPE BASE64"}: the host keys of the nodes, known without contacting them (read
        where they were made); the controller pins them before first contact. {}: learned then."""
        ...

    # -- a cluster's own lifecycle (jobplane/autostop.py, provision/lifecycle.py) ------------------

    def power_off(self, cluster_dir: Path, ranks: list[int], ssh_user: str, request: Mapping[str, Any],
                  *, down: bool) -> PowerOff:
        """How the head stops (or, `down`, removes) every node once the cluster is idle; UserError
        when this provider's nodes cannot do that themselves."""
        ...

    def price(self, request: Mapping[str, Any]) -> Price:
        """The price of one node of this (recorded) request, or a Price that says why there is none."""
        ...

    def stop_problem(self, request: Mapping[str, Any]) -> str | None:
        """Why this (recorded) cluster's nodes cannot be stopped and kept (`gpuctl stop`), saying what to do
        instead; None: they can, by applying the root with power_inputs(running=False)."""
        ...

    def power_inputs(self, running: bool) -> dict[str, Any]:
        """The module inputs that keep every node running, or stopped with its disks (`gpuctl stop` /
        `gpuctl start`), set on the cluster's root as last written."""
        ...

    def node_states(self, node_ids: list[str], region: str | None) -> dict[str, tuple[str, float | None]]:
        """{node id: (running | stopped | terminated | ..., when it got there or None)} as the cloud says,
        for a cluster that may have stopped or removed itself; {} when it cannot be asked."""
        ...

    def autostop_problem(self, request: Mapping[str, Any], *, down: bool) -> str | None:
        """Why this cluster cannot stop (or, `down`, remove) itself, asked before anything is made; None: it can."""
        ...

    def outcomes_left(self, cluster_dir: Path) -> dict[str, dict[str, Any]]:
        """What a cluster that removed itself left of its jobs' ends (the head's job.json, by the
        head's job name), where its head could leave word on this machine; else nothing (the
        jobs nobody saw end are then LOST)."""
        ...

    def removed_itself(self, cluster_dir: Path, *, finished: bool = True) -> float | None:
        """When the cluster took itself down (autodown), as the nodes left word; None: it did not.
        `finished` False: when it began, also where it never finished (what is left must go)."""
        ...

    def lost_nodes(self, cluster_dir: Path, inv: ClusterRef, request: Mapping[str, Any] | None) -> dict[int, str]:
        """{rank: why} for every node the platform itself says is gone (no ssh). {} when it cannot
        be asked (an API error, a timeout) or knows nothing: the caller then relies on its probes."""
        ...

    def spot_notice(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """Where a managed job's nodes poll for interruption notices ({url, interval_s}), or None."""
        ...


class BaseProvider:
    """Every hook's default: a provider that attaches no fabric, has no instance types, no
    console and no zones, and whose nodes are destroyed with the cluster."""

    name = ""
    module_name = ""  # directory under terraform/modules/
    provisions = True
    local = False
    containers_outlive_cluster = False
    checks_console_host_keys = False
    authorizes_internal_key_at_boot = False
    node_resource = ""
    power_resource = ""

    def module_dir(self) -> Path:
        path = terraform_dir() / "modules" / self.module_name
        if not (path / "main.tf").is_file():
            raise FileNotFoundError(f"gpuctl installation is missing terraform/modules/{self.module_name}")
        return path

    def check(self, req: ClusterRequest) -> None:
        """`gpuctl validate` and `apply` run it before anything is written; prepare runs it again
        for the callers (the Python API, --dry-run) that come straight to provision."""
        return None

    def prepare(self, req: ClusterRequest) -> ClusterRequest:
        self.check(req)
        return req

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str,
                    internal_public_key: str = "") -> dict[str, Any]:
        raise NotImplementedError(f"provider '{self.name}' renders no Terraform root")

    def terraform_env(self) -> dict[str, str]:
        return {}

    def describe(self, req: ClusterRequest, outputs: Mapping[str, Any] | None = None) -> list[str]:
        return []

    def retry_zone(self, req: ClusterRequest, error: BaseException) -> tuple[ClusterRequest | None, str | None]:
        return None, None

    def cleanup(self, cluster_dir: Path) -> None:
        return None

    def node_addresses(self, ranks: Sequence[int]) -> list[str]:
        """`module.cluster.<node_resource>[rank]` per rank: the node is one counted resource."""
        if not self.node_resource:
            raise UserError(f"infra {self.name}: gpuctl did not make these nodes, so it cannot make one again; "
                            "replace the machine yourself and update the inventory")
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise ValueError(f"node ranks are integers from 0: {bad[0]!r}")
        return [f"module.{MODULE_NAME}.{self.node_resource}[{r}]" for r in ranks]

    def resources_problem(self, resources: "Resources") -> tuple[str, str] | None:
        return None

    def pick_accelerator(self, req: ClusterRequest, accelerators: Mapping[str, float]) -> tuple[str, float]:
        return next(iter(accelerators.items()))

    def instance_type(self, req: ClusterRequest) -> str | None:
        return None

    def task_warnings(self, task: "Task", req: ClusterRequest) -> list[str]:
        return []

    def check_reach(self) -> None:
        return None

    def node_python(self) -> str | None:
        return None

    def expected_fabric(self, request: Mapping[str, Any] | None) -> str | None:
        return None

    def fabric_env(self, request: Mapping[str, Any] | None) -> dict[str, str]:
        return {}

    def expected_efa(self, request: Mapping[str, Any] | None) -> int | None:
        return None

    def expected_gpus(self, gpus_per_node: int) -> int:
        return gpus_per_node

    def bucket_region(self, region: str | None) -> str | None:
        return None

    def console_host_keys(self, node_id: str, region: str | None, known_hosts: Path,
                          alias: str) -> tuple[set[str], list[str]]:
        return set(), []

    def boot_host_keys(self, cluster_dir: Path, node_count: int) -> dict[int, str]:
        return {}

    def price(self, request: Mapping[str, Any]) -> Price:
        return Price(source=f"gpuctl knows no prices for {self.name} nodes")

    def node_states(self, node_ids: list[str], region: str | None) -> dict[str, tuple[str, float | None]]:
        return {}

    def autostop_problem(self, request: Mapping[str, Any], *, down: bool) -> str | None:
        return f"autostop needs nodes gpuctl made (infra aws or local); {self.name} nodes are yours to stop"

    def power_off(self, cluster_dir: Path, ranks: list[int], ssh_user: str, request: Mapping[str, Any],
                  *, down: bool) -> PowerOff:
        raise UserError(self.autostop_problem(request, down=down) or f"{self.name}: no power-off plan")

    def stop_problem(self, request: Mapping[str, Any]) -> str | None:
        name = request.get("name") or "NAME"
        return f"gpuctl cannot stop {self.name} nodes and keep them; `gpuctl down {name}` removes the cluster"

    def power_inputs(self, running: bool) -> dict[str, Any]:
        return {}

    def removed_itself(self, cluster_dir: Path, *, finished: bool = True) -> float | None:
        return None

    def outcomes_left(self, cluster_dir: Path) -> dict[str, dict[str, Any]]:
        return {}

    def lost_nodes(self, cluster_dir: Path, inv: ClusterRef, request: Mapping[str, Any] | None) -> dict[int, str]:
        return {}  # nothing to ask but the nodes themselves

    def spot_notice(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """None: no interruption notices, except a test's own metadata service (any provider)."""
        url = os.environ.get(SPOT_NOTICE_URL_ENV)
        return {"url": url, "interval_s": 1.0} if url else None
