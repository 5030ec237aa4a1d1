"""The state bucket: small objects under one prefix, and a cluster's lock.

Objects are written with server-side encryption (SSE-KMS with the configured
key, else SSE-S3); who may read them is the bucket's IAM policy. The lock is
an object created with `If-None-Match: *`: S3 (and S3-compatible stores that
implement conditional writes) create it for exactly one writer, the same
mechanism Terraform's S3 backend uses for `use_lockfile`.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.state.remotestate.settings import ENV, StateSettings

LOCK_POLL_SECONDS = 2.0


class ClusterLocked(ProvisionError):
    """Another runner holds the cluster's lock (exit code 3: try again later)."""

    exit_code = 3


class S3Store:
    """get/put/list/delete of keys under the state prefix, with errors as one line."""

    def __init__(self, settings: StateSettings) -> None:
        import boto3
        from botocore.config import Config

        self.settings = settings
        session = boto3.session.Session(profile_name=settings.profile) if settings.profile else boto3.session.Session()
        self.client = session.client(
            "s3", region_name=settings.region, endpoint_url=settings.endpoint_url,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                          s3={"addressing_style": "path"} if settings.endpoint_url else None),
        )

    def key(self, *parts: str) -> str:
        return "/".join((self.settings.prefix, *parts))

    def _encryption(self) -> dict[str, str]:
        if self.settings.kms_key_id:
            return {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": self.settings.kms_key_id}
        return {"ServerSideEncryption": "AES256"}

    def get(self, key: str) -> bytes | None:
        found = self.get_tagged(key)
        return None if found is None else found[0]

    def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (what a conditional delete names), or None when absent."""
        try:
            reply = self._call("read", key, lambda: self.client.get_object(Bucket=self.settings.bucket, Key=key))
            return reply["Body"].read(), str(reply.get("ETag", ""))
        except _Missing:
            return None

    def put(self, key: str, data: bytes, *, only_if_absent: bool = False) -> bool:
        """Write `key`; with only_if_absent, False when it already exists (nothing written)."""
        if only_if_absent:
            return self.put_new(key, data) is not None
        self.put_etag(key, data)
        return True

    def put_new(self, key: str, data: bytes) -> str | None:
        """Write `key` only if it does not exist (If-None-Match); the new object's ETag, else None."""
        try:
            reply = self._call("write", key, lambda: self.client.put_object(
                Bucket=self.settings.bucket, Key=key, Body=data, IfNoneMatch="*", **self._encryption()))
        except _Exists:
            return None
        return str(reply.get("ETag", ""))

    def put_if(self, key: str, data: bytes, etag: str) -> str | None:
        """Replace `key` only while its ETag is `etag` (If-Match: S3's conditional write, in one
        request); the new object's ETag, else None (it changed or is gone)."""
        reply = self._if_match("write", key, etag, lambda: self.client.put_object(
            Bucket=self.settings.bucket, Key=key, Body=data, IfMatch=etag, **self._encryption()),
            lambda: {"ETag": self.put_etag(key, data)})
        return None if reply is None else str(reply.get("ETag", ""))

    def get_aged(self, key: str) -> tuple[bytes, str, float] | None:
        """The object's bytes, ETag and age in seconds by the store's own clock (its Last-Modified
        against the reply's Date), so runners whose clocks differ agree on it; None when absent."""
        from email.utils import parsedate_to_datetime

        try:
            reply = self._call("read", key, lambda: self.client.get_object(Bucket=self.settings.bucket, Key=key))
        except _Missing:
            return None
        data = reply["Body"].read()
        modified = reply.get("LastModified")
        date = (reply.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
        try:
            now = parsedate_to_datetime(date).timestamp() if date else time.time()
        except (TypeError, ValueError):
            now = time.time()
        age = max(0.0, now - modified.timestamp()) if modified is not None else 0.0
        return data, str(reply.get("ETag", "")), age

    def put_etag(self, key: str, data: bytes) -> str:
        """Write `key`; the ETag the store gave the new object."""
        reply = self._call("write", key, lambda: self.client.put_object(
            Bucket=self.settings.bucket, Key=key, Body=data, **self._encryption()))
        return str(reply.get("ETag", ""))

    def delete(self, key: str) -> None:
        try:
            self._call("delete", key, lambda: self.client.delete_object(Bucket=self.settings.bucket, Key=key))
        except _Missing:
            pass

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete `key` only while its ETag is `etag` (If-Match: S3's conditional delete), in one
        request, so an object replaced meanwhile is never removed; False when it changed or is gone."""
        return self._if_match("delete", key, etag, lambda: self.client.delete_object(
            Bucket=self.settings.bucket, Key=key, IfMatch=etag), lambda: self.delete(key) or {}) is not None

    def _if_match(self, verb: str, key: str, etag: str, conditional: Callable[[], Any],
                  plain: Callable[[], Any]) -> Any:
        """`conditional()`, a request carrying If-Match: `etag`; its reply, or None when the object
        changed or is gone. A store without conditional requests: compare the ETag, then `plain()`."""
        try:
            return self._call(verb, key, conditional)
        except (_Missing, _Exists):
            return None
        except _Unsupported:
            current = self.get_tagged(key)
            return plain() if current is not None and current[1] == etag else None

    def list(self, prefix: str) -> dict[str, str]:
        """key -> ETag of every object under `prefix` (a folder: ends with /)."""
        found: dict[str, str] = {}
        token: dict[str, str] = {}
        while True:
            page = self._call("list", prefix, lambda after=token: self.client.list_objects_v2(
                Bucket=self.settings.bucket, Prefix=prefix, **after))
            for item in page.get("Contents", []):
                found[item["Key"]] = item.get("ETag", "")
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _call(self, verb: str, key: str, fn: Callable[[], Any]) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f"s3://{self.settings.bucket}/{key}"
        try:
            return fn()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise _Missing() from None
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise _Exists() from None
            if code in ("NotImplemented", "501"):
                raise _Unsupported() from None
            if code == "NoSuchBucket":
                raise UserError(f"state bucket '{self.settings.bucket}' does not exist (state.bucket / "
                                f"{ENV['bucket']}); create it, with versioning on, or fix the name") from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
                raise UserError(f"cannot {verb} {where}: {code}; give this runner's AWS identity "
                                f"s3:GetObject/PutObject/DeleteObject/ListBucket on the state bucket") from None
            raise ProvisionError(f"cannot {verb} {where}: {code or exc}") from None
        except NoCredentialsError:
            raise UserError(f"cannot {verb} {where}: no AWS credentials for the state bucket; set AWS_PROFILE "
                            f"or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or state.profile)") from None
        except BotoCoreError as exc:
            raise ProvisionError(f"cannot {verb} {where}: {exc}") from None


class _Missing(Exception):
    pass


class _Exists(Exception):
    pass


class _Unsupported(Exception):
    pass


def holder_text(holder: dict[str, Any]) -> str:
    """'ci@runner-7 (pid 123, `gpuctl apply`, since 2026-11-24T02:00:00Z)'."""
    return (f"{holder.get('who', '?')} (pid {holder.get('pid', '?')}, `{holder.get('command', '?')}`, "
            f"since {holder.get('since', '?')})")


def _me(command: str, token: str) -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    run = os.environ.get("GITHUB_RUN_ID") or os.environ.get("CI_JOB_ID")
    return {"who": f"{user}@{socket.gethostname()}", "pid": os.getpid(), "command": command, "token": token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **({"ci_run": run} if run else {})}


@contextmanager
def cluster_lock(store: S3Store, name: str, *, command: str, on_wait: Callable[[str], None],
                 timeout: float | None = None) -> Iterator[None]:
    """Hold `locks/<name>.json` in the state bucket for the block; wait up to `timeout` seconds for it.

    Released only if the lock object is still the one we wrote (its ETag), so a
    `force-unlock` and another runner's lock taken since are not undone.
    """
    key = store.key("locks", f"{name}.json")
    token = secrets.token_hex(8)  # makes each hold's object, so its ETag, unique
    body = json.dumps(_me(command, token)).encode()
    wait = store.settings.lock_timeout if timeout is None else timeout
    deadline = time.monotonic() + wait
    said = False
    while (etag := store.put_new(key, body)) is None:
        holder = _read_lock(store, key)
        if holder is None:
            continue  # released between our write and our read: try again
        if time.monotonic() >= deadline:
            raise ClusterLocked(f"cluster '{name}' is locked by {holder_text(holder)} in "
                                f"s3://{store.settings.bucket}/{key}; wait for it and retry, or if that runner is "
                                f"gone: gpuctl force-unlock {name}")
        if not said:
            on_wait(f"Waiting up to {wait:.0f}s for {holder_text(holder)}, which holds cluster '{name}'")
            said = True
        time.sleep(LOCK_POLL_SECONDS)
    try:
        yield
    finally:
        # Conditional on the ETag of our own write: a force-unlock followed by another
        # runner's lock (between a read and a delete, with a read-then-delete) stays.
        store.delete_if(key, etag)


def _read_lock(store: S3Store, key: str) -> dict[str, Any] | None:
    found = _read_tagged_lock(store, key)
    return None if found is None else found[0]


def _read_tagged_lock(store: S3Store, key: str) -> tuple[dict[str, Any], str] | None:
    """The lock's holder and its object's ETag, or None when unlocked."""
    found = store.get_tagged(key)
    if found is None:
        return None
    data, etag = found
    try:
        holder = json.loads(data)
    except ValueError:
        return {"who": "an unreadable lock object"}, etag
    return (holder if isinstance(holder, dict) else {"who": "an unreadable lock object"}), etag


def read_lock(store: S3Store, name: str) -> dict[str, Any] | None:
    return _read_lock(store, store.key("locks", f"{name}.json"))


def break_lock(store: S3Store, name: str) -> dict[str, Any] | None:
    """Remove the cluster's lock (force-unlock); the holder it had, or None.

    The delete names the ETag of the lock just read: if it changed hands in between,
    the new lock is read and named instead of being removed under the old name.
    """
    key = store.key("locks", f"{name}.json")
    while True:
        found = _read_tagged_lock(store, key)
        if found is None:
            return None
        holder, etag = found
        if store.delete_if(key, etag):
            return holder
