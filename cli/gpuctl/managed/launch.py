"""Starting, finding and reviving managed jobs' supervisors; cancelling a job.

A supervisor is `gpuctl _supervise ID`, detached (its own session, output to the job's
supervisor.log), on the machine that holds the Terraform state and the credentials. Nothing else
keeps it alive: every `gpuctl jobs ...` command (and `gpuctl status`) looks for jobs that have not
ended and whose supervisor is gone, and starts one again. The new one claims the job only if the
dead one still holds it (store.claim), so two commands reviving at once start one owner.

With shared state the same holds across runners: a job's supervisor holds its lease in the bucket
(managed/shared.py), and any runner whose command finds a lease run out (or a job nobody ever
claimed) brings the job's kept task, files and secrets to itself and starts a supervisor, which
takes the lease only if it is still the run-out one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuctl.jobplane import joblogs
from gpuctl.managed import freeze, stages
from gpuctl.managed.store import ManagedJob, Store, supervisor_log, write_secrets
from gpuctl.spec.request import PORTABLE_NAME_MAX

MAX_CLUSTER_NAME = PORTABLE_NAME_MAX  # every provider takes it (AWS: 32)
CLAIM_GRACE_S = 60.0


def cluster_name(job_name: str, job_id: int, n: int = 1) -> str:
    """The job's own cluster: `<name>-mj<id>` (the `n`th choice: `<name>-mj<id>-<n>`), in the
    characters a cluster name allows."""
    suffix = f"-mj{job_id}" + (f"-{n}" if n > 1 else "")
    base = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-") or "job"
    if not base[0].isalpha():
        base = "j" + base
    return base[: MAX_CLUSTER_NAME - len(suffix)].rstrip("-") + suffix


def task_id(cluster: str, job_id: int, submitted_at: float) -> str:
    """The id every attempt shares (SkyPilot's sky-managed-<time>_<name>_<id>)."""
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime(submitted_at))
    return f"gpuctl-managed-{stamp}_{cluster}_{job_id}"


def create(*, name: str, file: Path, text: str, envs: Mapping[str, str], secrets: Mapping[str, str],
           infra: str | None, num_nodes: int | None, store: Store | None = None,
           taken: Callable[[str], bool] = lambda name: False, pipeline: Any = None) -> ManagedJob:
    """A PENDING job for FILE (`text`: the YAML as read and checked), with its task and local files
    kept (freeze.py) and its secrets in its private directory (never in the table); its cluster's
    name is one that `taken` (an existing cluster, another job's) does not know. `pipeline`
    (spec.pipeline.Pipeline): its stages run one after another, the first one first."""
    store = store or Store()
    now = time.time()
    # the directory it was launched from: a task's relative workdir is read from there, as apply reads it
    launch = {"file": str(file.resolve()), "cwd": os.getcwd(), "envs": dict(envs), "infra": infra,
              "num_nodes": num_nodes, "cluster_token": cluster_token(), "secrets": sorted(secrets)}
    store.pull()  # with shared state, other runners' jobs name clusters too
    used = {job.cluster for job in store.all()}

    def cluster_of(job_id: int) -> str:
        return free_cluster_name(name, job_id, lambda c: c in used or taken(c))

    job = store.create(name=name, launch=launch, cluster_of=cluster_of,
                       task_id_of=lambda i: task_id(cluster_of(i), i, now))
    if secrets:
        write_secrets(job.id, dict(secrets))
    try:
        frozen = freeze.freeze(job.id, file, text,
                               stages=[s.text for s in pipeline.stages] if pipeline is not None else None)
    except BaseException:  # refused (UserError) or interrupted: no job is left behind
        store.delete(job.id)
        raise
    kept_launch: dict[str, Any] = {**launch, "frozen": frozen}
    more: dict[str, Any] = {}
    if pipeline is not None:
        kept_launch["pipeline"] = stages.new(pipeline.name, [(s.name, s.line) for s in pipeline.stages],
                                             job.cluster, job.task_id)
        more["task_id"] = stages.task_id(kept_launch["pipeline"], 1)
    store.update(job.id, launch=json.dumps(kept_launch), **more)
    kept = store.get(job.id) or job
    try:
        freeze.push(kept, store)  # shared state: for whichever runner takes the job over
    except BaseException:
        store.delete(job.id)
        raise
    return kept


def free_cluster_name(job_name: str, job_id: int, taken: Callable[[str], bool], *, start: int = 1) -> str:
    """`<name>-mj<id>` (from the `start`th choice on: `<name>-mj<id>-<start>`), or the next choice when
    a cluster (the user's own `gpuctl apply`) or another job already has that name: a managed job
    never runs on, nor removes, a cluster it did not make."""
    for n in range(start, start + 1000):
        if not taken(candidate := cluster_name(job_name, job_id, n)):
            return candidate
    raise RuntimeError(f"no free cluster name for managed job {job_id}")


def stage_cluster_name(job: ManagedJob, stage: int, store: Store, registry: Any) -> str:
    """The cluster of a pipeline's stage that cannot run on the one before's: `<name>-mj<id>-<stage>`,
    or the next choice that no cluster of the pipeline's, of another job's, of the registry's or on
    the platform has."""
    from gpuctl.provision.provisioner import cluster_exists  # a stage's hand-over only

    record = stages.of(job) or {}
    used = set(record.get("clusters", [])) | {j.cluster for j in store.all() if j.id != job.id}
    return free_cluster_name(job.name, job.id, lambda c: c in used or cluster_exists(c)
                             or registry.cluster(c) is not None, start=stage)


def cluster_token() -> str:
    """The token a job's cluster is stamped with when its supervisor makes it (owner.json)."""
    import secrets

    return secrets.token_hex(16)


def spawn(job_id: int, *, until: float | None = None) -> int:
    """Start a supervisor for the job, detached; its PID (it claims the job itself). `until`: the
    time it hands the job back at (`jobs supervise --for`), once every rank runs."""
    log = supervisor_log(job_id)
    extra = {HAND_BACK_ENV: repr(until)} if until is not None else {}
    with open(log, "ab") as out:
        os.chmod(log, 0o600)
        proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "_supervise", str(job_id)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "GPUCTL_PLAIN": "1", **extra})
    return proc.pid


HAND_BACK_ENV = "GPUCTL_MANAGED_HAND_BACK_AT"


def supervisor_alive(job: ManagedJob) -> bool:
    return job.supervisor_pid is not None and joblogs.same_process(job.supervisor_pid, job.supervisor_start or "")


def wait_claimed(store: Store, job_id: int, pid: int, timeout: float = 30.0) -> bool:
    """Whether the supervisor `pid` (or another live one) holds the job within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get(job_id)
        if job is None or job.terminal or (job.supervisor_pid == pid and supervisor_alive(job)):
            return True
        if job.supervisor_pid not in (None, pid) and supervisor_alive(job):
            return True
        time.sleep(0.1)
    return False


def revive(store: Store | None = None, *, say: Callable[[str], None] | None = None,
           until: float | None = None) -> list[int]:
    """Start a supervisor for every job not ended whose supervisor died; the ids revived. With
    shared state, also for another runner's job whose lease ran out (`say` tells of each)."""
    store = store or Store()
    if store.bucket is not None:
        return _revive_shared(store, say or (lambda text: None), until)
    if not store.path.exists():
        return []
    revived = []
    now = time.time()
    for job in store.all():
        # a job whose launcher died before its supervisor claimed it counts too, once it had the time
        unclaimed = job.supervisor_pid is None and now - job.submitted_at > CLAIM_GRACE_S
        if not job.terminal and (unclaimed or job.supervisor_pid is not None) and not supervisor_alive(job):
            spawn(job.id, until=until)
            revived.append(job.id)
    return revived


def _revive_shared(store: Store, say: Callable[[str], None], until: float | None) -> list[int]:
    from gpuctl.managed import shared

    store.pull()
    me = shared.runner_identity()["id"]
    revived = []
    for job in store.all():
        if job.terminal or supervisor_alive(job):
            continue  # ended, or a supervisor of this runner's has it (or is taking its lease)
        lease = shared.read_lease(store.bucket, job.id)
        if lease is None:
            if job.supervisor_runs == 0 and time.time() - job.submitted_at <= CLAIM_GRACE_S:
                continue  # its launcher is starting its supervisor
            why = ("no supervisor ever took it" if job.supervisor_runs == 0 else
                   "its last supervisor handed it back (`jobs supervise --for`) or ended without a word")
        elif lease.runner == me:
            if lease.live_here(me):
                continue
            why = None  # this runner's own supervisor died: started again, as with local state
        elif not lease.expired:
            continue
        else:
            why = f"its supervisor on {lease.text()} stopped renewing its lease {lease.age:.0f} s ago"
        if lease is None or lease.runner != me:
            problem = take_over(store, job)
            if problem is not None:
                say(f"Managed job {job.id} ({job.name}) needs a supervisor ({why}), but this runner cannot "
                    f"take it over: {problem}")
                continue
            say(f"Taking over managed job {job.id} ({job.name}): {why}")
        spawn(job.id, until=until)
        revived.append(job.id)
    return revived


def take_over(store: Store, job: ManagedJob) -> str | None:
    """What a supervisor on this runner needs of a job launched elsewhere: its kept task and files
    from the bucket, its secrets from this runner's environment. Why it cannot, else None."""
    from gpuctl.managed import shared
    from gpuctl.managed.store import drop_secrets

    names = job.launch.get("secrets") or []
    found, missing = shared.missing_secrets(names)
    if missing:
        return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set in its environment "
                "(a job's secrets are never in the state bucket: set them, by name, on every runner "
                "that may take jobs over)")
    problem = freeze.pull(job, store)
    if problem is not None:
        return problem
    if found:
        write_secrets(job.id, found)
    else:
        drop_secrets(job.id)
    return None
