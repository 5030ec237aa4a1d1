"""A storage mount's local directory into its bucket (jobplane/bucketupload.py), against moto's S3 in
this process: SkyPilot's rules for what goes up (.skyignore, else what git ignores; never .git or a
symlink), the bucket made when missing, a second upload sending only what changed, and failures as
one line naming the field with no secret in it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import boto3
import pytest
from moto import mock_aws

from gpuctl.jobplane import bucketupload
from gpuctl.spec.buckets import BucketMount

SECRETS = {"AWS_ACCESS_KEY_ID": "AKIDUPLOADTEST", "AWS_SECRET_ACCESS_KEY": "upload-secret-key"}


@pytest.fixture()
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for var in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with mock_aws():
        yield boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    return root


def keys(s3: object, bucket: str) -> dict[str, bytes]:
    listing = s3.list_objects_v2(Bucket=bucket).get("Contents", [])  # type: ignore[attr-defined]
    return {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()  # type: ignore[attr-defined]
            for o in listing}


def fill(*mounts: BucketMount, secrets: dict[str, str] = SECRETS, region: str | None = "us-east-1"):
    return bucketupload.fill_buckets(mounts, {}, secrets, endpoint=None, region=region)


def test_the_directory_goes_to_the_top_of_a_bucket_made_for_it(s3: object, tmp_path: Path):
    src = tree(tmp_path / "examples", {"a.py": "print(1)\n", "sub/b.txt": "beta\n", ".git/HEAD": "ref\n"})
    os.symlink("/etc/hostname", src / "link")  # not followed, not sent (aws s3 sync --no-follow-symlinks)
    mount = BucketMount(dest="/data", bucket="my-sky-upload", create=True, upload=str(src))
    [done] = fill(mount)
    assert (done.sent, done.unchanged) == (2, 0)
    assert keys(s3, "my-sky-upload") == {"a.py": b"print(1)\n", "sub/b.txt": b"beta\n"}


def test_a_second_upload_sends_only_what_changed_and_deletes_nothing(s3: object, tmp_path: Path):
    src = tree(tmp_path / "d", {"a.txt": "one\n", "b.txt": "two\n"})
    mount = BucketMount(dest="~/d", bucket="twice", create=True, upload=str(src), mode="COPY")
    assert [(f.sent, f.unchanged) for f in fill(mount)] == [(2, 0)]
    s3.put_object(Bucket="twice", Key="made-by-a-job.txt", Body=b"keep\n")  # type: ignore[attr-defined]
    assert [(f.sent, f.unchanged) for f in fill(mount)] == [(0, 2)]
    (src / "b.txt").write_text("two, longer\n")
    assert [(f.sent, f.unchanged) for f in fill(mount)] == [(1, 1)]
    assert keys(s3, "twice") == {"a.txt": b"one\n", "b.txt": b"two, longer\n", "made-by-a-job.txt": b"keep\n"}


def test_an_existing_bucket_is_filled_in_place(s3: object, tmp_path: Path):
    s3.create_bucket(Bucket="already-there")  # type: ignore[attr-defined]
    s3.put_object(Bucket="already-there", Key="old.txt", Body=b"old\n")  # type: ignore[attr-defined]
    src = tree(tmp_path / "d", {"new.txt": "new\n"})
    fill(BucketMount(dest="/d", bucket="already-there", create=True, upload=str(src)))
    assert keys(s3, "already-there") == {"old.txt": b"old\n", "new.txt": b"new\n"}


def test_git_ignored_files_stay_here_as_in_skypilot(tmp_path: Path):
    src = tree(tmp_path / "repo", {".gitignore": "*.ckpt\nbuild/\n", "train.py": "x\n", "w.ckpt": "big\n",
                                   "build/out.o": "obj\n", "sub/keep.txt": "k\n", "sub/x.ckpt": "big\n"})
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    assert [k for k, _ in bucketupload.files_to_upload(src)] == [".gitignore", "sub/keep.txt", "train.py"]


def test_a_skyignore_replaces_the_git_rules(tmp_path: Path):
    src = tree(tmp_path / "repo", {".gitignore": "*.ckpt\n", ".skyignore": "/top.txt\n*.log\n# comment\ndata\n",
                                   "top.txt": "t\n", "sub/top.txt": "kept: only the top one is /top.txt\n",
                                   "a.log": "l\n", "sub/b.log": "l\n", "w.ckpt": "sent: .skyignore wins\n",
                                   "data/x.bin": "d\n", "sub/data/y.bin": "d\n"})
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    assert [k for k, _ in bucketupload.files_to_upload(src)] == [".gitignore", ".skyignore", "sub/top.txt", "w.ckpt"]


def test_outside_git_everything_but_git_and_links_goes(tmp_path: Path):
    src = tree(tmp_path / "plain", {".gitignore": "*.ckpt\n", "w.ckpt": "sent\n", ".git/config": "x\n"})
    assert [k for k, _ in bucketupload.files_to_upload(src)] == [".gitignore", "w.ckpt"]


def test_mounts_without_an_upload_are_left_to_the_nodes(s3: object):
    assert fill(BucketMount(dest="/d", bucket="made-by-the-head", create=True),
                BucketMount(dest="/e", bucket="x", prefix="p", mode="COPY")) == []
    assert s3.list_buckets()["Buckets"] == []  # type: ignore[attr-defined]


def test_a_directory_gone_since_validation_is_one_line(s3: object, tmp_path: Path):
    with pytest.raises(bucketupload.UploadError) as err:
        fill(BucketMount(dest="/data", bucket="b-gone", create=True, upload=str(tmp_path / "gone")))
    assert str(err.value) == f"file_mounts./data: source {tmp_path / 'gone'} is no directory (any more); nothing was run"


def test_a_refused_upload_names_the_field_and_no_secret(s3: object, tmp_path: Path):
    """A bucket S3 refuses to create (a name too short: the spec refuses it first, S3 here) is one line."""
    src = tree(tmp_path / "d", {"a.txt": "a\n"})
    with pytest.raises(bucketupload.UploadError) as err:
        fill(BucketMount(dest="/data", bucket="ab", create=True, upload=str(src)),
             secrets={**SECRETS, "AWS_SESSION_TOKEN": "session-token-value"})
    message = str(err.value)
    assert message == (f"file_mounts./data: uploading {src} to s3://ab failed: InvalidBucketName: The specified "
                       "bucket is not valid."), message
    assert "\n" not in message and all(v not in message for v in (*SECRETS.values(), "session-token-value"))


def test_no_credentials_here_says_where_to_give_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for var in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    src = tree(tmp_path / "d", {"a.txt": "a\n"})
    with pytest.raises(bucketupload.UploadError) as err:
        fill(BucketMount(dest="~/d", bucket="no-creds", create=True, upload=str(src)), secrets={})
    assert str(err.value) == (f"file_mounts.~/d: uploading {src} to s3://no-creds: no AWS credentials on this "
                              "machine; give AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY under the task's secrets, "
                              "or set AWS_PROFILE")


def test_an_endpoint_that_does_not_answer_is_one_line(tmp_path: Path):
    src = tree(tmp_path / "d", {"a.txt": "a\n"})
    closed = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(bucketupload.UploadError) as err:
        bucketupload.fill_buckets([BucketMount(dest="/d", bucket="far", create=True, upload=str(src))], {}, SECRETS,
                                  endpoint=closed, region="us-east-1")
    assert str(err.value).startswith(f"file_mounts./d: uploading {src} to s3://far failed: Could not connect to the "
                                     f"endpoint URL: \"{closed}/far\""), str(err.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
