"""SkyPilot task YAMLs through the real `gpuctl validate` (offline: nothing is
provisioned or contacted), one test per compatibility rule of issue 9:
bucket mounts, docker images, any_of/ordered, aliases, relative paths,
validate = apply's offline checks, no silent drops, other clouds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gpuctlfork
import pytest


def validate(yaml_text: str, tmp: Path, *args: str, cwd: Path | None = None, name: str = "task.yaml",
             home: Path | None = None) -> subprocess.CompletedProcess:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml_text)
    env = {**os.environ, "GPUCTL_STATE_DIR": str(tmp / "state"), **({"HOME": str(home)} if home else {})}
    return gpuctlfork.run(["validate", *args, str(path)], cwd=cwd or tmp,
                          env=env, timeout=60)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc.stdout.strip()


def refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_bucket_file_mounts_url_and_storage_object(tmp_path: Path) -> None:
    out = ok(validate("""
file_mounts:
  /data: s3://my-datasets/imagenet/train
  /checkpoints:
    name: my-ckpt-bucket
    mode: MOUNT_CACHED
  /models:
    source: s3://my-models
    mode: mount
run: ls /data
""", tmp_path))
    assert "3 bucket mount(s)" in out
    refused(validate("file_mounts:\n  /data: gs://bucket/x\n", tmp_path), "task.yaml:2", "file_mounts./data",
            "gcs (gs://) sources are not supported by gpuctl")


def test_docker_image_id_runs_in_a_container_not_as_an_ami(tmp_path: Path) -> None:
    out = ok(validate("resources:\n  infra: aws\n  accelerators: H100:8\n  image_id: docker:nvcr.io/nvidia/pytorch:24.10-py3\n",
                      tmp_path))
    assert "p5.48xlarge" in out and "in container nvcr.io/nvidia/pytorch:24.10-py3" in out
    refused(validate("resources:\n  image_id: 'docker:'\n", tmp_path), "resources.image_id", "is not a container image")


def test_any_of_takes_the_first_alternative_gpuctl_can_provision(tmp_path: Path) -> None:
    proc = validate("""
resources:
  any_of:
    - infra: gcp
      accelerators: A100:8
    - infra: aws
      accelerators: H100:8
""", tmp_path)
    assert "aws, p5.48xlarge, H100:8" in ok(proc)
    assert "note: resources.any_of: using alternative 2 of 2 (aws, H100:8); skipped 1 ('gcp': not supported by gpuctl)" \
        in proc.stderr
    # accelerators as a set of choices: the first AWS sells
    assert "p4d.24xlarge, A100:8" in ok(validate("resources:\n  infra: aws\n  accelerators: '{H800:8, A100:8, H100:8}'\n",
                                                 tmp_path))


def test_aliases_gpus_and_spot_recovery(tmp_path: Path) -> None:
    proc = validate("resources:\n  infra: aws\n  gpus: L4:1\n  use_spot: true\n  spot_recovery: FAILOVER\n", tmp_path)
    assert "g6.xlarge, L4:1" in ok(proc)
    # acted on by `gpuctl jobs launch`: said, not warned about
    assert "job_recovery FAILOVER, 0 restart(s) on errors (gpuctl jobs launch)" in proc.stdout
    assert "job_recovery" not in proc.stderr


def test_relative_paths_resolve_from_the_current_directory_then_the_yaml_directory(tmp_path: Path) -> None:
    here, there = tmp_path / "here", tmp_path / "specs"
    (here / "code").mkdir(parents=True)
    (there / "data").mkdir(parents=True)
    text = "workdir: code\nfile_mounts:\n  /remote/data: data\n"
    assert ok(validate(text, tmp_path, cwd=here, name="specs/task.yaml"))  # code from cwd, data from the YAML's dir
    line = refused(validate("workdir: nowhere\n", tmp_path, cwd=here, name="specs/task.yaml"), "workdir")
    assert f"neither {here / 'nowhere'} nor {there / 'nowhere'} exists" in line


def test_git_workdir_is_accepted_and_checked(tmp_path: Path) -> None:
    out = ok(validate("workdir:\n  url: https://github.com/org/repo.git\n  ref: v1.2\nrun: x\n", tmp_path))
    assert "workdir from git https://github.com/org/repo.git" in out
    refused(validate("workdir:\n  url: --upload-pack=evil\n", tmp_path), "task.yaml:2", "workdir.url", "not a git URL")


def test_validate_checks_what_apply_checks_offline(tmp_path: Path) -> None:
    proc = validate("envs:\n  HF_TOKEN: null\nsecrets:\n  WANDB_KEY:\nrun: x\n", tmp_path)
    ok(proc)
    assert "task.yaml:2: envs.HF_TOKEN: no value yet; pass --env HF_TOKEN=VALUE at apply" in proc.stderr
    assert "task.yaml:4: secrets.WANDB_KEY: no value yet; pass --secret WANDB_KEY=VALUE at apply" in proc.stderr
    proc = validate("envs:\n  HF_TOKEN: null\nrun: x\n", tmp_path, "--env", "HF_TOKEN=abc", "--secret", "S=t0p")
    assert ok(proc) and "no value yet" not in proc.stderr
    refused(validate("run: x\n", tmp_path, "--env", "1BAD=x"), "--env 1BAD")
    for accel, itype in (("V100:1", "p3.2xlarge"), ("T4:1", "g4dn.xlarge"), ("B300:8", "p6-b300.48xlarge"),
                         ("A100-80GB:8", "p4de.24xlarge")):
        assert itype in ok(validate(f"resources:\n  infra: aws\n  accelerators: {accel}\n", tmp_path))
    assert "m6i.2xlarge" in ok(validate("resources:\n  infra: aws\nrun: x\n", tmp_path))
    assert "r6i.2xlarge" in ok(validate("resources:\n  infra: aws\n  cpus: 2+\n  memory: 64\n", tmp_path))
    refused(validate("resources:\n  infra: aws\n  accelerators: A100:2\n", tmp_path), "task.yaml:3",
            "resources.accelerators", "valid counts: 8")


def test_fields_not_acted_on_get_one_warning_each(tmp_path: Path) -> None:
    proc = validate("""
resources:
  ports: 8080
  labels: {team: ml}
  autostop: 10
  job_recovery: {strategy: EAGER_NEXT_REGION}
service:
  replicas: 2
config:
  kubernetes: {pod_config: {}}
run: x
""", tmp_path)
    ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    for field in ("resources.ports", "resources.labels", "service", "config.kubernetes"):
        assert sum(f": {field}: ignored" in w for w in warnings) == 1, (field, warnings)
    # autostop and job_recovery are acted on: no warning, and validate says what will be done
    assert not any("autostop" in w for w in warnings) and "autostop after 10 idle minute(s)" in proc.stdout
    assert not any("job_recovery" in w for w in warnings) and "job_recovery EAGER_NEXT_REGION" in proc.stdout
    local = validate("resources:\n  accelerators: A100:8\n  use_spot: true\n", tmp_path)
    ok(local)
    assert "resources.use_spot: ignored on infra local" in local.stderr
    if not Path("/dev/nvidia0").exists():
        assert "resources.accelerators: the local nodes have no GPU" in local.stderr


def test_a_pipeline_validates_stage_by_stage_and_is_refused_where_it_would_run(tmp_path: Path) -> None:
    """SkyPilot's pipeline format (issue 39): validate checks each stage and names it in its errors, at
    the file's own lines; apply (which runs one task) says what it is and what runs it."""
    pipe = ("name: pipe\nexecution: serial\n---\nname: train\nnum_nodes: 2\nresources:\n  infra: local\n"
            "run: echo a\n---\nname: eval\nresources:\n  infra: aws\n  accelerators: H100:8\nrun: echo b\n")
    out = ok(validate(pipe, tmp_path))
    assert out.splitlines() == [f"{tmp_path / 'task.yaml'}: OK: pipeline pipe, 2 stage(s), run one after another",
                                "  stage 1 (train): 2 node(s) on local",
                                "  stage 2 (eval): 1 node(s) on aws, p5.48xlarge, H100:8"], out
    doc = json.loads(ok(validate(pipe, tmp_path, "-o", "json")))
    assert doc["ok"] and doc["pipeline"] == "pipe" and [(s["stage"], s["name"], s["line"]) for s in doc["stages"]] \
        == [(1, "train", 4), (2, "eval", 10)]
    bad = pipe.replace("H100:8", "H100:x").replace("name: train", "name: train\nnum_node: 2")
    proc = validate(bad, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    src = tmp_path / "task.yaml"
    assert proc.stderr.splitlines() == [
        f"error: {src}:5: stage 1 (train): num_node: unknown field; did you mean 'num_nodes'?",
        f"  {src}:14: stage 2 (eval): resources.accelerators: 'H100:x' is not a valid accelerator; write "
        "NAME:COUNT such as A100:8"], proc.stderr
    headless = "name: a\nrun: x\n---\nrun: y\n"  # no header: every document is a stage
    assert ok(validate(headless, tmp_path)).splitlines()[1:] == ["  stage 1 (a): 1 node(s) on local",
                                                                  "  stage 2 (stage-2): 1 node(s) on local"]
    refused(validate("name: p\nexecution: parallel\n---\nrun: x\n---\nrun: y\n", tmp_path),
            "task.yaml:1", "execution: parallel (SkyPilot's job groups) is not supported by gpuctl")
    refused(validate("name: p\n---\nname: a\nrun: x\n---\nname: a\nrun: y\n", tmp_path),
            "stage name(s) a given to more than one stage")
    path = tmp_path / "apply.yaml"
    path.write_text(pipe)
    proc = gpuctlfork.run(["apply", str(path)], cwd=tmp_path,
                          env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "a SkyPilot pipeline; `gpuctl jobs launch" in proc.stderr and "one managed job" in proc.stderr
    assert not (tmp_path / "state" / "clusters").exists()  # nothing was made
    proc = gpuctlfork.run(["jobs", "launch", str(path), "--num-nodes", "3"], cwd=tmp_path,
                          env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}, timeout=60)
    assert proc.returncode == 2 and "set num_nodes in each stage" in proc.stderr, proc.stderr
    assert not (tmp_path / "state" / "managed").exists()  # no job was made


def test_infra_flag_replaces_every_location_in_the_file(tmp_path: Path) -> None:
    text = "resources:\n  infra: gcp\n  accelerators: A100:8\n"
    assert "1 node(s) on aws, p4d.24xlarge, A100:8" in ok(validate(text, tmp_path, "--infra", "aws"))
    any_of = "resources:\n  accelerators: A100:8\n  any_of:\n    - infra: gcp\n    - infra: azure\n"
    assert "1 node(s) on aws, p4d.24xlarge, A100:8" in ok(validate(any_of, tmp_path, "--infra", "aws/us-west-2"))
    refused(validate(text, tmp_path, "--infra", "gcp"), "--infra 'gcp': not supported by gpuctl")


@pytest.mark.parametrize("where", ["infra: gcp", "infra: azure/eastus", "cloud: lambda", "infra: k8s/ctx"])
def test_other_clouds_are_not_supported_by_gpuctl(tmp_path: Path, where: str) -> None:
    refused(validate(f"resources:\n  {where}\n", tmp_path), "task.yaml:2", "not supported by gpuctl",
            "gpuctl provisions on aws, local")


def test_a_relative_path_found_in_both_places_says_which_it_took(tmp_path: Path) -> None:
    (tmp_path / "specs").mkdir()
    proc = validate("workdir: .\nrun: x\n", tmp_path, name="specs/task.yaml")  # cwd: tmp_path
    ok(proc)
    assert (f"warning: {tmp_path / 'specs' / 'task.yaml'}:1: workdir: '.' is {tmp_path}, from the current directory "
            f"as in SkyPilot, not {tmp_path / 'specs'}; run gpuctl in {tmp_path / 'specs'} for the latter") \
        in proc.stderr


# -- issue 34, item 13: SkyPilot's own examples that stopped validating, one test per class -------------


def test_a_deploy_key_may_go_into_ssh_but_not_over_its_login_files(tmp_path: Path) -> None:
    """examples/dvc/dvc_pipeline.yaml copies ~/.ssh/id_rsa(.pub) to the nodes: files of your own in
    ~/.ssh are fine; ~/.ssh whole, what ssh and sshd read there and gpuctl's own files there are not."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    for name in ("id_rsa", "id_rsa.pub", "authorized_keys"):
        (home / ".ssh" / name).write_text("key\n")
    (home / ".gitconfig").write_text("[user]\n")
    dvc = """name: dvc-pipeline
resources:
  accelerators: T4:1
  infra: aws/us-east-2
workdir: .
file_mounts:
  ~/.ssh/id_rsa: ~/.ssh/id_rsa
  ~/.ssh/id_rsa.pub: ~/.ssh/id_rsa.pub
  ~/.gitconfig: ~/.gitconfig
run: dvc pull
"""
    assert "1 node(s) on aws, g4dn.xlarge, T4:1" in ok(validate(dvc, tmp_path, home=home))
    refused(validate("file_mounts:\n  ~/.ssh: ~/.ssh\n", tmp_path, home=home), "task.yaml:2", "file_mounts.~/.ssh",
            "is ~/.ssh, which the system or gpuctl needs as it is; give each key its own file_mount")
    refused(validate("file_mounts:\n  ~/.ssh/authorized_keys: ~/.ssh/authorized_keys\n", tmp_path, home=home),
            "file_mounts.~/.ssh/authorized_keys", "is in ~/.ssh/authorized_keys")
    refused(validate("file_mounts:\n  /root/.ssh/gpuctl_cluster: ~/.ssh/id_rsa\n", tmp_path, home=home),
            "file_mounts./root/.ssh/gpuctl_cluster", "~/.ssh/gpuctl* are gpuctl's own files")


def test_a100_40gb_is_the_40_gb_a100_of_p4d(tmp_path: Path) -> None:
    for accel, itype in (("A100-40GB:8", "p4d.24xlarge"), ("A100:8", "p4d.24xlarge"), ("A100-80GB:8", "p4de.24xlarge"),
                         ("a100-40gb:8", "p4d.24xlarge"), ("L40S:4", "g6e.12xlarge"), ("T4g:1", "g5g.xlarge")):
        assert f"aws, {itype}, " in ok(validate(f"resources:\n  infra: aws\n  accelerators: {accel}\n", tmp_path))
    assert "A100-40GB:8" in ok(validate("resources:\n  accelerators: A100-40GB:8\n", tmp_path))  # local: known


def test_a_relative_destination_lands_where_skypilot_puts_it(tmp_path: Path) -> None:
    """examples/torch_ddp_benchmark: `./torch_ddp_benchmark.py: ./examples/...` lands in the directory
    run starts in (SkyPilot: ~/sky_workdir; gpuctl: ~/gpuctl_workdir); `..` out of the home, or into a
    reserved place, is still refused."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "torch_ddp_benchmark.py").write_text("print(1)\n")
    bench = """name: torch-ddp-bench
num_nodes: 2
resources:
  accelerators: A100:8
  use_spot: True
  infra: aws
file_mounts:
  ./torch_ddp_benchmark.py: ./examples/torch_ddp_benchmark.py
  data/x: ./examples/torch_ddp_benchmark.py
run: torchrun --nnodes 2 torch_ddp_benchmark.py
"""
    assert "2 node(s) on aws, p4d.24xlarge, A100:8" in ok(validate(bench, tmp_path))
    refused(validate("file_mounts:\n  ../../../etc/cron.d/job: ./task.yaml\n", tmp_path), "task.yaml:2",
            "climbs out of the home")
    refused(validate("file_mounts:\n  ../.ssh/config: ./task.yaml\n", tmp_path), "task.yaml:2",
            "(that is ~/.ssh/config) is in ~/.ssh/config")


def test_a_named_storage_with_a_local_source_is_uploaded_at_apply(tmp_path: Path) -> None:
    """examples/managed_job_with_storage.yaml: `name:` + local `source:` makes the bucket and fills it
    from the directory (at apply, never at validate); a missing or non-directory source is one line."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "tmp-workdir").mkdir()
    (tmp_path / "tmpfile").write_text("t\n")
    managed = """resources:
  cloud: aws
  use_spot: true
  job_recovery: failover
workdir: ./examples
file_mounts:
  ~/bucket_workdir:
    name: sky-workdir-zhwu
    source: ./examples
    persistent: false
    mode: COPY
  /imagenet-image:
    source: s3://sky-imagenet-data
  /tmp/workdir: ./tmp-workdir
  ~/a/b/c/tmpfile: ./tmpfile
"""
    assert "2 bucket mount(s)" in ok(validate(managed, tmp_path))
    for mode in ("MOUNT", "MOUNT_CACHED"):
        ok(validate(f"file_mounts:\n  /ckpt:\n    name: my-ckpt\n    source: ./examples\n    mode: {mode}\n",
                    tmp_path))
    refused(validate("file_mounts:\n  /d:\n    name: bkt-x\n    source: ./missing\n", tmp_path), "task.yaml:2",
            "file_mounts./d", "source './missing' is no local directory to upload")
    refused(validate("file_mounts:\n  /d:\n    name: bkt-x\n    source: ./tmpfile\n", tmp_path), "task.yaml:2",
            "file_mounts./d", "a file; give the directory to upload into the bucket")


def test_a_long_task_name_gets_a_cluster_name_aws_takes(tmp_path: Path) -> None:
    out = ok(validate("name: distributed-training-with-pytorch-lightning-and-ddp\nresources:\n  infra: aws\n"
                      "run: x\n", tmp_path))
    name = out.split("; cluster ", 1)[1].split()[0]
    assert len(name) <= 32 and name.startswith("distributed-training-with-"), out
    assert f"; cluster {name} (the task's name, shortened to 32 characters" in out
    short = ok(validate("name: My Task\nrun: x\n", tmp_path)).splitlines()[0]
    assert short.endswith("; cluster my-task"), short  # a name that fits is only cleaned


# SkyPilot's own pipelines (examples/spot_pipeline/*, llm/gpt-2/gpt2-pipeline.yaml,
# examples/chain_dag/2_jobs.yaml, tests/test_yamls/{pipeline,failed_run_pipeline}.yaml), in their
# shape: their headers, stages, fields and layout as written there; long scripts cut to a line.
SKYPILOT_PIPELINES = {
    "bert_qa_train_eval.yaml": (
        "name: bert_qa\n\n---\n\nname: train\n\nresources:\n    accelerators: V100:1\n\nworkdir: ~/transformers\n\n"
        "file_mounts:\n    /checkpoint:\n        name: test-bert-train-eval # NOTE: Fill in your bucket name\n"
        "        mode: MOUNT\n\nsetup: |\n    pip install -e .\n\nrun: |\n    python run_qa.py --run_name "
        "$SKYPILOT_TASK_ID --output_dir /checkpoint/bert_qa/$SKYPILOT_TASK_ID\n\nenvs:\n    WANDB_API_KEY: # NOTE\n\n"
        "---\n\nname: eval\n\nresources:\n    accelerators: T4:1\n\nworkdir: ~/transformers\n\nfile_mounts:\n"
        "    /checkpoint:\n        name: test-bert-train-eval\n        mode: MOUNT\n\nrun: |\n"
        "    FIRST_TASK_UNIQUE_ID=$(echo \"$SKYPILOT_TASK_IDS\" | sed -n 1p)\n\nenvs:\n    WANDB_API_KEY: # NOTE\n",
        ["train", "eval"]),
    "multi_jobs.yaml": (
        "name: pipeline\n\n---\nname: train1\n\nresources:\n  accelerators: V100:1\n\nnum_nodes: 2\n\nsetup: |\n"
        "  echo setup for train\n\nrun: |\n  echo train ends\n\n---\nname: train2\n\nresources:\n  accelerators: V100:1\n\n"
        "run: |\n  echo train ends\n\n---\n\nname: eval1\n\nresources:\n  accelerators: T4:1\n\nrun: |\n  echo eval\n\n"
        "---\n\nname: eval2\n\nresources:\n  accelerators: T4:4\n\nrun: |\n  echo eval ends\n",
        ["train1", "train2", "eval1", "eval2"]),
    "single.yaml": ("name: dag-name\n\n---\nname: simple-task\n\nresources:\n  cpus: 2+\n  memory: 8+\n\nsetup: |\n"
                    "  echo setup for task 1\n\nrun: |\n  echo run for task 1\n\n", ["simple-task"]),
    "gpt2-pipeline.yaml": (
        "name: gpt2-data\n\nenvs:\n  BUCKET_NAME: # TODO: Fill in your bucket name\n  BUCKET_STORE: s3 # Can be s3, gcs\n\n"
        "resources:\n  cpus: 8+\n\nfile_mounts:\n  /cache:\n    name: $BUCKET_NAME\n    store: $BUCKET_STORE\n"
        "    mode: MOUNT\n\nrun: |\n  python dev/data/fineweb.py --version 10B\n---\nname: gpt2-train\n\nenvs:\n"
        "  BUCKET_NAME: # TODO\n  BUCKET_STORE: s3\n\nresources:\n  accelerators: A100:8\n"
        "  image_id: docker:nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04\n  any_of:\n    - infra: lambda\n"
        "      image_id: null\n    - infra: aws\n    - infra: gcp\n    - infra: kubernetes\n  \nfile_mounts:\n"
        "  ~/.cache/huggingface:\n    name: $BUCKET_NAME\n    store: $BUCKET_STORE\n    mode: COPY\n\nrun: |\n"
        "  mpirun -np $SKYPILOT_NUM_GPUS_PER_NODE --allow-run-as-root ./train_gpt2cu\n", ["gpt2-data", "gpt2-train"]),
    "2_jobs.yaml": ("name: pipeline\n\n---\nname: train\n\nresources:\n  accelerators: V100:1\n\nnum_nodes: 2\n\n"
                    "run: |\n  echo train ends\n\n---\n\nname: eval\n\nresources:\n  accelerators: T4:1\n\nrun: |\n"
                    "  echo eval ends\n", ["train", "eval"]),
    "pipeline.yaml": ("name: pipeline\n\n---\nname: a\n\nresources:\n  cpus: 2+\n\nrun: |\n  echo train starts\n\n---\n"
                      "name: b\n\nresources:\n  cpus: 2+\n\nsetup: |\n  echo setup\n\nrun: |\n  echo train\n\n---\n\n"
                      "name: eval1\n\nresources:\n  cpus: 2+\n\nrun: |\n  echo eval\n\n---\n\nname: eval2\n\n"
                      "resources:\n  cpus: 2+\n\nrun: |\n  echo eval ends\n", ["a", "b", "eval1", "eval2"]),
    "failed_run_pipeline.yaml": (
        "name: pipeline\n\n---\nname: train1\n\nnum_nodes: 2\n\nsetup: |\n  echo setup for train\n\nrun: |\n"
        "  echo train ends\n\n---\nname: train2\n\nrun: |\n  echo train ends\n\n---\n\nname: eval1\n\nrun: |\n"
        "  echo eval starts\n  exit 1\n\n---\n\nname: eval2\n\nrun: |\n  echo eval ends\n",
        ["train1", "train2", "eval1", "eval2"]),
}


@pytest.mark.parametrize("name", sorted(SKYPILOT_PIPELINES))
def test_skypilots_pipelines_validate_stage_by_stage(tmp_path: Path, name: str) -> None:
    text, stages = SKYPILOT_PIPELINES[name]
    home = tmp_path / "home"
    (home / "transformers").mkdir(parents=True)  # the bert example's workdir, as its comment asks
    doc = json.loads(ok(validate(text, tmp_path, "-o", "json", name=name, home=home)))
    assert [s["name"] for s in doc["stages"]] == stages, doc
