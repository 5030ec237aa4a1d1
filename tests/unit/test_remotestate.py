"""Shared state in S3 without a network: settings, the lock, the cluster directory's sync,
job ids across runners (moto in-process stands in for S3)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from gpuctl.common.errors import UserError
from gpuctl.state import remotestate
from gpuctl.state.registry import Registry
from gpuctl.state.remotestate import Remote, sync
from gpuctl.state.remotestate.settings import StateSettings, state_settings
from gpuctl.state.remotestate.store import (
    ClusterLocked,
    S3Store,
    break_lock,
    cluster_lock,
    read_lock,
)
from mototest import STATE_BUCKET

BUCKET = STATE_BUCKET
CONFIG = Path("/etc/gpuctl/config.yaml")


@pytest.fixture()
def store(state_bucket: Remote) -> S3Store:
    return state_bucket.store


# -- settings ----------------------------------------------------------------------


def test_local_is_the_default_and_a_bucket_alone_means_s3() -> None:
    assert state_settings(None, path=CONFIG, env={}).remote is False
    s = state_settings(None, path=CONFIG, env={"GPUCTL_STATE_BUCKET": BUCKET, "AWS_REGION": "eu-west-1"})
    assert (s.bucket, s.prefix, s.region, s.lock_timeout) == (BUCKET, "gpuctl", "eu-west-1", 600)
    assert s.url("clusters/x") == f"s3://{BUCKET}/gpuctl/clusters/x"


def test_environment_overrides_the_file() -> None:
    raw = {"backend": "s3", "bucket": "file-bucket", "prefix": "a/b", "lock_timeout": 5,
           "endpoint_url": "http://127.0.0.1:9000/"}
    s = state_settings(raw, path=CONFIG, env={"GPUCTL_STATE_BUCKET": BUCKET, "GPUCTL_STATE_LOCK_TIMEOUT": "0"})
    assert (s.bucket, s.prefix, s.lock_timeout, s.endpoint_url) == (BUCKET, "a/b", 0, "http://127.0.0.1:9000")
    assert state_settings(raw, path=CONFIG, env={"GPUCTL_STATE_BACKEND": "local"}).remote is False


@pytest.mark.parametrize(("raw", "env", "message"), [
    ({"bucket": BUCKET, "dir": "x"}, {}, "unknown key state.dir"),
    ({"backend": "s3"}, {}, "also give the bucket (state.bucket in /etc/gpuctl/config.yaml or GPUCTL_STATE_BUCKET)"),
    ({"backend": "gcs", "bucket": BUCKET}, {}, "state.backend 'gcs': use local or s3"),
    ({"bucket": "Bad_Bucket"}, {}, "state.bucket 'Bad_Bucket': not an S3 bucket name"),
    ({"bucket": BUCKET, "prefix": "a//b"}, {}, "state.prefix 'a//b'"),
    ({"bucket": BUCKET, "endpoint_url": "127.0.0.1:9000"}, {}, "give a URL"),
    ({"bucket": BUCKET}, {"GPUCTL_STATE_LOCK_TIMEOUT": "soon"}, "GPUCTL_STATE_LOCK_TIMEOUT 'soon': give whole seconds"),
    ({"bucket": BUCKET, "region": "mars"}, {}, "state.region 'mars': not an AWS region"),
])
def test_bad_settings_are_one_line_naming_the_key(raw: dict, env: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        state_settings(raw, path=CONFIG, env=env)
    assert message in err.value.message and "\n" not in err.value.message


def test_terraform_backend_uses_the_lockfile_and_the_endpoint() -> None:
    remote = remotestate.Remote(StateSettings(bucket=BUCKET, prefix="p", endpoint_url="http://127.0.0.1:5000",
                                              kms_key_id="alias/k"), store=None)  # type: ignore[arg-type]
    block = remotestate.with_backend({"terraform": {"required_version": ">= 1.5"}, "module": {}}, "c1", remote)
    s3 = block["terraform"]["backend"]["s3"]
    assert block["terraform"]["required_version"] == ">= 1.5"
    assert (s3["bucket"], s3["key"], s3["use_lockfile"], s3["encrypt"], s3["kms_key_id"]) == \
        (BUCKET, "p/clusters/c1/terraform.tfstate", True, True, "alias/k")
    assert s3["endpoints"] == {"s3": "http://127.0.0.1:5000", "sts": "http://127.0.0.1:5000"} and s3["use_path_style"]
    assert remotestate.with_backend({"module": {}}, "c1", None) == {"module": {}}


# -- the lock ------------------------------------------------------------------------


def test_second_holder_fails_naming_the_first_and_only_the_owner_releases(store: S3Store) -> None:
    waits: list[str] = []
    with cluster_lock(store, "c1", command="gpuctl apply", on_wait=waits.append):
        holder = read_lock(store, "c1")
        assert holder and holder["command"] == "gpuctl apply" and "@" in holder["who"]
        with pytest.raises(ClusterLocked) as err:
            with cluster_lock(store, "c1", command="gpuctl down", on_wait=waits.append, timeout=0):
                pass
        assert err.value.exit_code == 3
        assert f"cluster 'c1' is locked by {holder['who']} (pid {holder['pid']}, `gpuctl apply`" in err.value.message
        assert "gpuctl force-unlock c1" in err.value.message
        # a force-unlock during our hold, then someone else's lock: ours must not remove theirs on exit
        assert break_lock(store, "c1") is not None
        assert store.put(store.key("locks", "c1.json"), json.dumps({"who": "other", "token": "x"}).encode(),
                         only_if_absent=True)
    assert read_lock(store, "c1") == {"who": "other", "token": "x"}
    assert break_lock(store, "c1") == {"who": "other", "token": "x"} and read_lock(store, "c1") is None
    with cluster_lock(store, "c1", command="gpuctl apply", on_wait=waits.append):
        pass
    assert read_lock(store, "c1") is None and waits == []


def _race_before_delete(store: S3Store, monkeypatch: pytest.MonkeyPatch, key: str, other: dict) -> list[int]:
    """Make the next delete of `key` lose a race: just before S3 receives it, another runner
    force-unlocks and takes the lock (`other`). The list counts the deletes S3 received."""
    real_delete = store.client.delete_object
    seen: list[int] = []

    def racing_delete(**kwargs: object) -> object:
        if kwargs.get("Key") == key and not seen:
            real_delete(Bucket=BUCKET, Key=key)
            assert store.put(key, json.dumps(other).encode(), only_if_absent=True)
        seen.append(1)
        return real_delete(**kwargs)

    monkeypatch.setattr(store.client, "delete_object", racing_delete)
    return seen


@pytest.mark.parametrize("command", ["gpuctl apply", "gpuctl down"])
def test_release_never_removes_a_lock_taken_after_a_force_unlock(store: S3Store, monkeypatch: pytest.MonkeyPatch,
                                                                 command: str) -> None:
    key = store.key("locks", "c1.json")
    other = {"who": "ci@runner-9", "token": "theirs"}
    with cluster_lock(store, "c1", command=command, on_wait=print):
        seen = _race_before_delete(store, monkeypatch, key, other)
    assert seen and read_lock(store, "c1") == other  # the release was sent, conditional on our ETag


def test_force_unlock_names_the_lock_it_removes_when_it_changed_hands(store: S3Store,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    key = store.key("locks", "c1.json")
    assert store.put(key, json.dumps({"who": "dead@runner-1", "token": "a"}).encode(), only_if_absent=True)
    other = {"who": "live@runner-2", "token": "b"}
    _race_before_delete(store, monkeypatch, key, other)
    assert break_lock(store, "c1") == other and read_lock(store, "c1") is None


def test_release_on_a_store_without_conditional_deletes_compares_first(store: S3Store,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """S3-compatible stores that answer If-Match on DeleteObject with NotImplemented still release."""
    from botocore.exceptions import ClientError

    real_delete = store.client.delete_object

    def no_conditional_delete(**kwargs: object) -> object:
        if "IfMatch" in kwargs:
            raise ClientError({"Error": {"Code": "NotImplemented"}}, "DeleteObject")
        return real_delete(**kwargs)

    monkeypatch.setattr(store.client, "delete_object", no_conditional_delete)
    with cluster_lock(store, "c1", command="gpuctl apply", on_wait=print):
        pass
    assert read_lock(store, "c1") is None


# -- the cluster directory --------------------------------------------------------------


def _cluster(root: Path) -> Path:
    cdir = root / "clusters" / "c1"
    (cdir / "ssh").mkdir(parents=True)
    (cdir / "ssh" / "id_ed25519").write_text("PRIVATE KEY\n")
    (cdir / "inventory.yml").write_text(f"ansible_ssh_private_key_file: {cdir}/ssh/id_ed25519\n")
    (cdir / "terraform" / ".terraform").mkdir(parents=True)
    (cdir / "terraform" / ".terraform" / "huge-provider").write_text("binary")
    (cdir / "terraform" / "main.tf.json").write_text("{}")
    (cdir / "terraform" / "terraform.tfstate").write_text("{}")
    for machine_local in ("cm", "runner", "jobs", "nodes"):
        (cdir / machine_local).mkdir()
        (cdir / machine_local / "x").write_text("local only")
    return cdir


def test_pull_brings_the_cluster_to_another_state_dir_with_its_own_paths(store: S3Store, tmp_path: Path) -> None:
    a = _cluster(tmp_path / "a")
    assert sync.push_files(store, "c1", a) == 3
    assert sync.push_files(store, "c1", a) == 0  # unchanged: nothing moves
    keys = sorted(store.list(store.key("clusters", "c1", "files") + "/"))
    assert [k.rsplit("/files/", 1)[1] for k in keys] == ["inventory.yml", "ssh/id_ed25519", "terraform/main.tf.json"]
    stored = store.get(store.key("clusters", "c1", "files", "inventory.yml"))
    assert stored == b"ansible_ssh_private_key_file: @GPUCTL_CLUSTER_DIR@/ssh/id_ed25519\n"

    b = tmp_path / "b" / "clusters" / "c1"
    assert sync.pull_files(store, "c1", b)
    assert (b / "inventory.yml").read_text() == f"ansible_ssh_private_key_file: {b}/ssh/id_ed25519\n"
    assert stat.S_IMODE((b / "ssh" / "id_ed25519").stat().st_mode) == 0o600
    assert not (b / "cm").exists() and not (b / "terraform" / ".terraform").exists()

    (a / "prepared").write_text("abc\n")
    (a / "ssh" / "id_ed25519").unlink()
    sync.push_files(store, "c1", a)
    sync.pull_files(store, "c1", b)
    assert (b / "prepared").read_text() == "abc\n" and not (b / "ssh" / "id_ed25519").exists()
    assert not sync.pull_files(store, "c2", tmp_path / "none")


def test_job_ids_are_unique_across_runners(store: S3Store, tmp_path: Path) -> None:
    remote = remotestate.Remote(store.settings, store)
    one, two = Registry(tmp_path / "a.db", remote=remote), Registry(tmp_path / "b.db", remote=remote)
    one.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=2, status="UP", request={"x": 1})
    ids = [one.new_job("c1", name="a", num_nodes=2).job_id, two.new_job("c1", name="b", num_nodes=2).job_id,
           one.new_job("c1", name="c", num_nodes=1).job_id]
    assert ids == [1, 2, 3]
    one.update_job("c1", 1, status="SUCCEEDED", returncodes={0: 0, 1: 0})
    assert sync.get_record(store, "c1")["request"] == {"x": 1}
    two.import_cluster(sync.get_record(store, "c1"))
    two.import_jobs("c1", sync.get_jobs(store, "c1"))
    assert [(j.job_id, j.status, j.returncodes) for j in two.jobs("c1")] == \
        [(1, "SUCCEEDED", {0: 0, 1: 0}), (2, "PENDING", {}), (3, "PENDING", {})]
    assert two.cluster("c1").status == "UP"
    cdir = tmp_path / "c1"
    cdir.mkdir()
    assert len(sync.get_jobs(store, "c1", cdir)) == 3
    assert sync.get_jobs(store, "c1", cdir) == []  # nothing changed since: nothing read
    two.update_job("c1", 2, status="FAILED")
    assert [j["job_id"] for j in sync.get_jobs(store, "c1", cdir)] == [2]
    sync.delete_cluster(store, "c1")
    assert store.list(store.key("clusters") + "/") == {}


def test_a_cluster_another_runner_took_down_keeps_its_jobs_here_ended(store: S3Store, tmp_path: Path) -> None:
    remote = remotestate.Remote(store.settings, store)
    here, there = Registry(tmp_path / "a.db", remote=remote), Registry(tmp_path / "b.db", remote=remote)
    here.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=1, status="UP",
                        request={"state": remote.where("c1")})
    job = here.new_job("c1", name="a", num_nodes=1)
    there.forget("c1")  # `gpuctl down c1` on the other runner
    assert not here.adopt("c1")
    assert here.cluster("c1") is None
    assert [(j.job_id, j.status) for j in here.jobs("c1")] == [(job.job_id, "CANCELLED")]
    assert store.list(store.key("clusters") + "/") == {}  # the bucket forgets the cluster, its jobs too
    here.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=1, status="UP", request={})
    assert here.new_job("c1", name="b", num_nodes=1).job_id == job.job_id + 1
