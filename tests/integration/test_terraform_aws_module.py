"""terraform fmt / validate / test for terraform/modules/aws-gpu-instance-group, offline.

Runs against a temporary copy of the module (so no `.terraform/` or lock file lands in
the checkout), with Terraform pointed at the local provider mirror (`tf_cli_config`):
- `terraform fmt -check -recursive` over module, tests and examples;
- `terraform validate` of the module and of every example;
- `terraform test` (mocked AWS provider): every run passes, and the number of runs is
  the one pinned below, so a test that silently disappears fails here;
- each cross-input precondition, tripped alone, fails the plan with its own message
  (terraform test's expect_failures cannot check wording, so this does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import tfprovider

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "terraform" / "modules" / "aws-gpu-instance-group"
EXAMPLES = sorted(p.name for p in (MODULE / "examples").iterdir() if p.is_dir())

# run blocks per test file; change together with the file.
EXPECTED_RUNS = {
    "efa_layout": 10,
    "lifecycle": 8,
    "market": 4,
    "network": 9,
    "nodes": 6,
    "output_shapes": 6,
    "placement": 5,
    "security": 7,
    "validations": 30,
}

TIMEOUT = 300

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
NO_EFA_TYPE = """
  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported          = false
      efa_maximum_interfaces = 0
      maximum_network_cards  = 1
      network_cards          = [{ index = 0, maximum_interfaces = 3, baseline_bandwidth = 5, peak_bandwidth = 25, performance = "Up to 25 Gigabit" }]
    }
  }
"""
NO_OFFERINGS = """
  override_data {
    target = data.aws_ec2_instance_type_offerings.node
    values = {
      instance_types = []
      locations      = []
      location_types = []
    }
  }
"""

# name: (variables, overrides, the message the plan must fail with). Each case breaks
# exactly one rule of an otherwise valid 2 x p5.48xlarge cluster in us-east-1a.
MESSAGE_CASES = {
    "efa_on_type_without_efa": (
        'instance_type = "g4dn.xlarge"\n    efa = true',
        NO_EFA_TYPE,
        "instance type g4dn.xlarge does not support EFA; use network_tier standard or an EFA type such as p5.48xlarge",
    ),
    "public_ip_with_many_interfaces": (
        "associate_public_ip = true",
        "",
        "p5.48xlarge nodes get 32 network interfaces for EFA, and EC2 refuses an auto-assigned public IP "
        "with more than one. Set associate_public_ip = false and reach the nodes through "
        "bastion = { enabled = true } (ProxyJump), or set elastic_ip = true.",
    ),
    "public_ip_and_elastic_ip": (
        'instance_type = "g4dn.xlarge"\n    associate_public_ip = true\n    elastic_ip = true',
        NO_EFA_TYPE,
        "associate_public_ip and elastic_ip both give nodes a public address",
    ),
    "capacity_block_without_reservation": (
        'market = "capacity-block"',
        "",
        'market = "capacity-block" needs capacity_reservation_id',
    ),
    "spot_into_reservation": (
        'market = "spot"\n    capacity_reservation_id = "cr-0123456789abcdef0"',
        "",
        "Spot instances cannot launch into a capacity reservation",
    ),
    "existing_placement_without_name": (
        'placement_group = { mode = "existing" }',
        "",
        'placement_group.mode = "existing" needs placement_group.name',
    ),
    "both_key_inputs": (
        'key_name = "team-key"',
        "",
        "Set exactly one of ssh_public_key (imported as a new key pair) or key_name",
    ),
    "zone_not_the_subnets": (
        'subnet_id = "subnet-0fedcba9876543210"',  # the mocked subnet is in us-east-1b
        "",
        "availability_zone (us-east-1a) is not the zone of subnet_id (us-east-1b)",
    ),
    "no_zone_offers_type": (
        "availability_zone = null",
        NO_OFFERINGS,
        "No Availability Zone in this region offers p5.48xlarge",
    ),
    "nat_gateway_with_subnet_id": (
        'subnet_id = "subnet-0fedcba9876543210"\n    availability_zone = null\n    nat_gateway = true',
        "",
        "nat_gateway = true needs the module's own VPC, but subnet_id is given: the caller owns that subnet's routing.",
    ),
    "nat_gateway_with_elastic_ip": (
        "nat_gateway = true\n    elastic_ip = true",
        "",
        "nat_gateway = true puts the nodes in a private subnet, where a public address",
    ),
    "vpc_too_small_for_nat_gateway": (
        'vpc_cidr = "10.0.0.0/28"',
        "",
        "vpc_cidr 10.0.0.0/28 is too small for a private and a public subnet",
    ),
    "spot_nodes_stopped": (
        'market = "spot"\n    instance_state = "stopped"',
        "",
        "Spot nodes cannot be stopped (a one-time spot request ends when its instance stops)",
    ),
    "bastion_without_ssh_cidrs": (
        'bastion = { enabled = true, ami_id = "ami-0fedcba9876543210" }',
        "",
        "bastion.enabled is true but ssh_ingress_cidrs is empty",
    ),
}


def terraform(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run terraform; stderr (where `terraform test` prints each run's errors) joins stdout in order."""
    return subprocess.run(
        ["terraform", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT, check=False,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout}"
    return proc.stdout


def parallelism_flag(env: dict[str, str]) -> list[str]:
    """Terraform 1.12+ runs test runs in parallel; two at a time suits shared CI cores (1.11 has no flag)."""
    help_text = terraform(["test", "-help"], REPO, env).stdout
    return ["-parallelism=2"] if "-parallelism" in help_text else []


def flat(text: str) -> str:
    """Terraform wraps messages at 78 columns (and may draw boxes): one line, single spaces."""
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def tf_env(tf_cli_config: Path) -> dict[str, str]:
    env = {"GOGC": tfprovider.GOGC, **{k: v for k, v in os.environ.items() if not k.startswith("TF_")}}
    env.update(TF_CLI_CONFIG_FILE=str(tf_cli_config), TF_IN_AUTOMATION="1", TF_INPUT="0", CHECKPOINT_DISABLE="1")
    return env


@pytest.fixture(scope="module")
def module_copy(tmp_path_factory: pytest.TempPathFactory, tf_env: dict[str, str]) -> Iterator[Path]:
    """The module (with tests and examples) in a temp dir, initialised; removed afterwards."""
    root = tmp_path_factory.mktemp("aws-module")
    copy = root / MODULE.name
    shutil.copytree(MODULE, copy, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "terraform.tfstate*"))
    ok(terraform(["init", "-backend=false", "-no-color"], copy, tf_env))
    try:
        yield copy
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def mocked_env(module_copy: Path, tf_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """tf_env for commands that never configure the AWS provider (`terraform validate`, `terraform test`
    with mock providers): one provider process, started here in debug mode, serves every run its
    schema and validation (TF_REATTACH_PROVIDERS), where Terraform 1.11 starts a provider of its own
    twice per run (about 1 s of CPU each, 170 times for this module's runs) and per validate. Nothing
    configures it, so two terraform processes can share it (tests/tfprovider.py)."""
    with tfprovider.serving(tfprovider.installed_binary(module_copy), tf_env) as reattach:
        yield {**tf_env, "TF_REATTACH_PROVIDERS": reattach}


def test_fmt(module_copy: Path, tf_env: dict[str, str]) -> None:
    ok(terraform(["fmt", "-check", "-recursive", "-diff", "-no-color"], module_copy, tf_env))


def test_validate_module(module_copy: Path, mocked_env: dict[str, str]) -> None:
    assert "The configuration is valid" in ok(terraform(["validate", "-no-color"], module_copy, mocked_env))


@pytest.mark.parametrize("example", EXAMPLES)
def test_validate_example(module_copy: Path, tf_env: dict[str, str], mocked_env: dict[str, str], example: str) -> None:
    path = module_copy / "examples" / example
    assert 'source = "../.."' in (path / "main.tf").read_text(), "examples call the module by relative source"
    ok(terraform(["init", "-backend=false", "-no-color"], path, tf_env))
    assert "The configuration is valid" in ok(terraform(["validate", "-no-color"], path, mocked_env))


def test_module_from_a_git_source_with_subdir_and_ref(tmp_path: Path, tf_env: dict[str, str],
                                                      mocked_env: dict[str, str]) -> None:
    """The README's `git::URL//terraform/modules/aws-gpu-instance-group?ref=...` form, offline:
    a bare clone of this repository stands in for GitHub, pinned to the committed HEAD."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    bare = tmp_path / "gpuctl.git"
    ok(subprocess.run(["git", "clone", "--quiet", "--bare", "--", str(REPO), str(bare)], capture_output=True,
                      text=True))
    root = tmp_path / "root"
    root.mkdir()
    source = f"git::file://{bare}//terraform/modules/aws-gpu-instance-group?ref={head.stdout.strip()}"
    (root / "main.tf").write_text(
        'provider "aws" {\n  region = "us-east-1"\n}\n\n'
        f'module "training_cluster" {{\n  source = "{source}"\n\n'
        '  name              = "llm-train"\n  instance_type     = "p5.48xlarge"\n  node_count        = 2\n'
        '  availability_zone = "us-east-1a"\n  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA test"\n}\n\n'
        'output "ansible_inventory" {\n  value = module.training_cluster.ansible_inventory\n}\n')
    ok(terraform(["init", "-backend=false", "-no-color"], root, tf_env))
    installed = json.loads((root / ".terraform" / "modules" / "modules.json").read_text())["Modules"]
    (module,) = [m for m in installed if m["Key"] == "training_cluster"]
    assert module["Dir"].endswith("terraform/modules/aws-gpu-instance-group"), module
    assert (root / module["Dir"] / "outputs.tf").is_file()
    assert "The configuration is valid" in ok(terraform(["validate", "-no-color"], root, mocked_env))


def test_examples_cover_the_main_shapes() -> None:
    assert {"p5-efa", "existing-subnet", "standard-network"} <= set(EXAMPLES)


def test_run_counts_are_pinned() -> None:
    files = {p.name.removesuffix(".tftest.hcl"): p for p in (MODULE / "tests").glob("*.tftest.hcl")}
    assert set(files) == set(EXPECTED_RUNS)
    counts = {name: len(re.findall(r'^run "', p.read_text(), re.M)) for name, p in files.items()}
    assert counts == EXPECTED_RUNS


def test_terraform_test_passes(module_copy: Path, mocked_env: dict[str, str]) -> None:
    # Two terraform processes side by side, with about half the runs each, halve the wall
    # time; mocked runs keep their state in memory, so they share the directory safely.
    first = ["efa_layout", "validations"]
    groups = [first, sorted(set(EXPECTED_RUNS) - set(first))]
    flags = parallelism_flag(mocked_env)
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        procs = list(pool.map(
            lambda files: terraform(
                ["test", "-no-color", *flags, *[f"-filter=tests/{f}.tftest.hcl" for f in files]], module_copy,
                mocked_env
            ),
            groups,
        ))
    for files, proc in zip(groups, procs):
        out = ok(proc)
        summary = re.search(r"Success! (\d+) passed, (\d+) failed\.", out)
        assert summary, out
        assert (int(summary[1]), int(summary[2])) == (sum(EXPECTED_RUNS[f] for f in files), 0), out
        for name in files:
            assert f"tests/{name}.tftest.hcl... pass" in out, out
        assert "... skip" not in out and "... fail" not in out, out


def test_cross_input_errors_say_what_to_do(module_copy: Path, mocked_env: dict[str, str]) -> None:
    cases_dir = module_copy / "message-cases"
    cases_dir.mkdir()
    for name, (variables, overrides, _) in MESSAGE_CASES.items():
        (cases_dir / f"{name}.tftest.hcl").write_text(
            'mock_provider "aws" {\n  source = "./tests/mocks"\n}\n\n'
            "variables {\n"
            '  name              = "msg"\n'
            '  instance_type     = "p5.48xlarge"\n'
            "  node_count        = 2\n"
            '  availability_zone = "us-east-1a"\n'
            f'  ssh_public_key    = "{KEY}"\n'
            "}\n\n"
            f'run "{name}" {{\n  command = plan\n\n  variables {{\n    {variables}\n  }}\n{overrides}}}\n'
        )
    proc = terraform(["test", "-no-color", "-test-directory=message-cases"], module_copy, mocked_env)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert f"0 passed, {len(MESSAGE_CASES)} failed" in out, out
    # Sections per file: "message-cases/<name>.tftest.hcl... in progress" up to the next one.
    sections = dict(re.findall(r"message-cases/(\w+)\.tftest\.hcl\.\.\. in progress\n(.*?)(?=message-cases/\w+\.tftest\.hcl\.\.\. tearing down)", out, re.S))
    assert set(sections) == set(MESSAGE_CASES), out
    for name, (_, _, message) in MESSAGE_CASES.items():
        text = flat(sections[name])
        assert text.count("Error:") == 1, f"{name}: want exactly one error:\n{sections[name]}"
        assert flat(message) in text, f"{name}: want {message!r} in:\n{sections[name]}"
