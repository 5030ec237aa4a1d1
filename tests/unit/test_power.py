"""`gpuctl stop` / `start` without nodes: what each provider says of stopping its nodes, the module
input AWS clusters stop with, start's wait for ssh (a changed host key is refused, silent nodes are
named), the consent asked before jobs are ended, and what status and the cost history say of a
stopped cluster. The commands themselves run against moto: tests/integration/test_stop_start.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from gpuctl import cliargs, autostopcli, powercli
from gpuctl.common.console import Reporter
from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.providers import get_provider
from gpuctl.state import costs
from gpuctl.provision import lifecycle, ssh
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import JobRecord, Registry


def test_which_nodes_can_be_stopped_and_kept() -> None:
    aws = get_provider("aws")
    assert aws.stop_problem({"name": "a", "use_spot": False}) is None
    assert aws.stop_problem({"name": "a", "use_spot": True}) == (
        "spot nodes cannot be stopped (a one-time spot request ends when its instance stops); "
        "`gpuctl down a` removes the cluster")
    assert aws.power_inputs(running=False) == {"instance_state": "stopped"}
    assert aws.power_inputs(running=True) == {"instance_state": "running"}
    assert "`gpuctl down b` removes them" in (get_provider("local").stop_problem({"name": "b"}) or "")
    assert "`gpuctl down c` forgets the cluster" in (get_provider("ssh").stop_problem({"name": "c"}) or "")
    assert get_provider("local").power_inputs(running=False) == {}  # nothing to apply: stop_problem refuses


def nodes(count: int, tmp_path: Path) -> Inventory:
    return Inventory(cluster="pw", cloud="aws", region="us-east-1", nodes=tuple(
        Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=f"i-{r}", address=f"10.0.0.{r + 2}",
             ssh_host=f"198.51.100.{r + 2}", ssh_user="ubuntu", known_hosts=str(tmp_path / "known_hosts"))
        for r in range(count)))


def answers(codes: dict[int, tuple[int, str]]):  # noqa: ANN201 - a fake ssh.run_on_all
    calls: list[list[int]] = []

    def run_on_all(targets, command, *, control_dir, timeout=60):  # noqa: ANN001, ANN202
        calls.append([n.rank for n in targets])
        return {n.rank: subprocess.CompletedProcess(["ssh"], codes[n.rank][0], "", codes[n.rank][1]) for n in targets}
    return run_on_all, calls


def test_start_waits_until_every_node_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = nodes(2, tmp_path)
    rounds = iter([{0: (0, ""), 1: (255, "ssh: connect to host 198.51.100.3 port 22: Connection refused")},
                   {1: (0, "")}])
    seen: list[list[int]] = []

    def run_on_all(targets, command, *, control_dir, timeout=60):  # noqa: ANN001, ANN202
        seen.append([n.rank for n in targets])
        now = next(rounds)
        return {n.rank: subprocess.CompletedProcess(["ssh"], now[n.rank][0], "", now[n.rank][1]) for n in targets}

    monkeypatch.setattr(ssh, "run_on_all", run_on_all)
    monkeypatch.setattr(powercli, "WAIT_POLL_S", 0.01)
    powercli.wait_for_ssh(inv, reporter=Reporter(plain=True), timeout=30)
    assert seen == [[0, 1], [1]]  # a node that answered is not asked again


def test_start_refuses_a_node_whose_host_key_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_on_all, _ = answers({0: (0, ""), 1: (255, "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\n"
                                                  "Host key verification failed.")})
    monkeypatch.setattr(ssh, "run_on_all", run_on_all)
    with pytest.raises(UserError) as err:
        powercli.wait_for_ssh(nodes(2, tmp_path), reporter=Reporter(plain=True), timeout=30)
    assert err.value.message.startswith("worker1 (198.51.100.3): its SSH host key is not the one gpuctl recorded")


def test_start_names_the_nodes_that_never_answered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_on_all, calls = answers({0: (255, "ssh: connect to host 198.51.100.2 port 22: Connection timed out"),
                                 1: (0, "")})
    monkeypatch.setattr(ssh, "run_on_all", run_on_all)
    monkeypatch.setattr(powercli, "WAIT_POLL_S", 0.05)
    with pytest.raises(ProvisionError) as err:
        powercli.wait_for_ssh(nodes(2, tmp_path), reporter=Reporter(plain=True), timeout=0.2)
    assert err.value.message == (
        "cluster 'pw' is running again, but head (ssh: connect to host 198.51.100.2 port 22: Connection timed out) "
        "did not answer ssh within 0.2 s (GPUCTL_WAIT_TIMEOUT); `gpuctl status pw --refresh` shows each node, "
        "`gpuctl stop pw` stops it again")
    assert len(calls) >= 2 and all(c == [0] for c in calls[1:])


def job(job_id: int) -> JobRecord:
    return JobRecord(cluster="pw", job_id=job_id, name="train", status="RUNNING", task_id=None, num_nodes=2,
                     submitted_at=time.time())


def test_jobs_that_would_end_need_consent() -> None:
    powercli.consent({}, yes=False)  # nothing runs: nothing to ask
    powercli.consent({"pw": [job(3)]}, yes=True)
    with pytest.raises(UserError) as err:  # pytest's stdin is no terminal: nobody to ask
        powercli.consent({"pw": [job(3), job(4)], "other": [job(1)]}, yes=False)
    assert err.value.exit_code == 2 and err.value.message == (
        "jobs still run (cluster 'pw': job(s) 3, 4; cluster 'other': job(s) 1) and stopping ends them; wait for "
        "them (`gpuctl queue NAME`), or stop anyway with `gpuctl stop pw other -y`")


def test_status_and_cost_of_a_stopped_cluster(_isolated_state: Path) -> None:
    registry = Registry(remote=None)
    registry.upsert_cluster("pw", cloud="aws", region="us-east-1", zone="us-east-1a", num_nodes=2, status="UP",
                            request={"name": "pw", "instance_type": "p5.48xlarge", "region": "us-east-1"})
    registry.open_segment("pw", cloud="aws", region="us-east-1", instance_type="p5.48xlarge", num_nodes=2,
                          use_spot=False, node_price=55.0, price_source="list")
    cluster_dir("pw").mkdir(parents=True)
    when = time.time()
    (cluster_dir("pw") / lifecycle.STOP_FILE).write_text(f'{{"stopped_at": {when}}}')
    registry.set_cluster_status("pw", "STOPPED")
    registry.close_segment("pw", "stop", at=when)
    assert lifecycle.stopped_at("pw") == when
    lines, fields = autostopcli.status_of("pw", "STOPPED", registry)
    assert (fields["status"], fields["stopped_at"]) == ("STOPPED", when)
    assert lines == [f"  stopped at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))} (`gpuctl stop`); "
                     "its disks still bill: `gpuctl start pw` brings it back, `gpuctl down pw` removes it"]
    created = registry.cluster("pw").created_at
    first = costs.cluster_cost("pw", registry, created, now=when + 3600)
    later = costs.cluster_cost("pw", registry, created, now=when + 7200)
    assert first == later and first["per_hour"] is None  # stopped: nothing more counts
    assert costs.segment_row(registry.history("pw")[0], {"pw"}, when + 3600)["status"] == "STOPPED"
    with pytest.raises(UserError) as err:  # every command that needs the nodes (cliargs.cluster_inventory)
        cliargs.refuse_gone("pw", registry)
    assert err.value.message == "cluster 'pw' is stopped; `gpuctl start pw` brings it back"


def test_a_job_submitted_during_the_stop_is_recorded_as_ended(_isolated_state: Path) -> None:
    registry = Registry(remote=None)
    registry.upsert_cluster("pw", cloud="aws", region="us-east-1", zone=None, num_nodes=2, status="STOPPED",
                            request={"name": "pw"})
    done, late = registry.new_job("pw", name="a", num_nodes=2), registry.new_job("pw", name="b", num_nodes=2)
    registry.update_job("pw", done.job_id, status="SUCCEEDED", ended_at=time.time())
    registry.update_job("pw", late.job_id, status="SETTING_UP")
    assert powercli.ended_meanwhile("pw", registry) == [late.job_id]
    assert registry.job("pw", done.job_id).status == "SUCCEEDED"
    ended = registry.job("pw", late.job_id)
    assert (ended.status, ended.detail) == ("CANCELLED", "ended by `gpuctl stop`: the cluster was stopped")
    assert ended.ended_at is not None



def test_start_of_an_up_cluster_starts_the_nodes_that_stopped_behind_gpuctl(
        _isolated_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A stop or start that did not finish, or nodes stopped from the console: the registry says UP,
    the cloud (one call) says stopped; `start` starts them, and says so; with none stopped it only
    says the cluster is up."""
    from gpuctl.cli import app
    from gpuctl.provision.ansibleinventory import write_inventory

    registry = Registry(remote=None)
    registry.upsert_cluster("pw", cloud="aws", region="us-east-1", zone=None, num_nodes=2, status="UP",
                            request={"name": "pw"})
    inv = nodes(2, tmp_path)
    cluster_dir("pw").mkdir(parents=True, exist_ok=True)
    write_inventory(inv, cluster_dir("pw") / "inventory.yml")
    started: list[str] = []
    monkeypatch.setattr(powercli, "start_cluster", lambda record, **kw: started.append(record.name) or inv)
    for stopped, says in ((["head", "worker1"], "Cluster 'pw' is up, but head, worker1 stopped: starting them"),
                          ([], "Cluster 'pw' is already up.")):
        monkeypatch.setattr(powercli, "stopped_nodes", lambda record, inventory, found=stopped: found)
        started.clear()
        app(args=["start", "pw"], prog_name="gpuctl", standalone_mode=False)
        assert says in capsys.readouterr().out
        assert started == (["pw"] if stopped else [])
