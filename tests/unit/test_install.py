"""Prepare's pieces that need no nodes: the agent's install step (in a temporary HOME), the
controller's per-node records, and merging a retry round into the first round's result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuctl.common.console import StepProgress
from gpuctl.configplane import bundle as node_bundle
from gpuctl.configplane import playbooks, prepare
from gpuctl.configplane.playbooks import HostFailure, PlaybookResult
from gpuctl.node import jobdir
from gpuctl.provision.inventory import Inventory, Node


def bundle(**extra: object) -> dict:
    return {"files": prepare.agent_files(), "ssh": None, "fabric": {"head": "127.0.0.1"}, "fingerprint": "fp1",
            **extra}


def install(home: Path, data: dict, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The install step as the module runs it: python3 -c BOOTSTRAP, the bundle on stdin, HOME=home."""
    env = {**os.environ, "HOME": str(home)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-c", prepare.install_bootstrap()], input=json.dumps(data),
                          capture_output=True, text=True, env=env, timeout=60)


def test_install_writes_the_agent_then_the_fingerprint_and_changes_nothing_the_second_time(tmp_path: Path):
    first = install(tmp_path, bundle())
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert result["changed"] is True and result["hostname"] == os.uname()[1] and "kind" in result
    gpuctl = tmp_path / ".gpuctl"
    assert (gpuctl / "lib" / "gpuctl_node.py").read_text() == node_bundle.agent_text()
    assert oct((gpuctl / "bin" / "gpuctl-node").stat().st_mode & 0o777) == "0o755"
    assert (gpuctl / "prepared").read_text() == "fp1\n" and (gpuctl / "fabric.env").is_file()
    assert not (tmp_path / ".ssh").exists()  # no ssh part: nothing there
    mtimes = {p: p.stat().st_mtime_ns for p in gpuctl.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    again = install(tmp_path, bundle())
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False, again.stdout
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # unchanged files are not rewritten
    # the installed launcher runs the installed agent
    launched = subprocess.run([str(gpuctl / "bin" / "gpuctl-node"), "--help"], capture_output=True, text=True,
                              env={**os.environ, "HOME": str(tmp_path)})
    assert launched.returncode == 0 and "install" in launched.stdout


def test_every_job_finds_a_damaged_or_missing_installed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """install records each file's sha256 (installed.json); prepared_problem, which every job's node
    runs first, names the file that is no longer what prepare wrote, so the node is prepared again."""
    assert install(tmp_path, bundle()).returncode == 0
    gpuctl = tmp_path / ".gpuctl"
    recorded = json.loads((gpuctl / "installed.json").read_text())
    assert set(recorded) == set(node_bundle.files()) and oct((gpuctl / "installed.json").stat().st_mode)[-3:] == "600"
    monkeypatch.setattr(jobdir, "GPUCTL_DIR", str(gpuctl))
    monkeypatch.setattr(jobdir, "PREPARED_FILE", str(gpuctl / "prepared"))
    monkeypatch.setattr(jobdir, "INSTALLED_FILE", str(gpuctl / "installed.json"))
    assert jobdir.prepared_problem("fp1") is None
    assert "differs from the expected" in jobdir.prepared_problem("fp2")
    probe = gpuctl / "lib" / "gpuctl-fabric-probe"
    probe.write_text(probe.read_text() + "# edited\n")
    assert jobdir.prepared_problem("fp1") == \
        "~/.gpuctl/lib/gpuctl-fabric-probe is damaged or missing (not what prepare installed)"
    (gpuctl / "lib" / "nodehealth.py").unlink()
    assert install(tmp_path, bundle()).returncode == 0  # prepare again: whole
    assert jobdir.prepared_problem("fp1") is None
    (gpuctl / "installed.json").unlink()
    assert "install record" in jobdir.prepared_problem("fp1")
    bad = install(tmp_path, bundle(files={**prepare.agent_files(), "../escape": {"mode": "0644", "text": "x"}}))
    assert bad.returncode == 1 and "'../escape' is not a file under ~/.gpuctl/bin or ~/.gpuctl/lib" in bad.stderr
    assert not (tmp_path / "escape").exists()


def test_install_names_the_step_that_failed(tmp_path: Path):
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    no_rsync = install(tmp_path / "a", bundle(), path=str(bare))
    assert no_rsync.returncode == 1 and no_rsync.stdout == ""
    assert no_rsync.stderr.strip() == ("gpuctl-node install: tools: rsync is not installed on this node; the node "
                                       "image needs python3 (the gpuctl agent) and rsync (workdir and file_mounts)")
    assert not (tmp_path / "a" / ".gpuctl" / "prepared").exists()  # never the fingerprint of a failed step

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".gpuctl").write_text("in the way\n")
    blocked = install(tmp_path / "b", bundle())
    assert blocked.returncode == 1 and "gpuctl-node install: cannot write" in blocked.stderr, blocked.stderr

    ssh = {"key": "KEY", "public_key": "ssh-ed25519 AAAA gpuctl-internal-c",
           "view": {"hosts": [{"names": ["head; rm -rf ~"], "address": "10.0.0.2", "port": 22}], "known_hosts": ""}}
    bad_view = install(tmp_path / "c", bundle(ssh=ssh))
    assert bad_view.returncode == 1 and "cluster view: a node name" in bad_view.stderr, bad_view.stderr
    ssh["view"]["hosts"][0]["names"] = ["head\n"]  # `$` would let a final newline through
    trailing = install(tmp_path / "d", bundle(ssh=ssh))
    assert trailing.returncode == 1 and "cluster view: a node name" in trailing.stderr, trailing.stderr
    assert not (tmp_path / "c" / ".gpuctl" / "prepared").exists()


def test_the_fabric_probe_runs_in_the_install_and_fails_in_one_line(tmp_path: Path):
    """The probe runs inside the install's own Python (a second one per node costs more than the
    probe); one that cannot be loaded runs as a program, and either failure is one line, no fingerprint."""
    import base64
    import zlib

    def with_probe(text: str) -> dict:
        data = bundle()
        entry = dict(data["files"]["lib/gpuctl-fabric-probe"])
        entry.pop("text", None)
        entry["zdata"] = base64.b64encode(zlib.compress(text.encode())).decode()
        data["files"] = {**data["files"], "lib/gpuctl-fabric-probe": entry}
        return data

    fine = install(tmp_path / "a", bundle())
    assert fine.returncode == 0 and json.loads(fine.stdout)["kind"] == "socket", fine.stderr
    assert (tmp_path / "a" / ".gpuctl" / "fabric.env").exists()
    raising = install(tmp_path / "b", with_probe("def probe(**kw):\n    raise RuntimeError('no devices')\n"
                                                 "def write(result, directory):\n    return False\n"))
    assert raising.returncode == 1 and raising.stderr.strip() == \
        "gpuctl-node install: fabric probe: RuntimeError: no devices", raising.stderr
    broken = install(tmp_path / "c", with_probe("def broken(:\n"))
    assert broken.returncode == 1, broken.stderr
    assert broken.stderr.startswith("gpuctl-node install: fabric probe: exit code 1: ") and \
        "SyntaxError" in broken.stderr and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert not (tmp_path / "b" / ".gpuctl" / "prepared").exists() and not (tmp_path / "c" / ".gpuctl" / "prepared").exists()


def test_no_fingerprint_keeps_the_record_and_an_empty_ssh_part_is_none(tmp_path: Path):
    assert install(tmp_path, bundle()).returncode == 0
    (tmp_path / ".gpuctl").chmod(0o755)  # a directory opened up since: made private again
    for empty in (None, "", {}):  # older ansible-core renders a template's None as ""
        done = install(tmp_path, bundle(fingerprint="", ssh=empty))
        assert done.returncode == 0, done.stderr
    assert (tmp_path / ".gpuctl" / "prepared").read_text() == "fp1\n"  # wait.yml and a bare role leave it
    assert oct((tmp_path / ".gpuctl").stat().st_mode & 0o777) == "0o700" and not (tmp_path / ".ssh").exists()
    half = install(tmp_path, bundle(ssh={"key": "", "public_key": "", "view": None}))
    assert half.returncode == 1 and "node-to-node SSH: the bundle has no key pair" in half.stderr


def test_install_authorizes_the_cluster_key_once_and_replaces_an_older_one(tmp_path: Path):
    ssh_dir = tmp_path / ".ssh"
    ssh_dir.mkdir()
    (ssh_dir / "authorized_keys").write_text("ssh-ed25519 OLD gpuctl-internal-c\nssh-rsa USERS me@laptop\n")
    view = {"hosts": [{"names": ["head", "10.0.0.2"], "address": "10.0.0.2", "port": 22, "user": "ubuntu",
                       "alias": "gpuctl-i-1"}], "known_hosts": "gpuctl-i-1 ssh-ed25519 AAAAhost\n"}
    ssh = {"key": "-----BEGIN KEY-----\nsecret\n-----END KEY-----", "public_key": "ssh-ed25519 NEW gpuctl-internal-c",
           "view": view}
    for _ in range(2):
        done = install(tmp_path, bundle(ssh=ssh))
        assert done.returncode == 0, done.stderr
    assert (ssh_dir / "authorized_keys").read_text() == "ssh-rsa USERS me@laptop\nssh-ed25519 NEW gpuctl-internal-c\n"
    assert oct((ssh_dir / "gpuctl_cluster").stat().st_mode & 0o777) == "0o600"
    assert (ssh_dir / "gpuctl_known_hosts").read_text() == view["known_hosts"]
    config = (ssh_dir / "config").read_text()
    assert "Host head 10.0.0.2\n" in config and "  HostKeyAlias gpuctl-i-1\n" in config
    assert "secret" not in done.stdout + done.stderr


def _inv(*ids: str) -> Inventory:
    return Inventory(cluster="c", cloud="local", nodes=tuple(
        Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=i, address=f"10.0.0.{r + 2}", ssh_host="h")
        for r, i in enumerate(ids)))


def test_records_are_kept_per_node(tmp_path: Path):
    inv = _inv("a", "b", "c")
    (tmp_path / "prepared").write_text("old-style single record\n")
    assert prepare.has_old_record(tmp_path)  # an upgraded cluster: "gpuctl changed", not "first job"
    assert prepare.recorded(tmp_path) == {} and [n.name for n in prepare.unprepared(tmp_path, inv, "fp")] == \
        ["head", "worker1", "worker2"]
    prepare.record(tmp_path, inv, inv.nodes[:2], "fp")
    assert not prepare.has_old_record(tmp_path)  # the old record goes once there are new ones
    assert [n.name for n in prepare.unprepared(tmp_path, inv, "fp")] == ["worker2"]
    assert len(prepare.unprepared(tmp_path, inv, "fp2")) == 3  # a new fingerprint: every node
    replaced = _inv("a", "B", "c")  # worker1 replaced: a new id
    prepare.record(tmp_path, replaced, replaced.nodes[2:], "fp")
    assert prepare.recorded(tmp_path) == {"a": "fp", "c": "fp"}  # b is gone with its node
    assert [n.name for n in prepare.unprepared(tmp_path, replaced, "fp")] == ["worker1"]
    prepare.forget(tmp_path, replaced.nodes[:1])
    assert prepare.recorded(tmp_path) == {"c": "fp"}
    prepare.forget(tmp_path)
    assert prepare.recorded(tmp_path) == {}
    prepare.forget(tmp_path / "no-such-cluster", replaced.nodes[:1])  # nothing recorded: nothing written
    # hand-written inventories without ids: the node is known by where it is reached
    bare = Node(name="worker1", rank=1, node_id="worker1", address="10.0.0.9", ssh_host="h9", ssh_port=2222)
    assert prepare.node_key(bare) == "root@h9:2222"


def test_the_fingerprint_leaves_the_peers_out():
    fp = prepare.fingerprint(internal_public_key="k", fabric_env={})
    assert fp == prepare.fingerprint(internal_public_key="k ", fabric_env={})
    assert fp != prepare.fingerprint(internal_public_key="k2", fabric_env={})


def test_a_retry_round_replaces_the_hosts_it_ran_again():
    first = PlaybookResult(ok=False, failures=[HostFailure("worker3", 3, 1, "install: broken")],
                           unreachable=["worker1", "worker2"],
                           unreachable_reasons={"worker1": "Connection refused", "worker2": "Connection refused"},
                           changed=["head", "worker3"])
    retry = PlaybookResult(ok=False, unreachable=["worker2"], unreachable_reasons={"worker2": "timed out"},
                           changed=["worker1"])
    merged = playbooks.merge_results(first, retry, ["worker1", "worker2"])
    assert not merged.ok and [f.host for f in merged.failures] == ["worker3"]
    assert merged.unreachable == ["worker2"] and merged.unreachable_reasons == {"worker2": "timed out"}
    assert merged.changed == ["head", "worker1", "worker3"]
    ok = playbooks.merge_results(PlaybookResult(ok=False, unreachable=["worker1"]), PlaybookResult(ok=True),
                                 ["worker1"])
    assert ok.ok and ok.unreachable == []


@pytest.mark.parametrize("every_tenth,expected", [(True, 11), (False, 64)])  # tenths 0 to 10
def test_progress_off_a_terminal_is_a_line_per_tenth(every_tenth: bool, expected: int):
    shown: list[str] = []
    step = StepProgress(shown.append, every_tenth=every_tenth)
    for done in range(1, 65):
        step.update(f"{done} of 64", done, 64)
    assert len(shown) == expected and shown[-1] == "64 of 64"
