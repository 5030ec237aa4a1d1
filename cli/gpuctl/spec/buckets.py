"""Cloud-bucket file_mounts as the job plane receives them: plain values.

The spec layer turns `file_mounts: {/data: s3://bucket/prefix}` and the
object form (`source`/`name`/`mode`/`store`) into `BucketMount`s; `name` with a
local `source` directory is filled from it by the controller before the job
(jobplane/bucketupload.py); the node
agent fetches (COPY) or mounts (MOUNT, MOUNT_CACHED) each one on every node
before setup (node/buckets.py), with rclone:

- COPY: `rclone copy` onto the node's disk, by one node per shared filesystem
  (the claim markers of the workdir copy);
- MOUNT: `rclone mount --daemon --vfs-cache-mode writes` (files written are
  uploaded as soon as they are closed);
- MOUNT_CACHED: the same with `--vfs-cache-mode full` (reads cached on the
  node's disk, writes uploaded in the background).

A mount on the nodes' own credentials (instance profile) outlives the job: the
next job finds the same mount and reuses it, a dead one is mounted again. A
mount made with the job's own AWS_* secrets (they are in its `rclone mount`
daemon's environment) goes when the job ends on the node, once its writes are
uploaded and no other running job holds it, so the secrets leave with the job.
A mount is the node user's alone (agent/buckets.py, rclone_mount_argv). Credentials never travel in the payload, an argv
or a log: rclone takes AWS's own chain (`env_auth`), that is the node's
instance profile, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN given under the task's `secrets:`, which reach the node on
stdin and rclone in its environment. An S3-compatible endpoint comes from
the task's AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL), a region from
AWS_REGION / AWS_DEFAULT_REGION or the cluster's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpuctl.common.errors import UserError
from gpuctl.spec import nodepaths

MODES = ("COPY", "MOUNT", "MOUNT_CACHED")
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS SDKs' own names, first wins
REGION_ENVS = ("AWS_REGION", "AWS_DEFAULT_REGION")
CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# What a node needs (the prepare step installs or checks it): rclone always, FUSE to mount.
TOOL_RCLONE = "rclone"
TOOL_FUSE = "fuse"


@dataclass(frozen=True)
class BucketMount:
    dest: str  # where on the node: absolute, or ~/...
    bucket: str
    prefix: str = ""  # key prefix inside the bucket, without a leading '/'; "" = the whole bucket
    mode: str = "MOUNT"  # one of MODES
    store: str = "s3"
    create: bool = False  # `name:` without `source:`: create the bucket when it does not exist
    # `name:` with a local `source:` (create is True too): this directory (absolute, on the controller)
    # is uploaded into the bucket before the job (jobplane/bucketupload.py); "" for none
    upload: str = ""

    def url(self) -> str:
        return f"{self.store}://{self.bucket}/{self.prefix}".rstrip("/")


def tools_needed(mounts: Sequence[BucketMount]) -> tuple[str, ...]:
    """The node tools a job with these mounts needs: () without buckets."""
    if not mounts:
        return ()
    return (TOOL_RCLONE,) + ((TOOL_FUSE,) if any(m.mode != "COPY" for m in mounts) else ())


def check(mounts: Sequence[BucketMount], envs: Mapping[str, str]) -> None:
    """Refuse, before anything runs, what the nodes could not do safely; UserError naming the field.

    The destinations' rules are nodepaths.destination_problem's (the spec's validation applies them
    too, so `validate` refuses what this refuses)."""
    if not mounts:
        return
    for m in mounts:
        where = f"file_mounts.{m.dest}"
        if m.mode not in MODES:
            raise UserError(f"{where}: mode {m.mode} is not a storage mode; use {', '.join(MODES)}")
        if m.store != "s3":
            raise UserError(f"{where}: store {m.store} is not supported by gpuctl; use s3")
        problem = nodepaths.destination_problem(m.dest, m.mode)
        if problem:
            raise UserError(f"{where}: {problem}")
    in_envs = [name for name in CREDENTIAL_NAMES if name in envs]
    if in_envs:
        raise UserError(f"envs.{in_envs[0]}: bucket mounts take AWS credentials from secrets: (sent to the nodes "
                        "on stdin, never stored or printed); move it there, or leave credentials out to use the "
                        "nodes' instance profile (config.aws.remote_identity)")
    endpoint = endpoint_of(envs)
    if endpoint and not endpoint.startswith(("http://", "https://")):
        name = next(n for n in ENDPOINT_ENVS if envs.get(n, "").strip())
        raise UserError(f"envs.{name} '{endpoint}': give the S3 endpoint as a URL such as https://s3.example.com")


def endpoint_of(envs: Mapping[str, str]) -> str | None:
    for name in ENDPOINT_ENVS:
        value = (envs.get(name) or "").strip()
        if value:
            return value.rstrip("/")
    return None


def storage_settings(envs: Mapping[str, str], *, default_region: str | None) -> dict[str, Any]:
    """How every node reaches the store (no credentials): the endpoint and the region, the task's
    AWS_REGION / AWS_DEFAULT_REGION else `default_region` (the provider's bucket_region: on AWS
    the cluster's own)."""
    chosen = next(((envs.get(n) or "").strip() for n in REGION_ENVS if (envs.get(n) or "").strip()), None)
    return {"endpoint": endpoint_of(envs), "region": chosen or default_region}


def payload_entries(mounts: Sequence[BucketMount]) -> list[dict[str, Any]]:
    """The mounts as the agent reads them (payload["buckets"])."""
    return [{"dest": m.dest, "bucket": m.bucket, "prefix": m.prefix.strip("/"), "mode": m.mode,
             "create": bool(m.create), "url": m.url()} for m in mounts]


def describe(mounts: Sequence[BucketMount]) -> list[str]:
    """One line per mount for the job's start: what goes where, and how."""
    how = {"COPY": "copied to", "MOUNT": "mounted at", "MOUNT_CACHED": "mounted (cached) at"}
    made = {m: f" (created if missing{f', filled from {m.upload}' if m.upload else ''})" if m.create else ""
            for m in mounts}
    return [f"{m.url()}{made[m]}: {how.get(m.mode, m.mode)} {m.dest}" for m in mounts]
