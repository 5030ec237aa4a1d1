"""Run one job on a provisioned cluster: the stage sequence, as a reader follows it.

submit: wait -> sync workdir (+ file_mounts) -> setup on all nodes -> hostfile
and env -> start `run` on the job's nodes (each stage a playbook, a barrier).
watch: follow every rank's log live, kill the other ranks as soon as one
fails (fail fast), record the outcome, copy the logs back.

Output is followed from the nodes' log files (Ansible cannot stream a task's
output), so a detached job can be watched later by `gpuctl logs`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from gpuctl import joblogs, jobenv, playbooks, ssh, stream
from gpuctl.console import Reporter
from gpuctl.errors import JobFailed
from gpuctl.inventory import Inventory, Node
from gpuctl.paths import cluster_dir
from gpuctl.sshkeys import ensure_internal_key
from gpuctl.state import Registry

KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL on the other ranks after a failure


@dataclass(frozen=True)
class JobSpec:
    """What to run, already validated (from a Task, or from `exec -- CMD`)."""

    name: str | None
    run: str | None
    setup: str | None = None
    workdir: Path | None = None
    file_mounts: Mapping[str, Path] = field(default_factory=dict)
    envs: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)
    num_nodes: int | None = None  # None: every node of the cluster
    gpus_per_node: int = 0
    fabric_env: Mapping[str, str] = field(default_factory=dict)  # NCCL/EFA defaults; envs win


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    status: str
    returncodes: dict[int, int | None]
    first_failed_rank: int | None = None


def _started_stamp() -> str:
    return time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime()) + f"-{time.time_ns() % 1_000_000:06d}"


def _write_secrets(path: Path, secrets: Mapping[str, str]) -> Path | None:
    if not secrets:
        return None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(jobenv.secrets_script(secrets))
    return path


def describe_codes(codes: Mapping[int, int | None], nodes: Mapping[int, Node], *, only_failed: bool = True) -> list[str]:
    lines = []
    for rank in sorted(codes):
        code = codes[rank]
        if only_failed and code == 0:
            continue
        node = nodes[rank]
        what = "lost contact (no exit code)" if code is None else f"exit code {code}"
        lines.append(f"rank {rank} ({node.name}, {node.address}): {what}")
    return lines


class JobRunner:
    """Runs the stages of a job on one cluster and records its state in the registry."""

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry) -> None:
        self.inv = inv
        self.reporter = reporter
        self.registry = registry
        self.cdir = cluster_dir(inv.cluster)
        self.inventory_path = self.cdir / "inventory.yml"
        self.private_data_dir = self.cdir / "runner"
        self.control_dir = ssh.control_dir_for(self.cdir / "cm")
        self.by_rank = {n.rank: n for n in inv.nodes}

    # stages ---------------------------------------------------------------
    def _playbook(self, name: str, extravars: dict, *, limit: list[str] | None = None) -> playbooks.PlaybookResult:
        return playbooks.run_playbook(name, inventory=self.inventory_path, private_data_dir=self.private_data_dir,
                                      extravars=extravars, limit=limit, control_dir=self.control_dir)

    def print_line(self, node: Node, line: str) -> None:
        """One line of a rank's output, prefixed `(worker1, rank=1)`."""
        self.reporter.rank_line(stream.format_prefix(node), node.rank, line)

    def _require(self, result: playbooks.PlaybookResult, what: str, job_id: int) -> None:
        if result.ok:
            return
        detail = describe_result(result)
        self.record_outcome(job_id, "FAILED", {}, [detail])
        raise JobFailed(f"job {job_id}: {what}: {detail}")

    def _setup(self, job_id: int, extravars: dict) -> None:
        """Setup on every node while following its output; a barrier before run."""
        done = threading.Event()
        box: dict[str, playbooks.PlaybookResult] = {}

        def play() -> None:
            try:
                box["result"] = self._playbook("setup.yml", extravars)
            finally:
                done.set()

        worker = threading.Thread(target=play, name="playbook-setup", daemon=True)
        worker.start()
        try:
            codes = stream.follow(self.inv.nodes, job_id=str(job_id), stage="setup", on_line=self.print_line,
                                  control_dir=self.control_dir, stop=done)
            worker.join()
        except KeyboardInterrupt:
            self.cancel(job_id, self.inv.nodes, stages=("setup",))
            raise
        result = box["result"]
        failed = describe_codes({r: c for r, c in codes.items() if c != 0}, self.by_rank)
        if not result.ok or failed:
            detail = failed or [describe_result(result)]
            self.record_outcome(job_id, "FAILED_SETUP", codes, detail)
            joblogs.fetch(self.inv.cluster, job_id, self.inv.nodes, control_dir=self.control_dir, stages=("setup",))
            raise JobFailed(f"job {job_id}: setup failed, run not started: " + "; ".join(detail))

    def submit(self, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool) -> tuple[int, tuple[Node, ...]]:
        """Every stage up to and including starting the ranks; returns (job id, job nodes)."""
        inv = self.inv
        job_nodes = inv.first(spec.num_nodes or len(inv.nodes))
        job = self.registry.new_job(inv.cluster, name=spec.name, num_nodes=len(job_nodes))
        task = jobenv.task_id(inv.cluster, job.job_id, _started_stamp())
        self.registry.update_job(inv.cluster, job.job_id, task_id=task)
        envs = {**spec.fabric_env, **spec.envs}
        setup = jobenv.setup_env(inv, task=task, gpus_per_node=spec.gpus_per_node, envs=envs)
        run = jobenv.run_env(inv, job_nodes, task=task, gpus_per_node=spec.gpus_per_node, envs=envs)
        secrets_path = _write_secrets(self.cdir / "secrets" / f"job-{job.job_id}.sh", spec.secrets)
        extravars = {
            "gpuctl_job_id": str(job.job_id),
            "gpuctl_workdir_src": str(spec.workdir) if spec.workdir else None,
            "gpuctl_file_mounts": [{"src": str(src), "dest": dest} for dest, src in spec.file_mounts.items()]
            if sync_file_mounts else [],
            "gpuctl_setup_env": setup.common,
            "gpuctl_setup_rank_vars": list(setup.rank_vars),
            "gpuctl_run_env": run.common,
            "gpuctl_run_rank_vars": list(run.rank_vars),
            "gpuctl_secrets_file": str(secrets_path) if secrets_path else None,
            "gpuctl_setup_script": spec.setup if run_setup else None,
            "gpuctl_run_script": spec.run,
            "gpuctl_setup_hostfile_lines": jobenv.hostfile_lines(inv.nodes),
            "gpuctl_hostfile_lines": jobenv.hostfile_lines(job_nodes),
            "gpuctl_run_hosts": [n.name for n in job_nodes],
            "gpuctl_internal_key": str(ensure_internal_key(self.cdir)[0]),
        }
        try:
            with self.reporter.stage(f"Waiting for {len(inv.nodes)} node(s)"):
                self._require(self._playbook("wait.yml", extravars), "nodes did not become reachable", job.job_id)
            if extravars["gpuctl_workdir_src"] or extravars["gpuctl_file_mounts"]:
                with self.reporter.stage("Syncing workdir" + (" and file_mounts" if sync_file_mounts else "")):
                    self._require(self._playbook("sync.yml", extravars), "sync failed", job.job_id)
            if run_setup and spec.setup:
                self.registry.update_job(inv.cluster, job.job_id, status="SETTING_UP", started_at=time.time())
                with self.reporter.stage(f"Running setup on {len(inv.nodes)} node(s)"):
                    self._setup(job.job_id, extravars)
            with self.reporter.stage("Writing hostfile and environment"):
                self._require(self._playbook("env.yml", extravars), "writing the job environment failed", job.job_id)
            with self.reporter.stage(f"Starting job {job.job_id} on {len(job_nodes)} node(s)"):
                result = self._playbook("run.yml", extravars, limit=[n.name for n in job_nodes])
                self.registry.update_job(inv.cluster, job.job_id, status="RUNNING", started_at=time.time())
                self._require(result, "starting the ranks failed", job.job_id)
        finally:
            if secrets_path:
                shutil.rmtree(secrets_path.parent, ignore_errors=True)
        self.reporter.info(f"Job {job.job_id} running ({task})")
        return job.job_id, job_nodes

    # watching -------------------------------------------------------------
    def watch(self, job_id: int, job_nodes: Sequence[Node], *, echo: bool = True,
              on_line: Callable[[Node, str], None] | None = None) -> JobOutcome:
        """Follow the ranks to their end, failing fast; Ctrl-C cancels the job on every node."""
        first_failed: list[int] = []
        killer: list[threading.Thread] = []

        def on_exit(node: Node, code: int | None) -> None:
            if code in (0, None) or first_failed:
                return
            first_failed.append(node.rank)
            others = [n for n in job_nodes if n.rank != node.rank]
            self.reporter.info(f"rank {node.rank} ({node.name}) exited with code {code}; "
                               f"stopping the other {len(others)} rank(s)")
            t = threading.Thread(target=ssh.kill_stage, kwargs=dict(
                nodes=others, job_id=str(job_id), stage="run", control_dir=self.control_dir,
                grace=KILL_GRACE_S), name="fail-fast", daemon=True)
            t.start()
            killer.append(t)

        sink = on_line or (self.print_line if echo else (lambda node, line: None))
        joblogs.mark_watching(self.inv.cluster, job_id)
        try:
            codes = stream.follow(job_nodes, job_id=str(job_id), stage="run", on_line=sink,
                                  control_dir=self.control_dir, on_exit=on_exit)
            for t in killer:
                t.join()
            return self._conclude(job_id, job_nodes, codes, first_failed[0] if first_failed else None)
        except KeyboardInterrupt:
            self.cancel(job_id, job_nodes)
            raise
        finally:
            joblogs.unmark_watching(self.inv.cluster, job_id)

    def _conclude(self, job_id: int, job_nodes: Sequence[Node], codes: Mapping[int, int | None],
                  first_failed: int | None) -> JobOutcome:
        joblogs.fetch(self.inv.cluster, job_id, job_nodes, control_dir=self.control_dir)
        current = self.registry.job(self.inv.cluster, job_id)
        failed = describe_codes(codes, self.by_rank)
        if current is not None and current.status == "CANCELLED":
            self.registry.update_job(self.inv.cluster, job_id, returncodes=dict(codes))
            raise JobFailed(f"job {job_id} was cancelled")
        status = "FAILED" if failed else "SUCCEEDED"
        self.record_outcome(job_id, status, codes, failed, first_failed=first_failed)
        if failed:
            first = first_failed if first_failed is not None else next(r for r in sorted(codes) if codes[r] != 0)
            rc_list = ", ".join(f"rank {r}: {'?' if c is None else c}" for r, c in sorted(codes.items()))
            node = self.by_rank[first]
            raise JobFailed(f"job {job_id} failed: rank {first} ({node.name}, {node.address}) failed first "
                            f"with exit code {codes[first]}; return codes: {rc_list}")
        self.reporter.info(f"Job {job_id} succeeded on {len(job_nodes)} node(s)")
        return JobOutcome(job_id, status, dict(codes), first_failed)

    def cancel(self, job_id: int, job_nodes: Sequence[Node], *, stages: Sequence[str] = ("setup", "run")) -> None:
        """End the job's process groups on every node and record it CANCELLED."""
        self.registry.update_job(self.inv.cluster, job_id, status="CANCELLED", ended_at=time.time())
        ssh.kill_stage(job_nodes, job_id=str(job_id), stage=stages, control_dir=self.control_dir,
                       grace=KILL_GRACE_S)
        joblogs.fetch(self.inv.cluster, job_id, job_nodes, control_dir=self.control_dir)

    def record_outcome(self, job_id: int, status: str, codes: Mapping[int, int | None], detail: list[str],
                       *, first_failed: int | None = None) -> None:
        """Write a finished job's state, return codes and first failed rank to the registry."""
        failed_rank = first_failed if first_failed is not None else next(
            (r for r in sorted(codes) if codes[r] != 0), None)
        self.registry.update_job(self.inv.cluster, job_id, status=status, ended_at=time.time(),
                                 returncodes=dict(codes), failed_rank=failed_rank,
                                 detail="; ".join(detail) or None)

    # detached jobs ----------------------------------------------------------
    def spawn_watcher(self, job_id: int) -> Path:
        """Watch a detached job from a background process: fail fast, record, fetch logs."""
        log = joblogs.local_job_dir(self.inv.cluster, job_id) / "watcher.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.Popen([sys.executable, "-m", "gpuctl", "_watch", self.inv.cluster, str(job_id)],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "GPUCTL_PLAIN": "1"})
        return log


def describe_result(result: playbooks.PlaybookResult) -> str:
    parts = [f"{f.host}: {f.message}" + (f" (exit code {f.rc})" if f.rc is not None and "exit code" not in f.message
                                          else "") for f in result.failures]
    parts += [f"{h}: unreachable ({result.unreachable_reasons.get(h, 'no reason given')})" for h in result.unreachable]
    if result.error:
        parts.append(result.error)
    return "; ".join(parts) or "ansible reported a failure"
