"""gpuctl.Cluster: a cluster for Python code, and broadcasts as gpuctl jobs.

    with gpuctl.Cluster("cluster.yaml", plugins=[gpuctl.plugins.torch()]) as cluster:
        results = train(data) @ cluster

A Cluster is brought up through the CLI's own path (spec.load_task ->
providers.request_for -> lifecycle.bring_up: lock, registry,
provision.provision), and every broadcast is one gpuctl job
(jobplane.runner.JobRunner): it shows in `gpuctl queue`, its output streams with the
usual rank prefixes and is kept for `gpuctl logs`, and the head stops the
other ranks as soon as one fails. How a call travels is in wire.py; what
runs on the node in remote.py.

The nodes' Python: on local nodes the controller's own interpreter (same
machine, same files); elsewhere the venv prepare makes in ~/.gpuctl/venv
with this Python's minor version, cloudpickle, the plugins' packages and
`packages=` (role gpuctl_python; its inputs are part of the prepare
fingerprint, so a new package prepares the nodes once more).
"""

from __future__ import annotations

import linecache
import os
import re
import secrets as _secrets
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from gpuctl.api import wire
from gpuctl.api.function import CallTarget, Function, unwrap
from gpuctl.api.plugins import Plugin
from gpuctl.common.console import Reporter
from gpuctl.common.errors import ClusterNotFound, JobCancelled, JobFailed, PrepareFailed, UserError
from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.common.safetext import printable
from gpuctl.jobplane.events import Event, Outcome
from gpuctl.node.protocol import STAGE_RUN
from gpuctl.jobplane.runner import JobOutcome, JobRunner, JobSpec
from gpuctl.providers import get_provider, request_for, resources_problem
from gpuctl.provision import lifecycle
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import Registry

if TYPE_CHECKING:
    from gpuctl.spec.request import ClusterRequest
    from gpuctl.spec import Task

CALLS_DIR = "~/.gpuctl/calls"  # on every node: the call files of broadcasts
NODE_VENV_PYTHON = "$HOME/.gpuctl/venv/bin/python"  # role gpuctl_python
_PACKAGE_RE_BAD = tuple("-;|&$`<>\n\r\t ")


class RemoteError(JobFailed):
    """A function raised on a node (or could not be loaded there, or returned what does not pickle).

    `rank`, `node` and `address` say where; `type_name`, `remote_traceback` and
    `exception` (the exception itself when it could travel, else None) say what; `job_id`, which
    job of the cluster it was.
    """

    def __init__(self, message: str, *, rank: int, node: str, address: str, record: dict[str, Any],
                 exception: BaseException | None = None, job_id: int | None = None) -> None:
        super().__init__(message, job_id=job_id)
        self.rank = rank
        self.node = node
        self.address = address
        self.stage = str(record.get("stage") or "call")
        self.type_name = str(record.get("type") or "Exception")
        self.remote_traceback = str(record.get("traceback") or "")
        self.missing_module = record.get("missing_module")
        self.exception = exception


_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+), in .*$')


def with_source_lines(tb: str) -> str:
    """A node's traceback with the source lines it could not read filled in from this machine's
    files (the function's module in a private home, or only on this machine): as a local one reads."""
    out: list[str] = []
    lines = tb.splitlines()
    for i, line in enumerate(lines):
        out.append(line)
        frame = _FRAME.match(line)
        shown = i + 1 < len(lines) and lines[i + 1].startswith("    ")
        if frame and not shown:
            source = linecache.getline(frame["path"], int(frame["line"])).strip()
            if source:
                out.append(f"    {printable(source)}")
    return "\n".join(out) + ("\n" if tb.endswith("\n") else "")


class _CallRunner(JobRunner):
    """A JobRunner that takes the call's marker lines out of the output and keeps the outcome."""

    live_partials = False  # a marker line caught mid-write must never show: lines are judged whole

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry, collector: wire.Collector) -> None:
        super().__init__(inv, reporter=reporter, registry=registry)
        self.collector = collector
        self.job_id: int | None = None
        self.outcome: Outcome | None = None

    def output_text(self, event: Event) -> str | None:
        if event.stage != STAGE_RUN or event.rank is None:
            return event.text
        return self.collector.take(event.rank, event.text)

    def conclude(self, job_id: int, job_nodes: Sequence[Node], outcome: Outcome) -> JobOutcome:
        self.job_id, self.outcome = job_id, outcome
        return super().conclude(job_id, job_nodes, outcome)


class Cluster(CallTarget):
    """A gpuctl cluster that runs Python functions on every node.

    `task`: a task YAML (SkyPilot's format, as `gpuctl apply` takes), or leave it out and
    give `infra` ("local", "aws/us-east-1", ...), `num_nodes` and `accelerators` ("H100:8").
    `name`: the cluster's name (default: the task's name; a fresh `gpuctl-XXXXXX` without
    a task). With `name=` only, an existing cluster is used as it is.
    `plugins`: gpuctl.plugins.torch(), jax(), keras(), huggingface(). `packages`: more
    pip requirements for the nodes' Python (where the nodes do not run this Python).
    When a `with` block ends, the cluster is torn down unless `keep=True` or it existed
    before; `down()` tears it down at any time.
    """

    def __init__(self, task: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 infra: str | None = None, num_nodes: int | None = None, accelerators: str | dict | None = None,
                 plugins: Iterable[Plugin] = (), packages: Iterable[str] = (), keep: bool = False) -> None:
        self.task_path = Path(task) if task is not None else None
        self._name = name
        self.infra = infra
        self.num_nodes = num_nodes
        self.accelerators = accelerators
        self.plugins = tuple(plugins)
        for plugin in self.plugins:
            if not isinstance(plugin, Plugin):
                raise TypeError(f"plugins: {plugin!r} is not a gpuctl plugin (gpuctl.plugins.torch(), jax(), ...)")
        self.packages = tuple(packages)
        for package in self.packages:
            if not isinstance(package, str) or not package or package.startswith(_PACKAGE_RE_BAD) \
                    or any(c in package for c in "\n\r\t ;|&$`"):
                raise ValueError(f"packages: {package!r} is not a pip requirement such as 'numpy' or 'numpy>=2'")
        self.keep = keep
        self.reporter = Reporter()
        self.registry = Registry()
        self.created = False  # brought up by this object (torn down at the end of `with` unless keep)
        self.task: Task | None = None
        self.inventory: Inventory | None = None
        self.gpus_per_node = 0

    # -- life -------------------------------------------------------------------
    @property
    def name(self) -> str:
        if self._name is None:
            raise UserError("this gpuctl.Cluster is not up yet (use `with gpuctl.Cluster(...) as cluster` or .up())")
        return self._name

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._inv().nodes

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            if self.created and not self.keep:
                self._down_quietly()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.created and not self.keep and self.inventory is not None:
            self.down()

    def up(self) -> Cluster:
        """Provision the cluster (or reuse it); run the task's setup and copy its file_mounts."""
        from gpuctl.provision import provisioner
        from gpuctl.spec.request import check_cluster_name
        from gpuctl.provision.taskchecks import check_task

        if self._name is not None:
            check_cluster_name(self._name)
        shaped = self.task_path is not None or any(v is not None for v in (self.infra, self.num_nodes,
                                                                           self.accelerators))
        if self._name is not None and not shaped and self.registry.cluster(self._name) is not None:
            inv = provisioner.load_inventory_of(self._name)
            if inv is None:
                raise UserError(f"cluster '{self._name}' has no inventory (it never came up); "
                                f"`gpuctl down {self._name}` removes what is left")
            self.inventory = inv
            rec = self.registry.cluster(self._name)
            self.gpus_per_node = inv.head.gpus
            if rec is not None and rec.request.get("container_image"):
                raise UserError(f"cluster '{self._name}' runs its jobs in a container "
                                f"({rec.request['container_image']}); the Python API does not run functions there yet")
            return self
        if self._name is not None and not shaped and not provisioner.cluster_exists(self._name):
            raise ClusterNotFound(self._name, hint=", or give a task YAML or infra=/num_nodes= to create it")
        task, req = self._request()
        self._name = req.name
        self.task = task
        self.gpus_per_node = req.gpus_per_node
        if task.container_image:
            raise UserError(f"{self.task_path}: image_id docker:...: the Python API does not run functions in a "
                            "container yet; use `gpuctl apply` for this task")
        check_task(task, req)  # what `gpuctl apply` refuses before anything is made, refused here too
        self.created = self.registry.cluster(req.name) is None and not provisioner.cluster_exists(req.name)
        self.inventory = lifecycle.bring_up(req, reporter=self.reporter, registry=self.registry,
                                            workdir=task.workdir, container_image=None)
        if task.setup or task.file_mounts or task.bucket_mounts:
            runner = JobRunner(self.inventory, reporter=self.reporter, registry=self.registry)
            # setup and the copies only, on every node; container_image is None (refused above)
            spec = replace(JobSpec.of_task(task, req), name=task.name or req.name, run=None, num_nodes=None)
            self._run_job(runner, spec, run_setup=True, sync_file_mounts=True)
        return self

    def down(self) -> None:
        """Tear the cluster down (terraform destroy) and forget it."""
        lifecycle.tear_down(self.name, reporter=self.reporter, registry=self.registry)
        self.inventory = None

    def _down_quietly(self) -> None:
        try:
            from gpuctl.provision import provisioner

            if self._name and provisioner.cluster_exists(self._name):
                self.down()
        except Exception as exc:  # noqa: BLE001 - the first error is the one to raise
            self.reporter.error(f"tearing down cluster '{self._name}' failed too: {exc}; "
                                f"run `gpuctl down {self._name}`")

    def _request(self) -> tuple[Task, ClusterRequest]:
        if self.task_path is not None:
            if self.accelerators is not None:
                raise UserError(f"{self.task_path}: set resources.accelerators in the task YAML; "
                                "accelerators= is for a Cluster without a task")
            task = _load_task(self.task_path)
            for warning in task.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            if task.run:
                print(f"note: {self.task_path}: run: not run by gpuctl.Cluster (functions run with fn(...) @ cluster); "
                      "`gpuctl apply` runs it", file=sys.stderr)
            req = request_for(task, name=self._name, infra=self.infra, num_nodes=self.num_nodes,
                              base_dir=self.task_path.resolve().parent)
            return task, req
        task = _task_from_keywords(self._name or f"gpuctl-{_secrets.token_hex(3)}", self.infra, self.num_nodes,
                                   self.accelerators)
        return task, request_for(task)

    def _inv(self) -> Inventory:
        if self.inventory is None:
            raise UserError("this gpuctl.Cluster is not up (use `with gpuctl.Cluster(...) as cluster`, or .up())")
        return self.inventory

    # -- calls --------------------------------------------------------------------
    def broadcast(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every node as one job; the return values in rank order."""
        return self._call(fn, args, kwargs, num_nodes=None)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(*args, **kwargs) on the head only; its return value."""
        return self._call(fn, args, kwargs, num_nodes=1)[0]

    def __rmatmul__(self, other: Any) -> Any:
        raise TypeError("decorate the function with @gpuctl.function, then: fn(...) @ cluster")

    __rrshift__ = __rmatmul__

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              num_nodes: int | None) -> list[Any]:
        import cloudpickle

        inv = self._inv()
        target = fn.fn if isinstance(fn, Function) else fn
        if not callable(target):
            raise TypeError(f"{target!r} is not callable")
        name = getattr(unwrap(target), "__name__", None) or "function"
        nonce = _secrets.token_hex(8)
        body = dumps_call(target, {"fn": target, "args": args, "kwargs": kwargs,
                                   "plugins": list(self.plugins)})
        data = wire.encode_call(wire.CallHeader(nonce, wire.python_version(), name, cloudpickle.__version__), body)
        local = get_provider(inv.cloud).local
        python_before = self._want_node_python() if not local else None
        job_nodes = inv.first(num_nodes or len(inv.nodes))
        collector = wire.Collector(nonce)
        runner = _CallRunner(inv, reporter=self.reporter, registry=self.registry, collector=collector)
        envs = dict(self.task.envs) if self.task else {}
        if local:  # the controller's interpreter: gpuctl from where this process has it
            envs["PYTHONPATH"] = os.pathsep.join(p for p in (_gpuctl_root(), envs.get("PYTHONPATH")) if p)
        secrets = dict(self.task.secrets) if self.task else {}
        for plugin in self.plugins:
            secrets.update(plugin.secrets())
        dest = f"{CALLS_DIR}/{nonce}.pkl"
        with tempfile.TemporaryDirectory(prefix="call-", dir=_private_tmp()) as tmp:
            path = Path(tmp) / f"{nonce}.pkl"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            spec = JobSpec(name=name, run=run_script(sys.executable if local else None, dest),
                           workdir=self.task.workdir if self.task else None, file_mounts={dest: path},
                           envs=envs, secrets=secrets, num_nodes=len(job_nodes), gpus_per_node=self.gpus_per_node,
                           queue_gpus=min([self.gpus_per_node, *(n.gpus for n in job_nodes)]),
                           internal_mounts=frozenset({dest}), workdir_implied=True)
            try:
                self._run_job(runner, spec, run_setup=False, sync_file_mounts=True, collector=collector,
                              job_nodes=job_nodes)
            except JobFailed as exc:
                if not local and isinstance(exc, PrepareFailed):
                    from gpuctl.configplane import prepare

                    prepare.set_python_env(cluster_dir(self.name), python_before)  # not a package that failed
                raise
        return [self._result(collector, node) for node in job_nodes]

    def _run_job(self, runner: JobRunner, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool,
                 collector: wire.Collector | None = None, job_nodes: Sequence[Node] = ()) -> None:
        try:
            runner.run(spec, run_setup=run_setup, sync_file_mounts=sync_file_mounts, detach=False)
        except JobCancelled:
            raise KeyboardInterrupt from None  # the job was cancelled on every node first
        except JobFailed as exc:
            if collector is None:
                raise
            error = _failure(exc, collector, job_nodes, runner)
            raise error from getattr(error, "exception", None)

    def _result(self, collector: wire.Collector, node: Node) -> Any:
        import cloudpickle

        data = collector.result(node.rank)
        if data is None:
            raise JobFailed(f"rank {node.rank} ({node.name}, {node.address}) ended without returning a result "
                            "(did the function end the process, e.g. with os._exit?)")
        try:
            return cloudpickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - one line naming the rank
            raise JobFailed(f"the result of rank {node.rank} ({node.name}) cannot be loaded here: "
                            f"{type(exc).__name__}: {exc}") from exc

    def node_packages(self) -> list[str]:
        """What the nodes' venv holds for this Cluster: cloudpickle, the plugins' packages, `packages=`."""
        import cloudpickle

        wanted = {f"cloudpickle=={cloudpickle.__version__}"} | set(self.packages)
        for plugin in self.plugins:
            wanted.update(plugin.packages(self.gpus_per_node))
        return sorted(wanted)

    def _want_node_python(self) -> dict[str, Any] | None:
        """Record what the nodes' venv must hold, for the next prepare (configplane/prepare.py);
        the record as it was."""
        from gpuctl.configplane import prepare

        return prepare.want_python_env(cluster_dir(self.name), wire.python_version(), self.node_packages())

    def __repr__(self) -> str:
        state = f"{len(self.inventory.nodes)} node(s) on {self.inventory.cloud}" if self.inventory else "not up"
        return f"<gpuctl.Cluster {self._name or '(unnamed)'}: {state}>"


# -- helpers -----------------------------------------------------------------------


def run_script(python: str | None, call_file: str) -> str:
    """The job's run stage: the node's Python runs gpuctl.api.remote on the call file.
    `python` None: the venv prepare made on the node (role gpuctl_python)."""
    py = shlex.quote(python) if python else f'"{NODE_VENV_PYTHON}"'
    where = "the controller's Python (local nodes share its files)" if python else \
        "the venv gpuctl prepares for the Python API (role gpuctl_python)"
    return (f"py={py}\n"
            f'if [ ! -x "$py" ]; then echo "gpuctl: no Python at $py on $(hostname) ({where})" >&2; exit 127; fi\n'
            f"exec \"$py\" -m gpuctl.api.remote -- {shlex.quote(call_file)}\n")


def _gpuctl_root() -> str:
    import gpuctl

    return str(Path(gpuctl.__file__).resolve().parent.parent)


def _private_tmp() -> Path:
    path = state_root() / "tmp"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _load_task(path: Path) -> Task:
    """The task YAML as `gpuctl apply` reads it; envs and secrets left null take their
    value from this process's environment when it has one (as `--env NAME` / `--secret NAME`)."""
    from gpuctl.spec import load_task
    from gpuctl.common.yamlfile import load_yaml

    overrides: dict[str, dict[str, str]] = {"envs": {}, "secrets": {}}
    try:
        raw = load_yaml(path.expanduser(), what="task YAML file")  # bounded: a YAML bomb is refused here too
    except UserError:
        raw = None  # load_task says what is wrong with the file
    if isinstance(raw, dict):
        for section, values in overrides.items():
            for key, value in (raw.get(section) or {}).items() if isinstance(raw.get(section), dict) else ():
                if value is None and isinstance(key, str) and key in os.environ:
                    values[key] = os.environ[key]
    return load_task(path, env_overrides=overrides["envs"], secret_overrides=overrides["secrets"],
                     resources_check=resources_problem)


def _task_from_keywords(name: str, infra: str | None, num_nodes: int | None,
                        accelerators: str | dict | None) -> Task:
    import pydantic

    from gpuctl.spec import Task

    resources: dict[str, Any] = {}
    if infra is not None:
        resources["infra"] = infra
    if accelerators is not None:
        resources["accelerators"] = accelerators
    data: dict[str, Any] = {"name": name, "resources": resources}
    if num_nodes is not None:
        data["num_nodes"] = num_nodes
    try:
        return Task.model_validate(data, context={"base_dir": Path.cwd(), "cwd": Path.cwd(),
                                                  "resources_check": resources_problem})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "resources") or "Cluster"
        raise UserError(f"gpuctl.Cluster({where}=...): {first.get('msg')}") from None


def dumps_call(fn: Any, call: dict[str, Any]) -> bytes:
    """cloudpickle of the call; the function's own module goes by value when the nodes could not
    import it (a script's module, a test file), other modules by reference."""
    import cloudpickle

    registered = []
    for module in _by_value_modules(fn):
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except ValueError:
            pass  # already registered by the user
    try:
        return cloudpickle.dumps(call)
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _by_value_modules(fn: Any) -> list[Any]:
    import sysconfig

    installed = {os.path.realpath(p) for p in (sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib"))
                 if p}
    modules = []
    name = getattr(unwrap(fn), "__module__", None)
    module = sys.modules.get(name or "")
    if module is None or name in ("__main__", None) or name.split(".")[0] == "gpuctl":
        return modules
    file = getattr(module, "__file__", None)
    if not file:
        return modules
    real = os.path.realpath(file)
    if not any(real.startswith(p + os.sep) for p in installed):
        modules.append(module)
    return modules


def _failure(exc: JobFailed, collector: wire.Collector, job_nodes: Sequence[Node], runner: _CallRunner) -> JobFailed:
    """The error a failed broadcast raises: the first rank's own exception (with its traceback),
    or the job plane's message when no rank sent one (killed, lost)."""
    import base64

    by_rank = {n.rank: n for n in job_nodes}
    records = {r: rec for r in by_rank if (rec := collector.error(r)) is not None}
    if not records:
        first = runner.outcome.first_failed if runner.outcome else None
        tail = collector.tail.get(first, []) if first is not None else []
        if tail:
            return JobFailed(exc.message + f"\nlast output of rank {first}:\n  " + "\n  ".join(tail[-5:]),
                             job_id=exc.job_id)
        return exc
    loads = [r for r, rec in records.items() if rec.get("stage") == "load"]
    first = runner.outcome.first_failed if runner.outcome and runner.outcome.first_failed in records else \
        collector.order[0] if collector.order else min(records)
    if loads and first in loads:  # the function cannot be loaded: usually on every node alike
        rec = records[first]
        alike = [r for r in loads if records[r].get("message") == rec.get("message")]
        where = ", ".join(f"{by_rank[r].name} (rank {r})" for r in alike)
        what = f"No module named {rec['missing_module']!r}" if rec.get("missing_module") else \
            f"{rec.get('type')}: {rec.get('message')}"
        hint = ("; install it on the nodes (gpuctl.Cluster(..., packages=[...])) or make it importable there "
                "(a workdir in the task YAML)" if rec.get("missing_module") else "")
        message = (f"the function cannot be loaded on {where}: {what} (Python {rec.get('python')} at "
                   f"{rec.get('executable')}){hint}")
    else:
        rec = {**records[first], "traceback": with_source_lines(str(records[first].get("traceback") or ""))}
        node = by_rank[first]
        what = {"call": "raised", "result": "returned a value that cannot be pickled:"}.get(str(rec.get("stage")),
                                                                                           "raised")
        message = (f"rank {first} ({node.name}, {node.address}) {what} {rec.get('type')}: {rec.get('message')}\n"
                   f"--- traceback on rank {first} ({node.name}) ---\n{str(rec.get('traceback') or '').rstrip()}")
    original = None
    if rec.get("exception"):
        try:
            import cloudpickle

            original = cloudpickle.loads(base64.b64decode(rec["exception"]))
        except Exception:  # noqa: BLE001 - its type may not exist here; the text says it all
            original = None
    node = by_rank[first]
    return RemoteError(message, rank=first, node=node.name, address=node.address, record=rec,
                       exception=original if isinstance(original, BaseException) else None, job_id=exc.job_id)
