"""Cost in view, as SkyPilot shows it: the price per hour at `validate` and `apply`, each cluster's
age and cost so far in `status`, and `gpuctl cost-report` over clusters that are gone too.

Estimates from the provider's dated price table (providers/aws/prices.py), times the nodes and the
hours the registry's history saw them up; not a bill. Where the price is unknown it says so and
why, never $0; local nodes say they have no cloud bill.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping

import typer

from gpuctl import usage
from gpuctl.common import output
from gpuctl.common.output import OutputOption, wants_json

if TYPE_CHECKING:
    from gpuctl.providers.base import Price


def describe(price: Price, instance_type: str | None, num_nodes: int, use_spot: bool) -> str:
    """One line: per node and for the cluster, on demand or spot as asked, and where it comes from."""
    if price.free:
        return f"price: {price.source}"
    per = price.per_node_hour(use_spot)
    if per is None:
        return f"price: unknown ({price.source})"
    market = "spot" if use_spot else "on demand"
    other = "" if use_spot or price.spot is None else f", spot ${price.spot:.2f}/h"
    return (f"price: {instance_type or 'a node'} ${per:.2f}/h {market}{other}; {num_nodes} node(s): "
            f"${per * num_nodes:.2f}/h ({price.source})")


def document(price: Price, num_nodes: int, use_spot: bool) -> dict[str, Any]:
    per = None if price.free else price.per_node_hour(use_spot)
    return {"per_node_hour": per, "on_demand_per_node_hour": price.on_demand, "spot_per_node_hour": price.spot,
            "cluster_per_hour": None if per is None else round(per * num_nodes, 4), "market":
            "spot" if use_spot else "on-demand", "source": price.source, "no_cloud_bill": price.free}


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:,.2f}"


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m" if hours < 48 else f"{hours // 24}d {hours % 24}h"


def status_line(fields: Mapping[str, Any]) -> str:
    """`status`'s line: how long the cluster has lived, and what it cost so far."""
    if fields["no_cloud_bill"]:
        cost = "no cloud bill"
    elif fields["cost_so_far"] is None:
        cost = f"cost unknown ({fields['price_source'] or 'no price recorded'})"
    else:
        rate = f" at ${fields['per_hour']:.2f}/h" if fields["per_hour"] else ""
        cost = f"{_money(fields['cost_so_far'])} so far{rate} (estimated)"
    return f"  age {_duration(fields['age_s'])}, {cost}"


def register(app: typer.Typer) -> None:
    @app.command("cost-report", cls=usage.HelpCommand, epilog=usage.examples_of("cost-report"))
    def cost_report(output_format: str = OutputOption) -> None:
        """Estimated cost of every cluster this state dir made, the ones that are gone too (as `sky cost-report`)."""
        from gpuctl.state.costs import segment_row  # here: `gpuctl --help` needs no registry
        from gpuctl.state.registry import Registry

        registry = Registry()
        now = time.time()
        names = {r.name for r in registry.clusters()}
        rows = [segment_row(s, names, now) for s in registry.history()]
        billed = [r["cost"] for r in rows if r["cost"] is not None and not r["no_cloud_bill"]]
        unknown = [r for r in rows if r["cost"] is None]
        if wants_json(output_format):
            output.emit("cost-report", {"ok": True, "clusters": rows, "total": round(sum(billed), 2),
                                        "unknown": len(unknown)})
            return
        if not rows:
            typer.echo("No clusters in this state dir's history yet.")
            return
        table = [("NAME", "LAUNCHED", "DURATION", "RESOURCES", "STATUS", "COST/H", "COST (EST.)")]
        for r in rows:
            free = r["per_hour"] == 0.0
            resources = f"{r['num_nodes']}x {r['instance_type'] or r['cloud']}" + (" spot" if r["use_spot"] else "")
            table.append((r["name"], time.strftime("%Y-%m-%d %H:%M", time.localtime(r["launched_at"])),
                          "-" if r["duration_s"] is None else _duration(r["duration_s"]), resources, r["status"],
                          "-" if r["per_hour"] is None or free else f"${r['per_hour']:,.2f}",
                          "no cloud bill" if free else _money(r["cost"])))
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        total = f"${sum(billed):,.2f}" if billed else "no cloud bill" if not unknown else "unknown"
        typer.echo(f"Total (estimated, where the price is known): {total}"
                   + (f"; {len(unknown)} without a known price" if unknown else ""))
