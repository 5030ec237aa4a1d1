"""One record of a cluster's request (issue 36 item 6): the registry's row holds the request as the
provider prepared it (what preflight learnt: the zone, the EFA count), the same cluster.json keeps,
and every check reads that one (health's expectations, the fabric check, the preparer, autostop)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuctl.common.console import Reporter
from gpuctl.healthcheck import health
from gpuctl.provision import lifecycle, provisioner
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.spec.request import ClusterRequest
from gpuctl.state.registry import Registry


def test_the_registry_keeps_the_prepared_request_that_every_check_reads(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    req = ClusterRequest(name="rec", num_nodes=1, cloud="local")
    prepared = replace(req, zone="learnt-zone", extra={"efa_interfaces": "32"})
    inv = Inventory(cluster="rec", cloud="local", nodes=(
        Node(name="head", rank=0, node_id="n0", address="10.0.0.2", ssh_host="10.0.0.2", ssh_port=22,
             ssh_user="u"),))

    def provision(request: ClusterRequest, *, on_start, **_: object) -> Inventory:
        assert request == req
        on_start(prepared)  # as provision does once the provider's preflight passed
        return inv

    monkeypatch.setattr(provisioner, "check_request", lambda request: None)
    monkeypatch.setattr(provisioner, "provision", provision)
    monkeypatch.setattr(lifecycle, "write_ssh_config", lambda inventory: tmp_path / "config")
    monkeypatch.setattr(lifecycle, "_trust_host_keys", lambda inventory: None)
    registry = Registry()
    lifecycle.bring_up(req, reporter=Reporter(plain=True), registry=registry, workdir=tmp_path)
    record = registry.cluster("rec")
    assert record is not None
    assert record.request == {**provisioner.request_to_dict(prepared), "workdir": str(tmp_path),
                              "container_image": None}
    assert record.request["zone"] == "learnt-zone" and record.request["extra"] == {"efa_interfaces": "32"}
    assert health.recorded_request(registry, "rec") == record.request  # what --health expects of the nodes
    assert health.recorded_request(registry, "never-made") is None
