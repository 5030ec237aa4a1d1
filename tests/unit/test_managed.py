"""Managed jobs without nodes: SkyPilot's job_recovery spellings, the recovery policy's rules, the
store's compare-and-set ownership, and the CLI's refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl.managed import launch
from gpuctl.managed.policy import AttemptEnd, decide
from gpuctl.managed.store import Event, Store, attempt_log, drop_secrets, read_secrets
from gpuctl.spec import load_task
from gpuctl.spec.recovery import JobRecovery, RecoveryError, parse_job_recovery

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, expected", [
    (None, None),
    ("FAILOVER", JobRecovery(strategy="FAILOVER")),
    ("eager_next_region", JobRecovery()),
    ("none", JobRecovery()),
    ({"max_restarts_on_errors": 2}, JobRecovery(max_restarts_on_errors=2)),
    ({"strategy": "FAILOVER", "recover_on_exit_codes": 33}, JobRecovery(strategy="FAILOVER", recover_on_exit_codes=(33,))),
    ({"recover_on_exit_codes": [33, 34, 33]}, JobRecovery(recover_on_exit_codes=(33, 34))),
    ({"strategy": None, "max_restarts_on_errors": None}, JobRecovery()),
])
def test_skypilot_spellings(value: object, expected: JobRecovery | None) -> None:
    assert parse_job_recovery(value) == expected


@pytest.mark.parametrize("value, key, words", [
    ("SOMEWHERE", "strategy", "is not a strategy"),
    ({"max_restarts_on_errors": -1}, "max_restarts_on_errors", "0 or more"),
    ({"max_restarts_on_errors": True}, "max_restarts_on_errors", "whole number"),
    ({"recover_on_exit_codes": [0]}, "recover_on_exit_codes", "1 to 255"),
    ({"recover_on_exit_codes": "33"}, "recover_on_exit_codes", "not an exit code"),
    ({"retries": 3}, "retries", "unknown key"),
    (7, "", "a strategy name or a mapping"),
])
def test_bad_settings_say_what_to_write(value: object, key: str, words: str) -> None:
    with pytest.raises(RecoveryError, match=words) as err:
        parse_job_recovery(value)
    assert err.value.key == key


def test_the_task_reads_job_recovery_and_its_alias(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  infra: local\n  spot_recovery: {max_restarts_on_errors: 1}\nrun: 'true'\n")
    task = load_task(path)
    assert task.resources.job_recovery == JobRecovery(max_restarts_on_errors=1)
    assert not any("job_recovery" in w for w in task.warnings)


def test_a_bad_job_recovery_names_the_field_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  infra: local\n  job_recovery: {max_restarts_on_errors: lots}\nrun: 'true'\n")
    proc = gpuctlfork.run(["validate", str(path)],
                          cwd=REPO, env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "job_recovery.max_restarts_on_errors" in proc.stderr and str(path) in proc.stderr


RECOVERY = JobRecovery(max_restarts_on_errors=1, recover_on_exit_codes=(33,))


def test_a_lost_node_is_always_recovered_and_only_it_is_replaced() -> None:
    end = AttemptEnd(status="FAILED", codes={0: 143, 1: None, 2: 143}, lost={1: "namespace gone"})
    d = decide(end, RECOVERY, restarts_so_far=5, transient_so_far=9)
    assert d.action == "recover" and d.replace == (1,) and d.kind == "recovery" and "namespace gone" in d.cause


def test_user_errors_restart_as_many_times_as_allowed_then_fail() -> None:
    end = AttemptEnd(status="FAILED", codes={0: 1, 1: 143}, first_failed=0)
    first = decide(end, RECOVERY, restarts_so_far=0, transient_so_far=0)
    assert first.action == "restart" and first.counted and first.exit_code == 1 and first.failed_rank == 0
    second = decide(end, RECOVERY, restarts_so_far=1, transient_so_far=0)
    assert second.action == "finish" and second.status == "FAILED" and second.exit_code == 1
    assert "rank 0 exited with code 1" in second.cause


def test_listed_exit_codes_restart_every_time_without_counting() -> None:
    end = AttemptEnd(status="FAILED", codes={0: 0, 1: 33}, first_failed=1)
    d = decide(end, RECOVERY, restarts_so_far=99, transient_so_far=0)
    assert d.action == "restart" and not d.counted and d.exit_code == 33 and d.failed_rank == 1


def test_setup_failures_end_failed_setup() -> None:
    end = AttemptEnd(status="FAILED_SETUP", codes={0: 0, 1: 2}, first_failed=1)
    d = decide(end, JobRecovery(), restarts_so_far=0, transient_so_far=0)
    assert d.action == "finish" and d.status == "FAILED_SETUP" and "in setup" in d.cause


def test_ranks_lost_with_every_node_up_restart_from_their_own_budget() -> None:
    end = AttemptEnd(status="FAILED", codes={0: 143, 1: None}, first_failed=1)
    assert decide(end, JobRecovery(), restarts_so_far=0, transient_so_far=2).action == "restart"
    spent = decide(end, JobRecovery(), restarts_so_far=0, transient_so_far=3)
    assert spent.action == "finish" and spent.status == "FAILED" and "budget" in spent.cause
    assert decide(AttemptEnd(status="SUCCEEDED", codes={0: 0}), JobRecovery(), restarts_so_far=0,
                  transient_so_far=0).status == "SUCCEEDED"


TASK = "resources:\n  infra: local\nrun: 'true'\n"


def test_store_claims_once_keeps_events_and_private_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    store = Store()
    job = launch.create(name="Train LLM!", file=tmp_path / "t.yaml", text=TASK, envs={"A": "1"},
                        secrets={"TOKEN": "s3cr3t"}, infra=None, num_nodes=None, store=store)
    assert job.cluster == f"train-llm-mj{job.id}" and job.task_id.endswith(f"_{job.cluster}_{job.id}")
    assert "s3cr3t" not in store.path.read_bytes().decode(errors="replace")
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    assert read_secrets(job.id) == {"TOKEN": "s3cr3t"}
    assert oct((tmp_path / "managed" / str(job.id) / "secrets.json").stat().st_mode & 0o777) == "0o600"
    # two supervisors started at once: one owner
    assert store.claim(job.id, 100, "7", previous=(None, None))
    assert not store.claim(job.id, 200, "8", previous=(None, None))
    assert store.owns(job.id, 100, "7") and not store.owns(job.id, 200, "8")
    store.add_event(Event(job=job.id, attempt=1, kind="recovery", cause="rank 1 lost", nodes=["1"], detected_at=10.0,
                          resumed_at=None, exit_code=None, failed_rank=None))
    store.resumed(job.id, 2, 25.0)
    assert store.events(job.id)[0].resumed_at == 25.0
    store.set_status(job.id, "SUCCEEDED")
    store.set_status(job.id, "RUNNING")  # a late write never revives an ended job
    assert store.get(job.id).status == "SUCCEEDED" and store.get(job.id).ended_at
    drop_secrets(job.id)
    assert read_secrets(job.id) == {}
    assert attempt_log(job.id, 1).parent.stat().st_mode & 0o077 == 0


def test_cluster_names_fit_the_rules() -> None:
    assert launch.cluster_name("x" * 80, 12345) == "x" * 24 + "-mj12345"  # 32: what every provider takes
    assert launch.cluster_name("9lives", 1) == "j9lives-mj1"
    assert launch.cluster_name("--", 2) == "job-mj2"


def _gpuctl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return gpuctlfork.run([*args], cwd=REPO,
                          env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}, timeout=60)


def test_cli_refusals_are_one_line_with_exit_2(tmp_path: Path) -> None:
    ssh_task = tmp_path / "ssh.yaml"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - {ip: 10.0.0.1, user: me}\n")
    ssh_task.write_text(f"resources:\n  infra: ssh/{hosts}\nrun: 'true'\n")
    nothing = tmp_path / "nothing.yaml"
    nothing.write_text("resources:\n  infra: local\n")
    for args, words in [(("jobs", "logs", "42"), "managed job 42 not found"),
                        (("jobs", "cancel", "42"), "managed job 42 not found"),
                        (("jobs", "launch", str(nothing)), "there is nothing to run"),
                        (("jobs", "launch", str(ssh_task)), "needs nodes gpuctl makes")]:
        proc = _gpuctl(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    empty = _gpuctl(tmp_path, "jobs", "queue", "-o", "json")
    assert empty.returncode == 0 and json.loads(empty.stdout)["jobs"] == []


def test_logs_of_an_attempt_that_never_was_is_one_line(tmp_path: Path) -> None:
    store = Store(tmp_path / "state" / "managed.db")
    job = launch.create(name="t", file=tmp_path / "t.yaml", text=TASK, envs={}, secrets={}, infra=None, num_nodes=None,
                        store=store)
    proc = _gpuctl(tmp_path, "jobs", "logs", str(job.id), "--attempt", "3")
    assert proc.returncode == 2 and "has 0 attempt(s) so far" in proc.stderr and "Traceback" not in proc.stderr


def _supervised_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: object):
    from gpuctl.managed import supervisor

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    task = tmp_path / "t.yaml"
    task.write_text(TASK)
    store = Store()
    job = launch.create(name="t", file=task, text=TASK, envs={}, secrets={"TOKEN": "x"}, infra=None, num_nodes=None,
                        store=store)
    if fields:
        store.update(job.id, **fields)
    return supervisor, store, job


def test_a_supervisor_that_keeps_dying_fails_the_job_and_drops_its_secrets(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, store, job = _supervised_job(tmp_path, monkeypatch, supervisor_runs=10, status="RUNNING")
    assert supervisor.Supervisor(job.id).run() == 1
    ended = store.get(job.id)
    assert ended.status == "FAILED_SUPERVISOR" and "stopped 10 times" in ended.reason and ended.destroyed
    assert read_secrets(job.id) == {}


def test_no_capacity_ends_failed_no_resource(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.common.errors import ProvisionError

    supervisor, store, job = _supervised_job(tmp_path, monkeypatch)
    monkeypatch.setenv("GPUCTL_MANAGED_CAPACITY_RETRIES", "1")
    monkeypatch.setenv("GPUCTL_MANAGED_BACKOFF_S", "0.05")
    tries = []

    def no_capacity(*args: object, **kwargs: object) -> None:
        tries.append(1)
        raise ProvisionError("InsufficientInstanceCapacity: no p5 in us-east-1a", insufficient_capacity=True)

    monkeypatch.setattr(supervisor.lifecycle, "bring_up", no_capacity)
    supervisor.Supervisor(job.id).run()
    ended = store.get(job.id)
    assert len(tries) == 2 and ended.status == "FAILED_NO_RESOURCE" and "InsufficientInstanceCapacity" in ended.reason


def test_a_second_supervisor_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, store, job = _supervised_job(tmp_path, monkeypatch)
    live = subprocess.Popen(["sleep", "30"])
    try:
        from gpuctl.jobplane.joblogs import process_start

        assert store.claim(job.id, live.pid, process_start(live.pid) or "", previous=(None, None))
        assert supervisor.Supervisor(job.id).run() == 0  # claimed by another: it leaves
        assert store.get(job.id).supervisor_pid == live.pid and store.get(job.id).status == "PENDING"
    finally:
        live.kill()
        live.wait()


def test_following_a_job_shows_the_supervisors_progress_as_it_comes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`jobs launch` follows the job: the supervisor's lines (provisioning, recovery, teardown) on one
    stream, whole lines only, beside the attempts' output; `jobs logs` only what comes from then on."""
    import io

    from gpuctl import jobscli
    from gpuctl.managed.store import supervisor_log

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    store = Store()
    job = launch.create(name="t", file=tmp_path / "t.yaml", text=TASK, envs={}, secrets={}, infra=None, num_nodes=None,
                        store=store)
    log = supervisor_log(job.id)
    log.write_text("10:00:00 supervisor 1 takes managed job 1\n==> Provisioning 2 local node(s)\n")
    progress, out = io.StringIO(), io.StringIO()
    from_start = jobscli.Progress(job.id, progress, from_start=True)
    from_now = jobscli.Progress(job.id, later := io.StringIO(), from_start=False)
    from_start.show()
    assert progress.getvalue().splitlines() == ["10:00:00 supervisor 1 takes managed job 1",
                                                "==> Provisioning 2 local node(s)"]
    with open(log, "a") as fh:
        fh.write("10:00:09 attempt 1: starting every rank\n10:00:10 half a li")  # the last line being written
    from_start.show()
    assert progress.getvalue().splitlines()[2:] == ["10:00:09 attempt 1: starting every rank"]
    store.update(job.id, attempt=1)
    attempt_log(job.id, 1).write_text("(head, rank=0) hello\n")
    store.set_status(job.id, "SUCCEEDED")
    with open(log, "a") as fh:
        fh.write("ne\n")
    final = jobscli.follow_logs(store, job.id, attempt=None, follow=True, out=out, progress=from_start)
    assert final.status == "SUCCEEDED"
    assert out.getvalue().splitlines() == ["== attempt 1 ==", "(head, rank=0) hello"]
    assert progress.getvalue().splitlines()[2:] == ["10:00:09 attempt 1: starting every rank", "10:00:10 half a line"]
    from_now.show()
    assert later.getvalue().splitlines() == ["10:00:09 attempt 1: starting every rank", "10:00:10 half a line"]


def test_launch_keeps_the_task_and_its_files_and_names_a_free_cluster(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What a job runs is what `jobs launch` read: the task (secret values left out of it), its
    workdir as a node would get it and its local file_mount sources, kept content-addressed; the
    user's files may change or go. Its cluster's name is one no cluster has."""
    from gpuctl.managed import freeze
    from gpuctl.providers import resources_problem
    from gpuctl.spec import load_task

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    workdir = tmp_path / "wd"
    (workdir / "big").mkdir(parents=True)
    (workdir / "train.py").write_text("print('v1')\n")
    (workdir / ".gitignore").write_text("big/\n")
    (workdir / "big" / "blob").write_text("left out, as the sync leaves it out")
    (tmp_path / "data.txt").write_text("d1")
    text = ("name: t\nworkdir: wd\nsecrets:\n  TOKEN: literal-s3cr3t\nfile_mounts:\n  /opt/data.txt: ./data.txt\n"
            "  /mnt/b: s3://bucket/x\nresources:\n  infra: local\nrun: python train.py\n")
    task = tmp_path / "t.yaml"
    task.write_text(text)
    store = Store()
    first = launch.create(name="t", file=task, text=text, envs={}, secrets={"TOKEN": "literal-s3cr3t"}, infra=None,
                          num_nodes=None, store=store, taken=lambda c: c == "t-mj1")
    assert first.cluster == "t-mj1-2" and first.task_id.endswith("_t-mj1-2_1")
    kept = freeze.frozen_task(first)
    assert kept is not None and "literal-s3cr3t" not in kept.read_text()
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    task.unlink()
    (workdir / "train.py").write_text("print('v2')\n")
    (tmp_path / "data.txt").unlink()
    loaded = load_task(kept, secret_overrides=read_secrets(first.id), resources_check=resources_problem)
    assert loaded.workdir is not None and (loaded.workdir / "train.py").read_text() == "print('v1')\n"
    assert not (loaded.workdir / "big").exists()
    assert [p.read_text() for p in loaded.file_mounts.values()] == ["d1"]
    assert list(loaded.bucket_mounts) == ["/mnt/b"] and loaded.secrets == {"TOKEN": "literal-s3cr3t"}
    # the same workdir launched again is kept once; the trees go with the last job that used them
    (workdir / "train.py").write_text("print('v1')\n")
    (tmp_path / "data.txt").write_text("d1")
    task.write_text(text)
    second = launch.create(name="t", file=task, text=text, envs={}, secrets={}, infra=None, num_nodes=None,
                           store=store)
    assert second.cluster == "t-mj2" and second.launch["frozen"]["trees"] == first.launch["frozen"]["trees"]
    trees = tmp_path / "state" / "managed" / "trees"
    store.set_status(first.id, "SUCCEEDED")
    freeze.release(store.get(first.id), store)
    assert sorted(p.name for p in trees.iterdir()) == sorted(first.launch["frozen"]["trees"])  # still used
    store.set_status(second.id, "LOST")
    freeze.release(store.get(second.id), store)
    assert list(trees.iterdir()) == []


def test_a_supervisor_that_cannot_read_its_task_says_why_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job launched before gpuctl kept its task, whose file is gone: one end, naming the file."""
    supervisor, store, job = _supervised_job(tmp_path, monkeypatch, status="RUNNING")
    launch_doc = {k: v for k, v in job.launch.items() if k != "frozen"}
    store.update(job.id, launch=json.dumps(launch_doc))
    (tmp_path / "t.yaml").unlink()
    assert supervisor.Supervisor(job.id).run() == 1
    ended = store.get(job.id)
    assert ended.status == "FAILED_SUPERVISOR" and f"{tmp_path / 't.yaml'} is gone" in ended.reason, ended.reason


def test_a_workdir_that_cannot_be_kept_refuses_the_launch_and_leaves_no_job(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.common.errors import UserError
    from gpuctl.managed import freeze

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "wd").mkdir()
    text = "workdir: wd\nresources:\n  infra: local\nrun: 'true'\n"
    (tmp_path / "t.yaml").write_text(text)

    def unreadable(src: Path, dest: Path) -> None:  # rsync's "Permission denied" on a file it cannot read
        raise UserError(f"could not keep a copy of the workdir {src} for the managed job: Permission denied")

    monkeypatch.setattr(freeze, "_copy_workdir", unreadable)
    with pytest.raises(UserError, match="could not keep a copy of the workdir"):
        launch.create(name="t", file=tmp_path / "t.yaml", text=text, envs={}, secrets={"K": "v"}, infra=None,
                      num_nodes=None, store=Store())
    assert Store().all() == [] and not (tmp_path / "state" / "managed" / "1").exists()
    assert [p.name for p in (tmp_path / "state" / "managed" / "trees").iterdir()] == []
