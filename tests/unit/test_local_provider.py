"""The local provider, the Terraform driver and the cluster key, without starting nodes.

Terraform runs for real where it is cheap (plan/validate of the local module,
which needs no provider); failures are produced by a fake `terraform` script so
the error parsing is tested against exactly the text Terraform prints.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import cluster_dir, terraform_dir
from gpuctl.providers import MODULE_NAME, get_provider, render_root
from gpuctl.providers.local import provider as local_provider
from gpuctl.provision import provisioner
from gpuctl.provision.sshkeys import ensure_cluster_key
from gpuctl.provision.terraform import PlanSummary, TerraformRoot, error_lines, parse_plan_json
from gpuctl.spec.request import ClusterRequest

needs_terraform = pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not on PATH")
MODULE = terraform_dir() / "modules" / "local-nodes"
PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG9wZW5zc2gta2V5LWZvci10ZXN0cy1vbmx5LXh4eHg= test"


@pytest.fixture(autouse=True)
def _private_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Reservations of these tests stay in tmp, not in the machine-wide registry."""
    reg = tmp_path / "registry"
    monkeypatch.setenv(local_provider.REGISTRY_ENV, str(reg))
    monkeypatch.delenv(local_provider.POOL_ENV, raising=False)
    return reg


def modes() -> list[str]:
    return ["netns", "loopback"] if os.geteuid() == 0 else ["loopback"]


# -- root_config -----------------------------------------------------------------


@pytest.mark.parametrize("mode", modes())
def test_root_config_calls_the_packaged_module_and_passes_the_contract_through(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(local_provider.MODE_ENV, mode)
    cdir = tmp_path / "clusters" / "demo"
    req = ClusterRequest(name="demo", num_nodes=3, cloud="local")
    config = get_provider("local").root_config(req, cluster_dir=cdir, ssh_public_key=PUBKEY + "\n")

    call = config["module"][MODULE_NAME]
    source = Path(call["source"])
    assert source.is_absolute() and source == MODULE.resolve()
    assert (source / "main.tf").is_file() and (source / "scripts" / "node.sh").is_file()
    assert config["output"] == {
        "nodes": {"value": "${module.cluster.nodes}"},
        "ssh_user": {"value": "${module.cluster.ssh_user}"},
        "bastion": {"value": "${module.cluster.bastion}"},
    }
    assert call["name"] == "demo" and call["node_count"] == 3 and call["mode"] == mode
    assert call["ssh_public_key"] == PUBKEY
    assert call["state_dir"] == str(cdir.resolve() / "nodes")
    assert call["node_path"].split(":")[0] == os.path.dirname(os.path.abspath(sys.executable))
    if mode == "netns":
        assert ipaddress.ip_network(call["subnet_cidr"]).prefixlen == 23 and "base_port" not in call
        # a normal user with passwordless sudo, made when missing, as a cloud image's login user
        assert call["ssh_user"] == "gpuctl" and call["create_user"] is True
    else:
        assert local_provider.PORT_RANGE[0] <= call["base_port"] < local_provider.PORT_RANGE[1] and "subnet_cidr" not in call
        assert call["keep_visible_paths"] == []


def test_the_nodes_user_is_gpuctl_unless_asked_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(local_provider.USER_ENV, raising=False)
    assert local_provider.local_user("netns") == "gpuctl"
    monkeypatch.setenv(local_provider.USER_ENV, "root")  # root by choice
    assert local_provider.local_user("netns") == "root"
    monkeypatch.setenv(local_provider.USER_ENV, "-oProxyCommand=x")
    with pytest.raises(UserError, match="GPUCTL_LOCAL_USER='-oProxyCommand=x': give a user name such as gpuctl"):
        local_provider.local_user("netns")
    # Python under root's private home (pyenv) stays visible to a normal user's nodes
    monkeypatch.setattr(local_provider, "keep_visible_paths",
                        lambda home: ["/root/.pyenv/versions/3.11.7"] if home is None or str(home) == "/root" else [])
    assert local_provider.node_keep_paths("gpuctl") == ["/root/.pyenv/versions/3.11.7"]
    assert local_provider.node_keep_paths("root") == ["/root/.pyenv/versions/3.11.7"]


@needs_terraform
@pytest.mark.parametrize("mode", modes())
def test_rendered_root_validates_and_plans_the_nodes(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_provider.MODE_ENV, mode)
    req = ClusterRequest(name="demo", num_nodes=2, cloud="local")
    root = TerraformRoot(tmp_path / "root")
    root.write(get_provider("local").root_config(req, cluster_dir=tmp_path / "c", ssh_public_key=PUBKEY))
    root.init()
    subprocess.run(["terraform", "validate", "-no-color"], cwd=root.workdir, check=True, capture_output=True)
    summary = root.plan()
    assert summary == PlanSummary(add=3 if mode == "netns" else 2, change=0, destroy=0, text=summary.text)
    assert "module.cluster.terraform_data.node[1]: Plan to create" in summary.text


def test_root_config_is_stable_across_renders(tmp_path: Path) -> None:
    provider = get_provider("local")
    cdir = tmp_path / "clusters" / "demo"
    req = ClusterRequest(name="demo", num_nodes=2, cloud="local")
    first = provider.root_config(req, cluster_dir=cdir, ssh_public_key=PUBKEY)
    again = provider.root_config(req, cluster_dir=cdir, ssh_public_key=PUBKEY)
    bigger = provider.root_config(ClusterRequest(name="demo", num_nodes=4, cloud="local"),
                                  cluster_dir=cdir, ssh_public_key=PUBKEY)
    assert again == first
    assert (cdir / local_provider.ALLOCATION_FILE).is_file()
    # Only the node count changes when the cluster grows: Terraform adds nodes, keeps the rest.
    diff = {k for k in first["module"][MODULE_NAME] if first["module"][MODULE_NAME][k] != bigger["module"][MODULE_NAME][k]}
    assert diff == {"node_count"}


def test_render_root_merges_extra_blocks() -> None:
    config = render_root(MODULE, {"name": "x"}, extra={"provider": {"aws": {"region": "us-east-1"}},
                                                       "terraform": {"required_providers": {"aws": {}}}})
    assert config["terraform"] == {"required_version": ">= 1.5", "required_providers": {"aws": {}}}
    assert config["provider"] == {"aws": {"region": "us-east-1"}}


def test_get_provider_names_unknown_clouds() -> None:
    with pytest.raises(UserError, match="infra 'gcp' has no Terraform provider"):
        get_provider("gcp")
    assert get_provider("local").name == "local"


def test_local_prepare_rejects_too_many_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv(local_provider.MODE_ENV, "loopback")
    with pytest.raises(UserError, match=r"num_nodes 254: infra local supports 1 to 253 nodes in loopback mode "
                                        r"\(its ports: a block of 256 per cluster\); lower num_nodes or use infra aws"):
        get_provider("local").prepare(ClusterRequest(name="big", num_nodes=254, cloud="local"))
    monkeypatch.setenv(local_provider.MODE_ENV, "netns")
    if os.geteuid() == 0:
        with pytest.raises(UserError, match=r"supports 1 to 509 nodes in netns mode \(its subnet: a /23 holds"):
            get_provider("local").prepare(ClusterRequest(name="big", num_nodes=510, cloud="local"))
    # A cluster made with a /24 before keeps it, and says how to get more.
    cdir = tmp_path / "clusters" / "old"
    cdir.mkdir(parents=True)
    (cdir / local_provider.ALLOCATION_FILE).write_text(
        local_provider.Allocation("netns", "root", "/usr/bin:/bin", subnet_cidr="10.213.7.0/24").to_json())
    with pytest.raises(UserError, match=r"supports 1 to 253 nodes in this cluster \(its subnet 10.213.7.0/24 holds "
                                        r"the bridge and 253 nodes\); a cluster made before holds fewer: make a new one"):
        get_provider("local").check(ClusterRequest(name="old", num_nodes=300, cloud="local"))
    get_provider("local").check(ClusterRequest(name="old", num_nodes=253, cloud="local"))


def test_a_locked_nodes_user_is_refused_before_anything_is_made(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """sshd refuses a locked account even with a key: one line naming the variable, not nodes that
    never let anyone in."""
    shadow = tmp_path / "shadow"
    shadow.write_text("root:*:19000:0:99999:7:::\nlocked:!:19000:0:99999:7:::\nopen:*:19000::::::\n"
                      "disabled:!*:19000::::::\n")
    assert [local_provider.account_locked(u, shadow) for u in ("root", "locked", "open", "disabled", "absent")] == \
        [False, True, False, True, False]
    assert local_provider.account_locked("locked", tmp_path / "unreadable") is False
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv(local_provider.MODE_ENV, "netns")
    monkeypatch.setattr(local_provider, "account_locked", lambda user: user == "locked")
    monkeypatch.setattr(local_provider, "_account_exists", lambda user: user in ("locked", "open"))
    monkeypatch.setenv(local_provider.USER_ENV, "locked")
    with pytest.raises(UserError, match=r"^GPUCTL_LOCAL_USER: the local nodes' user locked is locked .* \(usermod -p "
                                        r"'\*' locked\) or set GPUCTL_LOCAL_USER to another user$"):
        get_provider("local").check(ClusterRequest(name="l", num_nodes=1, cloud="local"))
    assert not (tmp_path / "clusters" / "l").exists()
    monkeypatch.setenv(local_provider.USER_ENV, "open")
    get_provider("local").check(ClusterRequest(name="l", num_nodes=1, cloud="local"))


def test_only_gpuctl_s_own_user_is_made_and_an_account_gets_no_sudo_unsaid(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUCTL_LOCAL_USER names an account of this machine, never one for gpuctl to make (with root's
    sudo); an account without sudo is said, since setups that call sudo fail there."""
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv(local_provider.MODE_ENV, "netns")
    monkeypatch.setattr(local_provider, "account_locked", lambda user: False)
    monkeypatch.setattr(local_provider, "_account_exists", lambda user: user == "alice")
    monkeypatch.setenv(local_provider.USER_ENV, "mallory")
    with pytest.raises(UserError, match=r"^GPUCTL_LOCAL_USER=mallory: no such user on this machine; gpuctl makes "
                                        r"only its own login user gpuctl .* create mallory yourself, or unset "
                                        r"GPUCTL_LOCAL_USER$"):
        get_provider("local").check(ClusterRequest(name="l", num_nodes=1, cloud="local"))
    assert not (tmp_path / "clusters" / "l").exists()
    monkeypatch.setenv(local_provider.USER_ENV, "alice")
    get_provider("local").check(ClusterRequest(name="l", num_nodes=1, cloud="local"))
    alloc = local_provider.allocate(tmp_path / "clusters" / "l", num_nodes=1, registry=tmp_path / "reg", used=[])
    assert alloc.ssh_user == "alice" and alloc.create_user is False
    monkeypatch.delenv(local_provider.USER_ENV)
    alloc = local_provider.allocate(tmp_path / "clusters" / "m", num_nodes=1, registry=tmp_path / "reg", used=[])
    assert alloc.ssh_user == "gpuctl" and alloc.create_user is True
    from gpuctl.spec import load_task

    task_file = tmp_path / "t.yaml"
    task_file.write_text("name: l\nresources: {infra: local}\nrun: sudo -n true\n")
    task = load_task(task_file)
    monkeypatch.setenv(local_provider.USER_ENV, "alice")
    for may, said in ((False, True), (True, False)):
        monkeypatch.setattr(local_provider, "_may_sudo", lambda user: may)
        lines = get_provider("local").task_warnings(task, ClusterRequest(name="x", num_nodes=1, cloud="local"))
        assert any("log in as alice, an account of this machine, which gpuctl grants no sudo" in w
                   for w in lines) is said


def test_state_dir_with_spaces_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="set GPUCTL_STATE_DIR"):
        get_provider("local").root_config(ClusterRequest(name="d", num_nodes=1, cloud="local"),
                                          cluster_dir=tmp_path / "my state" / "d", ssh_public_key=PUBKEY)


def test_a_cluster_that_cannot_be_rendered_is_not_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "my state"))
    with pytest.raises(UserError, match="set GPUCTL_STATE_DIR"):
        provisioner.provision(ClusterRequest(name="d", num_nodes=1, cloud="local"))
    assert not provisioner.cluster_exists("d")


# -- allocation --------------------------------------------------------------------


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text)


def test_subnet_allocation_skips_used_networks_and_other_clusters(tmp_path: Path, _private_registry: Path) -> None:
    used = [net("10.213.0.0/24"), net("10.213.1.128/25"), net("192.168.0.0/16")]
    a = local_provider.allocate(tmp_path / "a", num_nodes=2, mode="netns", used=used)
    b = local_provider.allocate(tmp_path / "b", num_nodes=2, mode="netns", used=used)
    assert a.subnet_cidr == "10.213.2.0/23"  # .0/23 overlaps a used /24 and a /25 route
    assert b.subnet_cidr == "10.213.4.0/23"  # .2/23 is reserved by cluster a
    # Stable: the same cluster gets the same subnet even when the world changed.
    assert local_provider.allocate(tmp_path / "a", num_nodes=5, mode="netns", used=[]) == a
    assert json.loads((tmp_path / "a" / "local.json").read_text())["subnet_cidr"] == "10.213.2.0/23"
    # A cluster that is gone frees its subnet.
    shutil.rmtree(tmp_path / "a")
    c = local_provider.allocate(tmp_path / "c", num_nodes=2, mode="netns", used=used)
    assert c.subnet_cidr == "10.213.2.0/23"
    # release() frees it at once.
    local_provider.release(tmp_path / "c")
    d = local_provider.allocate(tmp_path / "d", num_nodes=2, mode="netns", used=used)
    assert d.subnet_cidr == "10.213.2.0/23"


def test_subnet_pool_exhaustion_and_bad_pool_are_user_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_provider.POOL_ENV, "10.99.0.0/22")
    local_provider.allocate(tmp_path / "a", num_nodes=1, mode="netns", used=[net("10.99.3.0/24")])
    with pytest.raises(UserError, match=r"no free /23 left in 10.99.0.0/22"):
        local_provider.allocate(tmp_path / "b", num_nodes=1, mode="netns", used=[net("10.99.3.0/24")])
    monkeypatch.setenv(local_provider.POOL_ENV, "8.8.0.0/16")
    with pytest.raises(UserError, match="GPUCTL_LOCAL_SUBNET_POOL=8.8.0.0/16: use a private IPv4 range"):
        local_provider.allocate(tmp_path / "c", num_nodes=1, mode="netns", used=[])


def test_used_networks_reads_this_machine() -> None:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed")
    nets = local_provider.used_networks()
    assert any(n.overlaps(net("127.0.0.0/8")) for n in nets)


def test_loopback_allocation_skips_busy_ports(tmp_path: Path) -> None:
    first = local_provider.PORT_RANGE[0]
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", first + 1))
            busy.listen()
        except OSError:
            pass  # someone else holds it: the allocator must skip it all the same
        a = local_provider.allocate(tmp_path / "a", num_nodes=3, mode="loopback")
    assert a.base_port is not None and a.base_port >= first + local_provider.PORT_BLOCK
    assert (a.base_port - first) % local_provider.PORT_BLOCK == 0
    b = local_provider.allocate(tmp_path / "b", num_nodes=3, mode="loopback")
    assert b.base_port != a.base_port


def test_keep_visible_paths_are_python_prefixes_under_home(tmp_path: Path) -> None:
    base = Path(os.path.realpath(sys.base_prefix))
    assert str(base) in local_provider.keep_visible_paths(base.parent)
    assert local_provider.keep_visible_paths(tmp_path) == []


def test_keep_visible_paths_for_a_pyenv_venv_in_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    base = home / ".pyenv" / "versions" / "3.11.7"
    venv = home / "work" / "venv"
    (base / "bin").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    (base / "bin" / "python3").write_text("")
    (venv / "bin" / "python").symlink_to(base / "bin" / "python3")
    monkeypatch.setattr(sys, "base_prefix", str(base))
    monkeypatch.setattr(sys, "base_exec_prefix", str(base))
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    assert local_provider.keep_visible_paths(home) == [str(base), str(venv)]
    assert local_provider.node_path().split(":")[0] == str(venv / "bin")  # the venv, not its symlink's target
    # A prefix inside another one is covered by the outer bind.
    monkeypatch.setattr(sys, "prefix", str(base / "envs" / "inner"))
    monkeypatch.setattr(sys, "exec_prefix", str(base / "envs" / "inner"))
    assert local_provider.keep_visible_paths(home) == [str(base)]


def test_keep_visible_paths_behind_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clone in a 0700 home (Debian 12's adduser default): its venv and source must stay visible to
    the nodes' login user, which node.sh decides from these paths."""
    home = tmp_path / "alice"
    venv, src = home / "gpuctl" / ".venv", home / "gpuctl" / "cli"
    (venv / "bin").mkdir(parents=True)
    src.mkdir()
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    home.chmod(0o700)
    assert str(venv) in local_provider.keep_visible_paths(None)
    home.chmod(0o755)
    tmp_path.chmod(0o755)
    if not any(local_provider._closed_to_others(a) for a in tmp_path.parents):
        assert str(venv) not in local_provider.keep_visible_paths(None)
    # a venv others cannot read is said, with what to do
    venv.chmod(0o700)
    assert local_provider._closed_paths([str(venv), str(src)]) == [str(venv)]


def test_forced_mode_must_be_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_provider.MODE_ENV, "docker")
    with pytest.raises(UserError, match="GPUCTL_LOCAL_MODE=docker: use netns or loopback"):
        local_provider.detect_mode()


# -- cluster key ---------------------------------------------------------------------


def test_cluster_key_is_made_once_and_private(tmp_path: Path) -> None:
    key, pub = ensure_cluster_key(tmp_path)
    assert key == tmp_path / "ssh" / "id_ed25519"
    assert pub.startswith("ssh-ed25519 ") and "\n" not in pub
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    before = key.stat()
    key2, pub2 = ensure_cluster_key(tmp_path)
    assert (key2, pub2) == (key, pub)
    assert (key.stat().st_ino, key.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # Lost public half: derived again from the private key, not a new pair.
    (tmp_path / "ssh" / "id_ed25519.pub").unlink()
    assert ensure_cluster_key(tmp_path)[1].split()[:2] == pub.split()[:2]
    # The key really is the pair ssh-keygen reads.
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, check=True).stdout
    assert derived.split()[:2] == pub.split()[:2]


# -- TerraformRoot against a fake terraform ------------------------------------------

FAKE_TF = """#!/bin/sh
# Fake terraform: records its argv, prints canned output, exits with a canned code.
printf '%s\\n' "$@" > "$FAKE_TF_DIR/argv"
printf '%s' "${AWS_ENDPOINT_URL_EC2-unset}" > "$FAKE_TF_DIR/endpoint"
[ -f "$FAKE_TF_DIR/stdout" ] && cat "$FAKE_TF_DIR/stdout"
[ -f "$FAKE_TF_DIR/stderr" ] && cat "$FAKE_TF_DIR/stderr" >&2
exit "$(cat "$FAKE_TF_DIR/rc" 2>/dev/null || echo 0)"
"""

CLI_CONFIG_WARNING = """There are some problems with the CLI configuration:
╷
│ Warning: Unable to open CLI configuration file
│
│ The CLI configuration file at "/root/.terraformrc" does not exist.
╵

"""

CAPACITY_STDERR = CLI_CONFIG_WARNING + """╷
│ Error: creating EC2 Instance: InsufficientInstanceCapacity: We currently do not have sufficient p5.48xlarge capacity in the Availability Zone you requested (us-east-1a).
│ 	status code: 500, request id: 0f6c
│
│   with module.cluster.aws_instance.node[1],
│   on .terraform/modules/cluster/main.tf line 88, in resource "aws_instance" "node":
│   88: resource "aws_instance" "node" {
│
╵
"""


class FakeTerraform:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = root
        root.mkdir(parents=True, exist_ok=True)
        self.bin = root / "terraform"
        self.bin.write_text(FAKE_TF)
        self.bin.chmod(0o755)
        monkeypatch.setenv("FAKE_TF_DIR", str(root))

    def will(self, *, rc: int = 0, stdout: str = "", stderr: str = "") -> None:
        (self.dir / "rc").write_text(str(rc))
        (self.dir / "stdout").write_text(stdout)
        (self.dir / "stderr").write_text(stderr)

    @property
    def argv(self) -> list[str]:
        return (self.dir / "argv").read_text().splitlines()

    @property
    def endpoint(self) -> str:
        """AWS_ENDPOINT_URL_EC2 as the last command had it ("unset": it had none)."""
        return (self.dir / "endpoint").read_text()


@pytest.fixture
def fake_tf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTerraform:
    return FakeTerraform(tmp_path / "faketf", monkeypatch)


def test_capacity_error_is_flagged_and_warnings_are_dropped(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    fake_tf.will(rc=1, stderr=CAPACITY_STDERR)
    with pytest.raises(ProvisionError) as info:
        root.apply()
    err = info.value
    assert err.insufficient_capacity is True
    assert "terraform apply failed" in err.message
    assert "Error: creating EC2 Instance: InsufficientInstanceCapacity" in err.message
    assert "status code: 500, request id: 0f6c" in err.message
    assert "CLI configuration" not in err.message  # a warning, not the reason
    assert "line 88" not in err.message and "│" not in err.message  # source context and box drawing
    assert (root.workdir / "logs" / "apply.log").read_text().count("InsufficientInstanceCapacity") == 1


def test_apply_counts_resources_as_terraform_makes_them(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    stream = [{"type": "planned_change"}, {"type": "planned_change"}, {"type": "apply_start"},
              {"type": "apply_complete"}, {"type": "apply_complete"},
              {"type": "change_summary", "changes": {"operation": "apply", "add": 2, "change": 0, "remove": 0}}]
    fake_tf.will(stdout="".join(json.dumps(m) + "\n" for m in stream) + "not json\n")
    seen: list[tuple[int, int]] = []
    assert root.apply(lambda done, total: seen.append((done, total))) is True
    assert seen == [(1, 2), (2, 2)]
    assert fake_tf.argv[0] == "apply" and {"-auto-approve", "-input=false", "-json", "-no-color"} <= set(fake_tf.argv)
    fake_tf.will(rc=1, stderr=CAPACITY_STDERR)  # a failure reads as without the stream
    with pytest.raises(ProvisionError) as info:
        root.apply(lambda done, total: None)
    assert info.value.insufficient_capacity and "terraform apply failed" in info.value.message


def test_json_diagnostics_become_the_message(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    diag = {"@level": "error", "@message": "Error: local-exec provisioner error", "type": "diagnostic",
            "diagnostic": {"severity": "error", "summary": "local-exec provisioner error",
                           "detail": "Error running command 'up': exit status 1. Output: local-nodes: node 0: "
                                     "sshd exited during start-up",
                           "address": "module.cluster.terraform_data.node[0]"}}
    warn = {"@level": "warn", "type": "diagnostic", "diagnostic": {"severity": "warning", "summary": "Deprecated"}}
    fake_tf.will(rc=1, stdout="\n".join(json.dumps(m) for m in (warn, diag)) + "\n", stderr=CLI_CONFIG_WARNING)
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    with pytest.raises(ProvisionError) as info:
        root.destroy()
    assert info.value.insufficient_capacity is False
    assert "Error: local-exec provisioner error" in info.value.message
    assert "sshd exited during start-up" in info.value.message
    assert "module.cluster.terraform_data.node[0]" in info.value.message
    assert "Deprecated" not in info.value.message


def test_commands_pass_only_flags_current_terraform_takes(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin), lock_timeout="7s")
    fake_tf.will(rc=0, stdout='{"type":"change_summary","changes":{"add":0,"change":0,"remove":2,"operation":"destroy"}}\n')
    root.destroy()
    argv = fake_tf.argv
    assert argv[0] == "destroy"
    assert {"-auto-approve", "-input=false", "-json", "-no-color", "-lock-timeout=7s"} <= set(argv)
    assert not [a for a in argv
                if a.startswith(("-force", "-synchronous", "-state", "-var", "-reconfigure", "-refresh"))]
    root.destroy(refresh=False)
    assert fake_tf.argv[0] == "destroy" and "-refresh=false" in fake_tf.argv
    fake_tf.will(rc=0, stdout='{"type":"change_summary","changes":{"add":1,"change":0,"remove":0,"operation":"apply"}}\n')
    assert root.apply() is True
    assert fake_tf.argv[0] == "apply" and "-auto-approve" in fake_tf.argv
    fake_tf.will(rc=0, stdout='{"type":"change_summary","changes":{"add":0,"change":0,"remove":0,"operation":"apply"}}\n')
    assert root.apply() is False
    fake_tf.will(rc=0, stdout="Terraform has been successfully initialized!\n")
    root.init()
    assert fake_tf.argv == ["init", "-input=false", "-no-color"]
    fake_tf.will(rc=2, stdout='{"type":"change_summary","changes":{"add":0,"change":1,"remove":1,"operation":"plan"}}\n')
    summary = root.plan(replace=["module.cluster.aws_instance.node[1]", "module.cluster.aws_instance.node[3]"])
    assert (summary.change, summary.destroy) == (1, 1)
    assert fake_tf.argv[0] == "plan" and {"-detailed-exitcode", "-lock-timeout=7s"} <= set(fake_tf.argv)
    assert [a for a in fake_tf.argv if a.startswith("-replace")] == [
        "-replace=module.cluster.aws_instance.node[1]", "-replace=module.cluster.aws_instance.node[3]"]


PLANNED_OUTPUTS = '{"type":"outputs","outputs":{"nodes":{"sensitive":false,"action":"create"}}}\n'
APPLIED = '{"type":"change_summary","changes":{"add":1,"change":0,"remove":0,"operation":"apply"}}\n'


def applied_outputs_line(**outputs: object) -> str:
    return json.dumps({"type": "outputs", "outputs": {
        name: {"sensitive": name.startswith("secret"), "type": "string", "value": value}
        for name, value in outputs.items()}}) + "\n"


def test_outputs_right_after_an_apply_are_the_ones_it_printed(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    """No `terraform output` run after an apply or refresh: its JSON stream ends with the values.
    Any other command, or a sensitive output (the stream leaves its value out), means asking again."""
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    fake_tf.will(rc=0, stdout=PLANNED_OUTPUTS + APPLIED + applied_outputs_line(ssh_user="u", nodes=["a"]))
    for apply in (root.apply, lambda: root.apply(on_count=lambda done, total: None), root.refresh):
        apply()
        fake_tf.will(rc=0, stdout='{"ssh_user": {"value": "from-output"}}')
        assert root.outputs() == {"ssh_user": "u", "nodes": ["a"]}
        assert fake_tf.argv[0] == "apply"  # nothing ran since
        fake_tf.will(rc=0, stdout=PLANNED_OUTPUTS + APPLIED + applied_outputs_line(ssh_user="u", nodes=["a"]))
    root.init()
    fake_tf.will(rc=0, stdout='{"ssh_user": {"value": "from-output"}}')
    assert root.outputs() == {"ssh_user": "from-output"} and fake_tf.argv[0] == "output"
    fake_tf.will(rc=0, stdout=APPLIED + applied_outputs_line(ssh_user="u", secret_token="t"))
    root.apply()
    fake_tf.will(rc=0, stdout='{"ssh_user": {"value": "u"}, "secret_token": {"value": "t", "sensitive": true}}')
    assert root.outputs() == {"ssh_user": "u", "secret_token": "t"} and fake_tf.argv[0] == "output"
    fake_tf.will(rc=1, stdout=PLANNED_OUTPUTS, stderr="Error: it broke\n")
    with pytest.raises(ProvisionError):
        root.apply()
    fake_tf.will(rc=0, stdout='{"ssh_user": {"value": "after-a-failure"}}')
    assert root.outputs() == {"ssh_user": "after-a-failure"}


@needs_terraform
def test_an_applys_outputs_are_what_terraform_output_says(tmp_path: Path) -> None:
    root = TerraformRoot(tmp_path / "root")
    root.write({"resource": {"terraform_data": {"node": {"count": 2, "input": {"ip": "10.0.0.${count.index}"}}}},
                "output": {"nodes": {"value": "${[for n in terraform_data.node : {ip = n.output.ip, port = 22}]}"},
                           "user": {"value": "gpuctl"}, "bastion": {"value": None}}})
    root.init()
    root.apply()
    expected = {"nodes": [{"ip": "10.0.0.0", "port": 22}, {"ip": "10.0.0.1", "port": 22}], "user": "gpuctl"}
    assert root.outputs() == expected and not (root.workdir / "logs" / "output.log").exists()
    assert TerraformRoot(root.workdir).outputs() == expected  # `terraform output -json`
    root.refresh()
    assert root.outputs() == expected


def test_a_roots_environment_reaches_every_command_and_nothing_else(fake_tf: FakeTerraform, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider's additions (an emulator's endpoints) go to each terraform command of that root,
    streamed or not, over this process's environment, which they never change."""
    monkeypatch.delenv("AWS_ENDPOINT_URL_EC2", raising=False)
    url = "http://127.0.0.1:5999"
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin), env={"AWS_ENDPOINT_URL_EC2": url})
    fake_tf.will(rc=0, stdout='{"type":"change_summary","changes":{"add":1,"change":0,"remove":0,"operation":"apply"}}\n')
    root.apply()
    assert fake_tf.endpoint == url
    root.apply(on_count=lambda done, total: None)
    assert fake_tf.endpoint == url
    fake_tf.will(rc=0, stdout="{}")
    root.outputs()
    assert fake_tf.endpoint == url and "AWS_ENDPOINT_URL_EC2" not in os.environ
    TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin)).outputs()
    assert fake_tf.endpoint == "unset"


def test_init_counts_as_done_until_the_root_changes(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    """provision() inits once per root as written (with shared state it inits the root first, to read its state)."""
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    root.write({"module": {"cluster": {"source": "/m"}}})
    assert not root.initialised
    fake_tf.will(rc=0, stdout="Terraform has been successfully initialized!\n")
    root.init()
    assert root.initialised
    root.write({"module": {"cluster": {"source": "/m"}}})  # the same root again
    assert root.initialised
    assert not TerraformRoot(root.workdir, terraform_bin=str(fake_tf.bin)).initialised  # as far as it knows
    root.write({"module": {"cluster": {"source": "/moved"}}})
    assert not root.initialised
    root.write({"module": {"cluster": {"source": "/m"}}})
    fake_tf.will(rc=1, stderr="Error: Failed to query available provider packages\n")
    with pytest.raises(ProvisionError):
        root.init()
    assert not root.initialised  # a failed init is no init


def test_unformatted_failure_falls_back_to_stderr_tail(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    fake_tf.will(rc=3, stderr="panic: something odd\n\ngoroutine 1 [running]:\nmain.main()\n")
    with pytest.raises(ProvisionError, match=r"(?s)panic: something odd.*main\.main\(\)"):
        TerraformRoot(tmp_path / "r", terraform_bin=str(fake_tf.bin)).init()


def test_missing_terraform_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="could not run terraform"):
        TerraformRoot(tmp_path / "r", terraform_bin=str(tmp_path / "no-such-terraform")).init()


def test_long_errors_keep_the_summary_and_the_end() -> None:
    stderr = "╷\n│ Error: local-exec provisioner error\n" + "".join(f"│ line {i}\n" for i in range(40)) + "╵\n"
    lines = error_lines("", stderr, limit=6)
    assert lines == ["Error: local-exec provisioner error", "...", "line 36", "line 37", "line 38", "line 39"]


# -- PlanSummary ---------------------------------------------------------------------

PLAN_JSON = textwrap.dedent("""\
    {"@level":"info","@message":"Terraform 1.11.4","type":"version","terraform":"1.11.4"}
    {"@level":"info","@message":"module.cluster.terraform_data.node[2]: Plan to create","type":"planned_change","change":{"action":"create"}}
    {"@level":"info","@message":"module.cluster.terraform_data.node[1]: Plan to replace","type":"planned_change","change":{"action":"replace"}}
    {"@level":"info","@message":"module.cluster.terraform_data.x: Plan to update","type":"planned_change","change":{"action":"update"}}
    {"@level":"info","@message":"Plan: 2 to add, 1 to change, 1 to destroy.","type":"change_summary","changes":{"add":2,"change":1,"import":0,"remove":1,"operation":"plan"}}
    {"@level":"info","@message":"Outputs: 3","type":"outputs","outputs":{}}
    """)


def test_plan_summary_from_json(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    fake_tf.will(rc=2, stdout=PLAN_JSON)  # -detailed-exitcode: 2 = changes
    summary = TerraformRoot(tmp_path / "r", terraform_bin=str(fake_tf.bin)).plan()
    assert (summary.add, summary.change, summary.destroy, summary.changed) == (2, 1, 1, True)
    assert "-detailed-exitcode" in fake_tf.argv and "-json" in fake_tf.argv
    assert summary.describe() == [
        "module.cluster.terraform_data.node[2]: Plan to create",
        "module.cluster.terraform_data.node[1]: Plan to replace",
        "module.cluster.terraform_data.x: Plan to update",
        "Plan: 2 to add, 1 to change, 1 to destroy.",
    ]
    assert "Terraform 1.11.4" not in summary.text and "Outputs" not in summary.text


def test_plan_without_summary_is_an_error(fake_tf: FakeTerraform, tmp_path: Path) -> None:
    assert parse_plan_json('{"type":"version"}\nnot json\n') is None
    fake_tf.will(rc=0, stdout='{"type":"version"}\n')
    with pytest.raises(ProvisionError, match="printed no change summary"):
        TerraformRoot(tmp_path / "r", terraform_bin=str(fake_tf.bin)).plan()


def test_no_changes_describes_itself() -> None:
    assert PlanSummary(0, 0, 0, "").describe() == ["No changes."]
    assert not PlanSummary(0, 0, 0, "").changed


@needs_terraform
def test_terraform_root_end_to_end_without_providers(tmp_path: Path) -> None:
    """Real terraform on a root of built-ins: plan counts, apply, re-apply is a no-op, outputs, destroy."""
    root = TerraformRoot(tmp_path / "root")
    root.write({"resource": {"terraform_data": {"x": {"input": "hello"}}},
                "output": {"greeting": {"value": "${terraform_data.x.output}"}, "nothing": {"value": None}}})
    root.init()
    assert (root.plan().add, root.plan().changed) == (1, True)
    assert root.apply() is True
    assert root.has_state()
    assert root.plan().changed is False
    assert root.apply() is False
    # Terraform leaves null outputs out of state: consumers must treat "absent" as null.
    assert root.outputs() == {"greeting": "hello"}
    root.destroy()
    assert not root.has_state()
    root.destroy()  # idempotent


@needs_terraform
def test_module_is_formatted_and_its_terraform_tests_pass(tmp_path: Path) -> None:
    subprocess.run(["terraform", "fmt", "-check", "-recursive", str(MODULE)], check=True, capture_output=True)
    copy = tmp_path / "local-nodes"
    shutil.copytree(MODULE, copy, ignore=shutil.ignore_patterns(".terraform*"))
    subprocess.run(["terraform", "init", "-backend=false", "-no-color"], cwd=copy, check=True, capture_output=True)
    test = subprocess.run(["terraform", "test", "-no-color"], cwd=copy, capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    assert "0 failed" in test.stdout


# -- provision layer without nodes -------------------------------------------------------


@needs_terraform
def test_dry_run_of_a_new_cluster_registers_nothing() -> None:
    req = ClusterRequest(name="dry", num_nodes=2, cloud="local")
    summary = provisioner.plan(req)
    assert summary.add >= 2 and summary.destroy == 0
    assert not cluster_dir("dry").exists()
    assert not provisioner.cluster_exists("dry")


def test_destroy_of_an_unknown_cluster_names_it() -> None:
    with pytest.raises(UserError, match="cluster 'nope' not found"):
        provisioner.destroy("nope")
    with pytest.raises(UserError, match="cluster 'nope' not found"):
        provisioner.load_cluster("nope")


def test_ssh_infra_adopts_a_hand_written_inventory(tmp_path: Path) -> None:
    inv_file = tmp_path / "hosts.yml"
    inv_file.write_text(textwrap.dedent("""\
        all:
          hosts:
            a: {ansible_host: 10.1.0.5, ansible_user: ubuntu}
            b: {ansible_host: 10.1.0.6, ansible_user: ubuntu, gpuctl_gpus: 4}
        """))
    req = ClusterRequest(name="mine", num_nodes=2, cloud="ssh", gpus_per_node=8, inventory_path=inv_file)
    assert provisioner.plan(req).describe()[0].startswith("infra ssh: would use 2 existing host(s)")
    assert not provisioner.cluster_exists("mine")
    inv = provisioner.provision(req)
    assert [(n.rank, n.address, n.gpus) for n in inv.nodes] == [(0, "10.1.0.5", 8), (1, "10.1.0.6", 4)]
    request, loaded = provisioner.load_cluster("mine")
    assert request["cloud"] == "ssh" and request["inventory_path"] == str(inv_file)
    assert loaded.nodes == inv.nodes
    with pytest.raises(UserError, match="already exists on ssh"):
        provisioner.provision(ClusterRequest(name="mine", num_nodes=1, cloud="local"))
    provisioner.destroy("mine")
    assert not provisioner.cluster_exists("mine")
    with pytest.raises(UserError, match="lists 2 host\\(s\\) but num_nodes is 3"):
        provisioner.provision(ClusterRequest(name="mine", num_nodes=3, cloud="ssh", inventory_path=inv_file))


def test_a_state_file_an_interrupted_apply_left_empty_is_terraforms_to_read(fake_tf: FakeTerraform,
                                                                              tmp_path: Path) -> None:
    """Ctrl-C while terraform wrote its state can leave terraform.tfstate empty: the next command
    runs (terraform reads an empty state as none), never a traceback of the library in between."""
    root = TerraformRoot(tmp_path / "root", terraform_bin=str(fake_tf.bin))
    root.workdir.mkdir(parents=True)
    (root.workdir / "terraform.tfstate").write_text("")
    fake_tf.will(stdout="Terraform has been successfully initialized!\n")
    root.init()
    assert fake_tf.argv[0] == "init" and not any(a.startswith("-state") for a in fake_tf.argv)
