"""Hardening (issue 8), each finding with its regression test: names match in
full (no trailing newline), inventory fields cannot reach ssh as options or
add lines to a config file, user files with control bytes are one clear line,
SSH open to the world needs an explicit yes, the local-node registry refuses
a planted directory, and gpuctl's files are private."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import gpuctlfork
import pytest
import yaml

from gpuctl.common.config import aws_settings
from gpuctl.common.envargs import parse_env_assignments
from gpuctl.common.errors import UserError
from gpuctl.jobplane.runner import JobSpec
from gpuctl.providers.local import provider as local_provider
from gpuctl.provision import sshconfig
from gpuctl.provision.inventory import Inventory, Node, load_inventory
from gpuctl.provision.ssh import proxy_command, ssh_argv
from gpuctl.spec import load_task
from gpuctl.spec.request import check_cluster_name

# -- 3. names match in full ---------------------------------------------------------


@pytest.mark.parametrize("name", ["ok\n", "ok\nx", "OK", "-ok", "ok "])
def test_cluster_names_match_in_full(name: str):
    with pytest.raises(UserError):
        check_cluster_name(name)


def test_secret_name_with_trailing_newline_is_refused(tmp_path: Path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"run": "echo hi", "secrets": {"TOKEN\n": "x"}}))
    with pytest.raises(UserError, match="secrets"):
        load_task(path)


@pytest.mark.parametrize("item", ["TOKEN\n=x", "A\nB=1"])
def test_cli_env_names_match_in_full(item: str):
    with pytest.raises(UserError):
        parse_env_assignments([item])


def test_jobspec_repr_hides_secrets():
    spec = JobSpec(name="x", run="true", secrets={"TOKEN": "hunter2-value"})
    assert "hunter2-value" not in repr(spec)


# -- 2. inventory fields ---------------------------------------------------------------


def write_inventory(tmp_path: Path, **hostvars: object) -> Path:
    host = {"ansible_host": "10.0.0.5", **hostvars}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {"n1": host}}}))
    return path


@pytest.mark.parametrize("field,value,fragment", [
    ("ansible_host", "-oProxyCommand=touch /tmp/x", "ansible_host"),
    ("ansible_host", "10.0.0.5\nMatch exec \"touch /tmp/x\"", "ansible_host"),
    ("ansible_host", "host name", "ansible_host"),
    ("ansible_port", "22 -oX", "ansible_port"),
    ("ansible_port", 70000, "ansible_port"),
    ("ansible_user", "-oProxyCommand=x", "ansible_user"),
    ("ansible_user", "root\nMatch all", "ansible_user"),
    ("gpuctl_proxy_jump", "-oProxyCommand=touch@x", "gpuctl_proxy_jump"),
    ("gpuctl_proxy_jump", "ubuntu@bastion\nMatch exec x", "gpuctl_proxy_jump"),
    ("ansible_ssh_private_key_file", "/k\nMatch exec x", "key path"),
])
def test_bad_inventory_field_is_one_clear_error(tmp_path: Path, field: str, value: object, fragment: str):
    path = write_inventory(tmp_path, **{field: value})
    with pytest.raises(UserError) as err:
        load_inventory(path)
    assert fragment in str(err.value) and "\n" not in str(err.value).rstrip("\n").split("'")[0]


def test_good_inventory_fields_pass(tmp_path: Path):
    inv = load_inventory(write_inventory(tmp_path, ansible_port=2222, ansible_user="ubuntu",
                                         gpuctl_proxy_jump="ec2-user@bastion.example.com:22"))
    assert inv.nodes[0].ssh_port == 2222 and inv.nodes[0].proxy_jump == "ec2-user@bastion.example.com:22"


def test_every_ssh_argv_ends_options_before_the_host():
    node = Node(name="head", rank=0, node_id="i", address="10.0.0.5", ssh_host="10.0.0.5",
                proxy_jump="u@bastion")
    argv = ssh_argv(node, "true")
    assert argv[argv.index("10.0.0.5") - 1] == "--" and argv[-1] == "true"
    assert proxy_command(node).endswith("-- u@bastion")


def test_ssh_config_refuses_control_characters(tmp_path: Path):
    node = Node(name="head", rank=0, node_id="i", address="10.0.0.5", ssh_host="10.0.0.5",
                ssh_key="/k\nMatch exec x")
    with pytest.raises(UserError, match="control character"):
        sshconfig.write(Inventory(cluster="c", cloud="ssh", nodes=(node,)), tmp_path / "c.conf")
    assert not (tmp_path / "c.conf").exists()


# -- 6. control bytes in user files -------------------------------------------------------


@pytest.mark.parametrize("data,fragment", [
    (b"name: x\x00\nrun: echo\n", "1:8: control character U+0000"),
    (b"run: echo\n\x07bell: 1\n", "2:1: control character U+0007"),
])
def test_task_yaml_with_control_bytes_is_one_line(tmp_path: Path, data: bytes, fragment: str):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(data)
    with pytest.raises(UserError) as err:
        load_task(path)
    assert fragment in str(err.value) and str(err.value).startswith(str(path))


@pytest.mark.parametrize("kind", ["inventory", "config"])
def test_other_user_files_with_control_bytes_are_one_line(tmp_path: Path, kind: str,
                                                          monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / ("inv.yml" if kind == "inventory" else "config.yaml")
    path.write_bytes(b"all:\n  hosts:\n    n1: {ansible_host: 10.0.0.5}\x00\n")
    with pytest.raises(UserError, match="U\\+0000"):
        if kind == "inventory":
            load_inventory(path)
        else:
            aws_settings({}, path=path)


def test_control_bytes_through_the_cli_exit_2_without_traceback(tmp_path: Path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"run: echo\x00\n")
    proc = gpuctlfork.run(["validate", str(path)],
                          env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "U+0000" in proc.stderr


# -- 7. SSH open to the world ----------------------------------------------------------------


def test_ssh_open_to_world_needs_an_explicit_yes(tmp_path: Path):
    with pytest.raises(UserError, match="whole internet"):
        aws_settings({"GPUCTL_SSH_INGRESS_CIDRS": "0.0.0.0/0"}, path=tmp_path / "none.yaml")
    with pytest.raises(UserError, match="whole internet"):
        aws_settings({"GPUCTL_SSH_INGRESS_CIDRS": "203.0.113.7/32,::/0"}, path=tmp_path / "none.yaml")
    ok = aws_settings({"GPUCTL_SSH_INGRESS_CIDRS": "0.0.0.0/0", "GPUCTL_SSH_OPEN_TO_WORLD": "1"},
                      path=tmp_path / "none.yaml")
    assert ok.ssh_ingress_cidrs == ("0.0.0.0/0",)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("aws:\n  ssh_ingress_cidrs: [0.0.0.0/0]\n  ssh_open_to_world: true\n")
    assert aws_settings({}, path=cfg).ssh_ingress_cidrs == ("0.0.0.0/0",)
    assert aws_settings({"GPUCTL_SSH_INGRESS_CIDRS": "203.0.113.7/32"},
                        path=tmp_path / "none.yaml").ssh_ingress_cidrs == ("203.0.113.7/32",)


# -- 5. local-node registry and private files ----------------------------------------------------


def test_registry_refuses_a_planted_symlink(tmp_path: Path):
    target = tmp_path / "victim"
    target.mkdir()
    planted = tmp_path / "gpuctl-alloc-0"
    planted.symlink_to(target)
    with pytest.raises(UserError, match="not a directory"):
        with local_provider._locked(planted):
            pass
    assert not (target / ".lock").exists()


def test_registry_refuses_a_directory_of_another_user(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 65534, 65534)
    with pytest.raises(UserError, match="another user"):
        with local_provider._locked(other):
            pass


def test_registry_made_private(tmp_path: Path):
    reg = tmp_path / "reg"
    with local_provider._locked(reg):
        pass
    assert stat.S_IMODE(reg.stat().st_mode) == 0o700


def test_state_dir_and_files_are_private(tmp_path: Path):
    state = tmp_path / "state"
    path = tmp_path / "cluster.yaml"
    path.write_text("run: echo hi\n")
    proc = gpuctlfork.run(["status"],
                          env={**os.environ, "GPUCTL_STATE_DIR": str(state)})
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for p in state.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p


# -- 1. host keys: learned once, verified afterwards ----------------------------------------


def pinned_node(tmp_path: Path, **kw: object) -> Node:
    base = dict(name="worker1", rank=1, node_id="i-0abc", address="10.0.0.6", ssh_host="203.0.113.9",
                known_hosts=str(tmp_path / "known_hosts"))
    base.update(kw)
    return Node(**base)  # type: ignore[arg-type]


def test_controller_ssh_learns_then_verifies_under_the_node_id(tmp_path: Path):
    argv = ssh_argv(pinned_node(tmp_path), "true")
    opts = " ".join(argv)
    assert "StrictHostKeyChecking=accept-new" in opts and "StrictHostKeyChecking=no" not in opts
    assert f"UserKnownHostsFile={tmp_path / 'known_hosts'}" in opts and "HostKeyAlias=gpuctl-i-0abc" in opts
    assert "/dev/null" not in opts.replace("GlobalKnownHostsFile=/dev/null", "")


def test_ansible_inventory_carries_the_host_key_options(tmp_path: Path):
    from gpuctl.provision.ansibleinventory import to_ansible

    inv = Inventory(cluster="c", cloud="aws", nodes=(pinned_node(tmp_path, rank=0, name="head"),))
    host = to_ansible(inv)["all"]["children"]["gpuctl_nodes"]["hosts"]["head"]
    assert "StrictHostKeyChecking=accept-new" in host["ansible_ssh_common_args"]
    assert host["gpuctl_host_key_alias"] == "gpuctl-i-0abc"


def test_nodes_verify_each_other_strictly(tmp_path: Path):
    from gpuctl.jobplane.payload import peer_entry

    opts = " ".join(peer_entry(pinned_node(tmp_path))["ssh"])
    assert "StrictHostKeyChecking=yes" in opts and "HostKeyAlias=gpuctl-i-0abc" in opts
    assert "UserKnownHostsFile=~/.ssh/gpuctl_known_hosts" in opts


def test_ssh_config_pins_host_keys(tmp_path: Path):
    text = sshconfig.render(Inventory(cluster="c", cloud="aws", nodes=(pinned_node(tmp_path, rank=0, name="head"),)))
    assert "StrictHostKeyChecking accept-new" in text and "HostKeyAlias gpuctl-i-0abc" in text
    assert "StrictHostKeyChecking no" not in text


def test_forget_host_keys_drops_only_the_named_or_the_stale(tmp_path: Path):
    from gpuctl.provision.ssh import forget_host_keys

    kh = tmp_path / "known_hosts"
    kh.write_text("gpuctl-i-1 ssh-ed25519 AAAA1\ngpuctl-i-2 ssh-ed25519 AAAA2\n"
                  "gpuctl-bastion-1.2.3.4 ssh-ed25519 AAAB\ngpuctl-i-3 ssh-ed25519 AAAA3\n")
    assert forget_host_keys(kh, {"gpuctl-i-2"}) == 1
    assert "AAAA2" not in kh.read_text() and "AAAA1" in kh.read_text()
    assert forget_host_keys(kh, {"gpuctl-i-1"}, keep_only=True) == 1  # i-3 was replaced
    assert kh.read_text() == "gpuctl-i-1 ssh-ed25519 AAAA1\ngpuctl-bastion-1.2.3.4 ssh-ed25519 AAAB\n"


def test_a_changed_key_message_names_the_node_and_the_fix(tmp_path: Path):
    from gpuctl.provision.ssh import host_key_changed, host_key_error

    assert host_key_changed("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.")
    assert not host_key_changed("Connection refused")
    msg = host_key_error(pinned_node(tmp_path))
    assert "worker1" in msg and "gpuctl forget-host-key" in msg and "\n" not in msg


# -- 1b. AWS: learned keys against the instance console ----------------------------------


CONSOLE = """[   12.3] cloud-init[1234]: Cloud-init v. 24.1 running
ec2: #############################################################
ec2: -----BEGIN SSH HOST KEY FINGERPRINTS-----
ec2: 256 SHA256:{ed} root@ip-10-0-0-5 (ED25519)
ec2: 3072 SHA256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA root@ip-10-0-0-5 (RSA)
ec2: -----END SSH HOST KEY FINGERPRINTS-----
ec2: #############################################################
"""


def test_console_fingerprints_match_the_learned_key(tmp_path: Path):
    from gpuctl.providers.aws import hostkeys

    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    blob = key.with_suffix(".pub").read_text().split()[1]
    expected = subprocess.run(["ssh-keygen", "-lf", str(key.with_suffix(".pub"))], capture_output=True,
                              text=True, check=True).stdout.split()[1]
    assert hostkeys.fingerprint(blob) == expected  # the same as OpenSSH's
    kh = tmp_path / "known_hosts"
    kh.write_text(f"gpuctl-i-1 ssh-ed25519 {blob}\n")
    learned = hostkeys.learned_fingerprints(kh, "gpuctl-i-1")
    printed = hostkeys.console_fingerprints(CONSOLE.format(ed=expected[len("SHA256:"):]))
    assert learned == {expected} and expected in printed
    assert hostkeys.mismatched(learned, printed) == []
    other = hostkeys.console_fingerprints(CONSOLE.format(ed="B" * 43))
    assert hostkeys.mismatched(learned, other) == [expected]  # an impostor's key
    assert hostkeys.mismatched(learned, set()) == []  # nothing printed yet: nothing to compare


def test_a_key_the_console_does_not_list_stops_gpuctl_and_is_forgotten(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    from gpuctl.providers.aws import hostkeys
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.preparer import Preparer
    from gpuctl.state.registry import Registry

    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kh = tmp_path / "known_hosts"
    kh.write_text(f"gpuctl-i-1 ssh-ed25519 {key.with_suffix('.pub').read_text().split()[1]}\n")
    node = pinned_node(tmp_path, rank=0, name="head", node_id="i-1")
    preparer = Preparer(Inventory(cluster="c", cloud="aws", nodes=(node,), region="us-east-1"),
                        reporter=Reporter(plain=True), registry=Registry())
    monkeypatch.setattr(hostkeys, "console_output", lambda node_id, region: CONSOLE.format(ed="B" * 43))
    with pytest.raises(UserError, match="head .* not one the instance printed"):
        preparer.check_console_host_keys([node])
    assert kh.read_text() == ""  # forgotten: nothing trusts it
    monkeypatch.setattr(hostkeys, "console_output", lambda node_id, region: "")
    preparer.check_console_host_keys([node])  # no console yet: said, not a failure
