"""Skyward's spelling of a pool, so its examples run with only the import changed.

    with gpuctl.Compute(provider=gpuctl.Local(), nodes=2, plugins=[gpuctl.plugins.torch()]) as compute:
        results = train() @ compute

`Compute` is `Cluster` with Skyward's argument names: `provider` (gpuctl.AWS(),
gpuctl.Local()), `nodes`, `accelerator` (gpuctl.accelerators.A100(), or "A100:8").
Everything else is the Cluster's: provisioned through gpuctl's own pipeline,
torn down when the block ends unless `keep=True`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from gpuctl.api.cluster import Cluster
from gpuctl.api.plugins import Plugin


@dataclass(frozen=True)
class Provider:
    """Where a pool's nodes come from, as a gpuctl infra string."""

    infra: str


def AWS(region: str | None = None, zone: str | None = None) -> Provider:  # noqa: N802 - Skyward's name
    """EC2 (GPU instance group, EFA, placement group), in `region`/`zone` or the one gpuctl picks."""
    return Provider("/".join(p for p in ("aws", region, zone) if p))


def Local() -> Provider:  # noqa: N802 - the same spelling as AWS()
    """Nodes on this machine (one network namespace each): for trying a pool without a cloud."""
    return Provider("local")


@dataclass(frozen=True)
class Accelerator:
    name: str
    count: float = 1

    def __str__(self) -> str:
        count = int(self.count) if float(self.count).is_integer() else self.count
        return f"{self.name}:{count}"


class _Accelerators:
    """`gpuctl.accelerators.A100()`, `.H100(8)`, `.A100_80GB()`: any name AWS's catalog knows."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        spelled = re.sub(r"_(?=\d+GB$)", "-", name)  # A100_80GB -> A100-80GB

        def make(count: float = 1) -> Accelerator:
            return Accelerator(spelled, count)

        make.__name__ = name
        return make


accelerators = _Accelerators()


def Compute(provider: Provider | None = None, *, nodes: int = 1,  # noqa: N802 - Skyward's name
            accelerator: Accelerator | str | None = None, plugins: Iterable[Plugin] = (),
            packages: Iterable[str] = (), name: str | None = None, keep: bool = False) -> Cluster:
    """A Cluster from Skyward's arguments; local nodes when no provider is given."""
    return Cluster(name=name, infra=(provider or Local()).infra, num_nodes=nodes,
                   accelerators=str(accelerator) if accelerator is not None else None,
                   plugins=plugins, packages=packages, keep=keep)
