"""A managed job's supervisor: one detached process, where gpuctl runs, for the job's whole life.

It brings the job's own cluster up, runs attempt after attempt until the job ends, and takes the
cluster down however it ends (checked: no node left). Between attempts it replaces only the nodes
that were lost (Terraform `-replace`), prepares only those, and restarts every rank with the same
task id and the next epoch (`GPUCTL_ATTEMPT`).

While an attempt runs, the job's own stream is the health signal (the head's coordinator ends the
attempt as soon as a rank or a node is lost); each tick also asks the platform whether a node is
gone (a terminated instance, a removed namespace), so a lost head is seen without waiting on ssh.
A node that only stops answering gets a grace before it counts as lost.

No controller VM: if this process dies, the next `gpuctl jobs ...` command starts another one,
which claims the job (compare-and-set on its PID and start time) and carries on: a RUNNING attempt
is watched again, anything else is fenced, then recovered. The cluster's own lease (autostop's)
takes the cluster down if no supervisor comes back. With shared state the supervisor also holds
the job's lease in the bucket (managed/shared.py), so that one on another runner can take over;
`jobs supervise --for` has it hand the job back once every rank runs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from gpuctl.common.console import Reporter
from gpuctl.common.errors import JobFailed, ProvisionError, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.jobplane import autostop, joblogs, replacement
from gpuctl.jobplane.preparer import Preparer
from gpuctl.jobplane.runner import JobRunner, JobSpec
from gpuctl.managed import fencing, freeze, owner, shared, stages
from gpuctl.managed.launch import HAND_BACK_ENV, stage_cluster_name as launch_cluster_name, supervisor_alive
from gpuctl.managed.policy import AttemptEnd, Decision, decide
from gpuctl.managed.store import (
    Event, ManagedJob, Store, attempt_log, drop_secrets, kept_log, read_secrets, supervisor_log,
)
from gpuctl.providers import get_provider
from gpuctl.provision import lifecycle, provisioner
from gpuctl.provision.inventory import Inventory
from gpuctl.spec.autostop import Autostop
from gpuctl.spec.recovery import JobRecovery
from gpuctl.state.registry import Registry

# The managed cluster's own autostop: down once idle and no supervisor renews its lease.
MANAGED_AUTOSTOP = Autostop(idle_minutes=1, down=True, wait_for="jobs")
LOCAL_POLL_S = 0.5  # how often the supervisor reads the attempt's state and the cancel flag
MAX_SUPERVISOR_RUNS = 10  # a supervisor that keeps dying (a bug, a broken state): the job fails, the cluster goes


def _seconds(name: str, default: float) -> float:
    try:
        return max(0.05, float(os.environ.get(name) or default))
    except ValueError:
        return default


def tick_s() -> float:
    return _seconds("GPUCTL_MANAGED_TICK_S", 5.0)


def grace_s() -> float:
    """How long a node that stops answering, while the platform says it runs, may stay silent."""
    return _seconds("GPUCTL_MANAGED_GRACE_S", 120.0)


def capacity_backoff_s() -> float:
    return _seconds("GPUCTL_MANAGED_BACKOFF_S", 30.0)


class Cancelled(Exception):
    """`gpuctl jobs cancel` asked for the job to end."""


class Superseded(Exception):
    """Another supervisor owns the job now: this one must touch nothing more."""


class HandBack(Exception):
    """`jobs supervise --for` ran its time, and every rank runs: the job's lease is given up for the
    next runner to take, the attempt goes on."""


def hand_back_at() -> float | None:
    try:
        return float(os.environ[HAND_BACK_ENV])
    except (KeyError, ValueError):
        return None


class AttemptRunner(JobRunner):
    """A JobRunner whose jobs nobody else watches: the supervisor follows them itself."""

    def spawn_watcher(self, job_id: int) -> Path:
        return Path(os.devnull)


class Supervisor:
    def __init__(self, job_id: int, *, out: TextIO | None = None) -> None:
        self.store = Store()
        self.job_id = job_id
        self.reporter = Reporter(stream=out or sys.stdout, plain=True)
        self.registry = Registry()
        self.pid = os.getpid()
        self.start = joblogs.process_start(self.pid) or ""
        self.stop_attempt = threading.Event()
        self.lease: autostop.Lease | None = None
        self.req: Any = None  # the cluster's request, once the task is loaded
        self.ended_at: float | None = None  # when the running attempt was seen to end (or a node lost)
        self.logs_kept: set[int] = set()  # attempts whose output is in the state bucket (shared state)

    # -- the job's row -------------------------------------------------------------------------
    def job(self) -> ManagedJob:
        job = self.store.get(self.job_id)
        if job is None:
            raise Superseded(f"managed job {self.job_id} is gone from the state")
        if (job.supervisor_pid, job.supervisor_start) != (self.pid, self.start):
            raise Superseded(f"managed job {self.job_id} is owned by supervisor {job.supervisor_pid}")
        if self.store.lease is not None:
            try:
                self.store.lease.check()
            except shared.LeaseLost as exc:
                raise Superseded(str(exc)) from None
        return job

    def say(self, text: str) -> None:
        self.reporter.info(f"{time.strftime('%H:%M:%S')} {text}")

    def check_cancel(self) -> None:
        if self.cancel_asked(self.job()):
            raise Cancelled()

    def cancel_asked(self, job: ManagedJob) -> bool:
        """A cancel on this runner (the job's flag) or, with shared state, on any (its lease's word)."""
        return job.cancel_requested or (self.store.lease is not None and self.store.lease.cancelled)

    # -- the whole life ------------------------------------------------------------------------
    def run(self) -> int:
        job = self.store.get(self.job_id)
        if job is None or job.terminal:
            return 0
        if job.supervisor_pid not in (None, self.pid) and supervisor_alive(job):
            return 0  # a live supervisor has it: one owner
        if not self.store.claim(self.job_id, self.pid, self.start,
                                previous=(job.supervisor_pid, job.supervisor_start)):
            return 0  # another supervisor claimed it first
        if self.store.bucket is not None and not self.take_lease():
            return 0
        job = self.job()
        if job.supervisor_runs > MAX_SUPERVISOR_RUNS:
            last = f"; the last time: {job.reason}" if (job.reason or "").startswith("supervisor error") else ""
            return self.finish("FAILED_SUPERVISOR", f"its supervisor stopped {job.supervisor_runs - 1} times{last}")
        self.say(f"supervisor {self.pid} takes managed job {job.id} ({job.name}) in state {job.status}")
        try:
            return self._run(job)
        except (Superseded, shared.LeaseLost) as exc:
            self.say(f"stopping: {exc}")
            if self.store.lease is not None and self.store.lease.lost_to is not None:
                drop_secrets(self.job_id)  # another runner's supervisor has the job, and its own copy
            return 0
        except HandBack:
            self.say("handing the job back: every rank runs, and this runner's time (`jobs supervise --for`) "
                     "is up; the next runner to look takes it over")
            drop_secrets(self.job_id)  # the next taker reads them from its own environment
            return 0
        except Cancelled:
            return self.finish("CANCELLED", "cancelled by the user")
        except Exception as exc:  # noqa: BLE001 - the job must not be left without an owner and a reason
            self.say("supervisor error:\n" + traceback.format_exc())
            self.store.update(self.job_id, reason=f"supervisor error: {type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            if self.lease is not None:
                self.lease.__exit__(None, None, None)
            if self.store.lease is not None:
                self.keep_logs()
                self.store.lease.release()

    def take_lease(self) -> bool:
        """Shared state: hold the job's lease in the bucket, if it is free, run out, or this runner's
        own from a supervisor that died."""
        lease = shared.Lease(self.store.bucket, self.job_id, pid=self.pid, start=self.start)

        def may_take(view: shared.LeaseView) -> bool:
            return not view.live_here(lease.me["id"]) if view.runner == lease.me["id"] else view.expired

        holder = lease.acquire(may_take)
        if holder is not None:
            self.say(f"managed job {self.job_id} is supervised by {holder.text()}, whose lease runs; stopping")
            if holder.runner != lease.me["id"]:
                drop_secrets(self.job_id)
            return False
        self.store.lease = lease
        self.store.push(self.job_id)  # the bucket's row now says which runner supervises the job
        try:  # the logs as the last holder kept them, so that this one's keeping extends, not undoes, them
            shared.pull_logs(self.store.bucket, self.job_id, lambda k: kept_log(self.job_id, k))
        except (ProvisionError, UserError) as exc:
            self.say(f"could not fetch the kept logs from the state bucket: {exc}")
        self.say(f"holding managed job {self.job_id}'s lease in the state bucket ({lease.me['who']}, "
                 f"term {lease.term:g} s)")
        return True

    def keep_logs(self, attempt: int | None = None) -> None:
        """Shared state: an attempt's output once it ended (`attempt`), or, as the supervisor stops,
        those not kept yet (the last one's so far), and its own log, in the bucket for the other
        runners; only while it holds the job (a runner that lost it would overwrite the new holder's)."""
        job = self.store.get(self.job_id)
        if job is None or self.store.lease is None or not self.store.lease.held():
            return
        try:
            for k in [attempt] if attempt is not None else range(1, job.attempt + 1):
                if k not in self.logs_kept:
                    shared.push_log(self.store.bucket, job.id, k, attempt_log(job.id, k))
            if attempt is not None:
                self.logs_kept.add(attempt)  # ended: its log changes no more
            shared.push_log(self.store.bucket, job.id, 0, supervisor_log(job.id))
        except (ProvisionError, UserError) as exc:
            self.say(f"could not keep the logs in the state bucket: {exc}")

    def _run(self, job: ManagedJob) -> int:
        if self.store.bucket is not None:
            self.registry.adopt(job.cluster)  # the cluster as the last runner left it, before any teardown
        self.check_cancel()  # a cancel that found no supervisor started this one
        try:
            task, req, recovery = self.load(job)
        except UserError as exc:  # its task cannot be read again: said once, not retried
            return self.finish("FAILED_SUPERVISOR", f"its task could not be loaded: {exc.message}")
        self.sweep_stage_clusters(job)  # a pipeline's earlier stage's cluster, if a supervisor died removing it
        mine = owner.owns(job)
        if job.status == "PENDING":
            if provisioner.cluster_exists(job.cluster) and not mine:
                return self.finish("FAILED_SUPERVISOR", f"a cluster named {job.cluster} exists and is not this "
                                   "job's; it was left untouched", take_down=False)
            owner.stamp(job)  # before anything is made: a half-made cluster is this job's too
            self.store.set_status(job.id, "STARTING")
            stage = stages.current(record) if (record := stages.of(job)) is not None else {}
            reused = (stage.get("reused") and mine and (inv := provisioner.load_inventory_of(job.cluster)) is not None
                      and get_provider(req.cloud).removed_itself(cluster_dir(job.cluster)) is None)
            if reused:
                self.say(f"stage {stage['index']} ({stage['name']}) runs on {job.cluster} as the stage before "
                         "left it: nothing made again")
                if self.lease is None:  # a supervisor that took the job over between the stages
                    self.arm(inv)
            else:
                if stage.get("reused"):  # the cluster went meanwhile: made again, and setup runs on it
                    self.store.update(job.id, launch=json.dumps(stages.not_reused(job.launch)))
                inv = self.bring_up(req, task)
        elif not mine:
            return self.gone(job, own=False)
        elif get_provider(req.cloud).removed_itself(cluster_dir(job.cluster)) is not None:
            return self.gone(job, own=True)  # its lease ran out with no supervisor to renew it
        else:
            inv = provisioner.load_inventory_of(job.cluster) or self.bring_up(req, task)
        end: AttemptEnd | None = None
        attempt = job.attempt
        resumed = job.status != "PENDING"
        lost_meanwhile = self.lost_now(inv) if resumed else {}
        watch = resumed and job.status == "RUNNING" and job.cluster_job is not None and not lost_meanwhile
        if watch:
            try:
                self.arm(inv)
            except autostop.AutostopUnreachable as exc:  # a head the platform says runs, but silent
                self.say(f"{exc}; recovering instead of watching attempt {job.attempt}")
                watch = False
        if watch:
            self.say(f"watching attempt {job.attempt} again (cluster job {job.cluster_job})")
            end = self.watch_again(inv, job)
            self.keep_logs(job.attempt)
        elif lost_meanwhile and job.status == "RUNNING":
            # nodes went while no supervisor watched a running attempt (its runner died with them):
            # their loss ends the attempt, recorded and recovered as any node loss (a loss seen
            # before, RECOVERING, is recovered below without a second record)
            self.ended_at = time.time()
            self.say("lost while no supervisor watched: " + "; ".join(
                f"{inv.nodes[r].name} ({why})" for r, why in sorted(lost_meanwhile.items()) if r < len(inv.nodes)))
            end = AttemptEnd(status="ABORTED", lost=lost_meanwhile)
        elif resumed:
            # what the last supervisor was doing is unknown: fence, replace what is gone, restart;
            # a supervisor's restart is no failure of the job and counts against no budget
            lost = self.lost_now(inv)
            self.say(f"resuming from {job.status}: fencing attempt {job.attempt}, then recovering")
            inv = self.recover(inv, req, Decision("recover", kind="recovery", replace=tuple(sorted(lost)),
                                                  cause="supervisor restarted"), attempt)
        while True:
            if end is not None:
                decision = self.decision(end, recovery)
                if decision.action == "finish":
                    assert decision.status is not None
                    return self.conclude(decision.status, decision.cause, exit_code=decision.exit_code,
                                         failed_rank=decision.failed_rank)
                inv = self.recover(inv, req, decision, attempt)
            attempt += 1
            self.check_cancel()
            end = self.run_attempt(inv, task, req, attempt)
            self.keep_logs(attempt)

    def load(self, job: ManagedJob) -> tuple[Any, Any, JobRecovery]:
        from gpuctl.providers import request_for, resources_problem
        from gpuctl.spec import load_task

        launch = job.launch
        if launch.get("cwd") and Path(launch["cwd"]).is_dir():
            os.chdir(launch["cwd"])  # relative paths in the task mean what they meant at launch
        # the task as launched, its local files the copies kept then (freeze.py); a job launched by an
        # older gpuctl has only the user's file
        kept = freeze.frozen_task(job)
        if kept is None and not Path(launch["file"]).is_file():
            raise UserError(f"{launch['file']} is gone (this job was launched before gpuctl kept a copy)")

        def load(source: Any, text: str | None = None) -> Any:
            return load_task(source, env_overrides=launch.get("envs") or {}, secret_overrides=read_secrets(job.id),
                             infra_override=launch.get("infra"), resources_check=resources_problem, text=text)
        record = stages.of(job)
        if record is not None:  # a pipeline: its current stage, from the kept pipeline
            if kept is None:
                raise UserError("the pipeline's kept stages are gone")
            from gpuctl.spec.pipeline import load_pipeline

            pipeline = load_pipeline(kept, load_stage=lambda source, text: load(source, text))
            task = pipeline.stages[int(record["current"]) - 1].task
        else:
            task = load(kept or launch["file"])
        req = request_for(task, name=job.cluster, infra=launch.get("infra"), num_nodes=launch.get("num_nodes"),
                          base_dir=Path(launch["file"]).resolve().parent)
        self.req = replace(req, autodown=True)
        self.task = task
        return task, self.req, task.resources.job_recovery or JobRecovery()

    # -- the cluster ---------------------------------------------------------------------------
    def bring_up(self, req: Any, task: Any) -> Inventory:
        tries = 0
        while True:
            self.check_cancel()
            try:
                inv = lifecycle.bring_up(req, reporter=self.reporter, registry=self.registry, workdir=task.workdir,
                                         container_image=task.container_image)
                break
            except ProvisionError as exc:
                tries += 1
                if not exc.insufficient_capacity or tries > capacity_retries():
                    self.finish("FAILED_NO_RESOURCE", str(exc))
                    raise Superseded("no capacity") from None
                self.say(f"no capacity ({exc}); trying again in {capacity_backoff_s():g} s")
                time.sleep(capacity_backoff_s())
        self.arm(inv)
        return inv

    def arm(self, inv: Inventory) -> None:
        """The cluster takes itself down once idle and no supervisor renews its lease."""
        lease_s = autostop.lease_seconds()
        Preparer(inv, reporter=self.reporter, registry=self.registry).ensure_prepared()  # the head's agent watches
        record = self.registry.cluster(inv.cluster)
        autostop.arm(inv, MANAGED_AUTOSTOP, request=record.request if record else {}, lease_s=lease_s)
        self.hold_lease(inv, lease_s)

    def hold_lease(self, inv: Inventory, lease_s: float) -> None:
        """Renew the cluster's lease on its head (a new head after a replacement) while this runs."""
        if self.lease is not None:
            self.lease.__exit__(None, None, None)
        self.lease = autostop.Lease(inv, lease_s).__enter__()

    def lost_now(self, inv: Inventory) -> dict[int, str]:
        """The nodes the platform says are gone (no ssh)."""
        provider = get_provider(inv.cloud)
        request = provisioner.request_to_dict(self.req) if self.req is not None else None
        try:
            return provider.lost_nodes(cluster_dir(inv.cluster), inv, request)
        except Exception as exc:  # noqa: BLE001 - no answer from the platform: the probes decide
            self.say(f"the platform did not say which nodes run: {exc}")
            return {}

    # -- one attempt ---------------------------------------------------------------------------
    def run_attempt(self, inv: Inventory, task: Any, req: Any, attempt: int) -> AttemptEnd:
        job = self.job()
        self.store.update(job.id, attempt=attempt, cluster_job=None)
        fencing.fence(inv, job.task_id, attempt)  # nothing of an older attempt runs, or starts, anywhere
        provider = get_provider(inv.cloud)
        spec = replace(JobSpec.of_task(task, req), task_id=job.task_id, epoch=attempt,
                       spot_notice=provider.spot_notice(provisioner.request_to_dict(req)))
        run_setup = True
        if (record := stages.of(job)) is not None:  # a pipeline's stage: it says which, and its start
            launch = stages.started(job.launch, cluster=inv.cluster, attempt=attempt)
            self.store.update(job.id, launch=json.dumps(launch))
            stage = stages.current(launch["pipeline"])
            spec = replace(spec, job_vars=stages.job_vars(record, stage))
            # the previous stage's setup ran on these very nodes: the first attempt skips it
            run_setup = not (stage["setup_skipped"] and stage["first_attempt"] == attempt)
            self.say(f"stage {stage['index']} ({stage['name']}) of {len(record['stages'])}"
                     + ("; its setup ran for the stage before, on these nodes: skipped" if not run_setup else ""))
        self.say(f"attempt {attempt}: starting every rank on {len(inv.nodes)} node(s)")
        self.stop_attempt.clear()
        with open(attempt_log(job.id, attempt), "a", buffering=1) as log:
            runner = AttemptRunner(inv, reporter=Reporter(stream=log, plain=True), registry=self.registry)
            thread, result = _in_thread(f"attempt-{attempt}", lambda: runner.run(
                spec, run_setup=run_setup, sync_file_mounts=True, detach=False, stop=self.stop_attempt.is_set))
            lost = self.monitor(inv, thread, lambda: runner.job_id, attempt)
            thread.join()
            error = result.get("error")
            # the job the attempt ran: its outcome's or its failure's; for an error that is no job's
            # failure (a changed host key), the one its runner made, if it got that far
            said = result["outcome"].job_id if "outcome" in result else getattr(error, "job_id", None)
            cluster_job = said if said is not None else runner.job_id
            if error is not None and not isinstance(error, (JobFailed, UserError)):
                raise error  # the attempt's end was recorded; anything else is the supervisor's own failure
            return self.ended(inv, runner, cluster_job, lost, aborted=self.stop_attempt.is_set())

    def monitor(self, inv: Inventory, thread: threading.Thread, cluster_job_of: Callable[[], int | None],
                attempt: int) -> dict[int, str]:
        """Until the attempt's thread ends: mark RUNNING once every rank runs (`cluster_job_of()`: the
        cluster job the attempt runs, once it exists); stop the attempt when a node is gone or the
        user cancels."""
        running = False
        next_check = time.monotonic() + tick_s()
        self.ended_at = None
        while thread.is_alive():
            # the job's own state (RUNNING, a cancel) is a local read: seen within half a second;
            # the platform (an API call on a cloud) is asked once a tick
            thread.join(min(tick_s(), LOCAL_POLL_S))
            if not thread.is_alive():
                self.ended_at = time.time()
                break
            job = self.job()
            if self.cancel_asked(job):
                self.stop_attempt.set()
                thread.join()
                raise Cancelled()
            until = hand_back_at()
            if until is not None and time.time() >= until and job.status == "RUNNING" and job.cluster_job:
                self.stop_attempt.set()  # lets go of the attempt's stream; the ranks run on
                thread.join()
                raise HandBack()
            cluster_job = cluster_job_of()
            if not running and cluster_job is not None:
                record = self.registry.job(inv.cluster, cluster_job)
                if record is not None and record.status == "RUNNING":
                    running = True
                    now = time.time()
                    self.store.set_status(job.id, "RUNNING", cluster_job=cluster_job,
                                          started_at=job.started_at or now)
                    self.store.resumed(job.id, attempt, now)
                    self.say(f"attempt {attempt}: every rank runs (cluster job {cluster_job})")
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + tick_s()
            lost = self.lost_now(inv)
            if lost:
                self.ended_at = time.time()
                self.say("lost: " + "; ".join(f"{inv.nodes[r].name} ({why})" for r, why in sorted(lost.items())
                                              if r < len(inv.nodes)))
                self.stop_attempt.set()
                return lost
        self.ended_at = self.ended_at or time.time()
        return {}

    def watch_again(self, inv: Inventory, job: ManagedJob) -> AttemptEnd:
        """A restarted supervisor: follow the attempt that runs, from its start."""
        assert job.cluster_job is not None
        with open(attempt_log(job.id, job.attempt), "a", buffering=1) as log:
            log.write(f"== attempt {job.attempt}: supervisor restarted; the attempt's output again from its "
                      "start ==\n")
            runner = AttemptRunner(inv, reporter=Reporter(stream=log, plain=True), registry=self.registry)
            nodes = inv.first(len(inv.nodes))
            self.stop_attempt.clear()
            # an error (the head did not answer) leaves no outcome: recovered below
            thread, result = _in_thread(f"attempt-{job.attempt}", lambda: runner.follow(
                job.cluster_job or 0, nodes, echo=True, stop=self.stop_attempt.is_set))
            lost = self.monitor(inv, thread, lambda: job.cluster_job, job.attempt)
            thread.join()
            outcome = result.get("outcome")
            if outcome is not None:
                runner.settle(job.cluster_job, nodes, outcome)
            return self.ended(inv, runner, job.cluster_job, lost, aborted=outcome is None)

    def ended(self, inv: Inventory, runner: JobRunner, cluster_job: int | None, lost: Mapping[int, str], *,
              aborted: bool) -> AttemptEnd:
        """What the attempt left: its record, the nodes lost (the platform's word, spot notices, and
        nodes silent past the grace), with what still runs of it stopped."""
        record = self.registry.job(inv.cluster, cluster_job) if cluster_job is not None else None
        lost = {**lost, **self.lost_now(inv)}  # gone nodes are not asked: they cannot answer
        alive = [n for n in inv.nodes if n.rank not in lost]
        if aborted or record is None or record.status not in ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED"):
            if cluster_job is not None:
                runner.stop_leftovers(cluster_job, alive)
            status = "ABORTED"
        else:
            status = record.status
        job = self.job()
        self.started_as(job, record)
        answers = fencing.query(inv, job.task_id, job.attempt, ranks=[n.rank for n in alive])
        for rank, answer in answers.items():
            if answer.doomed:
                lost.setdefault(rank, f"preempted: spot interruption notice ({answer.doomed})")
        silent = [r for r, a in answers.items() if not a.ok and r not in lost]
        if status != "SUCCEEDED" and silent:
            lost.update(self.wait_for_silent(inv, silent))
        codes = dict(record.returncodes) if record is not None and record.returncodes else {}
        return AttemptEnd(status=status, codes=codes, first_failed=record.failed_rank if record else None,
                          lost=lost)

    def started_as(self, job: ManagedJob, record: Any) -> None:
        """The job's start from its cluster job's record, when no look of the monitor saw it running
        (an attempt over between two looks, or while no supervisor lived)."""
        if job.started_at is None and record is not None and record.started_at is not None:
            self.store.update(job.id, started_at=record.started_at)

    def wait_for_silent(self, inv: Inventory, ranks: list[int]) -> dict[int, str]:
        """Nodes that did not answer: lost once the platform says so, or once silent for the grace
        (which starts again with every episode: a node that answered once is given a full one)."""
        deadline = time.monotonic() + grace_s()
        self.say(f"no answer from {', '.join(inv.nodes[r].name for r in ranks)}; waiting up to {grace_s():g} s")
        pending = set(ranks)
        while pending:
            self.check_cancel()
            gone = {r: why for r, why in self.lost_now(inv).items() if r in pending}
            if gone:
                return gone
            answers = fencing.query(inv, self.job().task_id, self.job().attempt, ranks=sorted(pending))
            pending -= {r for r, a in answers.items() if a.ok}
            if not pending:
                return {}
            if time.monotonic() > deadline:
                return {r: f"no answer for {grace_s():g} s" for r in sorted(pending)}
            time.sleep(min(tick_s(), 5.0))
        return {}

    # -- between attempts ----------------------------------------------------------------------
    def decision(self, end: AttemptEnd, recovery: JobRecovery) -> Decision:
        job = self.job()
        d = decide(end, recovery, restarts_so_far=job.restarts, transient_so_far=job.transient)
        if d.action != "finish":
            self.store.add_event(Event(job=job.id, attempt=job.attempt, kind=d.kind, cause=d.cause,
                                       nodes=[str(r) for r in d.replace], detected_at=self.ended_at or time.time(),
                                       resumed_at=None, exit_code=d.exit_code, failed_rank=d.failed_rank))
            counts = {"recovery": "recoveries", "transient": "transient"}
            more: dict[str, Any] = {"reason": d.cause}
            if d.kind in counts:
                more[counts[d.kind]] = getattr(job, counts[d.kind]) + 1
            if d.counted:
                more["restarts"] = job.restarts + 1
            self.store.set_status(job.id, "RECOVERING", **more)
            self.say(f"attempt {job.attempt} ended: {d.cause}; {d.action}")
        return d

    def recover(self, inv: Inventory, req: Any, decision: Decision, attempt: int) -> Inventory:
        """Fence the attempt everywhere, then replace the lost nodes (replacement.py: their records
        forgotten, they prepared, the head's watcher armed again) and renew the lease on the head."""
        job = self.job()
        confirmed = fencing.fence(inv, job.task_id, attempt + 1,
                                  ranks=[n.rank for n in inv.nodes if n.rank not in decision.replace])
        unconfirmed = [r for r, ok in confirmed.items() if not ok and r not in decision.replace]
        ranks = sorted({*decision.replace, *unconfirmed})
        if unconfirmed:
            self.say(f"could not fence {', '.join(inv.nodes[r].name for r in unconfirmed)}: replacing them too")
        if not ranks:
            if self.lease is None:
                self.arm(inv)
            return inv
        self.check_cancel()
        names = ", ".join(inv.nodes[r].name for r in ranks)
        self.say(f"replacing {names} (only these; the other nodes stay)")
        tries = 0
        lease_s = autostop.lease_seconds()
        while True:
            try:
                # the head may be new, and the workers' addresses are: the watcher is armed again
                inv = replacement.replace_nodes(inv, ranks, reporter=self.reporter, registry=self.registry,
                                                setting=MANAGED_AUTOSTOP, lease_s=lease_s,
                                                check=self.check_cancel).inv
                break
            except ProvisionError as exc:
                tries += 1
                if not exc.insufficient_capacity:
                    raise
                if tries > capacity_retries():
                    self.say(f"no capacity for {names} after {tries} tries: the whole cluster again elsewhere")
                    lifecycle.tear_down(inv.cluster, reporter=self.reporter, registry=self.registry)
                    task, req2, recovery = self.load(job)
                    if recovery.strategy == "EAGER_NEXT_REGION":
                        req2 = replace(req2, zone=None)
                    return self.bring_up(req2, task)
                self.say(f"no capacity for {names} ({exc}); again in {capacity_backoff_s():g} s")
                time.sleep(capacity_backoff_s())
            self.check_cancel()
        self.hold_lease(inv, lease_s)
        self.check_cancel()
        return inv

    # -- the end -------------------------------------------------------------------------------
    def finish(self, status: str, reason: str | None, *, exit_code: int | None = None,
               failed_rank: int | None = None, take_down: bool = True) -> int:
        """Take the cluster down (only one this job made), check nothing of it is left, then record
        the job's end."""
        job = self.store.get(self.job_id)
        assert job is not None
        if self.store.lease is not None and not self.store.lease.held():
            self.say(f"not ending the job {status}: this supervisor no longer holds its lease")
            return 0  # a runner that lost the job takes nothing down and writes nothing
        take_down = take_down and owner.owns(job)
        record = stages.of(job)
        closing: dict[str, Any] = {}
        if record is not None:  # written with the job's end, one write: never SKIPPED stages of a job going on
            stage = stages.current(record)
            closing["launch"] = json.dumps(stages.closed(job.launch, status, reason, attempt=job.attempt))
            if status != "SUCCEEDED":
                reason = f"stage {stage['index']} ({stage['name']}): {reason}" if reason else \
                    f"stage {stage['index']} ({stage['name']}) ended {status}"
        if status == "CANCELLED":
            self.store.set_status(job.id, "CANCELLING")
        self.say(f"job ends {status}" + (f": {reason}" if reason else "")
                 + ("; taking its cluster down" if take_down else ""))
        if self.lease is not None:
            self.lease.__exit__(None, None, None)
            self.lease = None
        left = self.take_down(job.cluster) if take_down else None
        if record is not None:
            earlier = self.sweep_stage_clusters(self.store.get(job.id) or job)
            if earlier:
                left = "; ".join([left, *earlier] if left else earlier)
        drop_secrets(job.id)
        if left:
            reason = f"{reason}; cluster NOT fully removed: {left}" if reason else f"cluster NOT fully removed: {left}"
        self.store.set_status(job.id, status, reason=reason, exit_code=exit_code, failed_rank=failed_rank,
                              destroyed=0 if left else 1, **closing)
        ended = self.store.get(job.id)
        if ended is not None and ended.terminal and (record is None or status == "SUCCEEDED"):
            freeze.release(ended, self.store)  # a pipeline that did not succeed keeps them: `jobs resume`
        self.say(f"managed job {job.id}: {status}")
        return 0 if status == "SUCCEEDED" else 1

    def conclude(self, status: str, reason: str | None, *, exit_code: int | None = None,
                 failed_rank: int | None = None, take_down: bool = True) -> int:
        """The attempts are over: the job's end, or, for a pipeline's stage that succeeded with more
        to come, the next stage."""
        job = self.job()
        record = stages.of(job)
        if record is None or status != "SUCCEEDED" or int(record["current"]) >= len(record["stages"]):
            return self.finish(status, reason, exit_code=exit_code, failed_rank=failed_rank, take_down=take_down)
        return self.next_stage(job, record)

    def next_stage(self, job: ManagedJob, record: dict[str, Any]) -> int:
        """Stage K succeeded: stage K+1 runs on the same cluster when it asks for the same one (its
        setup skipped when it is the same), else on a cluster of its own, and K's goes. The stage that
        succeeded and the next one's start are one write of the job's row."""
        done = stages.closed(job.launch, "SUCCEEDED", None, attempt=job.attempt)
        stage = stages.current(record)
        nxt = stage["index"] + 1
        prev_req, prev_task = self.req, self.task
        try:
            task, req, _ = self.load(replace(job, launch=stages.advanced(done, cluster=job.cluster)))
        except UserError as exc:  # the next stage cannot be read again: it, not the one that succeeded, failed
            self.store.update(job.id, launch=json.dumps(stages.advanced(done, cluster=job.cluster)))
            return self.finish("FAILED_SUPERVISOR", f"its task could not be loaded: {exc.message}")
        reuse = (owner.owns(job) and stages.same_cluster(provisioner.request_to_dict(prev_req),
                                                         provisioner.request_to_dict(req))
                 and get_provider(req.cloud).removed_itself(cluster_dir(job.cluster)) is None)
        if reuse:
            cluster = job.cluster
        else:
            cluster = launch_cluster_name(job, nxt, self.store, self.registry)
        # what the setup sees is the same as for the stage before: skipped on the same nodes
        setup_same = reuse and bool(task.setup) and stages.same_setup(prev_task, task)
        launch = stages.advanced(done, cluster=cluster, reused=reuse, setup_skipped=setup_same)
        # each stage has its own recovery budgets, as a managed job of its own would
        self.store.update(job.id, launch=json.dumps(launch), cluster=cluster, status="PENDING",
                          task_id=stages.task_id(record, nxt), cluster_job=None, reason=None, restarts=0, transient=0)
        self.say(f"stage {stage['index']} ({stage['name']}) succeeded; stage {nxt} "
                 f"({launch['pipeline']['stages'][nxt - 1]['name']}) runs "
                 + (f"on the same cluster {cluster}" if reuse else f"on a cluster of its own, {cluster}"))
        if not reuse:
            if self.lease is not None:
                self.lease.__exit__(None, None, None)
                self.lease = None
            self.sweep_stage_clusters(self.job())
        return self._run(self.job())

    def sweep_stage_clusters(self, job: ManagedJob) -> list[str]:
        """A pipeline's clusters other than the current stage's (made for an earlier stage), taken
        down: a supervisor that died between a stage's end and its cluster's removal leaves one.
        What could not be removed, said."""
        left = []
        for cluster in (stages.of(job) or {}).get("clusters", []):
            if cluster == job.cluster:
                continue
            if self.registry.remote is not None:
                self.registry.adopt(cluster)  # made by another runner's supervisor: its records are in the bucket
            if owner.owns(replace(job, cluster=cluster)):
                self.say(f"taking down {cluster}, an earlier stage's cluster")
                if (what := self.take_down(cluster)) is not None:
                    self.say(f"cluster {cluster} NOT fully removed: {what}")
                    left.append(f"{cluster}: {what}")
        return left

    def gone(self, job: ManagedJob, *, own: bool) -> int:
        """The job's cluster went while no supervisor watched (`gpuctl down`, its own autodown once
        the lease ran out): never made again. The attempt's outcome, where a record of it survived,
        else LOST with why. `own`: what is left of it (records of an autodown) is the job's to
        remove."""
        cluster = self.registry.cluster(job.cluster)
        if own and cluster is not None:  # the outcomes its head left as it went are recorded first
            autostop.reconcile(job.cluster, cluster.status, self.registry)
        record = self.registry.job(job.cluster, job.cluster_job) if job.cluster_job is not None else None
        if record is not None and record.status in ("SUCCEEDED", "FAILED", "FAILED_SETUP") and record.ended_at:
            codes = dict(record.returncodes or {})
            failed = record.failed_rank
            self.started_as(job, record)
            return self.conclude(record.status, None if record.status == "SUCCEEDED" else record.detail,
                                 exit_code=codes.get(failed) if failed is not None else None, failed_rank=failed,
                                 take_down=own)
        how = "it removed itself once no supervisor renewed its lease" if own else "it was removed (`gpuctl down`)"
        return self.finish("LOST", f"its cluster {job.cluster} is gone ({how}) while the job was {job.status}; "
                           f"the outcome of attempt {job.attempt} is unknown", take_down=own)

    def take_down(self, cluster: str) -> str | None:
        """Destroy the cluster and check it: None when nothing is left, else what is.

        The check asks the platform, as recovery does, about every node the cluster had: from a
        private copy of the cluster's records taken before `down` removes them (a local node's
        namespace and sshd; an instance's state in EC2)."""
        if self.registry.remote is not None:
            self.registry.adopt(cluster)  # what another runner made is in the bucket, not (yet) here
        inv = provisioner.load_inventory_of(cluster)
        if inv is None and not (cluster_dir(cluster) / "terraform").exists():
            # stamped (owner.json) but nothing made yet: no Terraform to ask
            shutil.rmtree(cluster_dir(cluster), ignore_errors=True)
            self.registry.forget(cluster)
            return None
        request = provisioner.load_cluster(cluster)[0] if inv is not None else {}
        with tempfile.TemporaryDirectory(prefix="gpuctl-down-check-") as tmp:
            records = Path(tmp) / cluster
            if inv is not None:
                shutil.copytree(cluster_dir(cluster), records, symlinks=True, ignore=_records_only)
            for attempt in (1, 2):
                try:
                    lifecycle.tear_down(cluster, reporter=self.reporter, registry=self.registry)
                    break
                except (ProvisionError, UserError) as exc:
                    self.say(f"teardown {attempt} failed: {exc}")
                    if attempt == 2:
                        return f"terraform destroy failed: {exc}"
            if inv is None:
                return None
            try:
                gone = get_provider(inv.cloud).lost_nodes(records, inv, request)
            except Exception as exc:  # noqa: BLE001 - an unchecked teardown is said, not hidden
                return f"could not check that the nodes are gone: {exc}"
        left = [n.name for n in inv.nodes if n.rank not in gone]
        return ", ".join(left) + " still there" if left else None


def _in_thread(name: str, work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """`work()` in a thread the supervisor watches beside it; its result under "outcome" or what
    it raised under "error", once the thread ended."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["outcome"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the supervisor's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def _records_only(directory: str, names: list[str]) -> set[str]:
    """copytree's filter for the teardown check: the cluster's small records, not its Terraform
    state, keys, sockets or the nodes' homes."""
    skip = {"terraform", "cm", "ssh", "home"}
    out = set()
    for name in names:
        path = Path(directory) / name
        if name in skip or path.is_socket() or (path.is_file() and path.stat().st_size > 1 << 20):
            out.add(name)
    return out


def capacity_retries() -> int:
    try:
        return max(0, int(os.environ.get("GPUCTL_MANAGED_CAPACITY_RETRIES") or 3))
    except ValueError:
        return 3


def main(job_id: int) -> int:
    """`gpuctl _supervise ID`: the detached supervisor's entry point."""
    return Supervisor(job_id).run()
