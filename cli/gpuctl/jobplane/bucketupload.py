"""Local directories into the buckets named for them, from the controller, before the job is submitted.

SkyPilot's storage mount with `name:` and a local `source:` makes the bucket when it is missing and
uploads the directory into it from the machine that launches; the nodes then mount or copy the bucket
as any other (agent/buckets.py: MOUNT, MOUNT_CACHED or COPY). gpuctl does the same here, on every
apply, before anything runs on the nodes, so an upload that fails runs nothing. `validate` never
reaches this module: it uploads nothing.

What goes up is what SkyPilot sends (sky/data/storage_utils.py get_excluded_files, and its S3 sync):
- with a `.skyignore` in the directory, whatever its lines match is left out (SkyPilot's reading: a
  line starting with `/` from the top, any other at any depth, as Python's glob matches them);
  without one, in a git work tree, what git reports ignored (gitignore.ignored_by_git);
- never `.git/`, and no symlink (`aws s3 sync --no-follow-symlinks`);
- a file only when the bucket lacks it, its size differs, or it changed after its upload (aws s3 sync's
  rule: a second apply of the same directory sends nothing); nothing in the bucket is deleted.
The directory's files land at the top of the bucket, as SkyPilot puts a single directory source.

Credentials are the task's AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) secrets
when it gives them, the ones the nodes use, else this machine's own (the AWS SDK's chain; the profile
of gpuctl's config when one is set). Endpoint and region are the nodes' (spec/buckets.py
storage_settings). No credential reaches an argv or a message.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuctl.common.config import aws_settings
from gpuctl.jobplane import gitignore
from gpuctl.spec.buckets import CREDENTIAL_NAMES, BucketMount

SKYIGNORE = ".skyignore"
PARALLEL_UPLOADS = 8
_CREDENTIAL_ARGS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


class UploadError(Exception):
    """An upload that could not be done: one line naming the mount's field and why."""


@dataclass(frozen=True)
class Filled:
    """What one mount's upload did: files sent, and files the bucket already had as they are here."""

    mount: BucketMount
    sent: int
    unchanged: int


def _skyignored(root: Path) -> set[str] | None:
    """The paths (relative to `root`) a .skyignore in `root` leaves out; None without one."""
    path = root / SKYIGNORE
    if not path.is_file():
        return None
    out: set[str] = set()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern = "." + line if line.startswith("/") else "**/" + line
        for found in glob.glob(os.path.join(glob.escape(str(root)), pattern), recursive=True):
            out.add(os.path.relpath(found, root))
    return out


def files_to_upload(root: Path) -> list[tuple[str, Path]]:
    """(bucket key, local file) for every file of `root` that goes up, in a stable order."""
    left_out = _skyignored(root)
    if left_out is None:
        left_out = {p.rstrip("/") for p in gitignore.ignored_by_git(root) or ()}
    out: list[tuple[str, Path]] = []
    for top, dirs, files in os.walk(root, followlinks=False):
        rel_top = os.path.relpath(top, root)
        rel = (lambda name: name) if rel_top == "." else (lambda name: f"{rel_top}/{name}")
        dirs[:] = sorted(d for d in dirs if d != ".git" and rel(d) not in left_out
                         and not os.path.islink(os.path.join(top, d)))
        for name in sorted(files):
            path = Path(top) / name
            if rel(name) in left_out or path.is_symlink() or not path.is_file():
                continue
            out.append((rel(name).replace(os.sep, "/"), path))
    return sorted(out)


def _client(envs: Mapping[str, str], secrets: Mapping[str, str], *, endpoint: str | None,
            region: str | None) -> Any:
    import boto3  # lazy: boto3 is slow to import and only a job with an upload needs it
    from botocore.config import Config

    given = {arg: secrets[name] for arg, name in zip(_CREDENTIAL_ARGS, CREDENTIAL_NAMES) if secrets.get(name)}
    profile = None if given else aws_settings().profile
    session = boto3.session.Session(profile_name=profile, **given) if profile or given else boto3.session.Session()
    return session.client("s3", region_name=region, endpoint_url=endpoint,
                          config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10,
                                        read_timeout=120, s3={"addressing_style": "path"} if endpoint else None))


def _ensure_bucket(client: Any, bucket: str, region: str | None) -> None:
    """The bucket, made when it does not exist (as for `name:` without a source)."""
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
    config = {"CreateBucketConfiguration": {"LocationConstraint": region}} if region and region != "us-east-1" else {}
    try:
        client.create_bucket(Bucket=bucket, **config)
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) != "BucketAlreadyOwnedByYou":
            raise


def _in_bucket(client: Any, bucket: str) -> dict[str, tuple[int, float]]:
    """{key: (size, last modified as a timestamp)} of what the bucket holds."""
    out: dict[str, tuple[int, float]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents") or ():
            out[item["Key"]] = (int(item["Size"]), item["LastModified"].timestamp())
    return out


def _fill(client: Any, mount: BucketMount, region: str | None) -> Filled:
    root = Path(mount.upload)
    if not root.is_dir():  # gone since validation
        raise UploadError(f"file_mounts.{mount.dest}: source {root} is no directory (any more); nothing was run")
    files = files_to_upload(root)
    _ensure_bucket(client, mount.bucket, region)
    have = _in_bucket(client, mount.bucket)
    todo = []
    for key, path in files:
        st = path.stat()
        size, modified = have.get(key, (-1, 0.0))
        if size != st.st_size or int(st.st_mtime) > modified:  # S3 keeps whole seconds
            todo.append((key, path))
    from concurrent.futures import ThreadPoolExecutor  # (and logging): only a job with bucket uploads

    with ThreadPoolExecutor(max_workers=PARALLEL_UPLOADS) as pool:
        list(pool.map(lambda item: client.upload_file(str(item[1]), mount.bucket, item[0]), todo))
    return Filled(mount, len(todo), len(files) - len(todo))


def fill_buckets(mounts: Sequence[BucketMount], envs: Mapping[str, str], secrets: Mapping[str, str], *,
                 endpoint: str | None, region: str | None) -> list[Filled]:
    """Upload every mount's local directory into its bucket (made if missing); UploadError on the first
    that fails, naming its field. Mounts without an upload are left to the nodes."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    wanted = list({(m.bucket, m.upload): m for m in mounts if m.upload}.values())  # two mounts of one: once
    if not wanted:
        return []
    client = _client(envs, secrets, endpoint=endpoint, region=region)
    done = []
    for mount in wanted:
        where = f"file_mounts.{mount.dest}: uploading {mount.upload} to s3://{mount.bucket}"
        try:
            done.append(_fill(client, mount, region))
        except NoCredentialsError:
            raise UploadError(f"{where}: no AWS credentials on this machine; give AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY under the task's secrets, or set AWS_PROFILE") from None
        except ClientError as exc:
            error = exc.response.get("Error", {})
            why = f"{error.get('Code') or 'error'}: {error.get('Message') or exc}"
            raise UploadError(_without(f"{where} failed: {why}", secrets.values())) from None
        except (BotoCoreError, S3UploadFailedError, OSError) as exc:
            raise UploadError(_without(f"{where} failed: {exc}", secrets.values())) from None
    return done


def _without(message: str, values: Any) -> str:
    """`message` with no secret value in it (an SDK error may quote what it was given)."""
    for value in sorted((v for v in values if len(v) >= 4), key=len, reverse=True):
        message = message.replace(value, "***")
    return message
