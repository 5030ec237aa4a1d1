"""The one entry to prepare (jobplane/preparer.py), used with no job runner: which nodes it
prepares, what it records, and that a prepared cluster costs nothing.

The prepare play itself is configplane's (tests/unit/test_fabric.py, test_playbooks_unit.py);
here it is a stand-in that says which hosts it was asked for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gpuctl.common.console import Reporter
from gpuctl.common.errors import PrepareFailed
from gpuctl.common.paths import cluster_dir
from gpuctl.configplane import playbooks, prepare
from gpuctl.jobplane import preparer as preparer_module
from gpuctl.jobplane.preparer import Preparer
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import Registry


def local_inventory(name: str = "c", ids: tuple[str, ...] = ("n-0", "n-1", "n-2")) -> Inventory:
    nodes = tuple(Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=i, address=f"10.213.0.{r + 2}",
                       ssh_host=f"10.213.0.{r + 2}", ssh_user="gpuctl") for r, i in enumerate(ids))
    return Inventory(cluster=name, cloud="local", nodes=nodes)


class Play:
    """prepare.run_prepare as seen from the preparer: every host asked for is installed, except
    those in `failing`."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.asked: list[list[str]] = []
        self.failing = failing

    def __call__(self, inventory_path: Path, **kw: Any) -> playbooks.PlaybookResult:
        names = list(kw["limit"])
        self.asked.append(names)
        for host in names:
            if host not in self.failing:
                kw["on_installed"](host, {"kind": "socket", "interface": "lo"})
        failures = [playbooks.HostFailure(h, None, 1, "install step failed") for h in names if h in self.failing]
        return playbooks.PlaybookResult(ok=not failures, failures=failures)


@pytest.fixture
def play(monkeypatch: pytest.MonkeyPatch) -> Play:
    fake = Play()
    monkeypatch.setattr(preparer_module.prepare, "run_prepare", fake)
    return fake


def test_a_preparer_alone_prepares_only_the_nodes_not_recorded(play: Play) -> None:
    inv = local_inventory()
    cluster_dir(inv.cluster).mkdir(parents=True)
    out = io.StringIO()
    preparer = Preparer(inv, reporter=Reporter(stream=out, plain=True), registry=Registry(remote=None))
    value = preparer.fingerprint()
    prepare.record(preparer.cdir, inv, [inv.nodes[0], inv.nodes[2]], value)
    preparer.ensure_prepared()  # the fingerprint the cluster needs now: the same value
    assert play.asked == [["worker1"]]
    assert "Preparing 1 of 3 node(s) (worker1 not prepared yet)" in out.getvalue()
    assert prepare.recorded(preparer.cdir) == {n.node_id: value for n in inv.nodes}
    preparer.ensure_prepared()
    assert play.asked == [["worker1"]]  # every node recorded: no play


def test_a_node_that_failed_is_not_recorded_and_the_others_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preparer_module.prepare, "run_prepare", Play(failing=("worker2",)))
    inv = local_inventory()
    cluster_dir(inv.cluster).mkdir(parents=True)
    preparer = Preparer(inv, reporter=Reporter(stream=io.StringIO(), plain=True), registry=Registry(remote=None))
    with pytest.raises(PrepareFailed, match="worker2: install step failed"):
        preparer.ensure_prepared()
    assert set(prepare.recorded(preparer.cdir)) == {"n-0", "n-1"}


# -- the job a failure names (JobFailed.job_id) ---------------------------------------------------


def test_a_job_whose_nodes_could_not_be_prepared_fails_naming_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.healthcheck import collect
    from gpuctl.jobplane.runner import JobRunner, JobSpec

    monkeypatch.setattr(preparer_module.prepare, "run_prepare", Play(failing=("worker1",)))
    inv = local_inventory()
    cluster_dir(inv.cluster).mkdir(parents=True)
    registry = Registry(remote=None)
    runner = JobRunner(inv, reporter=Reporter(stream=io.StringIO(), plain=True), registry=registry)
    with pytest.raises(PrepareFailed) as failed:
        runner.run(JobSpec(name="one", run="true"), run_setup=False, sync_file_mounts=False, detach=False)
    job = registry.job(inv.cluster, failed.value.job_id)
    assert job is not None and job.job_id == runner.job_id and job.name == "one" and job.status == "FAILED"
    # a check's probe job, while another check of the cluster starts its own (made while this one prepares):
    # the failure names this one, not the newest of its name
    play = Play(failing=("worker1",))
    monkeypatch.setattr(preparer_module.prepare, "run_prepare",
                        lambda path, **kw: registry.new_job(inv.cluster, name="probe", num_nodes=3) and play(path, **kw))
    probe = collect.CollectingRunner(inv, reporter=Reporter(stream=io.StringIO(), plain=True), registry=registry)
    job_id, failure = collect.run_probe_job(probe, JobSpec(name="probe", run="true"), registry)
    assert job_id == probe.job_id and job_id < max(j.job_id for j in registry.jobs(inv.cluster))
    assert failure is not None and "worker1: install step failed" in failure


def test_every_failure_settle_reads_names_the_job() -> None:
    from gpuctl.jobplane.events import Outcome
    from gpuctl.jobplane.runner import JobRunner

    inv = local_inventory()
    registry = Registry(remote=None)
    runner = JobRunner(inv, reporter=Reporter(stream=io.StringIO(), plain=True), registry=registry)
    for outcome in (Outcome("FAILED", run={0: 0, 1: 3, 2: 0}, first_failed=1), Outcome("FAILED_SETUP", setup={0: 2}),
                    Outcome("FAILED", detail="sync failed"), Outcome("CANCELLED")):
        job = registry.new_job(inv.cluster, name="j", num_nodes=3)
        result, error = runner.settle(job.job_id, inv.nodes, outcome)
        assert error is not None and error.job_id == result.job_id == job.job_id, outcome
    job = registry.new_job(inv.cluster, name="j", num_nodes=3)
    result, error = runner.settle(job.job_id, inv.nodes, Outcome("SUCCEEDED", run={0: 0, 1: 0, 2: 0}))
    assert error is None and result.job_id == job.job_id and result.status == "SUCCEEDED"
