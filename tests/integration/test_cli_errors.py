"""Every bad input through the real `gpuctl` command: one line naming the field
or file, exit code 2, no traceback, and nothing provisioned."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gpuctlfork
import pytest

GOOD_RUN = "run: echo hi\n"


def gpuctl(*args: str, cwd: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return gpuctlfork.run([*args], cwd=cwd,
                          env=env, timeout=120)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_nothing_provisioned(state: Path) -> None:
    clusters = state / "clusters"
    assert not clusters.exists() or not any(clusters.iterdir())


CASES = {
    "unknown-field": ("nodes: 2\n" + GOOD_RUN, ["cluster.yaml:1", "nodes", "did you mean 'num_nodes'"]),
    "yaml-syntax": ("run: echo hi\nnum_nodes: [1\n", ["cluster.yaml:", "YAML"]),
    "num-nodes-zero": ("num_nodes: 0\n" + GOOD_RUN, ["cluster.yaml:1", "num_nodes"]),
    "num-nodes-negative": ("num_nodes: -2\n" + GOOD_RUN, ["cluster.yaml:1", "num_nodes"]),
    "num-nodes-not-int": ("num_nodes: two\n" + GOOD_RUN, ["cluster.yaml:1", "num_nodes"]),
    "bad-accelerator": ("resources:\n  accelerators: 'A100:x'\n" + GOOD_RUN, ["cluster.yaml:2", "resources.accelerators"]),
    "bad-accelerator-count": ("resources:\n  accelerators: {A100: 0}\n" + GOOD_RUN, ["cluster.yaml:2", "resources.accelerators"]),
    "missing-workdir": ("workdir: ./does-not-exist\n" + GOOD_RUN, ["cluster.yaml:1", "workdir"]),
    "missing-mount-source": ("file_mounts:\n  /data/x: ./nope.txt\n" + GOOD_RUN, ["cluster.yaml:2", "file_mounts"]),
    "relative-mount-dest-climbs-out": ("file_mounts:\n  ../../x: ./cluster.yaml\n" + GOOD_RUN,
                                       ["cluster.yaml:2", "file_mounts.../../x", "climbs out of the home"]),
    "mount-over-login-keys": ("file_mounts:\n  ~//.ssh/./authorized_keys: ./cluster.yaml\n" + GOOD_RUN,
                              ["cluster.yaml:2", "file_mounts.~//.ssh/./authorized_keys", "is in ~/.ssh"]),
    "mount-at-agent": ("file_mounts:\n  /root/.gpuctl/bin/gpuctl-node: ./cluster.yaml\n" + GOOD_RUN,
                       ["cluster.yaml:2", "file_mounts./root/.gpuctl/bin/gpuctl-node", "is in ~/.gpuctl"]),
    "mount-at-etc": ("file_mounts:\n  /usr/../etc/: .\n" + GOOD_RUN, ["cluster.yaml:2", "(that is /etc)"]),
    "bucket-mount-over-workdir": ("file_mounts:\n  /root/gpuctl_workdir/:\n    source: s3://victim\n    mode: MOUNT\n"
                                  + GOOD_RUN, ["cluster.yaml:2", "would cover ~/gpuctl_workdir"]),
    "bad-env-key": ("envs:\n  1BAD: x\n" + GOOD_RUN, ["cluster.yaml:2", "envs"]),
    "run-not-string": ("run: [echo, hi]\n", ["cluster.yaml:1", "run"]),
    "setup-not-string": ("setup: {a: 1}\n" + GOOD_RUN, ["cluster.yaml:1", "setup"]),
    "bad-network-tier": ("resources:\n  network_tier: fastest\n" + GOOD_RUN, ["cluster.yaml:2", "network_tier"]),
    "bad-infra": ("resources:\n  infra: gcp\n" + GOOD_RUN, ["cluster.yaml:2", "infra"]),
}


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_task_file(case: str, command: str, tmp_path: Path, _isolated_state: Path):
    text, fragments = CASES[case]
    (tmp_path / "cluster.yaml").write_text(text)
    proc = gpuctl(command, "cluster.yaml", cwd=tmp_path)
    assert_user_error(proc, *fragments)
    assert_nothing_provisioned(_isolated_state)


@pytest.mark.parametrize("command", ["validate", "apply"])
def test_every_problem_is_named_on_a_line_of_its_own(command: str, tmp_path: Path, _isolated_state: Path):
    """Several problems: exit 2, the first on the `error:` line, each further one on its own line with
    its file:line and field (no "(and N more problems)"); -o json's error holds them all."""
    (tmp_path / "cluster.yaml").write_text("num_nodes: 0\nresources:\n  accelerators: 'A100:x'\n"
                                           "file_mounts:\n  /data: ./nope\n" + GOOD_RUN)
    proc = gpuctl(command, "cluster.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(": ", 2)[:2] for line in lines] == [
        ["error", "cluster.yaml:1"], ["  cluster.yaml:3", "resources.accelerators"],
        ["  cluster.yaml:5", "file_mounts./data"]], proc.stderr
    assert lines[0] == "error: cluster.yaml:1: num_nodes: must be a positive int, got 0"
    assert "more problem" not in proc.stderr
    as_json = gpuctl(command, "cluster.yaml", "-o", "json", cwd=tmp_path)
    doc = json.loads(as_json.stdout)
    assert as_json.returncode == 2 and doc["ok"] is False and doc["exit_code"] == 2
    assert doc["error"] == proc.stderr.strip().removeprefix("error: ")
    assert_nothing_provisioned(_isolated_state)


def test_missing_file(tmp_path: Path, _isolated_state: Path):
    proc = gpuctl("apply", "nope.yaml", cwd=tmp_path)
    assert_user_error(proc, "nope.yaml")
    assert_nothing_provisioned(_isolated_state)


def test_bad_cli_overrides(tmp_path: Path, _isolated_state: Path):
    (tmp_path / "cluster.yaml").write_text(GOOD_RUN)
    assert_user_error(gpuctl("apply", "cluster.yaml", "--num-nodes", "0", cwd=tmp_path), "--num-nodes", "positive")
    assert_user_error(gpuctl("apply", "cluster.yaml", "--infra", "azure", cwd=tmp_path), "--infra", "azure")
    assert_user_error(gpuctl("apply", "cluster.yaml", "--env", "=x", cwd=tmp_path), "--env")
    assert_user_error(gpuctl("apply", "cluster.yaml", "-c", "Bad_Name", cwd=tmp_path), "Bad_Name")
    assert_nothing_provisioned(_isolated_state)


def test_null_secret_needs_a_value(tmp_path: Path, _isolated_state: Path):
    (tmp_path / "cluster.yaml").write_text("secrets:\n  HF_TOKEN: null\n" + GOOD_RUN)
    assert_user_error(gpuctl("apply", "cluster.yaml", cwd=tmp_path), "cluster.yaml:2", "secrets.HF_TOKEN")
    assert_nothing_provisioned(_isolated_state)


def test_unknown_cluster_for_down_and_status(tmp_path: Path, _isolated_state: Path):
    down = gpuctl("down", "nosuch", cwd=tmp_path)  # nothing to destroy is no error (issue 24)
    assert down.returncode == 0 and "Cluster 'nosuch' does not exist" in down.stdout, down
    assert_user_error(gpuctl("status", "nosuch", cwd=tmp_path), "nosuch")


def test_valid_file_validates(tmp_path: Path):
    (tmp_path / "cluster.yaml").write_text("num_nodes: 2\nresources:\n  accelerators: A100:8\n" + GOOD_RUN)
    proc = gpuctl("validate", "cluster.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 node(s) on local, A100:8" in proc.stdout


def test_aws_job_with_ssh_closed_is_refused_before_provisioning(tmp_path: Path, _isolated_state: Path):
    (tmp_path / "cluster.yaml").write_text("resources:\n  infra: aws/us-east-1\n  instance_type: g5.xlarge\n" + GOOD_RUN)
    env = {k: v for k, v in os.environ.items() if k != "GPUCTL_SSH_INGRESS_CIDRS"}
    proc = gpuctlfork.run(["apply", "cluster.yaml"], cwd=tmp_path, env=env,
                          timeout=120)
    assert_user_error(proc, "ssh_ingress_cidrs", "--provision-only")
    assert_nothing_provisioned(_isolated_state)


def test_shared_state_errors_are_one_line(tmp_path: Path, _isolated_state: Path):
    """A bad state setting, force-unlock without shared state, a state bucket that does not exist."""
    (tmp_path / "cluster.yaml").write_text("resources: {infra: local}\n" + GOOD_RUN)
    assert_user_error(gpuctl("force-unlock", "c1", cwd=tmp_path), "force-unlock: state is local")
    assert_user_error(gpuctl("status", cwd=tmp_path, env_extra={"GPUCTL_STATE_BUCKET": "Not_A_Bucket"}),
                      "GPUCTL_STATE_BUCKET 'Not_A_Bucket': not an S3 bucket name")
    from mototest import MotoServer, fake_aws_env

    with MotoServer() as moto:
        env = {**fake_aws_env(moto.url), "GPUCTL_STATE_DIR": str(_isolated_state),
               "GPUCTL_STATE_BUCKET": "no-such-state-bucket", "GPUCTL_STATE_ENDPOINT_URL": moto.url}
        proc = gpuctl("apply", "cluster.yaml", cwd=tmp_path, env_extra=env)
    assert_user_error(proc, "state bucket 'no-such-state-bucket' does not exist", "GPUCTL_STATE_BUCKET")
    assert_nothing_provisioned(_isolated_state)


# validate runs every refusal of apply that needs no node and no cloud call: the same line from both,
# and apply's comes before anything is written (no registry row, no cluster directory).
SAME_REFUSAL = {
    "local-a-billion-nodes": ("num_nodes: 1000000000\n" + GOOD_RUN, "num_nodes 1000000000: infra local supports 1 to"),
    "local-510-nodes": ("num_nodes: 510\nresources: {infra: local}\n" + GOOD_RUN, "num_nodes 510: infra local"),
    "aws-no-type-for-gpus": ("resources: {infra: aws/us-east-1, accelerators: 'A100:3'}\n" + GOOD_RUN, "A100:3"),
    "bucket-mount-in-workdir": ("file_mounts:\n  ~/gpuctl_workdir/data:\n    source: s3://victim\n    mode: MOUNT\n"
                                + GOOD_RUN, "gpuctl_workdir"),
    "bucket-cached-mount-on-workdir": ("file_mounts:\n  ~/gpuctl_workdir:\n    source: s3://victim/p\n"
                                       "    mode: MOUNT_CACHED\n" + GOOD_RUN, "gpuctl_workdir"),
    "bucket-credentials-in-envs": ("envs:\n  AWS_SECRET_ACCESS_KEY: abc\nfile_mounts:\n  /data:\n    source: s3://data-bucket\n"
                                   "    mode: COPY\n" + GOOD_RUN, "take AWS credentials from secrets"),
    "ssh-inventory-too-small": ("num_nodes: 3\nresources: {infra: ssh/inv.yml}\n" + GOOD_RUN,
                                "lists 2 host(s) but num_nodes is 3"),
    "ssh-inventory-missing": ("resources: {infra: ssh/none.yml}\n" + GOOD_RUN, "none.yml"),
}


@pytest.mark.parametrize("case", sorted(SAME_REFUSAL))
def test_validate_refuses_what_apply_refuses(case: str, tmp_path: Path, _isolated_state: Path):
    text, fragment = SAME_REFUSAL[case]
    (tmp_path / "cluster.yaml").write_text(text)
    (tmp_path / "inv.yml").write_text("all:\n  hosts:\n    a: {ansible_host: 10.9.0.1}\n    b: {ansible_host: 10.9.0.2}\n")
    validated = gpuctl("validate", "cluster.yaml", cwd=tmp_path)
    applied = gpuctl("apply", "cluster.yaml", cwd=tmp_path)
    assert_user_error(validated, fragment)
    assert_user_error(applied, fragment)
    assert validated.stderr == applied.stderr
    assert_nothing_provisioned(_isolated_state)
    assert gpuctl("status", cwd=tmp_path).stdout.strip() == "No clusters."


def test_a_long_task_name_is_shortened_but_a_long_cluster_flag_is_refused(tmp_path: Path, _isolated_state: Path):
    """A task name longer than AWS takes (SkyPilot's examples have them) gives a shortened cluster name,
    which validate shows; a -c NAME too long for the provider is one exit-2 line, nothing provisioned."""
    long = "torch-distributed-data-parallel-benchmark"
    (tmp_path / "cluster.yaml").write_text(f"name: {long}\nresources: {{infra: aws/us-east-1, "
                                           "instance_type: g5.xlarge}\n" + GOOD_RUN)
    proc = gpuctl("validate", "cluster.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.split("; cluster ", 1)[1].split()[0]
    assert len(name) == 32 and name.startswith("torch-distributed-data-pa-"), proc.stdout
    assert f"; cluster {name} (the task's name, shortened to 32 characters; pass -c NAME for another)" in proc.stdout
    doc = json.loads(gpuctl("validate", "cluster.yaml", "-o", "json", cwd=tmp_path).stdout)
    assert doc["cluster"] == name
    assert_user_error(gpuctl("apply", "cluster.yaml", "-c", "n" * 33, cwd=tmp_path),
                      f"cluster name '{'n' * 33}': AWS clusters take at most 32 characters; pass a shorter -c NAME")
    assert_user_error(gpuctl("apply", "cluster.yaml", "-c", "n" * 41, cwd=tmp_path),
                      f"cluster name '{'n' * 41}': use 1-40 lowercase letters")
    assert_nothing_provisioned(_isolated_state)
    short = gpuctl("validate", "cluster.yaml", cwd=tmp_path)  # the same name on every run
    assert f"; cluster {name} " in short.stdout


def test_validate_refuses_a_container_runtime_apply_refuses(tmp_path: Path, _isolated_state: Path):
    (tmp_path / "cluster.yaml").write_text("resources:\n  image_id: docker:ubuntu:22.04\n" + GOOD_RUN)
    env = {"GPUCTL_CONTAINER_RUNTIME": "lxc"}
    validated = gpuctl("validate", "cluster.yaml", cwd=tmp_path, env_extra=env)
    applied = gpuctl("apply", "cluster.yaml", cwd=tmp_path, env_extra=env)
    assert_user_error(validated, "GPUCTL_CONTAINER_RUNTIME=lxc")
    assert validated.stderr == applied.stderr
    assert_nothing_provisioned(_isolated_state)


def test_validate_refuses_a_name_taken_on_another_cloud(tmp_path: Path, _isolated_state: Path):
    (_isolated_state / "clusters" / "t").mkdir(parents=True)
    (_isolated_state / "clusters" / "t" / "cluster.json").write_text('{"name": "t", "cloud": "aws"}\n')
    (tmp_path / "cluster.yaml").write_text("name: t\n" + GOOD_RUN)
    validated = gpuctl("validate", "cluster.yaml", cwd=tmp_path)
    assert_user_error(validated, "cluster 't' already exists on aws")
    assert validated.stderr == gpuctl("apply", "cluster.yaml", cwd=tmp_path).stderr


@pytest.mark.parametrize("nodes", ["1000000000", "600"])
def test_refused_apply_leaves_no_cluster_behind(nodes: str, tmp_path: Path, _isolated_state: Path):
    """The refusal comes before the registry row: status shows nothing, and down knows no such cluster."""
    (tmp_path / "cluster.yaml").write_text("name: big\n" + GOOD_RUN)
    assert_user_error(gpuctl("apply", "cluster.yaml", "--num-nodes", nodes, "-o", "json", cwd=tmp_path),
                      "infra local supports 1 to")
    status = gpuctl("status", "-o", "json", cwd=tmp_path)
    assert status.returncode == 0 and json.loads(status.stdout)["clusters"] == []
    down = gpuctl("down", "big", cwd=tmp_path)  # as terraform destroy with nothing to destroy: exit 0
    assert down.returncode == 0 and down.stderr == "" and \
        down.stdout.strip() == "Cluster 'big' does not exist; nothing to tear down.", down
    assert_nothing_provisioned(_isolated_state)


@pytest.mark.parametrize("left", ["INIT", "STOPPING"])
def test_down_forgets_a_record_with_nothing_provisioned(left: str, tmp_path: Path, _isolated_state: Path):
    """A row an older gpuctl left behind (or an apply killed before it made anything) is removed, exit 0."""
    from gpuctl.state.registry import Registry

    registry = Registry(remote=None)
    registry.upsert_cluster("ghost", cloud="local", region=None, zone=None, num_nodes=1_000_000_000, status=left,
                            request={"name": "ghost"})
    proc = gpuctl("down", "ghost", "-o", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["ok"], doc["cluster"], doc["destroyed"]) == (True, "ghost", False)
    assert "nothing provisioned" in proc.stderr
    assert registry.cluster("ghost") is None
    assert gpuctl("status", cwd=tmp_path).stdout.strip() == "No clusters."


def test_down_takes_several_names_or_all_and_a_missing_one_is_no_error(tmp_path: Path, _isolated_state: Path):
    """SkyPilot's teardown habits: `down A B C`, `down -a`, `-y`; a cluster that is not there is said
    and passed over (a CI step that always tears down must not fail when apply never made it)."""
    (tmp_path / "cluster.yaml").write_text("resources:\n  infra: local\nnum_nodes: 1\n" + GOOD_RUN)
    for name in ("down-a", "down-b", "down-c"):
        made = gpuctl("apply", "cluster.yaml", "-c", name, "--provision-only", "-y", cwd=tmp_path)
        assert made.returncode == 0, made.stderr
    both = gpuctl("down", "down-a", "never-made", "down-b", "-o", "json", cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout)["clusters"] == [
        {"cluster": "down-a", "found": True, "destroyed": True},
        {"cluster": "never-made", "found": False, "destroyed": False},
        {"cluster": "down-b", "found": True, "destroyed": True}]
    assert "Cluster 'never-made' does not exist; nothing to tear down." in both.stderr
    assert json.loads(gpuctl("status", "-o", "json", cwd=tmp_path).stdout)["clusters"][0]["name"] == "down-c"
    every = gpuctl("down", "-a", "-y", cwd=tmp_path)
    assert every.returncode == 0 and "Cluster 'down-c' is gone." in every.stdout, every.stderr
    assert_nothing_provisioned(_isolated_state)
    assert gpuctl("down", "--all", cwd=tmp_path).stdout.strip() == "No clusters to tear down."
    assert_user_error(gpuctl("down", cwd=tmp_path), "give the cluster to tear down (gpuctl down NAME [NAME...])")
    assert_user_error(gpuctl("down", "-a", "down-a", cwd=tmp_path), "give cluster names or -a/--all, not both")
    assert_user_error(gpuctl("down", "ok-name", "Bad_Name", cwd=tmp_path), "cluster name 'Bad_Name'")
