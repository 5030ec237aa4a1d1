"""The AWS path end to end against a real moto server on 127.0.0.1.

Real terraform, the real hashicorp/aws provider (from the local mirror; one
process serves all of a test's terraform commands, tests/tfprovider.py), the
real aws-gpu-instance-group module and the real `gpuctl` CLI in a subprocess;
moto stands in for EC2. Checks that:
- `apply --provision-only` creates node_count running instances tagged with the
  cluster, writes an inventory listing their private IPs in rank order, and
  `down` from another runner's fresh state dir (state shared in moto's S3)
  terminates them -- with the first zone out of capacity (a proxy answers
  RunInstances there as EC2 does), so apply also moves to the next zone that
  offers the type and says so; the task's config.aws.remote_identity is the
  nodes' IAM instance profile; an instance terminated behind gpuctl's back is
  named lost and made again at its rank (lifecycle.replace_nodes), the others
  untouched;
- `apply --dry-run` of the 4 x p5.48xlarge example prints the Terraform plan
  summary, 32 EFA interfaces per node and the cluster placement group, and
  creates nothing;
- preflight failures are one line, exit code 2, no traceback, nothing created.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import boto3
import gpuctlfork
import pytest
import tfprovider
import yaml
from e2e import LOST_NODES_PY, REPLACE_NODES_PY, gpuctl_python
from mototest import CapacityShortage, MotoServer, fake_aws_env, isolated_aws_env

from gpuctl.providers.aws import provider as aws_provider
from gpuctl.state.registry import Registry

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
MOTO_UBUNTU_AMI = "ami-1e749f67"  # in moto's bundled image list


@pytest.fixture(scope="session")
def plugin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy of the 700 MB provider for all tests' `terraform init`."""
    return tmp_path_factory.mktemp("tf-plugin-cache")


@pytest.fixture()
def moto(moto_server: MotoServer) -> Iterator[MotoServer]:
    moto_server.reset()
    yield moto_server
    moto_server.reset()


@pytest.fixture(scope="session")
def aws_provider_binary(tmp_path_factory: pytest.TempPathFactory, tf_cli_config: Path, plugin_cache: Path) -> Path:
    """The hashicorp/aws binary that `terraform init` installs for the roots gpuctl renders (their
    version constraint, from the mirror)."""
    root = tmp_path_factory.mktemp("aws-provider")
    (root / "main.tf.json").write_text(json.dumps({"terraform": {"required_providers": {
        "aws": {"source": "hashicorp/aws", "version": aws_provider.PROVIDER_VERSION}}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_CLI_CONFIG_FILE=str(tf_cli_config), TF_PLUGIN_CACHE_DIR=str(plugin_cache), TF_IN_AUTOMATION="1")
    init = subprocess.run(["terraform", "init", "-input=false", "-no-color"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert init.returncode == 0, init.stdout + init.stderr
    return tfprovider.installed_binary(root)


@pytest.fixture()
def aws_env(moto: MotoServer, tf_cli_config: Path, plugin_cache: Path, _isolated_state: Path) -> dict[str, str]:
    env = fake_aws_env(moto.url)
    env.update(TF_CLI_CONFIG_FILE=str(tf_cli_config), TF_PLUGIN_CACHE_DIR=str(plugin_cache),
               TF_IN_AUTOMATION="1", GPUCTL_STATE_DIR=str(_isolated_state), GOGC=tfprovider.GOGC)
    return env


@contextmanager
def shared_provider(aws_env: dict[str, str], binary: Path, endpoint: str | None = None) -> Iterator[dict[str, str]]:
    """aws_env, where the terraform commands share one AWS provider process (tests/tfprovider.py)
    instead of starting four per command, with `endpoint` (default aws_env's) for the AWS API. It is
    started with what terraform would pass it: aws_env, with the endpoints gpuctl gives terraform
    (AwsProvider.terraform_env), less AWS_CA_BUNDLE: a provider configured a second time in one
    process fails on a CA bundle ("unable to add custom RootCAs"), and moto is plain HTTP. The
    commands run one after another, as its one configuration at a time requires."""
    endpoint = endpoint or aws_env["GPUCTL_AWS_ENDPOINT_URL"]
    env = {k: v for k, v in aws_env.items() if k != "AWS_CA_BUNDLE"}
    env.update(aws_provider.endpoint_env(endpoint))
    with tfprovider.serving(binary, env) as reattach:
        yield {**aws_env, "GPUCTL_AWS_ENDPOINT_URL": endpoint, "TF_REATTACH_PROVIDERS": reattach}


@pytest.fixture()
def tf_aws_env(aws_env: dict[str, str], aws_provider_binary: Path) -> Iterator[dict[str, str]]:
    """aws_env with one shared provider process for the test's terraform commands (shared_provider)."""
    with shared_provider(aws_env, aws_provider_binary) as env:
        yield env


def ec2(moto: MotoServer) -> object:
    return boto3.client("ec2", region_name=REGION, endpoint_url=moto.url, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def instances(moto: MotoServer, cluster: str) -> list[dict]:
    resp = ec2(moto).describe_instances(Filters=[{"Name": "tag:gpuctl-cluster", "Values": [cluster]}])
    return [i for r in resp["Reservations"] for i in r["Instances"]]


def running(moto: MotoServer, cluster: str) -> list[dict]:
    return [i for i in instances(moto, cluster) if i["State"]["Name"] in ("pending", "running")]


def assert_nothing_created(moto: MotoServer) -> None:
    client = ec2(moto)
    assert [r for r in client.describe_instances()["Reservations"]] == []
    assert [v for v in client.describe_vpcs()["Vpcs"] if not v["IsDefault"]] == []
    assert client.describe_key_pairs()["KeyPairs"] == []
    assert client.describe_launch_templates()["LaunchTemplates"] == []


def gpuctl(*args: str, env: dict[str, str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """The CLI (forked: tests/gpuctlfork.py) in its own process group, so a timeout also ends its terraform."""
    try:
        return gpuctlfork.run(args, env=env, cwd=cwd, timeout=timeout, new_session=True)
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"gpuctl {' '.join(args)} ran over {timeout}s:\n{late.stdout}\n{late.stderr}")


def task_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_provision_with_zone_failover_inventory_and_down(tmp_path: Path, moto: MotoServer, aws_env: dict[str, str],
                                                         aws_provider_binary: Path, _isolated_state: Path) -> None:
    """One provisioning run (terraform apply is the slow part) covering the whole path:
    us-east-1a has no capacity, so gpuctl destroys that attempt and provisions in
    us-east-1b; then inventory, SSH ingress, a replace and `down` are checked."""
    name = "moto-train"
    task = task_file(tmp_path, f"""\
        name: {name}
        num_nodes: 3
        resources:
          infra: aws/{REGION}
          instance_type: t3.micro
          image_id: {MOTO_UBUNTU_AMI}
        config:
          aws:
            remote_identity: [{{"other-*": wrong-profile}}, {{"moto-*": moto-data-reader}}]
        run: echo never runs with --provision-only
        """)
    boto3.client("iam", region_name=REGION, endpoint_url=moto.url, aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_instance_profile(InstanceProfileName="moto-data-reader")
    s3 = shared_state_bucket(moto)
    with CapacityShortage(moto.url, zones=["us-east-1a"]) as proxy, \
            shared_provider(aws_env, aws_provider_binary, proxy.url) as tf_aws_env:
        # one provider retry, so the capacity error surfaces at once (gpuctl.common.config)
        env = {**tf_aws_env, **shared_state(moto), "GPUCTL_AWS_MAX_RETRIES": "1",
               "GPUCTL_SSH_INGRESS_CIDRS": "198.51.100.7/32"}
        up = gpuctl("apply", str(task), "--provision-only", env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stdout + up.stderr
        check_cluster(moto, proxy, up.stdout, name, _isolated_state)
        check_module_inventory(_isolated_state / "clusters" / name, env, tmp_path)
        check_replace(moto, name, env, _isolated_state / "clusters" / name)
        # a CI runner that never saw the cluster takes it down: the Terraform state and the
        # rendered root come from the state bucket
        down = gpuctl("down", name, env={**env, "GPUCTL_STATE_DIR": str(tmp_path / "fresh-runner")}, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=STATE_BUCKET).get("Contents", [])] == []
    assert running(moto, name) == []
    assert len(instances(moto, name)) == 5  # terminated, not forgotten by moto (the first of ranks 1 and 2 too)
    assert [v for v in ec2(moto).describe_vpcs()["Vpcs"] if not v["IsDefault"]] == []


def test_stopped_nodes_come_back_with_apply_and_with_stop_and_start(tmp_path: Path, moto: MotoServer,
                                                                     tf_aws_env: dict[str, str],
                                                                     _isolated_state: Path) -> None:
    """The same instances, stopped and started again: by themselves (autostop's shutdown) then
    `gpuctl apply`, and by `gpuctl stop` / `gpuctl start` through Terraform (its own test beside the
    failover one above, so the two long Terraform chains run side by side)."""
    name = "moto-power"
    task = task_file(tmp_path, f"""\
        name: {name}
        num_nodes: 2
        resources:
          infra: aws/{REGION}/us-east-1b
          instance_type: t3.micro
          image_id: {MOTO_UBUNTU_AMI}
        run: echo never runs with --provision-only
        """)
    s3 = shared_state_bucket(moto)
    env = {**tf_aws_env, **shared_state(moto), "GPUCTL_SSH_INGRESS_CIDRS": "198.51.100.7/32"}
    up = gpuctl("apply", str(task), "--provision-only", env=env, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    ids = sorted(i["InstanceId"] for i in running(moto, name))
    assert len(ids) == 2
    # the nodes stop themselves (autostop's shutdown): the next apply starts the same nodes again
    ec2(moto).stop_instances(InstanceIds=ids)
    assert running(moto, name) == []
    again = gpuctl("apply", str(task), "--provision-only", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(i["InstanceId"] for i in running(moto, name)) == ids
    # a node's public address is new once it started (moto, as EC2, drops it at the stop): the apply's
    # inventory has the new ones, not the private addresses its outputs had while the nodes were stopped
    from gpuctl.provision.provisioner import load_inventory_of

    inv = load_inventory_of(name)
    assert inv is not None and {n.node_id: n.ssh_host for n in inv.nodes} == {
        i["InstanceId"]: i.get("PublicIpAddress") for i in running(moto, name)}
    check_stop_and_start(moto, name, env, _isolated_state, tmp_path, ids)
    down = gpuctl("down", name, env=env, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=STATE_BUCKET).get("Contents", [])] == []
    assert running(moto, name) == []


STATE_BUCKET = "gpuctl-team-state"


def shared_state(moto: MotoServer) -> dict[str, str]:
    return {"GPUCTL_STATE_BUCKET": STATE_BUCKET, "GPUCTL_STATE_ENDPOINT_URL": moto.url}


def shared_state_bucket(moto: MotoServer) -> object:
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto.url, aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket=STATE_BUCKET)
    return s3


STOP_KEYS = {"schema", "command", "ok", "cluster", "status", "stopped_at", "cancelled"}
START_KEYS = {"schema", "command", "ok", "cluster", "status", "started", "nodes", "autostop"}


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    return next((ln for ln in proc.stderr.splitlines() if ln.startswith("error:")), "")


def node_states_in_terraform(moto: MotoServer, name: str) -> list[str]:
    """The nodes' states in Terraform's state, which lives in the state bucket (its S3 backend)."""
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto.url, aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=STATE_BUCKET)["Contents"]
               if o["Key"].endswith(f"clusters/{name}/terraform.tfstate"))
    tfstate = json.loads(s3.get_object(Bucket=STATE_BUCKET, Key=key)["Body"].read())
    return [i["attributes"]["state"] for r in tfstate["resources"] if r["type"] == "aws_ec2_instance_state"
            for i in r["instances"]]


def states(moto: MotoServer, name: str) -> dict[str, str]:
    return {i["InstanceId"]: i["State"]["Name"] for i in instances(moto, name)
            if i["State"]["Name"] != "terminated"}


def check_stop_and_start(moto: MotoServer, name: str, env: dict[str, str], state: Path, tmp_path: Path,
                         ids: list[str]) -> None:
    """`gpuctl stop` / `start` (issue 34.9), on this cluster (shared state, as a CI runner has it):
    refused without consent while a job runs, then every node stopped through Terraform (its state
    says so), the job CANCELLED, status STOPPED with its cost frozen, what needs the nodes refused in
    one line; `start` without the task file brings the same instances back."""
    import time

    registry = Registry(path=state / "state.db", remote=None)
    job = registry.new_job(name, name="train", num_nodes=len(ids))  # a job the registry says still runs
    registry.update_job(name, job.job_id, status="RUNNING", started_at=time.time())
    asked = gpuctl("stop", name, env=env, cwd=tmp_path)  # no terminal to ask on and no -y: refused
    assert asked.returncode == 2 and error_line(asked) == (
        f"error: jobs still run (cluster '{name}': job(s) {job.job_id}) and stopping ends them; wait for them "
        f"(`gpuctl queue NAME`), or stop anyway with `gpuctl stop {name} -y`"), asked.stderr
    assert states(moto, name) == {i: "running" for i in ids}
    before = time.time()
    stop = gpuctl("stop", name, "-y", "-o", "json", env=env, cwd=tmp_path)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    doc = json.loads(stop.stdout)
    assert set(doc) == STOP_KEYS, doc
    assert (doc["ok"], doc["cluster"], doc["status"], doc["cancelled"]) == (True, name, "STOPPED", [job.job_id])
    assert before <= doc["stopped_at"] <= time.time()
    assert states(moto, name) == {i: "stopped" for i in ids}  # the same instances, stopped, not terminated
    assert node_states_in_terraform(moto, name) == ["stopped"] * len(ids)  # Terraform's state says so
    ended = registry.job(name, job.job_id)
    assert (ended.status, ended.detail) == ("CANCELLED", "ended by `gpuctl stop`: the cluster was stopped")
    assert registry.cluster(name).status == "STOPPED" and registry.history(name)[-1].ended_how == "stop"
    shown = json.loads(gpuctl("status", name, "-o", "json", env=env, cwd=tmp_path).stdout)["clusters"][0]
    assert (shown["status"], shown["stopped_at"], shown["per_hour"]) == ("STOPPED", doc["stopped_at"], None)
    time.sleep(1.5)
    later = json.loads(gpuctl("status", name, "-o", "json", env=env, cwd=tmp_path).stdout)["clusters"][0]
    assert later["cost_so_far"] == shown["cost_so_far"] and later["age_s"] == shown["age_s"]  # frozen
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["stopped_at"]))
    assert (f"  stopped at {stamp} (`gpuctl stop`); its disks still bill: `gpuctl start {name}` brings it back, "
            f"`gpuctl down {name}` removes it") in gpuctl("status", name, env=env, cwd=tmp_path).stdout.splitlines()
    for argv in (["exec", name, "--", "true"], ["ssh", name], ["check", name, "--health"],
                 ["replace", name, "worker1", "--no-health-check"]):
        refused = gpuctl(*argv, env=env, cwd=tmp_path)
        assert refused.returncode == 2 and error_line(refused) == \
            f"error: cluster '{name}' is stopped; `gpuctl start {name}` brings it back", (argv, refused.stderr)
    again = gpuctl("stop", name, env=env, cwd=tmp_path)
    assert again.returncode == 0 and f"Cluster '{name}' is already stopped." in again.stdout, again.stderr
    # start, without the task file: the same instances; moto's nodes never answer ssh, which it says
    start = gpuctl("start", name, env={**env, "GPUCTL_WAIT_TIMEOUT": "1"}, cwd=tmp_path)
    assert start.returncode == 1, start.stdout + start.stderr
    assert error_line(start).startswith(f"error: cluster '{name}' is running again, but head (") and \
        error_line(start).endswith(f"did not answer ssh within 1 s (GPUCTL_WAIT_TIMEOUT); `gpuctl status {name} "
                                   f"--refresh` shows each node, `gpuctl stop {name}` stops it again"), start.stderr
    assert states(moto, name) == {i: "running" for i in ids}
    assert node_states_in_terraform(moto, name) == ["running"] * len(ids)
    assert registry.cluster(name).status == "UP" and registry.history(name)[-1].ended_how is None  # counting again
    assert not (state / "clusters" / name / "stopped.json").exists()
    up = gpuctl("start", name, "-o", "json", env=env, cwd=tmp_path)
    assert up.returncode == 0 and "is already up" in up.stderr, up.stderr
    doc = json.loads(up.stdout)
    assert set(doc) == START_KEYS and (doc["status"], doc["started"]) == ("UP", False), doc
    assert sorted(n["node_id"] for n in doc["nodes"]) == ids
    report = json.loads(gpuctl("cost-report", "-o", "json", env=env, cwd=tmp_path).stdout)
    assert [r["status"] for r in report["clusters"] if r["name"] == name][-2:] == ["STOPPED", "UP"]


def rank_of(instance: dict) -> int:
    return int({t["Key"]: t["Value"] for t in instance["Tags"]}["gpuctl-rank"])


def check_replace(moto: MotoServer, name: str, env: dict[str, str], cdir: Path) -> None:
    """Rank 1's instance is terminated behind gpuctl's back: EC2 (lost_nodes) names it alone. Rank 2
    still runs, but (say) its health check found a bad GPU. One replace_nodes call (what `gpuctl
    replace` and a managed job's recovery run) makes a new instance at each rank (same Name and
    gpuctl-rank tags): the lost one created, the running one planned as a -replace, nothing else
    touched; the inventory follows, with rank 2's new address."""
    by_rank = {rank_of(i): i["InstanceId"] for i in running(moto, name)}
    ec2(moto).terminate_instances(InstanceIds=[by_rank[1]])
    lost = gpuctl_python(LOST_NODES_PY, name, env=env, timeout=300)
    assert lost.returncode == 0, lost.stdout + lost.stderr
    assert list(json.loads(lost.stdout)) == ["1"], lost.stdout
    assert json.loads(lost.stdout)["1"].startswith(f"instance {by_rank[1]} is terminated"), lost.stdout
    old_address = {rank_of(i): i["PrivateIpAddress"] for i in running(moto, name)}[2]
    rep = gpuctl_python(REPLACE_NODES_PY, name, "1", "2", env=env, timeout=600)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    now = {rank_of(i): i for i in running(moto, name)}
    assert sorted(now) == [0, 1, 2]
    assert now[0]["InstanceId"] == by_rank[0]
    assert now[1]["InstanceId"] != by_rank[1] and now[2]["InstanceId"] != by_rank[2]
    assert now[2]["PrivateIpAddress"] != old_address
    assert {t["Key"]: t["Value"] for t in now[1]["Tags"]}["Name"] == f"{name}-1"
    assert {t["Key"]: t["Value"] for t in now[2]["Tags"]}["Name"] == f"{name}-2"
    planned = [json.loads(line)["change"] for line in (cdir / "terraform" / "logs" / "apply.log").read_text().splitlines()
               if line.startswith("{") and '"type":"planned_change"' in line]
    made = {c["resource"]["addr"]: c["action"] for c in planned if c["action"] != "update"}
    # (moto can show an in-place update of an instance it keeps on a re-apply; none of the
    # others is made again)
    assert {addr: action for addr, action in made.items() if "[2]" not in addr} == {
        "module.cluster.aws_instance.node[1]": "create",  # terminated: gone from the state
        "module.cluster.aws_ec2_instance_state.node[1]": "create"}, planned
    assert made["module.cluster.aws_instance.node[2]"] == "replace", planned  # -replace of exactly it
    assert not [a for a in made if a.startswith("module.cluster.aws_instance.") and a[-3:] not in ("[1]", "[2]")]
    hosts = yaml.safe_load((cdir / "inventory.yml").read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
    assert [h["gpuctl_node_id"] for h in hosts.values()] == [now[r]["InstanceId"] for r in range(3)]
    assert list(hosts) == ["head", "worker1", "worker2"]


def check_module_inventory(cdir: Path, env: dict[str, str], tmp_path: Path) -> None:
    """The module's ansible_inventory output, from the real apply: what gpuctl's own inventory says,
    and an inventory Ansible and gpuctl (`infra: ssh/FILE`) both read."""
    from gpuctl.provision.inventory import load_inventory

    out = subprocess.run(["terraform", "output", "-raw", "ansible_inventory"], cwd=cdir / "terraform", env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    exported = tmp_path / "module-inventory.yml"
    exported.write_text(out.stdout)
    theirs = load_inventory(exported, cluster="moto-train")
    ours = load_inventory(cdir / "inventory.yml", cluster="moto-train")
    assert [(n.name, n.rank, n.address, n.ssh_host, n.node_id) for n in theirs.nodes] == \
        [(n.name, n.rank, n.address, n.ssh_host, n.node_id) for n in ours.nodes]
    listed = subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(exported), "--list"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert yaml.safe_load(listed.stdout)["gpuctl_nodes"]["hosts"] == ["head", "worker1", "worker2"]


def check_cluster(moto: MotoServer, proxy: CapacityShortage, stdout: str, name: str, state: Path) -> None:
    assert proxy.refused and set(proxy.refused) == {"us-east-1a"}
    assert "us-east-1a has no t3.micro capacity; trying us-east-1b (attempt 2 of 3)" in stdout.splitlines()

    nodes = running(moto, name)
    assert len(nodes) == 3
    assert {n["InstanceType"] for n in nodes} == {"t3.micro"}
    assert {n["IamInstanceProfile"]["Arn"].rsplit("/", 1)[1] for n in nodes} == {"moto-data-reader"}
    # no zone in infra: 1a (first offering zone) had no capacity, so all nodes are in 1b
    assert {n["Placement"]["AvailabilityZone"] for n in nodes} == {"us-east-1b"}
    # the failed attempt in 1a was destroyed: one cluster VPC, one subnet, in 1b
    vpcs = [v["VpcId"] for v in ec2(moto).describe_vpcs()["Vpcs"] if not v["IsDefault"]]
    assert len(vpcs) == 1
    subnets = ec2(moto).describe_subnets(Filters=[{"Name": "vpc-id", "Values": vpcs}])["Subnets"]
    assert [s["AvailabilityZone"] for s in subnets] == ["us-east-1b"]
    by_rank = sorted(nodes, key=lambda n: int({t["Key"]: t["Value"] for t in n["Tags"]}["gpuctl-rank"]))

    inv = yaml.safe_load((state / "clusters" / name / "inventory.yml").read_text())
    hosts = inv["all"]["children"]["gpuctl_nodes"]["hosts"]
    assert list(hosts) == ["head", "worker1", "worker2"]
    assert [h["gpuctl_rank"] for h in hosts.values()] == [0, 1, 2]
    assert [h["gpuctl_address"] for h in hosts.values()] == [n["PrivateIpAddress"] for n in by_rank]
    assert [h["gpuctl_node_id"] for h in hosts.values()] == [n["InstanceId"] for n in by_rank]
    assert [h["ansible_host"] for h in hosts.values()] == [n["PublicIpAddress"] for n in by_rank]
    assert {h["ansible_user"] for h in hosts.values()} == {"ubuntu"}
    assert (inv["all"]["vars"]["gpuctl_cloud"], inv["all"]["vars"]["gpuctl_zone"]) == ("aws", "us-east-1b")

    # SSH is open to the configured CIDR only (moto lists groups on the interfaces only)
    sg_ids = {g["GroupId"] for n in nodes for eni in n["NetworkInterfaces"] for g in eni["Groups"]}
    assert len(sg_ids) == 1
    rules = ec2(moto).describe_security_group_rules(Filters=[{"Name": "group-id", "Values": sorted(sg_ids)}])
    ssh_from = {r.get("CidrIpv4") for r in rules["SecurityGroupRules"]
                if not r["IsEgress"] and r.get("FromPort") == 22}
    assert ssh_from == {"198.51.100.7/32"}


def test_dry_run_of_p5_example_shows_plan_efa_and_placement(tmp_path: Path, moto: MotoServer,
                                                             tf_aws_env: dict[str, str]) -> None:
    example = REPO / "examples" / "aws-p5" / "cluster.yaml"
    # moto has no Deep Learning AMI parameter in SSM (and refuses to create /aws/ names),
    # so the example gets one of moto's images; everything else is as written.
    task = yaml.safe_load(example.read_text())
    assert (task["num_nodes"], task["resources"]["accelerators"], task["resources"]["network_tier"]) == (
        4, "H100:8", "best")
    task["resources"]["image_id"] = MOTO_UBUNTU_AMI
    task["workdir"] = str(example.parent)
    copy = tmp_path / "cluster.yaml"
    copy.write_text(yaml.safe_dump(task, sort_keys=False))
    out = gpuctl("apply", str(copy), "--dry-run", env=tf_aws_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "AWS us-east-1/us-east-1a: 4 x p5.48xlarge (8 x H100 each), on-demand" in text
    assert "EFA: 32 interfaces per node" in text
    assert "Placement group: p5-allreduce-us-east-1a (strategy cluster)" in text
    assert "SSH: closed (no ssh_ingress_cidrs)" in text
    assert re.search(r"^Plan: \d+ to add, 0 to change, 0 to destroy\.$", text, flags=re.M), text
    assert "aws_placement_group" in text and "aws_instance.node[3]" in text and "aws_instance.node[4]" not in text
    assert_nothing_created(moto)


P4DE_ZONES = "us-east-1b, us-east-1c"  # moto's offerings for p4de.24xlarge in us-east-1


@pytest.mark.parametrize(
    ("resources", "creds", "message"),
    [
        pytest.param({"infra": "aws/us-east-1", "instance_type": "p9.huge"}, True,
                     "error: resources.instance_type 'p9.huge': no such EC2 instance type "
                     "(see `aws ec2 describe-instance-types`)", id="unknown-type"),
        pytest.param({"infra": "aws/us-east-1/us-east-1a", "instance_type": "p4de.24xlarge"}, True,
                     f"error: resources.infra: p4de.24xlarge is not offered in us-east-1a; zones of us-east-1 "
                     f"that offer it: {P4DE_ZONES}", id="not-offered-in-zone"),
        pytest.param({"infra": "aws/us-east-1", "instance_type": "t3.micro", "image_id": "ami-0123456789abcdef0"},
                     True, "error: resources.image_id 'ami-0123456789abcdef0': no such AMI in us-east-1 "
                     "(AMIs are per region)", id="unknown-image"),
        pytest.param({"infra": "aws/us-east-1", "instance_type": "t3.micro"}, True,
                     "error: resources.image_id: none given, and the Deep Learning AMI parameter "
                     "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id "
                     "does not exist in us-east-1; set resources.image_id to an AMI id", id="no-default-image"),
        pytest.param({"infra": "aws/us-east-1", "instance_type": "g4dn.xlarge", "network_tier": "best"}, True,
                     "error: resources.network_tier: instance type g4dn.xlarge does not support EFA; "
                     "use network_tier: standard or an EFA type such as p5.48xlarge", id="no-efa"),
        pytest.param({"infra": "aws/us-east-1", "accelerators": "H100:8"}, False,
                     "error: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                     "or AWS_PROFILE (aws configure / aws sso login)", id="no-credentials"),
    ],
)
@pytest.mark.parametrize("mode", ["--provision-only", "--dry-run"])
def test_preflight_errors_are_one_line_and_create_nothing(
    tmp_path: Path, moto: MotoServer, aws_env: dict[str, str], _isolated_state: Path,
    resources: dict, creds: bool, message: str, mode: str,
) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"name": "bad", "num_nodes": 2, "resources": resources}))
    env = aws_env if creds else {**isolated_aws_env(aws_env), "GPUCTL_AWS_ENDPOINT_URL": moto.url}
    out = gpuctl("apply", str(task), mode, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [message]
    assert "Traceback" not in out.stdout + out.stderr
    assert_nothing_created(moto)
    assert not list((_isolated_state / "clusters").glob("*/terraform/terraform.tfstate"))
    assert Registry(remote=None).clusters() == []  # refused in preflight: no INIT row for `status` to show


def test_p5_with_ssh_cidrs_gets_a_bastion_whose_ami_moto_lacks(tmp_path: Path, moto: MotoServer,
                                                               aws_env: dict[str, str]) -> None:
    """With SSH CIDRs, 32-interface nodes are reached through a bastion; its Ubuntu AMI comes
    from Canonical's SSM parameter, which moto does not have: one line, nothing created."""
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"name": "p5", "num_nodes": 2, "resources": {
        "infra": "aws/us-east-1", "accelerators": "H100:8", "network_tier": "best", "image_id": MOTO_UBUNTU_AMI}}))
    out = gpuctl("apply", str(task), "--dry-run", env={**aws_env, "GPUCTL_SSH_INGRESS_CIDRS": "203.0.113.7/32"},
                 cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        "error: the bastion for nodes without public IPs needs the Ubuntu AMI parameter "
        "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id, "
        "which does not exist in us-east-1; pick another region"]
    assert_nothing_created(moto)
