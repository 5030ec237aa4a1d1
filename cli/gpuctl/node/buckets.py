"""Cloud-bucket file_mounts (payload["buckets"], payload["storage"]; spec/buckets.py on the controller).

rclone is configured through its environment only: remote BUCKET_REMOTE is
S3 with env_auth, i.e. AWS's own credential chain -- the AWS_* credentials
among the job's secrets (they reach rclone in its environment, never in an
argv, a file of ours or a log), else the node's instance profile. An
endpoint of the task's own (AWS_ENDPOINT_URL_S3) makes the remote
path-style, as S3-compatible stores expect.
  hello  every node checks it has rclone (and FUSE when something mounts):
         a node without is a problem (H RANK problem), so nothing runs;
  check  the head, once: creates the buckets named without a source, lists
         each source's top (a missing bucket is one line, nothing runs), and
         tells a single object (COPY to a file) from a prefix;
  fetch  after the workdir copy, every node (command `buckets TOKEN KINDS`):
         COPY  `rclone copy` by the node that owns the destination (the claim
               markers of the copy phase: nodes sharing a filesystem fetch once);
         MOUNT / MOUNT_CACHED  `rclone mount --daemon`, VFS cache mode writes
               (a file is uploaded as soon as it is closed) / full (reads
               cached on the node's disk too, uploads in the background);
         then B RANK CODE MESSAGE.
A mount on the node's own credentials outlives its job. MOUNTS_DIR/KEY.json
(KEY hashes the path) records what gpuctl mounted there; a later job reuses a
mount that answers and is the same (bucket, prefix, mode, endpoint, region,
credentials, access), unmounts a dead one (lazily) or a different one (refused
while something uses it) and mounts again, and never takes over a mount point
it did not make. A mount with the job's own credentials (secrets) is held by
the job (a shared flock on KEY.use) and unmounted at its cleanup, after its
uploads, by the last job holding it (unmount_bucket). KEY.log is the
mount's rclone log, KEY.cache its VFS cache (kept across remounts, so writes
not yet uploaded go up once the path is mounted again).
"""

import fcntl
import hashlib
import json
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from gpuctl.node.destinations import claim_destinations, destinations_problem, mount_table, release_claims
from gpuctl.node.follow import LineReader, ev
from gpuctl.node.jobdir import (GPUCTL_DIR, agent_file, dest_paths, ensure_dir, read_text, remove,
                                         write_private)
from gpuctl.node.protocol import CMD_UNMOUNT_BUCKET, EV_BUCKETS


BUCKET_REMOTE = "gpuctls3"
MOUNTS_DIR = os.path.join(GPUCTL_DIR, "mounts")
BUCKET_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

# mode -> (--vfs-cache-mode, --vfs-write-back)
BUCKET_CACHE = {"MOUNT": ("writes", "0s"), "MOUNT_CACHED": ("full", "5s")}
RCLONE_NET = ["--contimeout", "15s", "--timeout", "60s", "--low-level-retries", "3"]
BUCKET_CHECK_TIMEOUT = 120  # seconds for one listing or mkdir on the head
MOUNT_READY_S = 60  # seconds a new mount may take to appear

# Who may reach a mount (rclone_mount_argv); part of its identity, so that a mount an
# older agent opened to every user is mounted again, not reused.
MOUNT_ACCESS = "owner-0600"
UPLOAD_WAIT_S = 900  # how long a job's end waits for a mount's uploads before unmounting it
_SECRET_RE = re.compile(r"^export ([A-Za-z_][A-Za-z0-9_]*)='((?:[^']|'\"'\"')*)'$", re.M)
_LOG_STAMP_RE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s+")


def parse_secrets(text):
    """{NAME: value} of the secrets script gpuctl writes (`export NAME='value'`, jobenv.secrets_script)."""
    return dict((m.group(1), m.group(2).replace("'\"'\"'", "'")) for m in _SECRET_RE.finditer(text or ""))


def rclone_env(storage, secrets, base=None):
    """(rclone's environment, options every rclone call takes).

    The node's environment, the remote's settings, and the job's AWS credentials
    when its secrets give them (then no inherited AWS_* credential is mixed in).
    AWS_CA_BUNDLE becomes --ca-cert: rclone's HTTP client refuses the variable.
    """
    env = dict(os.environ if base is None else base)
    extra = []
    bundle = env.pop("AWS_CA_BUNDLE", None)
    if bundle and os.path.isfile(bundle):
        extra += ["--ca-cert", bundle]
    storage = storage or {}
    prefix = "RCLONE_CONFIG_%s_" % BUCKET_REMOTE.upper()
    endpoint = storage.get("endpoint")
    env[prefix + "TYPE"] = "s3"
    env[prefix + "PROVIDER"] = "Other" if endpoint else "AWS"  # Other: path-style requests
    env[prefix + "ENV_AUTH"] = "true"
    if endpoint:
        env[prefix + "ENDPOINT"] = endpoint
    if storage.get("region"):
        env[prefix + "REGION"] = storage["region"]
        if not endpoint and storage["region"] != "us-east-1":  # AWS makes buckets there without it
            env[prefix + "LOCATION_CONSTRAINT"] = storage["region"]
    if any(name in secrets for name in BUCKET_CREDENTIALS):
        for name in BUCKET_CREDENTIALS:
            env.pop(name, None)
            if name in secrets:
                env[name] = secrets[name]
    return env, extra


def rclone_remote(bucket, prefix=""):
    prefix = (prefix or "").strip("/")
    return "%s:%s%s" % (BUCKET_REMOTE, bucket, "/" + prefix if prefix else "")


def rclone_copy_argv(bucket, path, kind, extra=()):
    """Fetch a COPY source: a prefix into the directory `path`, one object (kind "file") to the file `path`."""
    return (["rclone", "copyto" if kind == "file" else "copy", "-q", "--transfers", "16", "--checkers", "16"]
            + RCLONE_NET + list(extra) + [rclone_remote(bucket["bucket"], bucket.get("prefix")), path])


def fuse_allow_other():
    """Whether FUSE lets this user open the mount to others (root, or user_allow_other in
    /etc/fuse.conf); rclone_mount_argv then lets the kernel check the files' modes instead."""
    return os.geteuid() == 0 or bool(re.search(r"^\s*user_allow_other\b", read_text("/etc/fuse.conf") or "", re.M))


def rclone_mount_argv(bucket, path, base, extra=(), allow_other=False, uid=None, gid=None):
    """Mount a bucket (prefix) at `path` as a daemon; `base` is MOUNTS_DIR/KEY (its log and cache).

    Only the job's user reaches the data: every file is theirs, 0600 (directories 0700), and
    the kernel checks those modes (--default-permissions); without it, --allow-other would let
    every local user read, write and delete through the mount whatever the listing shows.
    Where FUSE allows it (`allow_other`), root passes too (a container's root, or the runtime's
    daemon binding the path into one); elsewhere FUSE itself keeps everyone else out.
    """
    cache, write_back = BUCKET_CACHE[bucket["mode"]]
    owner = ["--uid", str(os.getuid() if uid is None else uid), "--gid", str(os.getgid() if gid is None else gid),
             "--umask", "0077"]
    return (["rclone", "mount", rclone_remote(bucket["bucket"], bucket.get("prefix")), path, "--daemon",
             "--vfs-cache-mode", cache, "--vfs-write-back", write_back, "--cache-dir", base + ".cache",
             "--log-file", base + ".log", "--log-level", "NOTICE"] + owner
            + (["--allow-other", "--default-permissions"] if allow_other else []) + RCLONE_NET + list(extra))


def bucket_tools_problem(buckets, which=shutil.which, exists=os.path.exists, usable=None):
    """What this node lacks for the job's buckets (rclone; FUSE to mount), or None."""
    if not buckets:
        return None
    missing = [] if which("rclone") else ["rclone"]
    mounts = any(b.get("mode") != "COPY" for b in buckets)
    if mounts:
        if not (which("fusermount3") or which("fusermount")):
            missing.append("fusermount3 (package fuse3)")
        if not exists("/dev/fuse"):
            missing.append("/dev/fuse (the fuse kernel module)")
    if not missing:
        # fusermount opens the device with the user's own rights: root's alone (0600) refuses the mount
        if mounts and not (os.access("/dev/fuse", os.R_OK | os.W_OK) if usable is None else usable):
            return ("/dev/fuse cannot be opened by %s on this node, and the job's bucket mounts need it; give it "
                    "mode 0666 as distributions do (chmod 666 /dev/fuse), or log in as root"
                    % pwd.getpwuid(os.getuid()).pw_name)
        return None
    return ("%s %s not installed, and the job's cloud-bucket file_mounts need %s; gpuctl installs rclone and fuse3 "
            "when it prepares AWS nodes, elsewhere install them on the node (local nodes: on this machine): "
            "apt-get install rclone fuse3" % (" and ".join(missing), "is" if len(missing) == 1 else "are",
                                              "it" if len(missing) == 1 else "them"))


def rclone_error(text):
    """What failed, from rclone's log lines: the last error, without its timestamp, with a hint."""
    lines = [_LOG_STAMP_RE.sub("", line).strip() for line in (text or "").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("NOTICE:", "For verbose messaging"))]
    failed = [line for line in lines if line.startswith(("Failed to", "ERROR", "CRITICAL", "Fatal error"))]
    msg = (failed or lines or ["rclone gave no reason"])[-1]
    msg = re.sub(r"^Failed to \w+( with \d+ errors: last error was)?: ", "", msg)[:300]
    if "NoCredentialProviders" in msg:
        msg += (" (no AWS credentials on the node: give AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY under "
                "secrets:, or give the nodes an instance profile with config.aws.remote_identity)")
    elif "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg:
        msg += " (the store refused the credentials)"
    return msg


def rclone_lines(argv, env, limit, timeout, procs=None):
    """Up to `limit` lines of an rclone listing, read as they come (a big bucket is never listed
    to its end); (exit code, lines, what it said on stderr)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                close_fds=True, cwd="/")
        if procs is not None:
            procs.append(proc)
        reader = LineReader(proc.stdout.fileno())
        lines = []
        deadline = time.time() + timeout
        try:
            while len(lines) < limit and not reader.eof:
                if time.time() > deadline:
                    proc.kill()
                    proc.wait()
                    return 124, lines, "no answer from the store within %ds" % timeout
                if select.select([reader.fd], [], [], 0.2)[0]:
                    lines += [line.decode("utf-8", "replace") for line in reader.read_lines() if line.strip()]
            if len(lines) >= limit and proc.poll() is None:
                proc.kill()
            code = proc.wait()
        finally:
            proc.stdout.close()
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    return (0 if len(lines) >= limit else code), lines[:limit], text


def rclone_run(argv, env, timeout, procs=None):
    """(exit code, rclone's error text) of one rclone command."""
    code, _, text = rclone_lines(argv, env, 1 << 30, timeout, procs)
    return code, text


def _filter_escape(name):
    return re.sub(r"([*?\[\]{}\\])", r"\\\1", name)


def check_bucket_sources(buckets, env, extra=(), timeout=BUCKET_CHECK_TIMEOUT, procs=None):
    """On the head, once per job: create the buckets named without a source, check every other
    source; (each mount's kind, "dir" or "file", None) or (None, the line that says what is wrong)."""
    extra = list(extra)
    kinds = []
    for b in buckets:
        url = b.get("url") or "s3://%s/%s" % (b["bucket"], b.get("prefix") or "")
        if b.get("create"):
            code, text = rclone_run(["rclone", "mkdir", "-q"] + RCLONE_NET + extra + [rclone_remote(b["bucket"])],
                                    env, timeout, procs)
            if code != 0:
                return None, "%s: cannot create the bucket: %s" % (url, rclone_error(text))
            kinds.append("dir")
            continue
        prefix = (b.get("prefix") or "").strip("/")
        code, lines, text = rclone_lines(["rclone", "lsf", "-q", "--max-depth", "1"] + RCLONE_NET + extra
                                         + [rclone_remote(b["bucket"], prefix)], env, 2, timeout, procs)
        if code == 3:  # rclone: directory not found, which for S3 is the bucket
            return None, "%s: no such bucket (%s); create it, or give name: without source: to have it made" % (
                url, b["bucket"])
        if code != 0:
            return None, "%s: %s" % (url, rclone_error(text))
        kind = "dir"
        base = prefix.rsplit("/", 1)[-1]
        if prefix and lines == [base]:  # a listing of one object names just it: is the prefix that object?
            parent = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            code, found, text = rclone_lines(["rclone", "lsf", "-q", "--max-depth", "1", "--files-only",
                                              "--include", "/" + _filter_escape(base)] + RCLONE_NET + extra
                                             + [rclone_remote(b["bucket"], parent)], env, 1, timeout, procs)
            if code == 0 and found == [base]:
                kind = "file"
        if b.get("mode") == "COPY" and prefix and not lines:
            return None, "%s: nothing in bucket %s under %s/" % (url, b["bucket"], prefix)
        kinds.append(kind)
    return kinds, None


def mount_point(dest):
    """The path a mount at `dest` has in the mount table (the parent's symlinks resolved)."""
    path = os.path.normpath(dest_paths(dest)[0])
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def mount_key(path):
    return hashlib.sha256(path.encode("utf-8", "replace")).hexdigest()[:16]


def mount_ident(bucket, storage, env):
    """What makes two mounts the same; the credentials enter only as a hash."""
    creds = hashlib.sha256("\0".join(env.get(n, "") for n in BUCKET_CREDENTIALS).encode()).hexdigest()
    what = {"bucket": bucket["bucket"], "prefix": (bucket.get("prefix") or "").strip("/"), "mode": bucket["mode"],
            "endpoint": (storage or {}).get("endpoint"), "region": (storage or {}).get("region"), "creds": creds,
            "access": MOUNT_ACCESS}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def answers(path, timeout=10.0):
    """Whether stat() of `path` returns in time (a dead FUSE mount says ENOTCONN; a hung one, nothing)."""
    box = []

    def probe():
        try:
            os.stat(path)
            box.append(True)
        except OSError:
            box.append(False)

    t = threading.Thread(target=probe)
    t.daemon = True
    t.start()
    t.join(timeout)
    return bool(box and box[0])


def mount_state(path, ident, record):
    """None (nothing mounted at `path`), "same", "other" (ours, another bucket or mode),
    "stale" (ours, not answering) or "foreign" (a mount point gpuctl did not make)."""
    entry = mount_table().get(path)
    if entry is None:
        return None
    if not record or record.get("path") != path or not entry[0].startswith("fuse.rclone"):
        return "foreign"
    if not answers(path):
        return "stale"
    return "same" if record.get("ident") == ident else "other"


def unmount(path, lazy=False):
    """Unmount a FUSE mount; None, or why not (a mount in use is not unmounted unless `lazy`)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        argv = [tool, "-u"] + (["-z"] if lazy else []) + [path]
    else:
        argv = ["umount"] + (["-l"] if lazy else []) + [path]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        return proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or ["exit code %d" % proc.returncode]
    return None


def mount_dirty(cache_dir):
    """Whether rclone's VFS cache may still hold a write not uploaded: a vfsMeta item that says
    "Dirty": true, or one that is not whole JSON. rclone rewrites an item's metadata in place (as an
    upload starts, for one), so a look can find it empty or cut short; taking that for clean ended
    the wait and unmounted the mount under the upload. An item gone meanwhile was cleaned away."""
    for root, _, files in os.walk(os.path.join(cache_dir, "vfsMeta")):
        for name in files:
            text = read_text(os.path.join(root, name))
            if text is None:
                continue
            try:
                info = json.loads(text)
            except ValueError:
                return True
            if not isinstance(info, dict) or info.get("Dirty") is True:
                return True
    return False


def hold_mount(base, cancelled=lambda: False):
    """A shared lock on a mount (MOUNTS_DIR/KEY.use) for as long as a job uses it: the fd, or
    None when cancelled. It waits while a job that ended unmounts it (unmount_bucket)."""
    fd = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except OSError:
            if cancelled():
                os.close(fd)
                return None
            time.sleep(0.2)


def mount_daemons(base):
    """This user's `rclone mount` processes serving MOUNTS_DIR/KEY (`base`): their cache dir names it."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat("/proc/" + name).st_uid != os.getuid():
                continue
            with open("/proc/%s/cmdline" % name, "rb") as fh:
                argv = fh.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == "rclone" and "mount" in argv and any(
                a == "--cache-dir" and b == base + ".cache" for a, b in zip(argv, argv[1:])):
            found.append(int(name))
    return found


def unmount_bucket(path, wait_s=UPLOAD_WAIT_S, settle_s=0.0):
    """Unmount what gpuctl mounted at `path` with a job's own credentials once no job holds it:
    after its uploads (up to `wait_s`), lazily if something outside the jobs still has it open.
    `settle_s`: how long the job that just ended may take to let go of it. Why it stayed, or None."""
    base = os.path.join(MOUNTS_DIR, mount_key(path))
    fd = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        settled = time.time() + settle_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.time() >= settled:
                    return "in use by another job, which unmounts it when it ends"
                time.sleep(0.1)
        deadline = time.time() + wait_s
        while mount_dirty(base + ".cache") and path in mount_table() and answers(path) and time.time() < deadline:
            time.sleep(0.5)  # a dead mount uploads nothing more: it is unmounted at once
        entry = mount_table().get(path)
        if entry is not None and entry[0].startswith("fuse.rclone") and unmount(path) and unmount(path, lazy=True):
            return "could not unmount it"
        remove(base + ".json")
        for pid in mount_daemons(base):  # a container's copy of the mount keeps the daemon up: end it
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        return None
    finally:
        os.close(fd)


def cmd_unmount_bucket(args):
    if args.lifeline_fd is not None:  # started when the mount was taken: wait for the job's owner here to end
        while True:
            try:
                if not os.read(args.lifeline_fd, 1):
                    break
            except InterruptedError:
                continue
        os.close(args.lifeline_fd)
    why = unmount_bucket(args.path, settle_s=5.0 if args.lifeline_fd is not None else 0.0)
    if why:
        sys.stderr.write("gpuctl-node: %s: %s\n" % (args.path, why))
    return 0


class NodeBuckets(object):
    """This node's part of the fetch step: claims at once, the COPYs and MOUNTs in a thread, then B."""

    def __init__(self, relay, token, kinds):
        self.relay = relay
        self.rank = relay.rank
        self.token = token
        self.buckets = relay.payload.get("buckets") or []
        self.kinds = list(kinds) + ["dir"] * (len(self.buckets) - len(kinds))
        self.storage = relay.payload.get("storage") or {}
        secrets = parse_secrets(relay.secrets)
        self.env, self.extra = rclone_env(self.storage, secrets)
        # Mounts made or reused with the job's own credentials, unmounted when it ends: [(fd, path)]
        self.own_credentials = any(name in secrets for name in BUCKET_CREDENTIALS)
        self.held = []
        self.procs = []
        self.claims = []  # COPY destinations claimed here: (index, dest)
        self.owners = []
        self.errors = []
        self.done = {"copied": [], "shared": [], "mounted": [], "reused": []}  # destinations, by what happened
        self.thread = None
        self.sent = False
        self.cancelled = False

    def start(self):
        """Free and claim the COPY destinations (before the nodes below hear of it), start the work."""
        why = destinations_problem({"buckets": self.buckets})  # again: the copies ran since the hello
        if why:
            self.errors.append(why)
            return
        try:
            for i, b in enumerate(self.buckets):
                if b.get("mode") != "COPY":
                    continue
                path = mount_point(b["dest"])
                if path in mount_table():  # a MOUNT of an earlier job there: copy onto the disk, not into it
                    why = self._release_mount(b, path, None)
                    if why:
                        self.errors.append(why)
                        continue
                ensure_dir(path if self.kinds[i] == "dir" else os.path.dirname(path))
                self.claims.append((i, {"path": b["dest"], "dir": self.kinds[i] == "dir"}))
            self.owners = claim_destinations(self.token, [d for _, d in self.claims], self.rank)
        except Exception as exc:  # noqa: BLE001 - reported as this node's result
            self.errors.append("preparing the destinations failed: %s" % exc)
        if not self.errors:
            self.thread = threading.Thread(target=self._work)
            self.thread.daemon = True
            self.thread.start()

    def busy(self):
        return not self.sent

    def poll(self, emit):
        if self.sent or (self.thread is not None and self.thread.is_alive()):
            return
        self.sent = True
        if self.errors:
            text = "; ".join(self.errors).replace("\n", " ")[:600]
            emit(ev(EV_BUCKETS, self.rank, 1, text))
        else:  # what happened where, for people and tests: {"copied": [DEST], "shared": [...], ...}
            emit(ev(EV_BUCKETS, self.rank, 0, json.dumps(dict((k, v) for k, v in self.done.items() if v),
                                                   separators=(",", ":"))))

    def release(self):
        if self.owners:
            release_claims(self.token, [d for _, d in self.claims], self.owners, self.rank)
            self.owners = []

    def kill(self):
        self.cancelled = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def end(self):
        """The job ended here: let go of the mounts it held with its own credentials; each one's
        watcher (`_watch`) unmounts it once this process is gone and no other job holds it."""
        for fd, _ in self.held:
            os.close(fd)
        self.held = []

    def _watch(self, path):
        """A detached `unmount-bucket` for a mount held with the job's credentials, started as the
        mount is taken: it waits on this process's lifeline, so the mount and the credentials in
        its rclone daemon go when the job ends here, however its owner ends (kill -9 included),
        after its uploads, unless another job still holds it (that job's watcher then does it)."""
        subprocess.Popen([sys.executable, agent_file(), CMD_UNMOUNT_BUCKET,
                          "--lifeline-fd", str(self.relay.lifeline), "--", path],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         close_fds=True, pass_fds=(self.relay.lifeline,), cwd="/", start_new_session=True)

    def _work(self):
        owned = dict((i, owner == self.rank) for (i, _), owner in zip(self.claims, self.owners))
        for i, b in enumerate(self.buckets):
            if self.cancelled:
                self.errors.append("cancelled")
                return
            try:
                if b.get("mode") != "COPY":
                    why, how = self._mount(b)
                elif owned.get(i):
                    why, how = self._copy(b, self.kinds[i]), "copied"
                else:  # a node sharing this filesystem owns the destination and fetches it
                    why, how = None, "shared"
            except Exception as exc:  # noqa: BLE001
                why, how = "%s: %s" % (b["dest"], exc), None
            if why:
                self.errors.append(why)
            else:
                self.done[how].append(b["dest"])

    def _copy(self, b, kind):
        path = os.path.normpath(dest_paths(b["dest"])[0])
        code, text = rclone_run(rclone_copy_argv(b, path, kind, self.extra), self.env, 1 << 30, self.procs)
        if code != 0:
            return "%s: copying to %s failed: %s" % (b.get("url"), b["dest"], rclone_error(text))
        return None

    def _release_mount(self, b, path, ident):
        """Unmount what gpuctl mounted at `path` (unless it is the same as wanted); why not, or None."""
        base = os.path.join(MOUNTS_DIR, mount_key(path))
        record = None
        try:
            with open(base + ".json") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            pass
        state = mount_state(path, ident, record)
        if state in (None, "same"):
            return None
        if state == "foreign":
            fstype = mount_table().get(path, ("?", ""))[0]
            return ("%s is a mount point (%s) that gpuctl did not make; give the bucket another destination"
                    % (b["dest"], fstype))
        why = unmount(path, lazy=(state == "stale"))
        if why:
            return ("%s is mounted from %s and in use (a running job?): %s; it is mounted again once nothing uses it"
                    % (b["dest"], (record or {}).get("url", "another bucket"), why[0]))
        remove(base + ".json")
        return None

    def _mount(self, b):
        """(why not, None) or (None, "mounted" | "reused")."""
        path = mount_point(b["dest"])
        base = os.path.join(MOUNTS_DIR, mount_key(path))
        ident = mount_ident(b, self.storage, self.env)
        os.makedirs(MOUNTS_DIR, 0o700, exist_ok=True)
        if self.own_credentials:
            fd = hold_mount(base, lambda: self.cancelled)
            if fd is None:
                return "cancelled", None
            self.held.append((fd, path))
            self._watch(path)
        why = self._release_mount(b, path, ident)
        if why:
            return why, None
        if path in mount_table():
            return None, "reused"  # the same mount, and it answers
        ensure_dir(path)
        if os.listdir(path):
            return "%s is not empty; a %s needs an empty (or new) directory" % (b["dest"], b["mode"]), None
        os.makedirs(MOUNTS_DIR, 0o700, exist_ok=True)
        remove(base + ".log")
        argv = rclone_mount_argv(b, path, base, self.extra, allow_other=fuse_allow_other())
        with open(base + ".out", "wb") as out:
            # --daemon: the mount's process leaves this one's session; its cwd holds nothing busy
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    close_fds=True, cwd="/", start_new_session=True)
            self.procs.append(proc)
            code = proc.wait()
        deadline = time.time() + MOUNT_READY_S  # rclone before 1.58 returns before the mount is up
        while code == 0 and path not in mount_table() and time.time() < deadline and not self.cancelled:
            time.sleep(0.1)
        if path not in mount_table():
            text = (read_text(base + ".out") or "") + (read_text(base + ".log") or "")
            return "%s: mounting at %s failed: %s" % (b.get("url"), b["dest"], rclone_error(text)), None
        write_private(base + ".json", json.dumps({"path": path, "dest": b["dest"], "url": b.get("url"),
                                                  "mode": b["mode"], "ident": ident}))
        return None, "mounted"
