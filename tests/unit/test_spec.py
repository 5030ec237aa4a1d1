"""cluster.yaml -> Task: SkyPilot task YAMLs load, and every mistake is one line
naming the file, the line, the dotted field and what to write instead."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gpuctl.common.errors import UserError
from gpuctl.providers import resources_problem
from gpuctl.spec import Resources, Task, load_task as spec_load_task, parse_env_assignments
from gpuctl.spec.autostop import Autostop
from gpuctl.spec.infra import Infra
from gpuctl.spec.recovery import JobRecovery
from gpuctl.spec.request import request_from_task

SPECS = Path(__file__).resolve().parents[1] / "data" / "specs"


def load_task(path: str | Path, **kwargs: object) -> Task:
    """As `gpuctl` loads a task: with the providers' offline check of the resources."""
    return spec_load_task(path, resources_check=resources_problem, **kwargs)  # type: ignore[arg-type]


def test_without_the_providers_check_only_the_cloud_is_checked(tmp_path: Path) -> None:
    path = write(tmp_path, "resources:\n  infra: aws\n  accelerators: H800:8\n")
    assert spec_load_task(path).resources.accelerators == {"H800": 8.0}  # the provider refuses it later
    path = write(tmp_path, "resources:\n  any_of:\n    - {infra: aws, accelerators: H800:8}\n"
                           "    - {infra: aws, accelerators: H100:8}\n")
    assert load_task(path).resources.accelerators == {"H100": 8.0}


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(path: Path, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        load_task(path, **kwargs)  # type: ignore[arg-type]
    message = info.value.message
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------
# Valid task YAMLs, as SkyPilot's docs write them


def test_minimal_task_runs_locally() -> None:
    task = load_task(SPECS / "minimal.yaml")
    assert task.run == "echo hi"
    assert (task.name, task.num_nodes, task.workdir, task.setup) == (None, 1, None, None)
    assert task.envs == {} and task.secrets == {} and task.file_mounts == {}
    assert task.resources.infra_spec() == Infra("local")
    assert task.resources.accelerator_pair() == (None, 0.0)


def test_distributed_torchrun_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SPECS)
    task = load_task(SPECS / "distributed.yaml")
    assert task.name == "minGPT-ddp"
    assert task.num_nodes == 2
    assert task.workdir == SPECS
    assert task.resources.accelerator_pair() == ("A100", 8.0)
    assert task.resources.cpus == "4+"
    assert "${SKYPILOT_NODE_RANK}" in (task.run or "")
    assert task.setup is not None and task.setup.startswith("git clone")


def test_infra_with_zone_and_best_network() -> None:
    res = load_task(SPECS / "infra_zone.yaml").resources
    assert res.infra_spec() == Infra("aws", "us-east-1", "us-east-1a")
    assert (res.network_tier, res.instance_type, res.use_spot, res.disk_size) == ("best", "p4d.24xlarge", False, 512)
    assert res.image_id == "ami-0123456789abcdef0"


def test_legacy_cloud_and_region() -> None:
    res = load_task(SPECS / "legacy_cloud.yaml").resources
    assert res.infra_spec() == Infra("aws", "us-west-2")
    assert res.accelerator_pair() == ("V100", 4.0)
    assert res.memory == "32+"


def test_accelerator_mapping_any_of_ports_and_numeric_envs() -> None:
    task = load_task(SPECS / "h100_any_of.yaml", secret_overrides={"HF_TOKEN": "hf_abc"})
    res = task.resources
    # gpuctl provisions the first alternative, merged over the shared fields.
    assert res.infra_spec() == Infra("aws", "us-east-1")
    assert res.accelerator_pair() == ("H100", 8.0)
    assert [alt.infra for alt in res.any_of or []] == ["aws/us-east-1", "aws/us-west-2"]
    assert res.ports == ["8080"]
    # Numbers and booleans keep their text as written.
    assert task.envs == {"MODEL_NAME": "meta-llama/Llama-3.1-8B-Instruct", "MAX_MODEL_LEN": "8192",
                         "TEMPERATURE": "0.70", "DEBUG": "true"}
    assert task.secrets == {"HF_TOKEN": "hf_abc"}


def test_skypilot_extras_are_kept_or_ignored_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SPECS)
    task = load_task(SPECS / "skypilot_extras.yaml")
    res = task.resources
    assert res.instance_type == "g6.xlarge"  # first of `ordered`
    assert res.infra_spec() == Infra("aws")
    assert res.labels == {"team": "ml", "cost-center": "1234"}
    assert res.disk_tier == "high"
    assert set(res.ignored) == {"accelerator_args"}
    assert res.job_recovery == JobRecovery(max_restarts_on_errors=3)  # acted on by `gpuctl jobs launch`
    assert res.autostop == Autostop(idle_minutes=10, down=True)
    assert set(task.ignored) == {"service"}
    assert task.config == {"docker": {"run_options": ["--cap-add=SYS_ADMIN"]}}
    assert task.file_mounts == {"~/.config/extras.yaml": SPECS / "skypilot_extras.yaml", "/data/specs": SPECS}


@pytest.mark.parametrize("name", sorted(p.name for p in SPECS.glob("*.yaml")))
def test_every_example_feeds_the_cluster_request(name: str) -> None:
    """The contract cluster.py relies on: every example becomes a ClusterRequest."""
    task = load_task(SPECS / name, secret_overrides={"HF_TOKEN": "x"})
    request = request_from_task(task)
    assert request.num_nodes == task.num_nodes
    assert request.gpus_per_node == int(task.resources.accelerator_pair()[1])


@pytest.mark.parametrize("name", sorted(p.name for p in SPECS.glob("*.yaml")))
def test_a_dumped_task_validates_back_to_itself(name: str) -> None:
    """Others may store a Task as JSON (state db); reloading must not re-merge or drop fields."""
    task = load_task(SPECS / name, secret_overrides={"HF_TOKEN": "x"})
    assert Task.model_validate(task.model_dump()) == task
    assert Task.model_validate_json(task.model_dump_json()) == task


def test_empty_file_is_an_empty_task(tmp_path: Path) -> None:
    task = load_task(write(tmp_path, ""))
    assert task.run is None and task.resources.infra_spec() == Infra("local")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("A100:8", {"A100": 8.0}),
        ("a100:8", {"a100": 8.0}),  # case kept as written
        ("H100", {"H100": 1.0}),
        ("A100:0.5", {"A100": 0.5}),
        ("{A100: 8}", {"A100": 8.0}),
        ("{A100:8}", {"A100": 8.0}),  # YAML reads this as the key 'A100:8' with no value
        ("[V100:1, A100:1]", {"V100": 1.0, "A100": 1.0}),
        ("'{V100:1, A100:1}'", {"V100": 1.0, "A100": 1.0}),
        ("A100-80GB:8", {"A100-80GB": 8.0}),
    ],
)
def test_accelerator_forms(tmp_path: Path, value: str, expected: dict[str, float]) -> None:
    res = load_task(write(tmp_path, f"resources:\n  accelerators: {value}\n")).resources
    assert res.accelerators == expected
    name, count = res.accelerator_pair()
    assert (name, count) == next(iter(expected.items()))
    assert isinstance(count, float)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("cpus", "8", "8"), ("cpus", "'8+'", "8+"), ("cpus", "0.5", "0.5"), ("cpus", "4.0", "4"),
        ("memory", "32", "32"), ("memory", "32+", "32+"), ("memory", "64GB+", "64GB+"),
        ("disk_size", "256", 256), ("disk_size", "256GB", 256), ("disk_size", "1TB", 1024),
        ("network_tier", "BEST", "best"), ("use_spot", "null", False),
        ("ports", "[8080, '10020-10040']", ["8080", "10020-10040"]),
    ],
)
def test_resource_value_forms(tmp_path: Path, field: str, value: str, expected: object) -> None:
    res = load_task(write(tmp_path, f"resources:\n  {field}: {value}\n")).resources
    assert getattr(res, field) == expected


def test_any_of_choice_with_its_own_location_replaces_the_shared_one(tmp_path: Path) -> None:
    path = write(tmp_path, """
        resources:
          cloud: aws
          region: us-east-1
          accelerators: A100:8
          ordered:
            - infra: aws/us-west-2
            - accelerators: H100:8
        """)
    res = load_task(path).resources
    assert (res.infra, res.cloud, res.region) == ("aws/us-west-2", None, None)
    assert res.infra_spec() == Infra("aws", "us-west-2")
    assert res.accelerator_pair() == ("A100", 8.0)


def test_per_region_image_id_picks_the_region(tmp_path: Path) -> None:
    path = write(tmp_path, """
        resources:
          infra: aws/us-west-2
          image_id:
            us-east-1: ami-east
            us-west-2: ami-west
        """)
    assert load_task(path).resources.image_id == "ami-west"


def test_relative_paths_resolve_against_the_yaml_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "data.txt").write_text("x")
    path = write(project, """
        workdir: src
        file_mounts:
          /remote/data.txt: data.txt
          ~/here: ../project/./src
        """)
    monkeypatch.chdir(tmp_path)
    task = load_task("project/cluster.yaml")
    assert task.workdir == project / "src"
    assert task.file_mounts == {"/remote/data.txt": project / "data.txt", "~/here": project / "src"}
    assert all(p.is_absolute() for p in task.file_mounts.values())
    assert path.exists()


def test_relative_destinations_land_where_skypilot_puts_them(tmp_path: Path) -> None:
    """SkyPilot takes a relative destination: a local file's below the remote workdir (~/sky_workdir,
    where run starts), a bucket's below the home. gpuctl places them the same way (its workdir is
    ~/gpuctl_workdir, where run starts too) and keeps the canonical path."""
    (tmp_path / "bench.py").write_text("print(1)\n")
    path = write(tmp_path, """
        envs:
          SUB: data
        file_mounts:
          ./torch_ddp_benchmark.py: ./bench.py
          $SUB/x/../y: ./bench.py
          ../outside.py: ./bench.py
          ckpt:
            name: my-ckpt
          models: s3://my-models/llama
        """)
    task = load_task(path)
    assert task.file_mounts == {"~/gpuctl_workdir/torch_ddp_benchmark.py": tmp_path / "bench.py",
                                "~/gpuctl_workdir/data/y": tmp_path / "bench.py",
                                "~/outside.py": tmp_path / "bench.py"}
    assert {d: (m.dest, m.bucket) for d, m in task.bucket_mounts.items()} == {
        "~/ckpt": ("~/ckpt", "my-ckpt"), "~/models": ("~/models", "my-models")}


def test_an_upload_source_found_in_both_places_is_warned_at_its_file_mounts_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "sub" / "examples").mkdir(parents=True)
    path = write(tmp_path / "sub", "run: x\nfile_mounts:\n  /d:\n    name: bkt-x\n    source: ./examples\n")
    monkeypatch.chdir(tmp_path)
    task = load_task(path)
    assert task.bucket_mounts["/d"].upload == str(tmp_path / "examples")  # SkyPilot's: the current directory
    assert [w.split(": '")[0] for w in task.warnings] == [f"{path}:3: file_mounts./d"]


def test_envs_expand_in_workdir_and_file_mounts(tmp_path: Path) -> None:
    (tmp_path / "run-7").mkdir()
    path = write(tmp_path, """
        envs:
          RUN: run-7
        workdir: ${RUN}
        file_mounts:
          /mnt/$RUN: ./$RUN
        """)
    task = load_task(path)
    assert task.workdir == tmp_path / "run-7"
    assert task.file_mounts == {"/mnt/run-7": tmp_path / "run-7"}


def test_yaml_anchors_and_merge_keys_are_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, """
        envs: &common
          A: "1"
        secrets:
          <<: *common
          A: "2"
        """)
    task = load_task(path)
    assert task.envs == {"A": "1"} and task.secrets == {"A": "2"}


def test_task_and_resources_can_be_built_in_code() -> None:
    task = Task(name="t", num_nodes=2, resources=Resources(accelerators="A100:8", infra="aws/us-east-1"), run="x")
    assert task.resources.accelerator_pair() == ("A100", 8.0)
    assert task.resources.infra_spec() == Infra("aws", "us-east-1")


# ---------------------------------------------------------------------------
# Each mistake: the line, the dotted field, and what to write instead

ERRORS = [
    # (id, yaml, line, field, expected text in the message)
    ("unknown-field", "name: x\nnodes: 2\n", 2, "nodes", "unknown field; did you mean 'num_nodes'?"),
    ("unknown-in-resources", "resources:\n  infra: aws\n  accelerator: A100:8\n", 3,
     "resources.accelerator", "did you mean 'accelerators'?"),
    ("gpus-alias-checked-as-accelerators", "resources:\n  gpus: 8\n", 2, "resources.gpus", "expected NAME:COUNT"),
    ("gpus-and-accelerators", "resources:\n  gpus: A100:8\n  accelerators: A100:8\n", 2, "resources.gpus",
     "give either gpus or accelerators"),
    ("gpu-synonym", "resources:\n  gpu: 8\n", 2, "resources.gpu", "did you mean 'accelerators'?"),
    ("resources-field-at-top", "accelerators: A100:8\n", 1, "accelerators", "did you mean 'resources.accelerators'?"),
    ("top-field-in-resources", "resources:\n  num_nodes: 2\n", 2, "resources.num_nodes",
     "did you mean the top-level 'num_nodes'?"),
    ("unknown-without-guess", "zzzz: 1\n", 1, "zzzz", "unknown field"),
    ("num-nodes-zero", "run: x\nnum_nodes: 0\n", 2, "num_nodes", "must be a positive int, got 0"),
    ("num-nodes-negative", "num_nodes: -3\n", 1, "num_nodes", "must be a positive int, got -3"),
    ("num-nodes-bool", "num_nodes: true\n", 1, "num_nodes", "must be a positive int, got true"),
    ("num-nodes-string", "num_nodes: '2'\n", 1, "num_nodes", "got '2' (a string; remove the quotes)"),
    ("num-nodes-float", "num_nodes: 2.5\n", 1, "num_nodes", "must be a positive int, got 2.5"),
    ("accel-not-a-number", "name: x\nrun: y\nresources:\n  infra: aws\n  cpus: 8\n  accelerators: A100:x\n", 6,
     "resources.accelerators", "'A100:x' is not a valid accelerator; write NAME:COUNT such as A100:8"),
    ("accel-zero", "resources:\n  accelerators: A100:0\n", 2, "resources.accelerators",
     "'A100:0': accelerator count must be a positive number"),
    ("accel-negative", "resources:\n  accelerators: {A100: -2}\n", 2, "resources.accelerators",
     "accelerator count must be a positive number"),
    ("accel-fraction-above-one", "resources:\n  accelerators: A100:1.5\n", 2, "resources.accelerators",
     "'A100:1.5': a fractional accelerator count must be below 1"),
    ("accel-two-colons", "resources:\n  accelerators: A100:8:2\n", 2, "resources.accelerators",
     "is not a valid accelerator"),
    ("accel-empty-name", "resources:\n  accelerators: ':8'\n", 2, "resources.accelerators",
     "is not a valid accelerator"),
    ("accel-number", "resources:\n  accelerators: 8\n", 2, "resources.accelerators", "write NAME:COUNT"),
    ("workdir-missing", "workdir: ./nope\n", 1, "workdir", "must be a valid directory"),
    ("workdir-is-file", "workdir: cluster.yaml\n", 1, "workdir", "must be a valid directory"),
    ("mount-source-missing", "run: x\nfile_mounts:\n  /data: ./missing\n", 3, "file_mounts./data",
     "does not exist locally"),
    # a relative destination is SkyPilot's: a local file's in the workdir, a bucket's in the home (test below);
    # one whose `..` climbs out of the home, or into a reserved place, is refused as that place
    ("mount-relative-climbs-out", "file_mounts:\n  /ok: .\n  ../../etc/cron.d/x: .\n", 3,
     "file_mounts.../../etc/cron.d/x", "~/gpuctl_workdir/../../etc/cron.d/x: '..' climbs out of the home"),
    ("mount-relative-into-ssh", "file_mounts:\n  ../.ssh/authorized_keys: .\n", 2,
     "file_mounts.../.ssh/authorized_keys", "(that is ~/.ssh/authorized_keys) is in ~/.ssh/authorized_keys"),
    ("mount-relative-workdir", "file_mounts:\n  ./: .\n", 2, "file_mounts../",
     "(that is ~/gpuctl_workdir) is ~/gpuctl_workdir, where gpuctl copies the workdir"),
    ("mount-s3-bad-bucket", "file_mounts:\n  /data: s3://Bad_Bucket/path\n", 2, "file_mounts./data",
     "'Bad_Bucket' is not an S3 bucket name"),
    ("mount-gs", "file_mounts:\n  /data: gs://bucket\n", 2, "file_mounts./data",
     "gcs (gs://) sources are not supported by gpuctl; use an s3:// bucket"),
    ("mount-store-gcs", "file_mounts:\n  /data:\n    name: bkt\n    store: gcs\n", 2, "file_mounts./data",
     "store: gcs is not supported by gpuctl"),
    ("mount-bad-mode", "file_mounts:\n  /data:\n    source: s3://bkt\n    mode: STREAM\n", 2, "file_mounts./data",
     "'STREAM' is not a storage mode; use COPY, MOUNT, MOUNT_CACHED"),
    # name: with a local source: SkyPilot's upload (the bucket is made and filled before the job)
    ("mount-upload-missing", "file_mounts:\n  /data:\n    name: bkt\n    source: ./nope\n", 2, "file_mounts./data",
     "source './nope' is no local directory to upload: "),
    ("mount-upload-file", "file_mounts:\n  /data:\n    name: bkt\n    source: cluster.yaml\n", 2, "file_mounts./data",
     "source 'cluster.yaml' is "),
    ("mount-upload-unnamed", "file_mounts:\n  /data:\n    source: .\n    mode: COPY\n", 2, "file_mounts./data",
     "source '.' is a local directory: give name: BUCKET"),
    ("mount-upload-list", "file_mounts:\n  /data:\n    name: bkt\n    source: [., ..]\n", 2, "file_mounts./data",
     "a list of sources is not supported by gpuctl"),
    ("mount-upload-bad-name", "file_mounts:\n  /data:\n    name: Bad_Bucket\n    source: .\n", 2,
     "file_mounts./data", "'Bad_Bucket' is not an S3 bucket name"),
    ("mount-nothing", "file_mounts:\n  /data:\n    mode: COPY\n", 2, "file_mounts./data",
     "needs source: s3://BUCKET/PATH or name: BUCKET"),
    ("git-workdir-option-url", "workdir:\n  url: -oProxyCommand=touch /tmp/x\n", 2, "workdir.url", "is not a git URL"),
    ("git-workdir-option-ref", "workdir:\n  url: https://github.com/a/b.git\n  ref: --upload-pack=x\n", 3,
     "workdir.ref", "is not a branch, tag or commit"),
    ("git-workdir-unknown-key", "workdir:\n  url: https://github.com/a/b.git\n  branch: main\n", 3,
     "workdir.branch", "unknown field"),
    ("bucket-relative-into-ssh", "file_mounts:\n  .ssh/config: s3://bkt/c\n", 2, "file_mounts..ssh/config",
     "~/.ssh/config is in ~/.ssh/config"),
    ("env-key-digit", "envs:\n  OK: 1\n  1BAD: x\n", 3, "envs.1BAD", "'1BAD' is not a valid variable name"),
    ("env-key-dash", "envs:\n  MY-VAR: x\n", 2, "envs.MY-VAR", "not a valid variable name"),
    ("env-null", "envs:\n  DATA_DIR:\n", 2, "envs.DATA_DIR", "no value; set one in envs or pass --env DATA_DIR=VALUE"),
    ("env-list-value", "envs:\n  X: [1, 2]\n", 2, "envs.X", "expected a string, got a list"),
    ("envs-not-mapping", "envs:\n  - A=1\n", 1, "envs", "expected a mapping of NAME: value"),
    ("run-list", "run:\n  - echo hi\n", 1, "run", "expected a shell script as a string, got a list; write 'run: |'"),
    ("setup-number", "setup: 5\n", 1, "setup", "expected a shell script as a string"),
    ("network-tier", "resources:\n  network_tier: fastest\n", 2, "resources.network_tier",
     "'fastest' is not a network tier; use standard or best"),
    ("infra-bad-region", "resources:\n  infra: aws/moon-1\n", 2, "resources.infra",
     "'moon-1' is not an AWS region name"),
    ("infra-other-cloud", "resources:\n  infra: gcp/us-central1\n", 2, "resources.infra",
     "gcp is not supported by gpuctl; gpuctl provisions on aws, local"),
    ("infra-unknown-cloud", "resources:\n  infra: mars/x\n", 2, "resources.infra", "unknown infra 'mars'"),
    ("infra-kubernetes", "resources:\n  infra: k8s/my-context\n", 2, "resources.infra",
     "Kubernetes is not supported by gpuctl"),
    ("aws-unknown-accelerator", "resources:\n  infra: aws\n  accelerators: H800:8\n", 3, "resources.accelerators",
     "no AWS instance type known for it"),
    ("aws-cpus-no-type", "resources:\n  infra: aws\n  cpus: 3\n", 3, "resources.cpus",
     "no AWS c6i/m6i/r6i instance type has cpus 3"),
    ("infra-wrong-zone", "resources:\n  infra: aws/us-east-1/us-west-2a\n", 2, "resources.infra",
     "is not a zone of us-east-1"),
    ("infra-and-cloud", "resources:\n  infra: aws\n  cloud: aws\n", 3, "resources.cloud",
     "give either infra or cloud/region/zone, not both"),
    ("legacy-bad-region", "resources:\n  cloud: aws\n  region: mars-1\n", 3, "resources.region",
     "'mars-1' is not an AWS region name"),
    ("legacy-region-without-cloud", "resources:\n  region: us-east-1\n", 2, "resources.region", "needs cloud"),
    ("alternative-bad-infra", "resources:\n  any_of:\n    - infra: aws\n    - infra: mars\n", 4,
     "resources.any_of.1.infra", "unknown infra 'mars'"),
    ("no-alternative-gpuctl-can-provision", "resources:\n  any_of:\n    - infra: gcp\n    - infra: azure\n", 2,
     "resources.any_of", "none of the 2 alternatives can be provisioned by gpuctl: 1 ('gcp': not supported"),
    ("any-of-and-ordered", "resources:\n  any_of: [{infra: aws}]\n  ordered: [{infra: aws}]\n", 3,
     "resources.ordered", "not both"),
    ("disk-zero", "resources:\n  disk_size: 0\n", 2, "resources.disk_size", "0 is not a positive whole number of GB"),
    ("disk-negative", "resources:\n  disk_size: -10\n", 2, "resources.disk_size", "not a positive whole number of GB"),
    ("disk-words", "resources:\n  disk_size: big\n", 2, "resources.disk_size", "not a positive whole number of GB"),
    ("cpus-words", "resources:\n  cpus: lots\n", 2, "resources.cpus", "'lots' is not a positive number or N+"),
    ("cpus-zero", "resources:\n  cpus: 0\n", 2, "resources.cpus", "not a positive number or N+"),
    ("memory-words", "resources:\n  memory: plenty+\n", 2, "resources.memory", "not a positive number or N+"),
    ("memory-list", "resources:\n  memory: [1]\n", 2, "resources.memory", "expected a number or N+"),
    ("use-spot-string", "resources:\n  use_spot: 'yes'\n", 2, "resources.use_spot", "expected true or false"),
    ("port-out-of-range", "resources:\n  ports: [8080, 70000]\n", 2, "resources.ports.1", "70000 is not a port"),
    ("image-other-region", "resources:\n  infra: aws/us-west-2\n  image_id: {us-east-1: ami-1}\n", 3,
     "resources.image_id", "no image for region us-west-2 (images are given for us-east-1)"),
    ("name-number", "name: 5\n", 1, "name", "expected a string, got 5"),
    ("resources-list", "resources:\n  - infra: aws\n", 1, "resources", "expected a mapping"),
    ("volumes", "run: x\nvolumes:\n  /v: vol\n", 2, "volumes", "volumes are not supported by gpuctl"),
    ("managed-secrets", "managed_secrets: [HF]\n", 1, "managed_secrets", "need SkyPilot's API server"),
    ("ignored-is-not-a-yaml-field", "run: x\nignored: {}\n", 2, "ignored", "unknown field"),
]


@pytest.mark.parametrize(("text", "line", "field", "expected"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_names_line_field_and_fix(tmp_path: Path, text: str, line: int, field: str, expected: str) -> None:
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'cluster.yaml'}:{line}: {field}: "), message
    assert expected in message


def test_message_shape_matches_the_issue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "name: x\nnum_nodes: 2\nresources:\n  infra: aws\n  cpus: 8+\n\n  accelerators: A100:x\n")
    assert error_of(Path("cluster.yaml")) == (
        "cluster.yaml:7: resources.accelerators: 'A100:x' is not a valid accelerator; write NAME:COUNT such as A100:8"
    )


def test_several_problems_are_each_named_in_file_order(tmp_path: Path) -> None:
    """No problem hides behind a count: each has its own line with its file:line and field, the
    first line being the one a single problem gives (issue 34, item 12)."""
    path = write(tmp_path, "foo: 1\nrun: 5\nnum_nodes: 0\nresources:\n  network_tier: fastest\n")
    with pytest.raises(UserError) as info:
        load_task(path)
    lines = info.value.message.split("\n")
    where = tmp_path / "cluster.yaml"
    assert lines == [
        f"{where}:1: foo: unknown field",
        f"  {where}:2: run: expected a shell script as a string, got a whole number; write 'run: |' and the "
        "commands on the lines below",
        f"  {where}:3: num_nodes: must be a positive int, got 0",
        f"  {where}:5: resources.network_tier: 'fastest' is not a network tier; use standard or best",
    ]
    assert "more problem" not in info.value.message


def test_several_problems_keep_secret_values_out(tmp_path: Path) -> None:
    path = write(tmp_path, "secrets:\n  TOKEN: hunter2-secret\nnum_nodes: 0\nworkdir: ./hunter2-secret\n")
    with pytest.raises(UserError) as info:
        load_task(path)
    assert len(info.value.message.split("\n")) == 2 and "hunter2-secret" not in info.value.message


def test_missing_file(tmp_path: Path) -> None:
    assert error_of(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: no such file; task YAML file expected there"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert "is a directory" in error_of(tmp_path)


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("name: x\nrun: [echo\n", "3:1", "YAML syntax error"),
        ("name: x\n  bad: y\n", "2:6", "YAML syntax error: mapping values are not allowed here"),
        ("name: x\n\trun: y\n", "2:1", "indent with spaces, not tabs"),
        ("run: a\n---\nrun: b\n", "2:1", "more than one YAML document"),
        ("run: !Ref x\n", "1:6", "could not determine a constructor"),
    ],
)
def test_yaml_errors_give_line_and_column(tmp_path: Path, text: str, where: str, expected: str) -> None:
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'cluster.yaml'}:{where}: ")
    assert expected in message


@pytest.mark.parametrize(("text", "kind"), [("- run: x\n", "a list"), ("just words\n", "a string"), ("42\n", "a whole number")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    assert error_of(write(tmp_path, text)) == (
        f"{tmp_path / 'cluster.yaml'}:1: the top level must be a mapping of task fields "
        f"(name, resources, run, ...), not {kind}"
    )


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "run: a\nname: b\nrun: c\n"))
    assert message == f"{tmp_path / 'cluster.yaml'}:3: run: duplicate key (first on line 1); give each field once"


# ---------------------------------------------------------------------------
# --env / --secret overrides


def test_env_overrides_fill_replace_and_extend(tmp_path: Path) -> None:
    path = write(tmp_path, "envs:\n  NEEDED: null\n  KEPT: a\n  REPLACED: b\n")
    task = load_task(path, env_overrides={"NEEDED": "1", "REPLACED": "c", "EXTRA": ""})
    assert task.envs == {"NEEDED": "1", "KEPT": "a", "REPLACED": "c", "EXTRA": ""}


def test_env_overrides_without_envs_section(tmp_path: Path) -> None:
    assert load_task(write(tmp_path, "run: x\n"), env_overrides={"A": "1"}).envs == {"A": "1"}


def test_env_override_name_is_validated(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "run: x\n"), env_overrides={"BAD-NAME": "1"})
    assert message.startswith("--env BAD-NAME: not a valid variable name")


def test_secret_override_fills_null_secret(tmp_path: Path) -> None:
    path = write(tmp_path, "secrets:\n  HF_TOKEN: null\n")
    assert load_task(path, secret_overrides={"HF_TOKEN": "hf_x"}).secrets == {"HF_TOKEN": "hf_x"}
    assert "pass --secret HF_TOKEN=VALUE" in error_of(path)


@pytest.mark.parametrize("name", ["A", "_x", "PATH_2", "lower_case"])
def test_valid_env_names(tmp_path: Path, name: str) -> None:
    assert load_task(write(tmp_path, f"envs:\n  {name}: v\n")).envs == {name: "v"}


@pytest.mark.parametrize("name", ["2X", "A-B", "A.B", "A B", "'É'", "''"])
def test_invalid_env_names(tmp_path: Path, name: str) -> None:
    assert "not a valid variable name" in error_of(write(tmp_path, f"envs:\n  {name}: v\n"))


def test_parse_env_assignments() -> None:
    environ = {"HOME_DIR": "/home/me"}
    items = ["A=1", "B=", "C=x=y", "HOME_DIR", "A=2"]
    assert parse_env_assignments(items, environ=environ) == {"A": "2", "B": "", "C": "x=y", "HOME_DIR": "/home/me"}


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("=1", "--env =1: missing NAME before '='"),
        ("1A=x", "--env 1A=x: not NAME=VALUE with a valid NAME"),
        ("UNSET_VAR", "--env UNSET_VAR: UNSET_VAR is not set in your environment; write --env UNSET_VAR=VALUE"),
    ],
)
def test_parse_env_assignments_errors(item: str, expected: str) -> None:
    with pytest.raises(UserError) as info:
        parse_env_assignments([item], environ={})
    assert info.value.message.startswith(expected)


# ---------------------------------------------------------------------------
# Secrets never appear in messages

SECRET = "hf_s3cr3t_VALUE"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (f"secrets:\n  HF_TOKEN: {SECRET}\n  BAD-NAME: {SECRET}\n", "secrets.BAD-NAME"),
        (f"secrets:\n  HF_TOKEN: [{SECRET}]\n", "secrets.HF_TOKEN"),
        (f"secrets:\n  HF_TOKEN: {{v: {SECRET}}}\n", "secrets.HF_TOKEN"),
        (f"secrets:\n  TOK: {SECRET}\nfile_mounts:\n  /x: /nonexistent/${{TOK}}\n", "file_mounts./x"),
        (f"secrets:\n  TOK: {SECRET}\nworkdir: /nonexistent/$TOK\n", "workdir"),
        (f"secrets:\n  - secrets:{SECRET}\n", "secrets"),
    ],
    ids=["bad-name", "list-value", "mapping-value", "expanded-in-file-mount", "expanded-in-workdir", "managed-ref"],
)
def test_secret_values_are_never_echoed(tmp_path: Path, text: str, field: str) -> None:
    message = error_of(write(tmp_path, text))
    assert f": {field}: " in message
    assert SECRET not in message


def test_secret_override_value_is_never_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, "file_mounts:\n  /x: /nonexistent/$TOK\n")
    message = error_of(path, secret_overrides={"TOK": SECRET})
    assert "file_mounts./x" in message and SECRET not in message


def test_secret_not_in_repr(tmp_path: Path) -> None:
    task = load_task(write(tmp_path, f"secrets:\n  HF_TOKEN: {SECRET}\n"))
    assert task.secrets == {"HF_TOKEN": SECRET}
    assert SECRET not in repr(task) and SECRET not in str(task)


def test_malformed_secret_flag_is_not_quoted() -> None:
    with pytest.raises(UserError) as info:
        parse_env_assignments([SECRET.replace("_", "-")], flag="--secret", secret=True, environ={})
    assert info.value.message.startswith("--secret #1: ")
    assert SECRET.replace("_", "-") not in info.value.message


def test_per_region_image_without_region_takes_the_first_region(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  infra: aws\n  image_id:\n    us-west-2: ami-0abc\n    us-east-1: ami-0def\n")
    res = load_task(path).resources
    assert (res.infra_spec().region, res.image_id) == ("us-west-2", "ami-0abc")


def test_skypilot_image_tags_boot_the_default_ami_with_a_warning(tmp_path: Path) -> None:
    from gpuctl.spec.request import request_from_task

    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  infra: aws\n  image_id: skypilot:gpu-ubuntu-2204\n")
    task = load_task(path)
    assert request_from_task(task).image_id is None
    assert any("resources.image_id: ignored; SkyPilot's own images" in w for w in task.warnings)
    path.write_text("resources:\n  infra: aws\n  image_id: docker:ubuntu:24.04\n")
    task = load_task(path)
    assert (task.container_image, request_from_task(task).image_id) == ("ubuntu:24.04", None)
