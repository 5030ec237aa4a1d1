"""Run one job on a provisioned cluster, as a reader follows it.

run: prepare the nodes if their prepared state is not the expected one (the
configuration plane, once: preparer.py) -> copy the workdir and file_mounts to the head
(once) -> one SSH call to the head that carries the job (the job plane):
the head's agent copies on to the workers, runs setup everywhere (a
barrier), starts `run` on the job's nodes, stops the others as soon as one
fails, and streams every event back here, where lines are printed with their
rank's prefix, saved per rank, and the outcome recorded.

A detached job keeps running (and failing fast) on the head; a background
`gpuctl _watch` attaches to it to record its outcome, and `queue`/`logs`
bring any unwatched job up to date from the head (jobs.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.errors import JobCancelled, JobDetached, JobFailed, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.common.ranklines import RankLines
from gpuctl.configplane import prepare
from gpuctl.jobplane import bucketupload, client, gitignore, jobenv, joblogs, payload, stream, upload
from gpuctl.node import protocol
from gpuctl.jobplane.events import Event, Outcome
from gpuctl.jobplane.gitignore import WorkdirFilter
from gpuctl.jobplane.jobview import JobView
from gpuctl.jobplane.preparer import Preparer
from gpuctl.providers import get_provider
from gpuctl.provision import containers, ssh
from gpuctl.provision.inventory import Inventory, Node, hostfile_lines
from gpuctl.spec import buckets
from gpuctl.spec.buckets import BucketMount
from gpuctl.state.registry import TERMINAL_JOB_STATES, Registry

if TYPE_CHECKING:
    from gpuctl.spec import Task
    from gpuctl.spec.request import ClusterRequest

KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL on the other ranks after a failure
PLACED_FILE = "placed.json"  # file_mount and bucket destinations inside the workdir so far (JobRunner.placed)


@dataclass(frozen=True)
class JobSpec:
    """What to run, already validated (from a Task, or from `exec -- CMD`)."""

    name: str | None
    run: str | None
    setup: str | None = None
    workdir: Path | None = None
    file_mounts: Mapping[str, Path] = field(default_factory=dict)
    envs: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)
    num_nodes: int | None = None  # None: every node of the cluster
    gpus_per_node: int = 0
    # What the job asks the head's queue for on each node (node/gpuqueue.py); None: gpus_per_node.
    # A probe of the nodes (health, fabric check) asks 0: it runs at once, beside a training.
    queue_gpus: int | None = None
    bucket_mounts: Sequence[BucketMount] = ()  # cloud buckets fetched (COPY) or mounted before setup
    container_image: str | None = None  # `image_id: docker:IMAGE`: setup and run inside this image
    internal_mounts: frozenset[str] = frozenset()  # file_mounts gpuctl placed itself (a call's file): not shown
    # The workdir is not one the user named for this job (exec -- CMD: the last apply's; a Python API
    # call: the cluster's): its copy is said only when files changed.
    workdir_implied: bool = False
    # A managed job's attempt: the task id all its attempts share, and the attempt's epoch (the
    # nodes refuse ranks of an older one), and how the nodes watch for spot interruption notices.
    task_id: str | None = None
    epoch: int | None = None
    spot_notice: Mapping[str, object] | None = None
    job_vars: Mapping[str, str] = field(default_factory=dict)  # gpuctl's own variables (a pipeline's stage)

    @classmethod
    def of_task(cls, task: Task, req: ClusterRequest) -> JobSpec:
        """The job a task YAML describes (`gpuctl apply`, `gpuctl launch`; the Python API's setup job)."""
        return cls(name=task.name, run=task.run, setup=task.setup, workdir=task.workdir,
                   file_mounts=dict(task.file_mounts), envs=dict(task.envs), secrets=dict(task.secrets),
                   num_nodes=req.num_nodes, gpus_per_node=req.gpus_per_node,
                   bucket_mounts=tuple(task.bucket_mounts.values()), container_image=task.container_image)


@dataclass(frozen=True)
class LeftoverReport:
    """What `cancel` found on the nodes: ranks where something of the job still ran (now stopped),
    and ranks whose agent could not be asked."""

    stopped: tuple[int, ...] = ()
    unreachable: tuple[int, ...] = ()


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    status: str
    returncodes: dict[int, int | None]
    first_failed_rank: int | None = None


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored while a first one is acted on (the job let go of with a watcher to
    record it, or ended on every node): a second one would stop that half-way, the job running on
    unrecorded, while the line said otherwise. Outside the main thread, signals never arrive."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _started_stamp() -> str:
    return time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime()) + f"-{time.time_ns() % 1_000_000:06d}"


def describe_codes(codes: Mapping[int, int | None], nodes: Mapping[int, Node], *, only_failed: bool = True,
                   lost: Mapping[int, str] | None = None) -> list[str]:
    lines = []
    for rank in sorted(codes):
        code = codes[rank]
        if only_failed and code == 0:
            continue
        node = nodes[rank]
        if code is None:
            why = (lost or {}).get(rank)
            what = f"lost ({why})" if why else "lost contact (no exit code)"
        else:
            what = f"exit code {code}"
        lines.append(f"rank {rank} ({node.name}, {node.address}): {what}")
    return lines


class JobRunner:
    """Runs jobs on one cluster through its head and records their state in the registry."""

    def __init__(self, inv: Inventory, *, reporter: Reporter, registry: Registry) -> None:
        self.inv = inv
        self.reporter = reporter
        self.registry = registry
        self.cdir = cluster_dir(inv.cluster)
        self.preparer = Preparer(inv, reporter=reporter, registry=registry)  # the nodes' prepared state
        self.control_dir = ssh.control_dir_for(self.cdir / "cm")
        self.by_rank = {n.rank: n for n in inv.nodes}
        self.job_id: int | None = None  # the job `run` made last, from the moment it exists (a supervisor reads it)
        self.output = RankLines(reporter)  # every rank's line in progress, as a terminal shows it

    def publish(self) -> None:
        """Leave the cluster's records in the state bucket (shared state only), for the next runner."""
        self.registry.publish(self.inv.cluster)

    # -- one job ----------------------------------------------------------------
    live_partials = True  # False: ranks' lines show only whole (a runner that reads them: check, health)

    def print_line(self, node: Node, line: str, *, stage: str = protocol.STAGE_RUN, eol: bool = True) -> None:
        """(The rest of) a line of a rank's output, prefixed `(worker1, rank=1)`, as a terminal shows
        it (common/ranklines.py: \\r redraws); `eol` False: its newline has not come (yet)."""
        self.output.line(node.rank, stage, stream.format_prefix(node), line, eol)

    def output_text(self, event: Event) -> str | None:
        """What of a rank's output line to print and save (None: nothing). All of it here;
        the Python API takes its result lines out (api/cluster.py)."""
        return event.text

    def run(self, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool, detach: bool,
            stop: Callable[[], bool] | None = None) -> JobOutcome:
        """The whole job; its outcome (status RUNNING when detached, or when `stop()` said to let go of
        it: the job then runs on and is the caller's). Raises JobFailed when it failed."""
        inv = self.inv
        job_nodes = inv.first(spec.num_nodes or len(inv.nodes))
        container = self.container_plan(spec)  # a bad GPUCTL_CONTAINER_RUNTIME stops here, before any job exists
        if container is not None and not (self.cdir / containers.CONTAINERS_MARK).exists():
            (self.cdir / containers.CONTAINERS_MARK).touch()  # `down` removes the nodes' containers
            self.publish()  # also a `down` from another runner
        buckets.check(spec.bucket_mounts, spec.envs)  # so does a bucket the nodes could not mount safely
        job = self.registry.new_job(inv.cluster, name=spec.name, num_nodes=len(job_nodes))
        self.job_id = job.job_id
        joblogs.mark_watching(inv.cluster, job.job_id)
        session: client.Session | None = None
        timing = ExitStack()  # the job's phase, once the nodes are prepared
        try:
            task = spec.task_id or jobenv.task_id(inv.cluster, job.job_id, _started_stamp())
            self.registry.update_job(inv.cluster, job.job_id, task_id=task)
            needed = prepare.features(self.cdir, buckets.tools_needed(spec.bucket_mounts))
            more = [f for f in needed if f not in self.preparer.features]
            self.preparer.features = needed
            fingerprint = self.preparer.fingerprint()
            self.preparer.ensure_prepared(fingerprint, f"the job's cloud buckets need {' and '.join(more)}"
                                          if more else None)
            timing.enter_context(self.reporter.phase("job"))
            mounts = dict(spec.file_mounts) if sync_file_mounts else {}
            self.record_placed([*mounts, *(b.dest for b in spec.bucket_mounts)])
            rules = self.workdir_rules(spec)
            items = self.copy_to_head(job.job_id, spec, mounts, rules) if spec.workdir is not None or mounts else []
            if sync_file_mounts and any(b.upload for b in spec.bucket_mounts):
                self.fill_buckets(job.job_id, spec)
            body = self._payload(job.node_job, task, spec, job_nodes, fingerprint, items, run_setup, container,
                                 rules)
            secrets_text = jobenv.secrets_script(spec.secrets)
            for line in buckets.describe(spec.bucket_mounts):
                self.reporter.info(f"Bucket {line}")
            hidden = set(spec.internal_mounts)
            if spec.workdir_implied and not any(i.changed for i in items if i.dest == payload.WORKDIR_DEST):
                hidden.add(payload.WORKDIR_DEST)  # a copy nobody named, unchanged on the head: not said
            view = JobView(self, job.job_id, job_nodes, task, echo=not detach,  # detached: `gpuctl logs` shows it
                            hidden_paths=frozenset(hidden))
            for attempt in (1, 2):
                session = client.Session(inv.head, job.node_job, self.control_dir, view.on_event,
                                         on_idle=self.output.tick)
                try:
                    outcome = session.submit(body, secrets_text,
                                             stop=(lambda: view.running or view.pending is not None) if detach else
                                             (stop or (lambda: False)))
                except (client.AgentMissing, client.HeadUnreachable) as exc:
                    if ssh.host_key_changed(str(exc)):
                        self.record_outcome(job.job_id, "FAILED", {}, ["the head's host key changed"])
                        raise UserError(ssh.host_key_error(inv.head)) from None
                    if attempt == 2:
                        raise JobFailed(f"job {job.job_id}: the head ({inv.head.ssh_host}) did not take the job: "
                                        f"{exc}", job_id=job.job_id) from None
                    self.preparer.prepare(fingerprint, [inv.head], f"{inv.head.name}: its agent did not answer: {exc}")
                    continue
                if outcome is not None and outcome.status == "UNPREPARED" and attempt == 1:
                    stale = [self.by_rank[r] for r in outcome.ranks if r in self.by_rank] or list(inv.nodes)
                    prepare.forget(self.cdir, stale)
                    why = [f"{n.name}: {view.unprepared[n.rank]}" if view.unprepared.get(n.rank) else n.name
                           for n in stale[:3]]
                    self.preparer.prepare(fingerprint, stale, "; ".join(why) + ("; ..." if len(stale) > 3 else "") +
                                          (" (not as prepared)" if not any(view.unprepared.values()) else ""))
                    view.reset()
                    continue
                break
            if outcome is None:  # detached once every rank started, or once it waits in the head's queue
                joblogs.unmark_watching(inv.cluster, job.job_id)
                self.spawn_watcher(job.job_id)
                if not view.running:
                    self.reporter.info(f"Job {job.job_id} is pending: it waits for {view.pending}")
                return JobOutcome(job.job_id, "RUNNING" if view.running else "PENDING", {})
            return self.conclude(job.job_id, job_nodes, outcome)
        except JobFailed as exc:
            if exc.job_id is None:  # a failure of no job's own (preparing the nodes for it): this job's now
                exc.job_id = job.job_id
            current = self.registry.job(inv.cluster, job.job_id)
            if current is not None and current.status not in TERMINAL_JOB_STATES:  # not PENDING until it is stale
                self.record_outcome(job.job_id, "FAILED", {}, [str(exc)])
            raise
        except KeyboardInterrupt:
            with interrupts_held():  # a second Ctrl-C must not leave the first half done
                if session is not None and not self.cancel_on_interrupt and self._detached(job.job_id, session):
                    name = inv.cluster
                    raise JobDetached(f"stopped following job {job.job_id} (Ctrl-C); it goes on running on cluster "
                                      f"'{name}'. Follow it again: gpuctl logs {name} {job.job_id}; cancel it: "
                                      f"gpuctl cancel {name} {job.job_id}") from None
                self._interrupted(job.job_id, job_nodes, session)
            raise JobCancelled(f"job {job.job_id} cancelled (Ctrl-C); its processes were stopped on every node",
                               job_id=job.job_id) from None
        finally:
            self.output.end()
            timing.close()
            joblogs.unmark_watching(inv.cluster, job.job_id)

    def copy_to_head(self, job_id: int, spec: JobSpec, mounts: Mapping[str, Path],
                     rules: WorkdirFilter) -> list[upload.Item]:
        """The workdir and file_mounts to the head, once per job (rsync: only what changed). A copy
        the user did not ask for by name (`spec.workdir_implied`, gpuctl's own files) is said only
        when files changed."""
        shown = [m for m in mounts if m not in spec.internal_mounts]
        what = " and ".join(w for w, has in (("workdir", spec.workdir), ("file_mounts", shown)) if has)
        title = f"Copying the {what or 'job'} to the head"

        def run() -> tuple[list[upload.Item], int]:
            try:
                items = upload.upload(self.inv.head, workdir=spec.workdir, file_mounts=mounts,
                                      control_dir=self.control_dir, workdir_rules=rules)
            except upload.UploadError as exc:
                self.record_outcome(job_id, "FAILED", {}, [str(exc)])
                if ssh.host_key_changed(str(exc)):
                    raise UserError(ssh.host_key_error(self.inv.head)) from None
                raise JobFailed(f"job {job_id}: {exc}", job_id=job_id) from None
            return items, sum(i.changed for i in items if i.dest not in spec.internal_mounts)

        if spec.workdir_implied and not shown:
            with self.reporter.quiet_stage(title) as report:
                items, changed = run()
                report(f"Copied the {what} to the head: {changed} changed file(s)" if changed and what else None)
            return items
        with self.reporter.stage(title) as step:
            items, changed = run()
            step.update(f"{changed} changed file(s)" if changed else "nothing changed")
        return items

    def fill_buckets(self, job_id: int, spec: JobSpec) -> None:
        """Storage mounts with `name:` and a local `source:`: their directories into their buckets
        (made if missing) from here, before the nodes mount or copy them (bucketupload.py)."""
        where = buckets.storage_settings(spec.envs, default_region=get_provider(self.inv.cloud).bucket_region(
            self.inv.region))
        named = ", ".join(dict.fromkeys(f"s3://{b.bucket}" for b in spec.bucket_mounts if b.upload))
        with self.reporter.stage(f"Uploading to {named}") as step:
            try:
                filled = bucketupload.fill_buckets(spec.bucket_mounts, spec.envs, spec.secrets,
                                                   endpoint=where["endpoint"], region=where["region"])
            except bucketupload.UploadError as exc:
                self.record_outcome(job_id, "FAILED", {}, [str(exc)])
                raise JobFailed(f"job {job_id}: {exc}", job_id=job_id) from None
            step.update("; ".join(f"s3://{f.mount.bucket}: {f.sent} file(s) sent, {f.unchanged} unchanged"
                                  for f in filled))

    def _payload(self, node_job: str, task: str, spec: JobSpec, job_nodes: Sequence[Node], fingerprint: str,
                 items: Sequence[upload.Item], run_setup: bool, container: dict | None = None,
                 rules: WorkdirFilter = WorkdirFilter()) -> dict:
        inv = self.inv
        setup_env = jobenv.setup_env(inv, task=task, gpus_per_node=spec.gpus_per_node, envs=spec.envs,
                                     attempt=spec.epoch, job_vars=spec.job_vars)
        run_env = jobenv.run_env(inv, job_nodes, task=task, gpus_per_node=spec.gpus_per_node, envs=spec.envs,
                                 attempt=spec.epoch, job_vars=spec.job_vars)
        dests = [{"path": i.dest, "dir": i.is_dir,
                  "rsync_args": payload.workdir_rsync_args(rules) if i.dest == payload.WORKDIR_DEST else []}
                 for i in items]
        return payload.build_payload(
            inv, job_id=node_job, fingerprint=fingerprint, job_nodes=len(job_nodes),
            setup=payload.stage_plan(spec.setup if run_setup else None, setup_env,
                                     hostfile_lines(inv.nodes)),
            run=payload.stage_plan(spec.run, run_env, hostfile_lines(job_nodes)),
            sync=dests, grace=KILL_GRACE_S, container=container, view=self.preparer.view(),
            buckets=buckets.payload_entries(spec.bucket_mounts),
            storage=buckets.storage_settings(spec.envs,
                                            default_region=get_provider(inv.cloud).bucket_region(inv.region)),
            epoch={"task": task, "value": spec.epoch} if spec.epoch is not None else None,
            spot_notice=dict(spec.spot_notice) if spec.spot_notice else None, gpus_per_node=spec.gpus_per_node if spec.queue_gpus is None else spec.queue_gpus)

    # -- what the workdir copy leaves alone ------------------------------------
    def placed(self) -> list[str]:
        """Destinations inside the workdir that file_mounts and buckets were given on this cluster so far."""
        try:
            return json.loads((self.cdir / PLACED_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return []

    def record_placed(self, dests: Sequence[str]) -> None:
        """Remember destinations inside the workdir before anything is copied there: `exec` copies the
        workdir without the task's file_mounts, and must still not delete them."""
        known = self.placed()
        more = [d for d in dests if d not in known and gitignore.nested_destinations([d])]
        if more:
            (self.cdir / PLACED_FILE).write_text(json.dumps(known + more) + "\n")
            self.publish()  # another runner's `exec` must leave them alone too

    def workdir_rules(self, spec: JobSpec) -> WorkdirFilter:
        """What the workdir copy leaves out: what git ignores, and the destinations of this job's and
        every earlier job's file_mounts and buckets that lie inside the workdir."""
        if spec.workdir is None:
            return WorkdirFilter()
        dests = [*self.placed(), *spec.file_mounts, *(b.dest for b in spec.bucket_mounts)]
        return gitignore.workdir_filter(Path(spec.workdir), gitignore.nested_destinations(dests))

    def container_plan(self, spec: JobSpec) -> dict | None:
        """image_id docker:IMAGE: the image, the container's name, the runtime asked for and the
        destinations bound into it (workdir, every file_mount and bucket, copied this time or not:
        the container a job with fewer needs is the same one)."""
        if not spec.container_image:
            return None
        return containers.job_plan(spec.container_image, self.inv.cluster,
                                   [*spec.file_mounts, *(b.dest for b in spec.bucket_mounts)])

    # True: Ctrl-C (or SIGTERM) ends the job on every node (a probe job, a Python API call, a managed
    # job's supervisor; `apply`/`exec --cancel-on-interrupt`). False: it only stops following a job the
    # head took, which goes on, as SkyPilot's Ctrl-C does (`apply` and `exec`).
    cancel_on_interrupt = True

    def _detached(self, job_id: int, session: client.Session) -> bool:
        """After a Ctrl-C: let go of a job the head has taken, which then goes on with a watcher here
        recording its end; False when the head never took it (nothing runs: it is cancelled)."""
        session.wait_until_started()
        if not session.header_seen:
            return False
        session.close()
        joblogs.unmark_watching(self.inv.cluster, job_id)
        self.spawn_watcher(job_id)
        return True

    def _interrupted(self, job_id: int, job_nodes: Sequence[Node], session: client.Session | None) -> None:
        """Ctrl-C (or SIGTERM) at any moment: end whatever of the job started, on every node."""
        self.registry.update_job(self.inv.cluster, job_id, status="CANCELLED", ended_at=time.time(), detail=None)
        if session is None:
            return  # nothing reached the nodes yet (prepare and copies are no job)
        session.wait_until_started()
        self.cancel(job_id, job_nodes, session=session)

    def conclude(self, job_id: int, job_nodes: Sequence[Node], outcome: Outcome) -> JobOutcome:
        """Record the outcome; raise the error naming what failed, or say it succeeded."""
        result, error = self.settle(job_id, job_nodes, outcome)
        if error is not None:
            raise error
        self.reporter.info(f"Job {job_id} succeeded on {len(job_nodes)} node(s)")
        return result

    def settle(self, job_id: int, job_nodes: Sequence[Node], outcome: Outcome
               ) -> tuple[JobOutcome, JobFailed | UserError | None]:
        """Write the head's outcome to the registry; (what was recorded, the error a user gets for it).

        One reading of an outcome for every place that learns one: the attached
        run, the detached job's watcher, and `queue`/`logs` bringing a job up to date.
        """
        def record(status: str, codes: Mapping[int, int | None], detail: list[str],
                   first: int | None = None) -> JobOutcome:
            self.record_outcome(job_id, status, codes, detail, first_failed=first)
            return JobOutcome(job_id, status, dict(codes), first)

        if outcome.status == "FAILED" and outcome.detail == client.COORDINATOR_GONE:
            # Whatever killed it may have killed the head's supervisors too: nothing there stops
            # what of the job still runs, so its nodes' agents are asked to.
            report = self.stop_leftovers(job_id, job_nodes)
            if report.stopped:
                names = ", ".join(f"{self.by_rank[r].name} (rank {r})" for r in report.stopped if r in self.by_rank)
                outcome = replace(outcome, detail=f"{outcome.detail}; stopped what still ran of it on {names}")
        current = self.registry.job(self.inv.cluster, job_id)
        if outcome.status == "CANCELLED" or (current is not None and current.status == "CANCELLED"):
            return (record("CANCELLED", outcome.run, ["cancelled"]),
                    JobFailed(f"job {job_id} was cancelled", job_id=job_id))
        if outcome.status == "FAILED_SETUP":
            failed = describe_codes({r: c for r, c in outcome.setup.items() if c != 0}
                                    | {r: None for r in outcome.lost}, self.by_rank, lost=outcome.lost)
            detail = failed or [outcome.detail]
            return (record("FAILED_SETUP", outcome.setup, detail),
                    JobFailed(f"job {job_id}: setup failed, run not started: " + "; ".join(detail), job_id=job_id))
        changed = [r for r, why in sorted(outcome.lost.items()) if ssh.host_key_changed(why)]
        if changed:  # a node's key is not the one the others know: nothing ran
            return (record("FAILED", {}, [f"host key of rank {changed[0]} changed"]),
                    UserError(ssh.host_key_error(self.by_rank[changed[0]])))
        if not outcome.run:
            if outcome.status == "SUCCEEDED":  # nothing to run (setup only)
                return record("SUCCEEDED", {}, []), None
            detail = outcome.detail or "failed before any rank ran"  # sync, a lost node, ...
            return record("FAILED", {}, [detail]), JobFailed(f"job {job_id}: {detail}", job_id=job_id)
        codes = {r: outcome.run.get(r) for r in range(len(job_nodes))}
        failed = describe_codes(codes, self.by_rank, lost=outcome.lost)
        if outcome.status == "SUCCEEDED" and not failed:
            return record("SUCCEEDED", codes, []), None
        first = outcome.first_failed if outcome.first_failed is not None else next(
            (r for r in sorted(codes) if codes[r] != 0), None)
        rc_list = ", ".join(f"rank {r}: {'?' if c is None else c}" for r, c in sorted(codes.items()))
        node = self.by_rank[first] if first is not None else self.inv.head
        what = (f"failed first with exit code {codes.get(first)}" if codes.get(first) is not None
                else f"was lost first ({outcome.lost.get(first, 'no exit code')})")
        return (record("FAILED", codes, failed, first),
                JobFailed(f"job {job_id} failed: rank {first} ({node.name}, {node.address}) {what}; "
                          f"return codes: {rc_list}", job_id=job_id))

    def node_job(self, job_id: int) -> str:
        """The job's name on the nodes (JobRecord.node_job)."""
        job = self.registry.job(self.inv.cluster, job_id)
        return job.node_job if job is not None else str(job_id)

    def cancel(self, job_id: int, job_nodes: Sequence[Node], *,
               session: client.Session | None = None) -> LeftoverReport:
        """End the job on every node (through the head's coordinator, then each node's agent) and
        record it CANCELLED; what the nodes' agents still found running and stopped."""
        self.registry.update_job(self.inv.cluster, job_id, status="CANCELLED", ended_at=time.time(), detail=None)
        node_job = self.node_job(job_id)
        answer = client.cancel_on_head(self.inv.head, node_job, self.control_dir, wait=KILL_GRACE_S + 20)
        # Whatever the coordinator answered (it may be dead, or may not reach a node whose relay
        # died): each node's agent stops what of the job is left there.
        report = self.stop_leftovers(job_id, job_nodes)
        if session is not None:
            session.close()
        current = self.registry.job(self.inv.cluster, job_id)
        if answer and isinstance(answer.get("run"), dict):
            codes = {int(r): c for r, c in answer["run"].items()}
            self.registry.update_job(self.inv.cluster, job_id, returncodes=codes)
        if current is not None and current.status != "CANCELLED":
            self.registry.update_job(self.inv.cluster, job_id, status="CANCELLED")
        joblogs.fetch(self.inv, job_id, node_job, control_dir=self.control_dir)
        return report

    def stop_leftovers(self, job_id: int, job_nodes: Sequence[Node]) -> LeftoverReport:
        """Stop every stage of the job still running on its nodes, whatever the job's recorded state
        (a record can say FAILED while a rank whose owner was killed still runs); secrets go too."""
        results = client.kill_stage(job_nodes, job_id=self.node_job(job_id), stage=protocol.STAGES,
                                 control_dir=self.control_dir, grace=KILL_GRACE_S)
        stopped, unreachable = [], []
        for rank, reply in sorted(results.items()):
            if reply.error is not None:
                unreachable.append(rank)
            elif any(answer.get("stopped") for answer in reply.answers()):
                stopped.append(rank)
        return LeftoverReport(stopped=tuple(stopped), unreachable=tuple(unreachable))

    def record_outcome(self, job_id: int, status: str, codes: Mapping[int, int | None], detail: list[str],
                       *, first_failed: int | None = None) -> None:
        """Write a finished job's state, return codes and first failed rank to the registry."""
        failed_rank = first_failed if first_failed is not None else next(
            (r for r in sorted(codes) if codes[r] != 0), None)
        self.registry.update_job(self.inv.cluster, job_id, status=status, ended_at=time.time(),
                                 returncodes=dict(codes), failed_rank=failed_rank,
                                 detail="; ".join(detail) or None)

    # -- attaching to a job that runs -------------------------------------------
    def attach(self, job_id: int, job_nodes: Sequence[Node], *, echo: bool,
               ranks: Sequence[int] | None = None, offset: int = 0, record: bool = False,
               save: bool | None = None) -> Outcome:
        """Follow a submitted job from its first event to its end (logs saved as they come); from
        byte `offset` of its events.log, only printed (`logs --tail`: jobs.follow_job)."""
        outcome = self.follow(job_id, job_nodes, echo=echo, ranks=ranks, stop=lambda: False, offset=offset,
                              record=record, save=save)
        assert outcome is not None
        return outcome

    def follow(self, job_id: int, job_nodes: Sequence[Node], *, echo: bool, stop: Callable[[], bool],
               ranks: Sequence[int] | None = None, offset: int = 0, record: bool = False,
               save: bool | None = None) -> Outcome | None:
        """`attach`, letting go of the job (None) once `stop()` says so (a managed job's supervisor).
        `record`: this follower owns the job (a detached job's watcher): it records its phases.
        `save` (default: from the start only) the logs as they come."""
        view = JobView(self, job_id, job_nodes, None, echo=echo, ranks=ranks, quiet=True,
                       save=offset == 0 if save is None else save, record=record)
        session = client.Session(self.inv.head, self.node_job(job_id), self.control_dir, view.on_event,
                                 on_idle=self.output.tick)
        return session.attach(offset, stop=stop)

    def spawn_watcher(self, job_id: int) -> Path:
        """Record a detached job's outcome from a background process (the head decides fail-fast)."""
        log = joblogs.local_job_dir(self.inv.cluster, job_id) / "watcher.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.Popen([sys.executable, "-m", "gpuctl", "_watch", self.inv.cluster, str(job_id)],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "GPUCTL_PLAIN": "1"})
        return log

