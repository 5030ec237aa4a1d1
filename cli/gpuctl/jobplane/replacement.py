"""Making some of a cluster's nodes again: the one operation behind `gpuctl replace` and a managed
job's recovery from lost nodes.

`replace_nodes`: Terraform makes the nodes of those ranks again, and only them
(provision/lifecycle.py: lock, registry, ssh config, host keys); their prepare records are
forgotten, so they are prepared again even where a new node keeps the old one's id or address;
the one entry to prepare (preparer.py) prepares them now, and only them; and the head's idle
watcher is given the cluster again (it powers the nodes off by address and key: the new ones now).
What each caller does around it stays its own: `gpuctl replace` asks first and checks health
after; the supervisor fences the other nodes first and retries when there is no capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from gpuctl.common.paths import cluster_dir
from gpuctl.configplane import prepare
from gpuctl.jobplane import autostop
from gpuctl.jobplane.preparer import Preparer
from gpuctl.provision import lifecycle
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import Registry

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.spec.autostop import Autostop


@dataclass(frozen=True)
class Replaced:
    """What a replacement did: the cluster afterwards, and the nodes made again as they were."""

    inv: Inventory
    old: tuple[Node, ...]

    @property
    def new(self) -> tuple[Node, ...]:
        """The nodes made again, as they are now (same ranks and names, new ids and addresses)."""
        ranks = {n.rank for n in self.old}
        return tuple(n for n in self.inv.nodes if n.rank in ranks)


def replace_nodes(inv: Inventory, ranks: Sequence[int], *, reporter: Reporter, registry: Registry,
                  setting: Autostop | None = None, lease_s: float = 0.0,
                  check: Callable[[], None] | None = None) -> Replaced:
    """Make the nodes of `ranks` of the cluster `inv` again, forget their prepare records, prepare
    them, and arm the head's idle watcher again: with `setting` (a managed job's), else the one
    saved for the cluster, if any, holding a lease of `lease_s`. `check()` runs once they are
    made, before they are prepared, and may raise to stop there (a cancel the caller sees)."""
    name = inv.cluster
    old = tuple(n for n in inv.nodes if n.rank in set(ranks))
    made = Replaced(lifecycle.replace_nodes(name, ranks, reporter=reporter, registry=registry), old)
    if not old:
        return made
    # The old records go, and so does any record under a new node's key: a node made again at the
    # same address, or with the same id, is a new machine all the same.
    prepare.forget(cluster_dir(name), [*old, *made.new])
    if check is not None:
        check()
    Preparer(made.inv, reporter=reporter, registry=registry).ensure_prepared()  # the others keep their records
    setting = setting if setting is not None else autostop.saved(name)
    if setting is not None:
        record = registry.cluster(name)
        autostop.arm(made.inv, setting, request=record.request if record else {}, lease_s=lease_s)
    return made
