"""Cost in view: the dated price list, the price line of validate/apply, the registry's history of
each cluster's size and price, and `gpuctl cost-report` over clusters that are gone too."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl import costcli
from gpuctl.providers import get_provider
from gpuctl.providers.aws import prices
from gpuctl.providers.base import Price
from gpuctl.state.registry import Registry
from gpuctl.state import costs


def test_the_price_list_is_dated_and_says_when_it_knows_nothing() -> None:
    p5 = prices.price_of("p5.48xlarge", "us-east-1")
    assert (p5.on_demand, p5.spot) == (55.04, 17.6289) and p5.source == "AWS us-east-1 list prices as of 2026-11-26"
    assert "us-west-2 may differ" in prices.price_of("p5.48xlarge", "us-west-2").source
    assert prices.price_of("p5.4xlarge", None).spot is None  # listed without a spot price
    unknown = prices.price_of("p5e.48xlarge", "us-east-1")  # listed without any price
    assert unknown.on_demand is None and "not in gpuctl's price list" in unknown.source
    assert "not in gpuctl's price list" in prices.price_of("x9.huge", "us-east-1").source
    # every type gpuctl picks by itself from accelerators is in the list
    from gpuctl.providers.aws.catalog import AWS_DEFAULT_TYPES
    assert {t for by_count in AWS_DEFAULT_TYPES.values() for t in by_count.values()} <= set(prices.PRICES)


def test_the_price_line_never_says_zero() -> None:
    p5 = prices.price_of("p5.48xlarge", "us-east-1")
    assert costcli.describe(p5, "p5.48xlarge", 2, False) == (
        "price: p5.48xlarge $55.04/h on demand, spot $17.63/h; 2 node(s): $110.08/h "
        "(AWS us-east-1 list prices as of 2026-11-26)")
    assert costcli.describe(p5, "p5.48xlarge", 4, True).startswith("price: p5.48xlarge $17.63/h spot; 4 node(s): $70.52/h")
    unknown = costcli.describe(prices.price_of("p5.4xlarge", None), "p5.4xlarge", 1, True)
    assert unknown.startswith("price: unknown (") and "$0" not in unknown
    assert costcli.describe(Price(source="local nodes: no cloud bill", free=True), None, 2, False) == \
        "price: local nodes: no cloud bill"
    doc = costcli.document(p5, 2, False)
    assert (doc["per_node_hour"], doc["cluster_per_hour"], doc["market"]) == (55.04, 110.08, "on-demand")
    assert get_provider("local").price({}).free and get_provider("ssh").price({}).on_demand is None


def test_history_keeps_each_size_and_price_and_survives_the_cluster(tmp_path: Path) -> None:
    registry = Registry(path=tmp_path / "state.db", remote=None)
    args = dict(cloud="aws", region="us-east-1", instance_type="p5.48xlarge", use_spot=False, node_price=55.04,
                price_source="list")
    registry.open_segment("a", num_nodes=2, **args)
    registry.open_segment("a", num_nodes=2, **args)  # a re-apply with nothing changed: the same segment
    assert len(registry.history()) == 1
    registry.open_segment("a", num_nodes=3, **args)  # grown: a new segment from now
    first, second = registry.history()
    assert (first.ended_how, first.num_nodes, second.ended_at, second.num_nodes) == ("resized", 2, None, 3)
    registry.close_segment("a", "down")
    assert registry.history()[-1].ended_how == "down"
    segment = registry.history()[-1]
    assert segment.cost(segment.started_at + 3600) is not None
    assert abs(second.cost(second.started_at + 1800) - 55.04 * 3 / 2) < 1e-9
    registry.open_segment("b", num_nodes=1, **{**args, "node_price": None})
    assert registry.history()[-1].cost(time.time()) is None  # unknown stays unknown


def test_cost_report_lists_clusters_that_are_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    registry = Registry(path=tmp_path / "state.db", remote=None)
    base = dict(cloud="aws", region="us-east-1", instance_type="p5.48xlarge", use_spot=False, price_source="list")
    registry.open_segment("gone", num_nodes=2, node_price=55.04, **base)
    registry.close_segment("gone", "down")
    registry.open_segment("auto", num_nodes=1, node_price=55.04, **base)
    registry.close_segment("auto", "autodown")
    registry.open_segment("odd", num_nodes=1, node_price=None, **{**base, "instance_type": "x9.huge"})
    registry.upsert_cluster("odd", cloud="aws", region="us-east-1", zone=None, num_nodes=1, status="UP", request={})
    registry.open_segment("home", num_nodes=2, node_price=0.0, **{**base, "cloud": "local", "instance_type": None})
    registry.upsert_cluster("home", cloud="local", region=None, zone=None, num_nodes=2, status="UP", request={})
    env = {**os.environ, "GPUCTL_STATE_DIR": str(tmp_path)}
    text = gpuctlfork.run(["cost-report"], env=env,
                          timeout=60)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["NAME", "LAUNCHED", "DURATION", "RESOURCES", "STATUS", "COST/H", "COST", "(EST.)"]
    by_name = {line.split()[0]: line for line in lines[1:-1]}
    assert "DOWN" in by_name["gone"] and "2x p5.48xlarge" in by_name["gone"] and "$110.08" in by_name["gone"]
    assert "AUTODOWNED" in by_name["auto"]
    assert "UP" in by_name["odd"] and "unknown" in by_name["odd"]
    assert "no cloud bill" in by_name["home"] and "$0" not in by_name["home"]
    assert lines[-1].startswith("Total (estimated, where the price is known): $") and "1 without a known price" in lines[-1]
    doc = json.loads(gpuctlfork.run(["cost-report", "-o", "json"],
                                    env=env, timeout=60).stdout)
    rows = {r["name"]: r for r in doc["clusters"]}
    assert (doc["ok"], doc["command"], doc["unknown"]) == (True, "cost-report", 1)
    assert rows["gone"]["status"] == "DOWN" and rows["gone"]["per_hour"] == 110.08 and rows["gone"]["cost"] >= 0
    assert rows["odd"]["cost"] is None and rows["home"]["no_cloud_bill"] is True


def test_validate_prints_the_price(tmp_path: Path) -> None:
    task = tmp_path / "p5.yaml"
    task.write_text("num_nodes: 2\nresources:\n  infra: aws\n  accelerators: H100:8\nrun: x\n")
    env = {**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}
    text = gpuctlfork.run(["validate", str(task)],
                          env=env, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "price: p5.48xlarge $55.04/h on demand, spot $17.63/h; 2 node(s): $110.08/h" in text.stdout
    doc = json.loads(gpuctlfork.run(["validate", str(task), "-o", "json"],
                                    env=env, timeout=60).stdout)
    assert doc["price"]["cluster_per_hour"] == 110.08 and doc["price"]["source"].endswith("2026-11-26")


def test_status_shows_age_and_cost_so_far(tmp_path: Path) -> None:
    registry = Registry(path=tmp_path / "state.db", remote=None)
    registry.open_segment("train", cloud="aws", region="us-east-1", instance_type="p5.48xlarge", num_nodes=2,
                          use_spot=False, node_price=55.04, price_source="list")
    started = registry.history()[0].started_at
    fields = costs.cluster_cost("train", registry, started, now=started + 72 * 60)
    assert (fields["age_s"], fields["per_hour"]) == (4320.0, 110.08)
    assert costcli.status_line(fields) == "  age 1h 12m, $132.10 so far at $110.08/h (estimated)"
    registry.open_segment("lab", cloud="aws", region="us-east-1", instance_type="x9.huge", num_nodes=1,
                          use_spot=False, node_price=None, price_source="x9.huge is not in gpuctl's price list")
    lab = costs.cluster_cost("lab", registry, registry.history()[-1].started_at)
    assert costcli.status_line(lab).endswith("cost unknown (x9.huge is not in gpuctl's price list)")
    registry.close_segment("train", "autodown", at=started + 600)  # it took itself down after 10 minutes
    gone = costs.cluster_cost("train", registry, started, now=started + 7200)
    assert gone["age_s"] == 600.0 and gone["per_hour"] is None
