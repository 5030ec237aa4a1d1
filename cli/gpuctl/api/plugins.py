"""Framework plugins: what the nodes need installed, and the environment around each call.

    gpuctl.Cluster(..., plugins=[gpuctl.plugins.torch()])

A plugin has a controller side (`packages`: what prepare installs on nodes
that do not run the controller's own Python; `secrets`: values that travel on
the job's secret channel) and a node side (`around`: a context manager that
sets the environment from instance_info() before the function body runs and
cleans up after). Only the node side travels in the call file: a plugin
pickles without its secrets.

Standard library only at import: the frameworks are imported on the node,
inside `around`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from typing import Any, Iterator, Mapping, Sequence

from gpuctl.api.runtime import InstanceInfo

_VERSION_RE = re.compile(r"^[A-Za-z0-9.*+!]+$")


def _pin(name: str, version: str | None) -> str:
    """`name` or `name==version` (a version with an operator is passed through)."""
    if not version or version == "latest":
        return name
    if version[0] in "<>=!~":
        return name + version
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"{name} version {version!r}: give a version such as 2.13.0 or a specifier such as >=2.3")
    return f"{name}=={version}"


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in os.environ for the block; put back what was there after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class Plugin:
    """Base: no packages, no secrets, nothing around the call."""

    name = "plugin"

    def packages(self, gpus_per_node: int = 0) -> list[str]:
        """pip requirements the nodes need (installed by prepare where the nodes have their own Python)."""
        return []

    def secrets(self) -> dict[str, str]:
        """Values set in the job's environment through its secret channel (never in a file of the call)."""
        return {}

    def env(self, info: InstanceInfo) -> dict[str, str]:
        """Environment variables set before the function body runs."""
        return {}

    @contextlib.contextmanager
    def around(self, info: InstanceInfo) -> Iterator[None]:
        with environment(self.env(info)):
            yield

    def __repr__(self) -> str:
        return f"gpuctl.plugins.{self.name}()"


class TorchPlugin(Plugin):
    """torch.distributed from instance_info(): MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
    LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, then init_process_group (nccl when CUDA
    is available, else gloo; or `backend`), destroyed when the call ends."""

    name = "torch"

    def __init__(self, backend: str | None = None, version: str | None = None) -> None:
        if backend is not None and backend not in ("nccl", "gloo", "mpi", "ucc", "xccl"):
            raise ValueError(f"torch(backend={backend!r}): use 'nccl', 'gloo' (or None: nccl with CUDA, else gloo)")
        self.backend = backend
        self.version = version
        _pin("torch", version)

    def packages(self, gpus_per_node: int = 0) -> list[str]:
        return [_pin("torch", self.version)]

    def env(self, info: InstanceInfo) -> dict[str, str]:
        return {"MASTER_ADDR": info.head_addr, "MASTER_PORT": str(info.head_port),
                "WORLD_SIZE": str(info.total_nodes), "RANK": str(info.node), "NODE_RANK": str(info.node),
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # one process per node

    @contextlib.contextmanager
    def around(self, info: InstanceInfo) -> Iterator[None]:
        with environment(self.env(info)):
            torch = importlib.import_module("torch")
            dist = importlib.import_module("torch.distributed")
            started = False
            if not dist.is_initialized():
                backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
                if backend == "nccl":
                    torch.cuda.set_device(0)
                dist.init_process_group(backend=backend, init_method="env://", world_size=info.total_nodes,
                                        rank=info.node)
                started = True
            try:
                yield
            finally:
                if started and dist.is_initialized():
                    dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"gpuctl.plugins.torch(backend={self.backend!r})"


class JaxPlugin(Plugin):
    """jax.distributed from instance_info(): JAX_COORDINATOR_ADDRESS (the head, port
    head_port + 1, so torch's rendezvous can use head_port beside it), JAX_NUM_PROCESSES,
    JAX_PROCESS_ID, JAX_LOCAL_DEVICE_COUNT, then jax.distributed.initialize; shut down after."""

    name = "jax"

    def __init__(self, version: str | None = None) -> None:
        self.version = version
        _pin("jax", version)

    def packages(self, gpus_per_node: int = 0) -> list[str]:
        return [_pin("jax[cuda12]" if gpus_per_node else "jax", self.version)]

    def env(self, info: InstanceInfo) -> dict[str, str]:
        return {"JAX_COORDINATOR_ADDRESS": f"{info.head_addr}:{info.head_port + 1}",
                "JAX_NUM_PROCESSES": str(info.total_nodes), "JAX_PROCESS_ID": str(info.node),
                "JAX_LOCAL_DEVICE_COUNT": str(info.accelerators or 1)}

    @contextlib.contextmanager
    def around(self, info: InstanceInfo) -> Iterator[None]:
        env = self.env(info)
        with environment(env):
            jax = importlib.import_module("jax")
            jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                       num_processes=info.total_nodes, process_id=info.node)
            try:
                yield
            finally:
                jax.distributed.shutdown()


class KerasPlugin(Plugin):
    """KERAS_BACKEND set before Keras is imported (Keras reads it once, at import)."""

    name = "keras"
    BACKENDS = {"jax": "jax", "torch": "torch", "tensorflow": "tensorflow", "numpy": None}

    def __init__(self, backend: str = "jax", version: str | None = None) -> None:
        if backend not in self.BACKENDS:
            raise ValueError(f"keras(backend={backend!r}): use one of {', '.join(self.BACKENDS)}")
        self.backend = backend
        self.version = version
        _pin("keras", version)

    def packages(self, gpus_per_node: int = 0) -> list[str]:
        extra = self.BACKENDS[self.backend]
        if extra == "jax" and gpus_per_node:
            extra = "jax[cuda12]"
        return [_pin("keras", self.version)] + ([extra] if extra else [])

    def env(self, info: InstanceInfo) -> dict[str, str]:
        return {"KERAS_BACKEND": self.backend}

    @contextlib.contextmanager
    def around(self, info: InstanceInfo) -> Iterator[None]:
        keras = sys.modules.get("keras")
        loaded = getattr(getattr(keras, "config", None), "backend", None)
        if callable(loaded) and loaded() != self.backend:
            raise RuntimeError(f"keras was imported with backend {loaded()!r} before gpuctl.plugins.keras could set "
                               f"{self.backend!r}; import keras inside the function")
        with environment(self.env(info)):
            yield

    def __repr__(self) -> str:
        return f"gpuctl.plugins.keras(backend={self.backend!r})"


class HuggingFacePlugin(Plugin):
    """transformers, datasets and tokenizers on the nodes; `token` reaches them as HF_TOKEN
    through the job's secrets (stdin to the head, a 0600 file on each node while the
    job runs), never in the call file, an argv or a log."""

    name = "huggingface"

    def __init__(self, token: str | None = None) -> None:
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("huggingface(token=...): give the token as a non-empty string, or leave it out")
        self._token = token

    def packages(self, gpus_per_node: int = 0) -> list[str]:
        return ["transformers", "datasets", "tokenizers"]

    def secrets(self) -> dict[str, str]:
        return {"HF_TOKEN": self._token} if self._token else {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (HuggingFacePlugin, ())  # the node side: the token is in the environment there

    def __repr__(self) -> str:
        return "gpuctl.plugins.huggingface(token=***)" if self._token else "gpuctl.plugins.huggingface()"


@contextlib.contextmanager
def around_all(plugins: Sequence[Plugin], info: InstanceInfo) -> Iterator[None]:
    """Every plugin's `around`, in order (cleaned up in reverse)."""
    with contextlib.ExitStack() as stack:
        for plugin in plugins:
            stack.enter_context(plugin.around(info))
        yield


def torch(backend: str | None = None, version: str | None = None) -> TorchPlugin:
    """PyTorch: torch.distributed initialized on every node (nccl with CUDA, else gloo)."""
    return TorchPlugin(backend=backend, version=version)


def jax(version: str | None = None) -> JaxPlugin:
    """JAX: jax.distributed initialized on every node."""
    return JaxPlugin(version=version)


def keras(backend: str = "jax", version: str | None = None) -> KerasPlugin:
    """Keras 3 with KERAS_BACKEND set before it is imported."""
    return KerasPlugin(backend=backend, version=version)


def huggingface(token: str | None = None) -> HuggingFacePlugin:
    """Hugging Face: transformers/datasets/tokenizers, and HF_TOKEN as a secret."""
    return HuggingFacePlugin(token=token)
