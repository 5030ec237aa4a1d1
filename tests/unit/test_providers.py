"""The provider registry, the Provider protocol's defaults, and the `ssh` provider."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuctl.common.errors import UserError
from gpuctl.providers import _PROVIDER_MODULES, get_provider, request_for
from gpuctl.providers.base import BaseProvider, Provider
from gpuctl.spec import load_task
from gpuctl.spec.request import ClusterRequest

PACKAGE = Path(__file__).resolve().parents[2] / "cli" / "gpuctl"


def request(cloud: str = "local", **kw) -> ClusterRequest:
    return ClusterRequest(name="c", num_nodes=2, cloud=cloud, **kw)


def test_the_registry_refuses_an_unknown_cloud_and_names_the_known_ones() -> None:
    with pytest.raises(UserError) as err:
        get_provider("mars")
    assert err.value.message == "infra 'mars' has no Terraform provider in gpuctl; use one of aws, local (or ssh/PATH)"


@pytest.mark.parametrize("cloud", sorted(_PROVIDER_MODULES))
def test_every_registered_provider_is_a_base_provider_under_its_name(cloud: str) -> None:
    provider = get_provider(cloud)
    assert isinstance(provider, BaseProvider) and isinstance(provider, Provider)
    assert provider.name == cloud
    assert _PROVIDER_MODULES[cloud] == f"gpuctl.providers.{cloud}.provider"


def test_base_provider_defaults() -> None:
    base = BaseProvider()
    req = request()
    assert (base.provisions, base.local, base.containers_outlive_cluster, base.checks_console_host_keys) == \
        (True, False, False, False)
    assert base.check(req) is None and base.prepare(req) is req
    assert base.describe(req) == [] and base.retry_zone(req, RuntimeError("x")) == (None, None)
    assert base.cleanup(Path("/nonexistent")) is None
    assert base.pick_accelerator(req, {"A100": 8.0, "H100": 8.0}) == ("A100", 8.0)
    assert base.instance_type(req) is None and base.check_reach() is None
    assert base.expected_fabric({"network_tier": "best"}) is None and base.fabric_env({"network_tier": "best"}) == {}
    assert base.bucket_region("us-east-1") is None and base.expected_efa({"network_tier": "best"}) is None
    assert base.expected_gpus(4) == 4
    assert base.console_host_keys("i-1", "us-east-1", Path("/nonexistent"), "a") == (set(), [])
    with pytest.raises(NotImplementedError):
        base.root_config(req, cluster_dir=Path("/x"), ssh_public_key="k")


def test_the_facts_of_each_provider() -> None:
    aws, local, ssh = get_provider("aws"), get_provider("local"), get_provider("ssh")
    assert (aws.provisions, aws.local, aws.containers_outlive_cluster, aws.checks_console_host_keys) == \
        (True, False, False, True)
    assert (local.provisions, local.local, local.containers_outlive_cluster, local.checks_console_host_keys) == \
        (True, True, True, False)
    assert (ssh.provisions, ssh.local, ssh.containers_outlive_cluster, ssh.checks_console_host_keys) == \
        (False, False, True, False)
    assert aws.bucket_region("eu-west-1") == "eu-west-1" and local.bucket_region("x") is None
    assert aws.expected_fabric({"network_tier": "best"}) == "efa" and aws.expected_fabric({}) is None
    # the health check's EFA count: what preflight chose for the type (cluster.json's extra), only with EFA
    p5 = {"network_tier": "best", "extra": {"aws.efa_interfaces": "32"}}
    assert aws.expected_efa(p5) == 32 and aws.expected_efa({**p5, "network_tier": "standard"}) is None
    assert aws.expected_efa({"network_tier": "best", "extra": {"aws.efa_interfaces": "many"}}) is None
    assert local.expected_efa(p5) is None and aws.expected_gpus(8) == 8
    assert local.expected_gpus(8) == (8 if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists() else 0)


def test_the_ssh_provider_provisions_nothing_and_needs_a_path(tmp_path: Path) -> None:
    ssh = get_provider("ssh")
    with pytest.raises(UserError, match="resources.infra 'ssh' needs an inventory path: infra: ssh/path/to/inv"):
        ssh.check(request("ssh"))
    ssh.check(request("ssh", inventory_path=tmp_path / "inventory.yml"))
    assert ssh.describe(request("ssh")) == [] and ssh.instance_type(request("ssh")) is None


def test_aws_picks_the_first_accelerator_it_sells_unless_the_type_is_given(tmp_path: Path) -> None:
    aws = get_provider("aws")
    options = {"H800": 8.0, "H100": 8.0}
    assert aws.pick_accelerator(request("aws"), options) == ("H100", 8.0)
    assert aws.pick_accelerator(request("aws", instance_type="p5.48xlarge"), options) == ("H800", 8.0)
    assert get_provider("local").pick_accelerator(request(), options) == ("H800", 8.0)
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nresources:\n  infra: aws/us-east-1\n  accelerators: {A100: 3, H100: 1}\nrun: x\n")
    task = load_task(path)
    assert (request_for(task).accelerator, request_for(task).gpus_per_node) == ("H100", 1)
    assert (request_for(task, infra="local").accelerator, request_for(task, infra="local").gpus_per_node) == ("A100", 3)


def test_a_long_task_name_gives_a_cluster_name_every_provider_takes(tmp_path: Path) -> None:
    """SkyPilot shortens a long task name for the cloud; so does gpuctl: a readable prefix and a hash
    of the whole name, at most PORTABLE_NAME_MAX (AWS's limit, the shortest), the same on every run."""
    from gpuctl.providers.aws.provider import MODULE_NAME_MAX
    from gpuctl.spec.request import PORTABLE_NAME_MAX, check_cluster_name

    assert PORTABLE_NAME_MAX <= MODULE_NAME_MAX
    names = {}
    for nodes in (8, 16):
        path = tmp_path / f"t{nodes}.yaml"
        path.write_text(f"name: distributed-training-with-pytorch-ddp-on-{nodes}-nodes\n"
                        "resources:\n  infra: aws/us-east-1\n  instance_type: g5.xlarge\nrun: x\n")
        req = request_for(load_task(path))
        get_provider("aws").check(req)  # no "AWS clusters take at most 32 characters"
        assert check_cluster_name(req.name) == req.name == request_for(load_task(path)).name
        assert len(req.name) == PORTABLE_NAME_MAX and req.name.startswith("distributed-training-with-")
        names[nodes] = req.name
    assert names[8] != names[16]  # the same prefix, two tasks: two clusters
    with pytest.raises(UserError, match="AWS clusters take at most 32 characters; pass a shorter -c NAME"):
        get_provider("aws").check(request_for(load_task(path), name="n" * 33))  # -c NAME is as given


def test_aws_resolves_the_instance_type_offline() -> None:
    aws = get_provider("aws")
    assert aws.instance_type(request("aws", accelerator="H100", gpus_per_node=8)) == "p5.48xlarge"
    assert aws.instance_type(request("aws", instance_type="g5.xlarge", accelerator="H100", gpus_per_node=8)) == \
        "g5.xlarge"


def test_local_warns_about_what_it_ignores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.providers.local import provider as local_provider

    monkeypatch.setattr(local_provider, "local_gpus_present", lambda: False)
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nresources:\n  accelerators: A100:1\n  use_spot: true\nrun: x\n")
    task = load_task(path)
    lines = get_provider("local").task_warnings(task, request_for(task))
    assert [line.split(": ", 1)[1] for line in lines] == [
        "resources.accelerators: the local nodes have no GPU (no NVIDIA device on this machine); jobs still see "
        "SKYPILOT_NUM_GPUS_PER_NODE=1",
        "resources.use_spot: ignored on infra local (nodes on this machine)"]
    assert get_provider("aws").task_warnings(task, request_for(task)) == []


def test_local_warns_when_the_nodes_user_would_have_no_sudo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.providers.local import provider as local_provider

    path = tmp_path / "t.yaml"
    path.write_text("name: t\nrun: x\n")
    task = load_task(path)
    monkeypatch.setattr(local_provider, "detect_mode", lambda: "netns")
    monkeypatch.setattr(local_provider.shutil, "which", lambda name: None)
    monkeypatch.delenv(local_provider.USER_ENV, raising=False)
    lines = get_provider("local").task_warnings(task, request_for(task))
    assert [line.split(": ", 1)[1] for line in lines] == [
        "the local nodes log in as gpuctl, whose passwordless sudo needs sudo on this machine "
        "(apt-get install sudo; `make deps` installs it)"]
    monkeypatch.setenv(local_provider.USER_ENV, "root")  # root needs no sudo
    assert get_provider("local").task_warnings(task, request_for(task)) == []


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, function-local imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def test_providers_import_nothing_above_them() -> None:
    above = ("state", "provision", "configplane", "jobplane", "healthcheck", "api", "cli")
    bad = [f"{path.relative_to(PACKAGE)}: {module}"
           for path in sorted((PACKAGE / "providers").rglob("*.py")) for module in _imports(path)
           if module.split(".")[:2][-1] in above and module.startswith("gpuctl.")]
    assert bad == []


def test_nothing_probes_a_provider_for_hooks() -> None:
    """Every hook is declared on Provider with a default in BaseProvider: call it."""
    bad = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
           if "getattr(provider" in path.read_text()]
    assert bad == []


def test_resources_problem_is_the_providers_word_at_validation(tmp_path: Path) -> None:
    from gpuctl.providers import resources_problem

    path = tmp_path / "t.yaml"
    path.write_text("name: t\nresources:\n  infra: aws\n  accelerators: H800:8\nrun: x\n")
    res = load_task(path).resources  # spec alone checks the cloud only
    assert resources_problem("aws", res)[0] == "accelerators"
    assert "no AWS instance type known for it" in resources_problem("aws", res)[1]
    assert resources_problem("local", res) is None and BaseProvider().resources_problem(res) is None
    with pytest.raises(UserError, match=r"t.yaml:4: resources.accelerators: 'H800': no AWS instance type"):
        load_task(path, resources_check=resources_problem)


def test_local_nodes_tell_ansible_their_python_so_it_discovers_none() -> None:
    """Local nodes are processes of this machine: their python3 is the one a login finds here, and the
    inventory names it (Ansible's interpreter discovery would cost one module run per node and play)."""
    from gpuctl.provision.ansibleinventory import to_ansible
    from gpuctl.provision.inventory import inventory_from_outputs

    python = get_provider("local").node_python()
    assert python is not None and Path(python).is_absolute() and Path(python).exists()
    assert get_provider("aws").node_python() is None and get_provider("ssh").node_python() is None
    out = {"nodes": [{"id": "n0", "private_ip": "10.0.0.2", "public_ip": None}], "ssh_user": "root", "bastion": None}
    local = to_ansible(inventory_from_outputs(out, cluster="c", cloud="local", ssh_key="/k", gpus_per_node=0))
    aws = to_ansible(inventory_from_outputs(out, cluster="c", cloud="aws", ssh_key="/k", gpus_per_node=0))
    assert local["all"]["vars"]["ansible_python_interpreter"] == python
    assert "ansible_python_interpreter" not in aws["all"]["vars"]
