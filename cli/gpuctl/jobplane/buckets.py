"""Cloud-bucket file_mounts as the job plane receives them: plain values.

The spec layer turns `file_mounts: {/data: s3://bucket/prefix}` and the
object form (`source`/`name`/`mode`/`store`) into `BucketMount`s; the node
agent fetches (COPY) or mounts (MOUNT, MOUNT_CACHED) each one on every node
before setup.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("COPY", "MOUNT", "MOUNT_CACHED")


@dataclass(frozen=True)
class BucketMount:
    dest: str  # where on the node: absolute, or ~/...
    bucket: str
    prefix: str = ""  # key prefix inside the bucket, without a leading '/'; "" = the whole bucket
    mode: str = "MOUNT"  # one of MODES
    store: str = "s3"
    create: bool = False  # `name:` without `source:`: create the bucket when it does not exist

    def url(self) -> str:
        return f"{self.store}://{self.bucket}/{self.prefix}".rstrip("/")
