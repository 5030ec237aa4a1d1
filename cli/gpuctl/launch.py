"""Run one job on a provisioned cluster: the stage sequence, as a reader follows it.

wait -> sync workdir and file_mounts -> setup (all nodes) -> hostfile and env
-> run (the job's nodes), each stage a playbook that is a barrier across nodes.
Setup and run output is followed live from the nodes' log files while the
playbooks do their work (Ansible itself cannot stream a task's output).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gpuctl import jobenv, playbooks, stream
from gpuctl.console import Reporter
from gpuctl.errors import JobFailed
from gpuctl.inventory import Inventory, Node
from gpuctl.paths import cluster_dir
from gpuctl.state import Registry


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


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    status: str
    returncodes: dict[int, int | None]


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


def _failure_lines(codes: Mapping[int, int | None], nodes: Mapping[int, Node]) -> list[str]:
    lines = []
    for rank in sorted(codes):
        code = codes[rank]
        if code == 0:
            continue
        node = nodes[rank]
        what = "lost contact (no exit code)" if code is None else f"exit code {code}"
        lines.append(f"rank {rank} ({node.name}, {node.address}): {what}")
    return lines


class JobRunner:
    """Runs the stages of one job and records its state in the registry."""

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry) -> None:
        self.inv = inv
        self.reporter = reporter
        self.registry = registry
        self.cdir = cluster_dir(inv.cluster)
        self.inventory_path = self.cdir / "inventory.yml"
        self.private_data_dir = self.cdir / "runner"
        self.control_dir = self.cdir / "cm"
        self.control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _playbook(self, name: str, extravars: dict, *, limit: list[str] | None = None) -> playbooks.PlaybookResult:
        return playbooks.run_playbook(
            name,
            inventory=self.inventory_path,
            private_data_dir=self.private_data_dir,
            extravars=extravars,
            limit=limit,
        )

    def _on_line(self, node: Node, line: str) -> None:
        self.reporter.rank_line(stream.format_prefix(node), node.rank, line)

    def _stage_with_output(self, playbook: str, stage: str, extravars: dict, nodes: tuple[Node, ...],
                           limit: list[str] | None = None) -> tuple[playbooks.PlaybookResult, dict[int, int | None]]:
        """Run a stage's playbook while following its log on `nodes`."""
        done = threading.Event()
        box: dict[str, playbooks.PlaybookResult] = {}

        def play() -> None:
            try:
                box["result"] = self._playbook(playbook, extravars, limit=limit)
            finally:
                done.set()

        worker = threading.Thread(target=play, name=f"playbook-{stage}", daemon=True)
        worker.start()
        codes = stream.follow(nodes, job_id=extravars["gpuctl_job_id"], stage=stage, on_line=self._on_line,
                              control_dir=self.control_dir, stop=done)
        worker.join()
        return box["result"], codes

    def run(self, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool) -> JobOutcome:
        inv = self.inv
        job_nodes = inv.first(spec.num_nodes or len(inv.nodes))
        job = self.registry.new_job(inv.cluster, name=spec.name, num_nodes=len(job_nodes))
        task = jobenv.task_id(inv.cluster, job.job_id, _started_stamp())
        self.registry.update_job(inv.cluster, job.job_id, task_id=task)
        setup = jobenv.setup_env(inv, task=task, gpus_per_node=spec.gpus_per_node, envs=spec.envs)
        run = jobenv.run_env(inv, job_nodes, task=task, gpus_per_node=spec.gpus_per_node, envs=spec.envs)
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
            "gpuctl_hostfile_lines": jobenv.hostfile_lines(job_nodes),
            "gpuctl_run_hosts": [n.name for n in job_nodes],
        }
        by_rank = {n.rank: n for n in inv.nodes}
        try:
            with self.reporter.stage(f"Waiting for {len(inv.nodes)} node(s)"):
                self._require(self._playbook("wait.yml", extravars), "nodes did not become reachable", job.job_id)
            with self.reporter.stage("Syncing workdir and file_mounts"):
                self._require(self._playbook("sync.yml", extravars), "sync failed", job.job_id)
            if run_setup and spec.setup:
                self.registry.update_job(inv.cluster, job.job_id, status="SETTING_UP", started_at=time.time())
                with self.reporter.stage(f"Running setup on {len(inv.nodes)} node(s)"):
                    result, codes = self._stage_with_output("setup.yml", "setup", extravars, inv.nodes)
                    failed = _failure_lines({r: c for r, c in codes.items() if c != 0}, by_rank)
                    if not result.ok or failed:
                        detail = failed or [self._describe(result)]
                        self._finish(job.job_id, "FAILED_SETUP", codes, detail)
                        raise JobFailed(f"job {job.job_id}: setup failed, run not started: " + "; ".join(detail))
            with self.reporter.stage("Writing hostfile and environment"):
                self._require(self._playbook("env.yml", extravars), "writing the job environment failed", job.job_id)
            self.registry.update_job(inv.cluster, job.job_id, status="RUNNING", started_at=time.time())
            self.reporter.info(f"Job {job.job_id} running on {len(job_nodes)} node(s) ({task})")
            result, codes = self._stage_with_output("run.yml", "run", extravars, job_nodes,
                                                    limit=[n.name for n in job_nodes])
        finally:
            if secrets_path:
                shutil.rmtree(secrets_path.parent, ignore_errors=True)
        failed = _failure_lines(codes, by_rank)
        if not result.ok and not failed:
            failed = [self._describe(result)]
        status = "FAILED" if failed else "SUCCEEDED"
        self._finish(job.job_id, status, codes, failed)
        if failed:
            raise JobFailed(f"job {job.job_id} failed: " + "; ".join(failed))
        self.reporter.info(f"Job {job.job_id} succeeded on {len(job_nodes)} node(s)")
        return JobOutcome(job.job_id, status, codes)

    def _describe(self, result: playbooks.PlaybookResult) -> str:
        parts = [f"{f.host}: {f.message}" + (f" (exit code {f.rc})" if f.rc is not None else "")
                 for f in result.failures]
        parts += [f"{h}: unreachable" for h in result.unreachable]
        return "; ".join(parts) or "ansible reported a failure"

    def _require(self, result: playbooks.PlaybookResult, what: str, job_id: int) -> None:
        if result.ok:
            return
        detail = self._describe(result)
        self._finish(job_id, "FAILED", {}, [detail])
        raise JobFailed(f"job {job_id}: {what}: {detail}")

    def _finish(self, job_id: int, status: str, codes: Mapping[int, int | None], detail: list[str]) -> None:
        failed_rank = next((r for r in sorted(codes) if codes[r] != 0), None)
        self.registry.update_job(self.inv.cluster, job_id, status=status, ended_at=time.time(),
                                 returncodes=dict(codes), failed_rank=failed_rank,
                                 detail="; ".join(detail) or None)
