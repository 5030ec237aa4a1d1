"""Node destinations of file_mounts (nodepaths.py): one canonical spelling, the places
gpuctl or the system needs refused in every spelling, and a MOUNT never over, in or
above the workdir -- through the spec (`validate` and `apply` read the same error
line) and through buckets.check (the Python API's path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuctl.api.cluster import CALLS_DIR
from gpuctl.common.errors import UserError
from gpuctl.jobplane import payload
from gpuctl.configplane import bundle
from gpuctl.node import destinations
from gpuctl.spec import buckets, load_task, nodepaths
from gpuctl.node import reserved
from gpuctl.spec.buckets import BucketMount

from test_jobplane_agent import agent


@pytest.mark.parametrize("dest,canonical", [
    ("~", "~"), ("~/", "~"), ("$HOME", "~"), ("${HOME}/", "~"), ("~/./a//b/", "~/a/b"), ("~/a/../b", "~/b"),
    ("$HOME/.ssh/../.ssh/authorized_keys", "~/.ssh/authorized_keys"), ("/", "/"), ("//", "/"), ("/..", "/"),
    ("/root//gpuctl_workdir/.", "/root/gpuctl_workdir"), ("/etc/../etc/", "/etc"), ("/data/x/../../tmp", "/tmp"),
])
def test_every_spelling_has_one_canonical_form(dest: str, canonical: str):
    assert nodepaths.normalize(dest) == canonical


@pytest.mark.parametrize("dest,says", [
    ("~/../root/.ssh", "climbs out of the home"), ("~root/.ssh", "another user's home"),
    ("$HOMEDIR/x", "must be an absolute path"), ("data", "must be an absolute path"),
])
def test_spellings_without_one_meaning_are_refused(dest: str, says: str):
    with pytest.raises(nodepaths.BadPath, match=says):
        nodepaths.normalize(dest)


def test_absolute_homes_are_checked_as_the_home():
    assert nodepaths.views("/root/x") == ["/root/x", "~/x"]
    assert nodepaths.views("/home/ubuntu") == ["/home/ubuntu", "~"]
    assert nodepaths.views("/data/home/x") == ["/data/home/x"]


RESERVED_EVERYWHERE = [
    # gpuctl's login keys and its own directory, in every spelling; ~/.ssh itself, what ssh and sshd read
    # there and gpuctl's own files there (agent/install.py writes them)
    "~/.ssh/authorized_keys", "~/.ssh", "$HOME/.ssh/", "${HOME}/.ssh/config", "/root/.ssh/authorized_keys",
    "~/.ssh/known_hosts", "~/.ssh/authorized_keys2", "~/.ssh/rc", "/home/ubuntu/.ssh/environment",
    "~/.ssh/gpuctl_cluster", "~/.ssh/gpuctl_known_hosts", "/root/.ssh/gpuctl_cluster.tmp123", "~/.ssh/x/../config",
    "/home/ubuntu/.ssh/authorized_keys", "~/x/../.ssh/authorized_keys", "~//.ssh", "~/./.gpuctl/bin/gpuctl-node",
    "~/.gpuctl", "/root/.gpuctl/jobs", "/home/ec2-user/.gpuctl/bin/gpuctl-node",
    # what the system needs whole, or not at all
    "/", "//", "/.", "~", "~/", "$HOME", "/root", "/root/", "/home/ubuntu/", "/home", "/etc", "/etc/", "/usr/../etc",
    "/usr", "/usr/local/bin", "/tmp", "/var", "/etc/ssh/sshd_config.d/50-gpuctl.conf", "/etc/sudoers.d/x",
    "/etc/passwd", "/proc/sys/kernel", "/sys", "/dev/shm/x", "/run/gpuctl", "/var/run/docker.sock", "/boot/x",
    # the login shell's startup files, what resolves names and loads libraries, the programs gpuctl runs
    "~/.bashrc", "$HOME/.profile", "/root/.bash_profile", "/home/ubuntu/.zshenv", "~/x/../.bashrc",
    "/etc/hosts", "/etc/nsswitch.conf", "/etc/profile.d/gpu.sh", "/etc/ld.so.preload", "/etc//environment",
    "/usr/bin/python3", "/usr/bin/rsync", "/usr/sbin/sshd", "/bin/bash", "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/lib64/ld-linux-x86-64.so.2", "/usr/local/../bin/ssh",
]


@pytest.mark.parametrize("mode", [None, "COPY", "MOUNT", "MOUNT_CACHED"])
@pytest.mark.parametrize("dest", RESERVED_EVERYWHERE)
def test_reserved_destinations_are_refused_in_every_spelling(dest: str, mode: str | None):
    problem = nodepaths.destination_problem(dest, mode)
    assert problem is not None and "such as /data or ~/data" in problem, problem


@pytest.mark.parametrize("dest", [
    "~/gpuctl_workdir", "~/gpuctl_workdir/", "$HOME/gpuctl_workdir", "/root/gpuctl_workdir",
    "/root/gpuctl_workdir/", "/home/ubuntu/gpuctl_workdir/ckpt", "~/gpuctl_workdir/./data/..",
    "~/data/../gpuctl_workdir", "/root//gpuctl_workdir/out",
])
@pytest.mark.parametrize("mode", ["MOUNT", "MOUNT_CACHED"])
def test_a_mount_never_covers_the_workdir(dest: str, mode: str):
    problem = nodepaths.destination_problem(dest, mode)
    assert problem is not None and f"a {mode} at {dest}" in problem and "would cover ~/gpuctl_workdir" in problem


@pytest.mark.parametrize("dest", ["/data", "~/data", "/root/ckpt", "/home/ubuntu/ckpt", "/tmp/x", "/etc/myapp",
                                  "/usr/local/share/models", "/mnt/data", "~/.cache/hf", "~/gpuctl_workdir_old",
                                  # a deploy key or other file of your own in ~/.ssh (SkyPilot's examples/dvc)
                                  "~/.ssh/id_rsa", "/root/.ssh/id_ed25519", "$HOME/.ssh/deploy/key",
                                  "/home/ubuntu/.ssh/config.d", "~/.ssh/my_gpuctl_key"])
def test_ordinary_destinations_pass(dest: str):
    for mode in (None, "COPY", "MOUNT", "MOUNT_CACHED"):
        assert nodepaths.destination_problem(dest, mode) is None, (dest, mode)


@pytest.mark.parametrize("dest", ["~/gpuctl_workdir", "$HOME/gpuctl_workdir/", "/root/gpuctl_workdir",
                                  "/home/ubuntu/gpuctl_workdir", "~/data/../gpuctl_workdir/."])
@pytest.mark.parametrize("mode", [None, "COPY"])
def test_a_copy_never_lands_on_the_workdir_itself(dest: str, mode: str | None):
    """The workdir copy (rsync --delete-after) and a file_mount there would delete each other's files."""
    problem = nodepaths.destination_problem(dest, mode)
    assert problem is not None and "where gpuctl copies the workdir on every job" in problem, problem


def test_copies_may_go_into_the_workdir():
    assert nodepaths.destination_problem("/root/gpuctl_workdir/data", "COPY") is None
    assert nodepaths.destination_problem("~/gpuctl_workdir/data") is None


def test_the_workdir_is_the_payloads():
    assert nodepaths.WORKDIR == payload.WORKDIR_DEST


def test_the_agent_checks_the_same_places():
    # One list (node/reserved.py): the agent's module reads the very objects nodepaths does, and the
    # agent's file is built from that module (test_agent_build keeps the committed file fresh).
    assert destinations.RESERVED_TREES is nodepaths.RESERVED_TREES is reserved.RESERVED_TREES
    assert destinations.RESERVED_DIRS is nodepaths.RESERVED_DIRS is reserved.RESERVED_DIRS
    assert destinations.WORKDIR is nodepaths.WORKDIR
    assert "reserved.py" in bundle.AGENT_MODULES and agent.RESERVED_TREES == reserved.RESERVED_TREES
    assert agent.GPUCTL_COPIES == (CALLS_DIR,)  # the only reserved place gpuctl copies into itself


def test_buckets_check_names_the_field():
    with pytest.raises(UserError) as err:
        buckets.check([BucketMount("/root/gpuctl_workdir", "victim")], {})
    assert err.value.message.startswith("file_mounts./root/gpuctl_workdir: a MOUNT at /root/gpuctl_workdir")
    with pytest.raises(UserError) as err:
        buckets.check([BucketMount("$HOME/.ssh", "b", mode="COPY")], {})
    assert err.value.message.startswith("file_mounts.$HOME/.ssh: $HOME/.ssh (that is ~/.ssh) is ~/.ssh, which the "
                                        "system or gpuctl needs as it is; give each key its own file_mount")


@pytest.mark.parametrize("mounts,field", [
    ("  ~/.ssh/authorized_keys: ./keys\n", "file_mounts.~/.ssh/authorized_keys"),
    ("  /data: .\n  /root/.ssh/authorized_keys: ./keys\n", "file_mounts./root/.ssh/authorized_keys"),
    ("  ~/.gpuctl/bin/gpuctl-node: ./keys\n", "file_mounts.~/.gpuctl/bin/gpuctl-node"),
    ("  /: .\n", "file_mounts./"),
    ("  ~/: .\n", "file_mounts.~/"),
    ("  /etc/: .\n", "file_mounts./etc/"),
    ("  ${WHERE}/.ssh: .\n", "file_mounts.${WHERE}/.ssh"),  # envs: WHERE=/root
    ("  /root/gpuctl_workdir:\n    source: s3://victim\n    mode: MOUNT\n", "file_mounts./root/gpuctl_workdir"),
    ("  /home/ubuntu/gpuctl_workdir/:\n    name: ckpt\n    mode: MOUNT_CACHED\n",
     "file_mounts./home/ubuntu/gpuctl_workdir/"),
    ("  /root:\n    source: s3://bkt\n    mode: MOUNT\n", "file_mounts./root"),
    ("  ~/.ssh: s3://bkt/keys\n", "file_mounts.~/.ssh"),
])
def test_the_spec_refuses_them_with_one_line_naming_the_field(tmp_path: Path, mounts: str, field: str):
    (tmp_path / "keys").write_text("ssh-ed25519 AAAA\n")
    path = tmp_path / "task.yaml"
    path.write_text(f"envs:\n  WHERE: /root\nrun: x\nfile_mounts:\n{mounts}")
    with pytest.raises(UserError) as err:
        load_task(path)
    line = err.value.message
    assert "\n" not in line and f": {field}: " in line, line
    assert "such as /data or ~/data" in line, line


def test_the_spec_keeps_ordinary_destinations(tmp_path: Path):
    path = tmp_path / "task.yaml"
    path.write_text("run: x\nfile_mounts:\n  ~/data/: .\n  /root/ckpt:\n    name: ckpt\n    mode: MOUNT\n")
    task = load_task(path)
    assert list(task.file_mounts) == ["~/data/"] and list(task.bucket_mounts) == ["/root/ckpt"]
