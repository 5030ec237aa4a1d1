"""`@gpuctl.function`: a function that runs on a cluster's nodes.

    @gpuctl.function
    def train(data, epochs=3): ...

    results = train(data, epochs=5) @ cluster   # every node, a list in rank order
    first = train(data) >> cluster              # one node, the head
    train.local(data)                           # here, as a plain call

Calling the decorated function runs nothing: it returns a PendingCall that
the `@` and `>>` operators hand to the cluster (Cluster.broadcast / Cluster.run).
The cluster is known here only as a `CallTarget`, which gpuctl.Cluster is
(api/cluster.py builds on this module, not the other way round).
"""

from __future__ import annotations

import functools
from typing import Any, Callable


class CallTarget:
    """What `fn(...) @ X` and `fn(...) >> X` run on; gpuctl.Cluster is the one kind."""

    def broadcast(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class Function:
    """A function to run on a cluster; call it to get a PendingCall."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"gpuctl.function: {fn!r} is not a function")
        functools.update_wrapper(self, fn, updated=())  # name and docs; not fn's __dict__ over ours
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> PendingCall:
        return PendingCall(self, args, kwargs)

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Run it here, as a plain call."""
        return self.fn(*args, **kwargs)

    def __matmul__(self, other: Any) -> Any:
        raise TypeError(f"call {self.__name__} first: {self.__name__}(...) @ cluster")

    __rshift__ = __matmul__

    def __repr__(self) -> str:
        return f"<gpuctl.function {getattr(self, '__qualname__', self.fn)!r}>"


class PendingCall:
    """A call of a gpuctl.function, not run yet: `@ cluster` runs it on every node,
    `>> cluster` on the head."""

    def __init__(self, function: Function, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs

    def __matmul__(self, cluster: CallTarget) -> list[Any]:
        return _cluster(cluster, "@").broadcast(self.function.fn, *self.args, **self.kwargs)

    def __rshift__(self, cluster: CallTarget) -> Any:
        return _cluster(cluster, ">>").run(self.function.fn, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"<pending call of {self.function.__name__}: use `@ cluster` or `>> cluster` to run it>"


def _cluster(value: Any, op: str) -> CallTarget:
    if not isinstance(value, CallTarget):
        raise TypeError(f"fn(...) {op} X: X must be a gpuctl.Cluster, not {type(value).__name__}")
    return value


def function(fn: Callable[..., Any]) -> Function:
    """Decorator: make `fn` runnable on a cluster (`fn(...) @ cluster`, `fn(...) >> cluster`)."""
    return Function(fn)


def unwrap(fn: Any) -> Any:
    """The user's own function under gpuctl.function / gpuctl.stdout / functools.wraps layers."""
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        inner = getattr(fn, "fn", None) if type(fn).__module__.startswith("gpuctl.") else None
        inner = inner or getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    return fn
