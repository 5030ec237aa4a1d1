"""On-demand and spot prices (USD per node-hour, Linux) of the AWS instance types gpuctl picks, for
`validate`, `apply`, `status` and `cost-report`: estimates, never a bill.

Read on 2026-11-26 from SkyPilot's public catalog (skypilot-org/skypilot-catalog,
catalogs/v8/aws/vms.csv at commit 00148f2a), region us-east-1. Spot is the lowest price across
us-east-1's Availability Zones in that snapshot (its Local Zones left out): it moves by the hour.
Other regions differ; a cluster elsewhere is priced from this list and says so. A type missing here,
or listed without a price, is shown as unknown, never as $0. Refresh the numbers with the catalog.
"""

from __future__ import annotations

from gpuctl.providers.base import Price

AS_OF = "2026-11-26"
REGION = "us-east-1"
SOURCE = f"AWS {REGION} list prices as of {AS_OF}"

# instance type -> (on demand, lowest spot); None: no price in the catalog
PRICES: dict[str, tuple[float | None, float | None]] = {
    "p3.2xlarge": (3.06, 0.3707),
    "p3.8xlarge": (12.24, 1.4129),
    "p3.16xlarge": (24.48, 2.6694),
    "p3dn.24xlarge": (31.212, 6.2567),
    "g4dn.xlarge": (0.526, 0.2),
    "g4dn.12xlarge": (3.912, 1.2875),
    "g4dn.metal": (7.824, 2.9236),
    "g5g.xlarge": (0.42, 0.1309),
    "g5g.16xlarge": (2.744, 0.4066),
    "g5.xlarge": (1.006, 0.4246),
    "g5.12xlarge": (5.672, 2.0796),
    "g5.48xlarge": (16.288, 4.5408),
    "g6.xlarge": (0.8048, 0.349),
    "g6.12xlarge": (4.6016, 1.7552),
    "g6.48xlarge": (13.3504, 3.7289),
    "g6e.xlarge": (1.861, 0.9154),
    "g6e.12xlarge": (10.49264, 3.7887),
    "g6e.48xlarge": (30.13118, 8.0189),
    "p4d.24xlarge": (21.957642, 2.4655),
    "p4de.24xlarge": (27.44705, 8.6505),
    "p5.4xlarge": (6.88, None),
    "p5.48xlarge": (55.04, 17.6289),
    "p5e.48xlarge": (None, None),
    "p5en.48xlarge": (63.296, 16.5551),
    "p6-b200.48xlarge": (113.9328, 21.0148),
    "p6-b300.48xlarge": (None, None),
    "inf1.xlarge": (0.228, 0.0469),
    "inf1.6xlarge": (1.18, 0.2165),
    "inf1.24xlarge": (4.721, 0.6808),
    "inf2.xlarge": (0.7582, 0.1152),
    "inf2.24xlarge": (6.49063, 1.6792),
    "inf2.48xlarge": (12.98127, 4.1929),
    "trn1.2xlarge": (1.34375, 0.2198),
    "trn1.32xlarge": (21.5, 2.4334),
    "trn2.48xlarge": (None, None),
    "c6i.large": (0.085, 0.0364),
    "c6i.xlarge": (0.17, 0.0648),
    "c6i.2xlarge": (0.34, 0.1536),
    "c6i.4xlarge": (0.68, 0.3128),
    "c6i.8xlarge": (1.36, 0.4371),
    "c6i.12xlarge": (2.04, 0.6814),
    "c6i.16xlarge": (2.72, 0.8412),
    "c6i.24xlarge": (4.08, 1.3005),
    "c6i.32xlarge": (5.44, 1.5111),
    "m6i.large": (0.096, 0.0352),
    "m6i.xlarge": (0.192, 0.0687),
    "m6i.2xlarge": (0.384, 0.1441),
    "m6i.4xlarge": (0.768, 0.2406),
    "m6i.8xlarge": (1.536, 0.4368),
    "m6i.12xlarge": (2.304, 0.6281),
    "m6i.16xlarge": (3.072, 1.0568),
    "m6i.24xlarge": (4.608, 1.2426),
    "m6i.32xlarge": (6.144, 1.6978),
    "r6i.large": (0.126, 0.0393),
    "r6i.xlarge": (0.252, 0.1153),
    "r6i.2xlarge": (0.504, 0.2283),
    "r6i.4xlarge": (1.008, 0.4076),
    "r6i.8xlarge": (2.016, 0.606),
    "r6i.12xlarge": (3.024, 0.8612),
    "r6i.16xlarge": (4.032, 1.0404),
    "r6i.24xlarge": (6.048, 1.6852),
    "r6i.32xlarge": (8.064, 2.2146),
}


def price_of(instance_type: str | None, region: str | None) -> Price:
    """The price of one node of `instance_type`, or a Price saying why there is none."""
    if not instance_type:
        return Price(source="no instance type chosen yet")
    known = PRICES.get(instance_type)
    if known is None or known == (None, None):
        return Price(source=f"{instance_type} is not in gpuctl's price list ({SOURCE})")
    elsewhere = f"; {region} may differ" if region and region != REGION else ""
    return Price(on_demand=known[0], spot=known[1], source=SOURCE + elsewhere)
