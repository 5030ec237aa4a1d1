"""The one replacement (jobplane/replacement.py) that `gpuctl replace` and a managed job's
supervisor share: the replaced nodes' prepare records go and they are prepared again, also where a
node made again keeps the old one's key; the head's watcher is armed again; the supervisor's
recovery goes through it.

Terraform is lifecycle.replace_nodes' (tests/unit/test_replace_nodes.py); here it is a stand-in
that makes rank 1 again with the same id, as a node gpuctl keys by where it is reached would be."""

from __future__ import annotations

import io
import os
from dataclasses import replace
from typing import Any

import pytest

from gpuctl.common.console import Reporter
from gpuctl.common.paths import cluster_dir
from gpuctl.configplane import prepare
from gpuctl.jobplane import autostop, replacement
from gpuctl.jobplane import preparer as preparer_module
from gpuctl.jobplane.preparer import Preparer
from gpuctl.provision.inventory import Inventory
from gpuctl.spec.autostop import Autostop
from gpuctl.state.registry import Registry

from test_preparer import Play, local_inventory


class Stand:
    """What the replacement touches outside this process, stood in for: Terraform (rank 1 made
    again with the same id, a new address), the prepare play, and the head's watcher."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, inv: Inventory) -> None:
        self.play = Play()
        self.armed: list[tuple[Inventory, Autostop, float]] = []
        self.replaced: list[list[int]] = []
        monkeypatch.setattr(preparer_module.prepare, "run_prepare", self.play)
        monkeypatch.setattr(replacement.lifecycle, "replace_nodes", self.replace_nodes)
        monkeypatch.setattr(autostop, "arm", self.arm)
        self.before = inv

    def replace_nodes(self, name: str, ranks: list[int], **kw: Any) -> Inventory:
        self.replaced.append(list(ranks))
        return replace(self.before, nodes=tuple(replace(n, address="10.213.0.99") if n.rank in ranks else n
                                                for n in self.before.nodes))

    def arm(self, inv: Inventory, setting: Autostop, *, request: Any, lease_s: float = 0.0) -> Any:
        self.armed.append((inv, setting, lease_s))
        return autostop.Armed(setting=setting, notes=[], head={})


def prepared_cluster(inv: Inventory) -> str:
    """Every node of `inv` recorded as prepared with the fingerprint the cluster needs; that value."""
    cluster_dir(inv.cluster).mkdir(parents=True, exist_ok=True)
    preparer = Preparer(inv, reporter=Reporter(stream=io.StringIO(), plain=True), registry=Registry(remote=None))
    value = preparer.fingerprint()
    prepare.record(preparer.cdir, inv, inv.nodes, value)
    return value


def test_the_replaced_nodes_are_forgotten_and_prepared_again_and_the_watcher_rearmed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inv = local_inventory()
    stand = Stand(monkeypatch, inv)
    value = prepared_cluster(inv)
    autostop.save(inv.cluster, Autostop(idle_minutes=5, down=False))
    out = io.StringIO()
    made = replacement.replace_nodes(inv, [1], reporter=Reporter(stream=out, plain=True),
                                     registry=Registry(remote=None))
    assert stand.replaced == [[1]] and [n.name for n in made.old] == ["worker1"]
    assert [(n.name, n.address) for n in made.new] == [("worker1", "10.213.0.99")]
    assert stand.play.asked == [["worker1"]]  # only it, though its key did not change
    assert "Preparing 1 of 3 node(s)" in out.getvalue()
    assert prepare.recorded(cluster_dir(inv.cluster)) == {n.node_id: value for n in inv.nodes}
    assert [(i.nodes[1].address, s.idle_minutes, lease) for i, s, lease in stand.armed] == [("10.213.0.99", 5, 0.0)]


def test_a_cancel_seen_once_the_nodes_are_made_stops_before_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = local_inventory()
    stand = Stand(monkeypatch, inv)
    prepared_cluster(inv)

    def cancelled() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replacement.replace_nodes(inv, [2], reporter=Reporter(stream=io.StringIO(), plain=True),
                                  registry=Registry(remote=None), check=cancelled)
    assert stand.replaced == [[2]] and stand.play.asked == [] and stand.armed == []
    assert "n-2" not in prepare.recorded(cluster_dir(inv.cluster))  # forgotten: the next job prepares it


def test_a_supervisors_recovery_forgets_and_prepares_the_replaced_nodes(tmp_path: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor once replaced nodes without forgetting their records: a node made again
    under the same key was left unprepared until a job found it so."""
    from gpuctl.jobplane.joblogs import process_start
    from gpuctl.managed import fencing, launch, supervisor
    from gpuctl.managed.policy import Decision
    from gpuctl.managed.store import Store

    task = tmp_path / "t.yaml"
    task.write_text("resources:\n  infra: local\nrun: 'true'\n")
    store = Store()
    job = launch.create(name="t", file=task, text=task.read_text(), envs={}, secrets={}, infra=None,
                        num_nodes=None, store=store)
    assert store.claim(job.id, os.getpid(), process_start(os.getpid()) or "", previous=(None, None))
    inv = local_inventory(job.cluster)
    stand = Stand(monkeypatch, inv)
    value = prepared_cluster(inv)
    fenced: list[Any] = []
    monkeypatch.setattr(fencing, "fence", lambda inv, task_id, epoch, ranks=None: fenced.append(ranks) or {})
    leases: list[Inventory] = []

    class Lease:
        def __init__(self, inv: Inventory, lease_s: float) -> None:
            leases.append(inv)

        def __enter__(self) -> Lease:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(autostop, "Lease", Lease)
    sup = supervisor.Supervisor(job.id, out=io.StringIO())
    after = sup.recover(inv, None, Decision("recover", kind="recovery", cause="lost", replace=(1,)), 1)
    assert fenced == [[0, 2]] and stand.replaced == [[1]]
    assert stand.play.asked == [["worker1"]]  # the old supervisor path asked for nothing here
    assert prepare.recorded(cluster_dir(inv.cluster)) == {n.node_id: value for n in inv.nodes}
    assert [s for _, s, _ in stand.armed] == [supervisor.MANAGED_AUTOSTOP]
    assert after.nodes[1].address == "10.213.0.99" and leases == [after]
