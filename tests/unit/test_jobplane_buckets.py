"""Cloud-bucket file_mounts without a network: how the agent builds rclone's argv and
environment (credentials only in the environment), reads mount tables and rclone's
errors, and a one-node job through `submit` with a stand-in rclone on PATH (the head's
check, the COPY before setup, a missing bucket, a node without rclone); the controller's
side (buckets.py: refusals, payload entries, storage settings; prepare's features)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuctl.common.errors import UserError
from gpuctl.configplane import prepare
from gpuctl.jobplane import jobenv
from gpuctl.jobplane.payload import build_payload
from gpuctl.providers import get_provider
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.spec import buckets
from gpuctl.spec.buckets import BucketMount

from e2e import wait_for
from test_jobplane_agent import agent, node_home, payload, submit  # noqa: F401 (a fixture)

SECRET_ID = "AKIDEXAMPLE-not-real"
SECRET_KEY = "k3y-'with quotes' and $dollar\nand a newline"
SECRETS = {"AWS_ACCESS_KEY_ID": SECRET_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "OTHER": "x"}
STORAGE = {"endpoint": "http://10.0.0.1:9000", "region": "us-east-1"}
BUCKET = {"dest": "/data", "bucket": "b", "prefix": "ds/train", "mode": "MOUNT", "create": False,
          "url": "s3://b/ds/train"}


# -- the agent's pure parts ---------------------------------------------------------


def test_secrets_parse_back_what_jobenv_writes():
    text = jobenv.secrets_script(SECRETS)
    assert agent.parse_secrets(text) == SECRETS


def test_rclone_env_takes_credentials_from_secrets_only():
    base = {"PATH": "/usr/bin", "AWS_SESSION_TOKEN": "stale-node-token", "AWS_CA_BUNDLE": "/nonexistent/ca.pem"}
    env, extra = agent.rclone_env(STORAGE, SECRETS, base)
    assert env["AWS_ACCESS_KEY_ID"] == SECRET_ID and env["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY
    assert "AWS_SESSION_TOKEN" not in env  # never mixed with the job's keys
    assert "OTHER" not in env and "AWS_CA_BUNDLE" not in env and extra == []
    assert env["RCLONE_CONFIG_GPUCTLS3_TYPE"] == "s3" and env["RCLONE_CONFIG_GPUCTLS3_ENV_AUTH"] == "true"
    assert env["RCLONE_CONFIG_GPUCTLS3_PROVIDER"] == "Other"  # an endpoint of its own: path-style
    assert env["RCLONE_CONFIG_GPUCTLS3_ENDPOINT"] == STORAGE["endpoint"]
    assert env["RCLONE_CONFIG_GPUCTLS3_REGION"] == "us-east-1"
    aws, _ = agent.rclone_env({"endpoint": None, "region": "eu-west-1"}, SECRETS, base)
    assert aws["RCLONE_CONFIG_GPUCTLS3_LOCATION_CONSTRAINT"] == "eu-west-1"  # where `name:` buckets are made


def test_rclone_env_without_secrets_leaves_the_node_identity(tmp_path: Path):
    bundle = tmp_path / "ca.pem"
    bundle.write_text("pem")
    env, extra = agent.rclone_env({"endpoint": None, "region": None}, {}, {"AWS_CA_BUNDLE": str(bundle)})
    assert not any(k in env for k in agent.BUCKET_CREDENTIALS)  # AWS's chain: the instance profile
    assert env["RCLONE_CONFIG_GPUCTLS3_PROVIDER"] == "AWS" and "RCLONE_CONFIG_GPUCTLS3_ENDPOINT" not in env
    assert extra == ["--ca-cert", str(bundle)]


def test_no_argv_carries_a_credential():
    env, extra = agent.rclone_env(STORAGE, SECRETS, {})
    argvs = [agent.rclone_copy_argv(dict(BUCKET, mode="COPY"), "/data", "dir", extra),
             agent.rclone_copy_argv(dict(BUCKET, mode="COPY"), "/data/f", "file", extra),
             agent.rclone_mount_argv(BUCKET, "/data", "/h/.gpuctl/mounts/k", extra),
             agent.rclone_mount_argv(dict(BUCKET, mode="MOUNT_CACHED"), "/data", "/h/.gpuctl/mounts/k", extra, True)]
    for argv in argvs:
        assert not any(s in " ".join(argv) for s in (SECRET_ID, "k3y", "quotes")), argv
    copy, copyto, mount, cached = argvs
    assert copy[:2] == ["rclone", "copy"] and copy[-2:] == ["gpuctls3:b/ds/train", "/data"]
    assert copyto[:2] == ["rclone", "copyto"]
    assert mount[:4] == ["rclone", "mount", "gpuctls3:b/ds/train", "/data"] and "--daemon" in mount
    assert mount[mount.index("--vfs-cache-mode") + 1] == "writes" and "--allow-other" not in mount
    assert cached[cached.index("--vfs-cache-mode") + 1] == "full" and "--allow-other" in cached
    assert mount[mount.index("--cache-dir") + 1] == "/h/.gpuctl/mounts/k.cache"


def option(argv: list, name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_mount_is_the_job_users_alone():
    """Every file the user's, 0600 in 0700 directories, and the kernel checks those modes whenever
    FUSE would let other users in (--allow-other alone let `nobody` read, write and delete)."""
    opened = agent.rclone_mount_argv(BUCKET, "/data", "/h/k", (), True, uid=1001, gid=1002)
    closed = agent.rclone_mount_argv(BUCKET, "/data", "/h/k", (), False)
    for argv in (opened, closed):
        assert option(argv, "--umask") == "0077"
        assert "--allow-other" not in argv or "--default-permissions" in argv
    assert (option(opened, "--uid"), option(opened, "--gid")) == ("1001", "1002")
    assert (option(closed, "--uid"), option(closed, "--gid")) == (str(os.getuid()), str(os.getgid()))
    assert "--allow-other" not in closed


def test_a_mount_opened_to_everyone_is_not_reused():
    """A mount an older agent made (its identity without the access) differs from today's."""
    env, _ = agent.rclone_env(STORAGE, SECRETS, {})
    creds = hashlib.sha256("\0".join(env.get(n, "") for n in agent.BUCKET_CREDENTIALS).encode()).hexdigest()
    before = {"bucket": "b", "prefix": "ds/train", "mode": "MOUNT", "endpoint": STORAGE["endpoint"],
              "region": STORAGE["region"], "creds": creds}
    older = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert agent.mount_ident(BUCKET, STORAGE, env) != older
    before["access"] = agent.MOUNT_ACCESS
    assert agent.mount_ident(BUCKET, STORAGE, env) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()
                                                                     ).hexdigest()


def test_tools_problem_names_what_is_missing():
    copy, mount = [dict(BUCKET, mode="COPY")], [BUCKET]
    have = {"rclone": "/usr/bin/rclone", "fusermount3": "/usr/bin/fusermount3"}
    assert agent.bucket_tools_problem([], which=lambda n: None) is None
    assert agent.bucket_tools_problem(mount, which=have.get, exists=lambda p: True, usable=True) is None
    text = agent.bucket_tools_problem(mount, which=have.get, exists=lambda p: True, usable=False)
    assert text.startswith("/dev/fuse cannot be opened by ") and "chmod 666 /dev/fuse" in text
    assert agent.bucket_tools_problem(copy, which=have.get, exists=lambda p: True, usable=False) is None
    assert agent.bucket_tools_problem(copy, which={"rclone": "/x"}.get, exists=lambda p: False) is None
    text = agent.bucket_tools_problem(copy, which=lambda n: None)
    assert text.startswith("rclone is not installed") and "apt-get install rclone fuse3" in text
    text = agent.bucket_tools_problem(mount, which={"rclone": "/x"}.get, exists=lambda p: False)
    assert text.startswith("fusermount3 (package fuse3) and /dev/fuse (the fuse kernel module) are not installed")


def test_rclone_errors_become_one_line_with_a_hint():
    log = ("2026/11/23 21:50:35 NOTICE: Config file \"/root/.config/rclone/rclone.conf\" not found - using defaults\n"
           "2026/11/23 21:50:35 ERROR : : error listing: NoCredentialProviders: no valid providers in chain. "
           "Deprecated.\n\tFor verbose messaging see aws.Config.CredentialsChainVerboseErrors\n"
           "2026/11/23 21:50:35 Failed to lsf with 2 errors: last error was: error in ListJSON: "
           "NoCredentialProviders: no valid providers in chain. Deprecated.\n")
    msg = agent.rclone_error(log)
    assert msg.startswith("error in ListJSON: NoCredentialProviders") and "under secrets:" in msg
    assert "\n" not in msg and "2026/" not in msg
    assert agent.rclone_error("") == "rclone gave no reason"


def test_mount_table_unescapes_paths():
    text = ("22 1 0:21 / /proc rw - proc proc rw\n"
            "44 50 0:40 / /root/my\\040ckpt rw,nosuid - fuse.rclone gpuctls3:b/p rw,user_id=0\n")
    assert agent.mount_table(text) == {"/proc": ("proc", "proc"), "/root/my ckpt": ("fuse.rclone", "gpuctls3:b/p")}


def test_mount_identity_follows_bucket_mode_endpoint_and_credentials():
    env, _ = agent.rclone_env(STORAGE, SECRETS, {})
    same = agent.mount_ident(BUCKET, STORAGE, env)
    assert agent.mount_ident(dict(BUCKET), dict(STORAGE), dict(env)) == same
    assert agent.mount_ident(dict(BUCKET, mode="MOUNT_CACHED"), STORAGE, env) != same
    assert agent.mount_ident(dict(BUCKET, prefix="other"), STORAGE, env) != same
    assert agent.mount_ident(BUCKET, dict(STORAGE, endpoint="http://elsewhere"), env) != same
    assert agent.mount_ident(BUCKET, STORAGE, dict(env, AWS_SECRET_ACCESS_KEY="rotated")) != same
    assert SECRET_ID not in same and SECRET_KEY not in same


def test_nothing_mounted_and_foreign_mount_points(tmp_path: Path):
    assert agent.mount_state(str(tmp_path / "nothing"), "id", None) is None
    assert agent.mount_state("/proc", "id", None) == "foreign"  # a mount point gpuctl did not make


def test_a_mount_with_writes_not_uploaded_is_dirty(tmp_path: Path):
    cache = tmp_path / "k.cache"
    assert not agent.mount_dirty(str(cache))
    meta = cache / "vfsMeta" / "gpuctls3" / "b" / "ckpt"
    meta.mkdir(parents=True)
    (meta / "done.pt").write_text('{\n\t"Size": 3,\n\t"Fingerprint": "3,abc",\n\t"Dirty": false\n}\n')
    assert not agent.mount_dirty(str(cache))
    (meta / "step9.pt").write_text('{\n\t"Size": 1000000,\n\t"Fingerprint": "",\n\t"Dirty": true\n}\n')
    assert agent.mount_dirty(str(cache))


@pytest.mark.parametrize("text", ["", '{\n\t"Size": 1000000,\n\t"Fing', "[]"])
def test_metadata_caught_mid_rewrite_counts_as_not_uploaded(tmp_path: Path, text: str):
    """rclone rewrites an item's metadata in place (truncate, then write) as its upload starts: a look
    that finds it empty or cut short must keep waiting, not unmount the mount under the upload."""
    meta = tmp_path / "k.cache" / "vfsMeta" / "gpuctls3" / "b" / "ckpt"
    meta.mkdir(parents=True)
    (meta / "done.pt").write_text('{"Size": 3, "Dirty": false}')
    (meta / "final.bin").write_text(text)
    assert agent.mount_dirty(str(tmp_path / "k.cache"))
    (meta / "final.bin").write_text('{"Size": 3000000, "Fingerprint": "3000000,x", "Dirty": false}')
    assert not agent.mount_dirty(str(tmp_path / "k.cache"))


def test_a_mount_another_job_holds_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The job that ends last unmounts: while another job holds the mount, its end leaves it."""
    monkeypatch.setattr(agent, "MOUNTS_DIR", str(tmp_path))
    base = str(tmp_path / agent.mount_key("/data"))
    fd = agent.hold_mount(base)
    try:
        assert agent.unmount_bucket("/data") == "in use by another job, which unmounts it when it ends"
    finally:
        os.close(fd)
    assert agent.unmount_bucket("/data") is None  # free, and nothing mounted there


def test_the_mounts_daemon_ends_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Unmounting ends the mount's rclone even where a copy of the mount (a container's) would
    keep it serving, with the job's credentials in its environment; other rclones stay."""
    monkeypatch.setattr(agent, "MOUNTS_DIR", str(tmp_path))
    base = str(tmp_path / agent.mount_key("/data"))
    sleeper = "import time; time.sleep(60)"
    ours, other = (subprocess.Popen(["bash", "-c", f'exec -a rclone "$0" -c "{sleeper}" mount --cache-dir {cache}',
                                     sys.executable]) for cache in (base + ".cache", base + "-other.cache"))
    try:
        wait_for("the stand-ins to start", lambda: agent.mount_daemons(base) == [ours.pid], timeout=10)
        assert agent.unmount_bucket("/data") is None
        assert ours.wait(timeout=10) == -signal.SIGTERM and other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


OWNER = """
import importlib.util, os, sys, time, types
spec = importlib.util.spec_from_file_location("agent", sys.argv[1])
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)
lifeline, _keep = os.pipe()  # as a Relay holds it: never written, EOF once this process is gone
held = agent.hold_mount(os.path.join(agent.MOUNTS_DIR, agent.mount_key("/data")))
agent.NodeBuckets._watch(types.SimpleNamespace(relay=types.SimpleNamespace(lifeline=lifeline)), "/data")
print("holding", flush=True)
time.sleep(300)
"""


def test_a_mount_with_the_jobs_credentials_goes_when_its_owner_is_killed(node_home: Path):
    """The job's owner on the node (coordinator or relay) is killed -9 while it holds a mount made
    with the job's credentials: the mount's watcher, started with the mount, still ends its
    daemon (and with it the credentials); while the owner lives, the daemon stays."""
    home_env = {**os.environ, "HOME": str(node_home)}
    base = node_home / ".gpuctl" / "mounts" / agent.mount_key("/data")
    base.parent.mkdir(parents=True)
    sleeper = "import time; time.sleep(120)"
    daemon = subprocess.Popen(["bash", "-c", f'exec -a rclone "$0" -c "{sleeper}" mount --cache-dir {base}.cache',
                               sys.executable])
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(agent.__file__)], env=home_env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "holding"
        assert daemon.poll() is None  # the owner lives: its watcher waits
        owner.kill()
        owner.wait()
        wait_for("the mount's daemon to end with its killed owner", lambda: daemon.poll() is not None, timeout=20)
        assert daemon.returncode == -signal.SIGTERM
    finally:
        for proc in (owner, daemon):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- one-node jobs with a stand-in rclone ----------------------------------------------


FAKE_RCLONE = r"""#!/bin/bash
# A stand-in for rclone: records its argv and the AWS/RCLONE names and values it got,
# lists every source but a bucket called "missing", copies one file.
printf 'ARGV %s\n' "$*" >> "$FAKE_RCLONE_LOG"
env | grep -E '^(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN)|RCLONE_CONFIG_)' \
  | sed 's/^/ENV /' >> "$FAKE_RCLONE_LOG"
verb=$1
last=${@: -1}
case "$verb" in
  lsf) case "$last" in gpuctls3:missing*) echo "Failed to lsf: directory not found" >&2; exit 3 ;; esac
       echo "a.txt" ;;
  mkdir) ;;
  copy) mkdir -p "$last" && echo "from the bucket" > "$last/a.txt" ;;
  *) echo "fake rclone: $verb is not faked" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """PATH with bash and a stand-in rclone only (nothing else of this machine's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "mkdir", "sed", "grep", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "rclone").write_text(FAKE_RCLONE)
    (bin_dir / "rclone").chmod(0o755)
    os.symlink(shutil.which("true"), bin_dir / "fusermount3")  # a MOUNT's tools are there (never reached)
    return bin_dir


def run_with(home: Path, bin_dir: Path, body: dict, secrets: dict, monkeypatch: pytest.MonkeyPatch):
    log = home.parent / "rclone.log"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_RCLONE_LOG", str(log))
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    events, outcome, err = submit(home, body, secrets_text=jobenv.secrets_script(secrets))
    return events, outcome, (log.read_text() if log.exists() else "")


def test_copy_lands_before_setup_with_credentials_in_the_environment(node_home: Path, fake_bin: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    mounts = [BucketMount(dest="~/data", bucket="b", prefix="ds", mode="COPY")]
    body = payload("20", "true", setup="cat ~/data/a.txt", buckets=buckets.payload_entries(mounts),
                   storage={"endpoint": "http://10.0.0.1:9000", "region": None})
    events, outcome, log = run_with(node_home, fake_bin, body, SECRETS, monkeypatch)
    assert outcome is not None and outcome.status == "SUCCEEDED", events
    assert ("setup", "from the bucket") in [(e.stage, e.text) for e in events if e.kind == "O"]
    phases = [e.text for e in events if e.kind == "P"]
    assert phases.index("buckets") < phases.index("mounts") < phases.index("setup")
    argv = [line for line in log.splitlines() if line.startswith("ARGV ")]
    assert argv[0].startswith("ARGV lsf -q --max-depth 1") and argv[0].endswith("gpuctls3:b/ds")
    assert argv[1].startswith("ARGV copy -q") and argv[1].endswith(f"gpuctls3:b/ds {node_home}/data")
    assert f"ENV AWS_ACCESS_KEY_ID={SECRET_ID}" in log and "ENV RCLONE_CONFIG_GPUCTLS3_PROVIDER=Other" in log
    assert not any(SECRET_ID in line or "k3y" in line for line in argv)
    job = node_home / ".gpuctl" / "jobs" / "20"
    for path in job.rglob("*"):  # the job's files (payload, events, logs) never hold a credential
        assert SECRET_ID not in path.read_text(errors="replace"), path
    assert not list((node_home / "data").glob(".gpuctl-claim-*"))


def test_missing_bucket_is_one_line_and_nothing_runs(node_home: Path, fake_bin: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    mounts = [BucketMount(dest="~/ckpt", bucket="made", mode="MOUNT", create=True),
              BucketMount(dest="~/data", bucket="missing", prefix="x", mode="COPY")]
    body = payload("21", "touch ~/ran", setup="touch ~/set", buckets=buckets.payload_entries(mounts),
                   storage={"endpoint": None, "region": "eu-west-1"})
    events, outcome, log = run_with(node_home, fake_bin, body, {}, monkeypatch)
    assert outcome is not None and outcome.status == "FAILED"
    assert outcome.detail == ("s3://missing/x: no such bucket (missing); create it, or give name: without source: "
                              "to have it made")
    assert "ARGV mkdir -q" in log and "gpuctls3:made" in log  # name: without source: created first
    assert "ENV AWS_ACCESS_KEY_ID" not in log  # no secrets: AWS's own chain (the instance profile)
    assert not (node_home / "ran").exists() and not (node_home / "set").exists()
    assert "mounts" not in [e.text for e in events if e.kind == "P"]


def test_node_without_rclone_runs_nothing(node_home: Path, fake_bin: Path, monkeypatch: pytest.MonkeyPatch):
    (fake_bin / "rclone").unlink()
    body = payload("22", "touch ~/ran", setup="touch ~/set",
                   buckets=buckets.payload_entries([BucketMount(dest="~/d", bucket="b", mode="COPY")]))
    _, outcome, _ = run_with(node_home, fake_bin, body, {}, monkeypatch)
    assert outcome is not None and outcome.status == "FAILED"
    assert outcome.detail.startswith("head: rclone is not installed, and the job's cloud-bucket file_mounts need it")
    assert not (node_home / "ran").exists() and not (node_home / "set").exists()


@pytest.mark.parametrize("link,target,dest,mode,says", [
    ("keys", ".ssh", "~/keys/authorized_keys", "COPY", "is in ~/.ssh"),
    ("keys", ".ssh", "~/keys", "MOUNT", "is ~/.ssh,"),
    ("keys", ".ssh", "~/keys/config", "COPY", "is in ~/.ssh/config"),
    ("keys", ".ssh", "~/keys/gpuctl_cluster", "COPY", "is one of gpuctl's own files in ~/.ssh"),
    ("tools", ".gpuctl/bin", "~/tools/gpuctl-node", "COPY", "is in ~/.gpuctl"),
    ("wd", "gpuctl_workdir", "~/wd", "MOUNT", "would cover ~/gpuctl_workdir"),
    ("wd", "gpuctl_workdir", "~/wd/out", "MOUNT_CACHED", "would cover ~/gpuctl_workdir"),
    ("up", "..", "~/up", "MOUNT", "would cover ~,"),  # the home's parent holds the home
    ("sys", "/etc", "~/sys", "COPY", "is /etc,"),
])
def test_the_node_refuses_reserved_places_behind_symlinks(node_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                           link: str, target: str, dest: str, mode: str, says: str):
    (node_home / ".ssh").mkdir()
    (node_home / "gpuctl_workdir").mkdir()
    (node_home / link).symlink_to(target)
    monkeypatch.setenv("HOME", str(node_home))
    why = agent.dest_problem(dest, mode)
    assert why is not None and says in why and f"{dest} (here " in why, why


def test_the_node_takes_a_deploy_key_into_ssh_but_not_its_login_files(node_home: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """~/.ssh is no longer reserved whole (SkyPilot's examples/dvc copies ~/.ssh/id_rsa): any other file
    or directory there is fine on the node too, through a symlink as well."""
    (node_home / ".ssh").mkdir()
    (node_home / "keys").symlink_to(".ssh")
    monkeypatch.setenv("HOME", str(node_home))
    for dest in ("~/.ssh/id_rsa", "~/keys/id_rsa", "~/.ssh/deploy/key"):
        assert agent.dest_problem(dest, "COPY") is None, dest
    assert agent.dest_problem("~/.ssh/certs", "MOUNT") is None
    for dest, says in (("~/.ssh/authorized_keys", "is in ~/.ssh/authorized_keys"), ("~/.ssh/known_hosts", "is in "),
                       ("~/.ssh/gpuctl_known_hosts", "gpuctl's own files"), ("~/.ssh", "is ~/.ssh,")):
        assert says in (agent.dest_problem(dest, "COPY") or ""), dest


def test_the_node_refuses_a_mount_at_a_workdir_that_is_a_symlink(node_home: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    elsewhere = tmp_path / "scratch" / "code"
    elsewhere.mkdir(parents=True)
    (node_home / "gpuctl_workdir").symlink_to(elsewhere)
    monkeypatch.setenv("HOME", str(node_home))
    for dest in (str(elsewhere), str(elsewhere.parent), str(elsewhere) + "/ckpt"):
        assert "would cover ~/gpuctl_workdir" in (agent.dest_problem(dest, "MOUNT") or ""), dest
    assert agent.dest_problem(str(elsewhere) + "/ckpt", "COPY") is None
    assert agent.dest_problem("~/data", "MOUNT") is None
    assert agent.dest_problem(str(tmp_path / "scratch" / "other"), "MOUNT_CACHED") is None


def test_a_reserved_destination_stops_the_job_before_anything_is_fetched(node_home: Path, fake_bin: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    (node_home / "gpuctl_workdir").mkdir()
    (node_home / "wd").symlink_to("gpuctl_workdir")
    mounts = [BucketMount(dest="~/data", bucket="b", prefix="ds", mode="COPY"),
              BucketMount(dest="~/wd", bucket="victim", mode="MOUNT")]
    body = payload("23", "touch ~/ran", setup="touch ~/set", buckets=buckets.payload_entries(mounts),
                   storage={"endpoint": "http://10.0.0.1:9000", "region": None})
    events, outcome, log = run_with(node_home, fake_bin, body, SECRETS, monkeypatch)
    assert outcome is not None and outcome.status == "FAILED", events
    assert outcome.detail == (f"head: file_mounts.~/wd: a MOUNT at ~/wd (here {node_home}/gpuctl_workdir) would "
                              "cover ~/gpuctl_workdir, which gpuctl rewrites on every job (the workdir copy would "
                              "delete through the mount into the bucket); mount it elsewhere, such as /data or "
                              "~/data"), outcome.detail
    assert log == ""  # rclone never ran: nothing listed, copied or mounted
    assert not (node_home / "ran").exists() and not (node_home / "set").exists() and not (node_home / "data").exists()


@pytest.mark.parametrize("link,target,sync,field", [
    ("keys", ".ssh", {"path": "~/keys/authorized_keys", "dir": False}, "file_mounts.~/keys/authorized_keys"),
    ("gpuctl_workdir", ".gpuctl", {"path": "~/gpuctl_workdir", "dir": True}, "workdir"),
])
def test_a_copy_through_a_symlink_into_a_reserved_place_runs_nothing(node_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      link: str, target: str, sync: dict, field: str):
    (node_home / ".ssh").mkdir()
    (node_home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 KEEP\n")
    (node_home / link).symlink_to(target)
    body = payload("24", "touch ~/ran", setup="touch ~/set", sync=[sync])
    events, outcome, _ = submit(node_home, body)
    assert outcome is not None and outcome.status == "FAILED", events
    assert outcome.detail.startswith(f"head: {field}: {sync['path']} (here {node_home}/"), outcome.detail
    assert "which gpuctl or the system needs on every node" in outcome.detail
    assert (node_home / ".ssh" / "authorized_keys").read_text() == "ssh-ed25519 KEEP\n"
    assert not (node_home / "ran").exists() and not (node_home / "set").exists()


def test_a_copy_onto_the_workdir_behind_a_symlink_runs_nothing(node_home: Path, monkeypatch: pytest.MonkeyPatch):
    """A file_mount whose real path is the workdir (through a link the controller cannot see) would be
    deleted by the workdir copy, or delete it: the node refuses it before anything is copied."""
    (node_home / "gpuctl_workdir").mkdir()
    (node_home / "code").symlink_to("gpuctl_workdir")
    monkeypatch.setenv("HOME", str(node_home))
    assert agent.workdir_copy_problem("~/code") is not None and agent.workdir_copy_problem("~/code/data") is None
    body = payload("25", "touch ~/ran", setup="touch ~/set", sync=[{"path": "~/code", "dir": True}])
    events, outcome, _ = submit(node_home, body)
    assert outcome is not None and outcome.status == "FAILED", events
    assert outcome.detail.startswith("head: file_mounts.~/code: ~/code is ~/gpuctl_workdir here"), outcome.detail
    assert not (node_home / "ran").exists() and not (node_home / "set").exists()


def test_gpuctls_own_call_files_still_reach_the_node(node_home: Path, monkeypatch: pytest.MonkeyPatch):
    """The Python API copies its call files to ~/.gpuctl/calls (api/cluster.py), which the spec
    refuses to file_mounts; the node lets gpuctl's own copy through, and nothing else in ~/.gpuctl."""
    monkeypatch.setenv("HOME", str(node_home))
    assert agent.dest_problem("~/.gpuctl/calls/0123abcd.pkl", "COPY") is None
    for dest, mode in (("~/.gpuctl/calls", "COPY"), ("~/.gpuctl/calls/../bin/gpuctl-node", "COPY"),
                       ("~/.gpuctl/calls/x", "MOUNT")):
        assert "is in ~/.gpuctl" in (agent.dest_problem(dest, mode) or ""), dest


def test_no_workdir_copy_through_a_mount(node_home: Path, monkeypatch: pytest.MonkeyPatch):
    """A mount at or in the workdir (one an older gpuctl accepted) stops the copy that would
    delete through it; a mount beside the workdir does not."""
    monkeypatch.setenv("HOME", str(node_home))
    wd = str(node_home / "gpuctl_workdir")
    body = {"sync": [{"path": "~/gpuctl_workdir", "dir": True}]}
    for point in (wd, wd + "/data/ckpt"):
        monkeypatch.setattr(agent, "mount_table", lambda: {"/proc": ("proc", "proc"),
                                                           point: ("fuse.rclone", "gpuctls3:victim")})
        why = agent.destinations_problem(body)
        assert why == (f"workdir: {point} is a mount point (fuse.rclone gpuctls3:victim), and the workdir copy would "
                       f"delete through it whatever your workdir lacks; unmount it (fusermount -u {point}) or mount "
                       "it elsewhere"), why
    monkeypatch.setattr(agent, "mount_table", lambda: {wd + "_old": ("fuse.rclone", "gpuctls3:b"), "/": ("ext4", "x")})
    assert agent.destinations_problem(body) is None


# -- the controller's side ---------------------------------------------------------------


@pytest.mark.parametrize("mount,envs,says", [
    (BucketMount("~/gpuctl_workdir/ckpt", "b"), {}, "would cover ~/gpuctl_workdir"),
    (BucketMount("~/", "b", mode="MOUNT_CACHED"), {}, "~/ is the home"),
    (BucketMount("~/.gpuctl/x", "b"), {}, "is in ~/.gpuctl"),
    (BucketMount("/data", "b", mode="COPY"), {"AWS_SECRET_ACCESS_KEY": "x"}, "envs.AWS_SECRET_ACCESS_KEY: bucket"),
    (BucketMount("/data", "b"), {"AWS_ENDPOINT_URL": "minio:9000"}, "envs.AWS_ENDPOINT_URL 'minio:9000'"),
])
def test_check_refuses_what_nodes_could_not_do_safely(mount: BucketMount, envs: dict, says: str):
    with pytest.raises(UserError) as err:
        buckets.check([mount], envs)
    assert says in err.value.message


def test_check_accepts_copy_into_the_workdir_and_plain_mounts():
    buckets.check([BucketMount("~/gpuctl_workdir/data", "b", mode="COPY"), BucketMount("/ckpt", "c")],
                  {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"})
    buckets.check([], {"AWS_SECRET_ACCESS_KEY": "not about buckets"})


def test_tools_storage_and_entries():
    copy, mount = BucketMount("/d", "b", "p/", mode="COPY"), BucketMount("~/c", "c", create=True)
    assert buckets.tools_needed([]) == () and buckets.tools_needed([copy]) == ("rclone",)
    assert buckets.tools_needed([copy, mount]) == ("rclone", "fuse")
    envs = {"AWS_ENDPOINT_URL": "http://b/", "AWS_ENDPOINT_URL_S3": "http://a/", "AWS_DEFAULT_REGION": "eu-west-1"}
    local, aws = get_provider("local"), get_provider("aws")
    assert buckets.storage_settings(envs, default_region=local.bucket_region(None)) == \
        {"endpoint": "http://a", "region": "eu-west-1"}
    assert buckets.storage_settings({}, default_region=aws.bucket_region("us-west-2")) == \
        {"endpoint": None, "region": "us-west-2"}
    assert buckets.storage_settings({}, default_region=local.bucket_region("x")) == {"endpoint": None, "region": None}
    assert buckets.payload_entries([copy, mount]) == [
        {"dest": "/d", "bucket": "b", "prefix": "p", "mode": "COPY", "create": False, "url": "s3://b/p"},
        {"dest": "~/c", "bucket": "c", "prefix": "", "mode": "MOUNT", "create": True, "url": "s3://c"}]
    assert buckets.describe([mount]) == ["s3://c (created if missing): mounted at ~/c"]


def test_payload_carries_buckets_and_no_credentials():
    inv = Inventory(cluster="c", cloud="local", nodes=(Node(name="head", rank=0, node_id="n0", address="10.0.0.2",
                                                            ssh_host="10.0.0.2", ssh_port=22, ssh_user="root"),))
    body = build_payload(inv, job_id=1, fingerprint="f", job_nodes=1, setup=None, run=None,
                         buckets=buckets.payload_entries([BucketMount("/d", "b")]), storage=STORAGE)
    assert body["buckets"][0]["bucket"] == "b" and body["storage"] == STORAGE
    assert build_payload(inv, job_id=1, fingerprint="f", job_nodes=1, setup=None, run=None,
                         storage=STORAGE)["storage"] is None


def test_features_grow_and_enter_the_fingerprint(tmp_path: Path):
    assert prepare.features(tmp_path) == ()
    assert prepare.features(tmp_path, ("fuse", "rclone")) == ("rclone", "fuse")
    prepare.record_features(tmp_path, ("rclone",))
    assert prepare.features(tmp_path) == ("rclone",) and prepare.features(tmp_path, ("fuse",)) == ("rclone", "fuse")
    with pytest.raises(ValueError):
        prepare.features(tmp_path, ("nfs",))
    plain = prepare.fingerprint(internal_public_key="k", fabric_env={})
    assert prepare.fingerprint(internal_public_key="k", fabric_env={}, features=()) == plain
    with_tools = prepare.fingerprint(internal_public_key="k", fabric_env={}, features=("rclone",))
    assert with_tools != plain
    assert prepare.fingerprint(internal_public_key="k", fabric_env={}, features=("rclone", "fuse")) != with_tools
