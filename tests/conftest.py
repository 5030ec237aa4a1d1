"""Shared fixtures: an isolated gpuctl state dir, and Terraform pointed at the
local filesystem mirror of hashicorp/aws (no registry on CI machines)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Terraform asks checkpoint-api.hashicorp.com for news at every command unless told not to; the
# tests' commands (and the gpuctl commands they run, which pass it on) reach only loopback.
os.environ["CHECKPOINT_DISABLE"] = "1"


def find_provider_mirror() -> Path | None:
    """The directory holding `registry.terraform.io/hashicorp/aws/...`, if any."""
    candidates = [os.environ.get("GPUCTL_TF_MIRROR"), "/opt/tf-plugins", "/usr/share/terraform/plugins",
                  str(Path.home() / ".terraform.d/plugins")]
    for c in candidates:
        if c and (Path(c) / "registry.terraform.io/hashicorp/aws").is_dir():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def tf_cli_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Terraform CLI config that installs hashicorp/* only from the mirror."""
    if not shutil.which("terraform"):
        pytest.fail("terraform is not on PATH; `make test` expects it (see README)")
    mirror = find_provider_mirror()
    if mirror is None:
        pytest.fail("no filesystem mirror of hashicorp/aws found; set GPUCTL_TF_MIRROR to its directory")
    cfg = tmp_path_factory.mktemp("tfcli") / "terraformrc"
    cfg.write_text(
        "provider_installation {\n"
        f'  filesystem_mirror {{\n    path    = "{mirror}"\n    include = ["registry.terraform.io/hashicorp/*"]\n  }}\n'
        '  direct {\n    exclude = ["registry.terraform.io/hashicorp/*"]\n  }\n'
        "}\n"
    )
    return cfg


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own GPUCTL_STATE_DIR so nothing touches ~/.gpuctl."""
    state = tmp_path / "gpuctl-state"
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(state))
    return state


@pytest.fixture()
def state_bucket(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - Iterator[Remote]
    """Shared state in S3 without a network: moto in-process, with the bucket mototest.STATE_BUCKET
    under the prefix ci/gpuctl, and fake credentials for it."""
    import boto3
    from moto import mock_aws
    from mototest import STATE_BUCKET

    from gpuctl.state.remotestate import Remote
    from gpuctl.state.remotestate.settings import StateSettings
    from gpuctl.state.remotestate.store import S3Store

    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=STATE_BUCKET)
        settings = StateSettings(bucket=STATE_BUCKET, prefix="ci/gpuctl", lock_timeout=0)
        yield Remote(settings, S3Store(settings))


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[MotoServer]
    """One moto server on loopback for the session (tests that need a clean one reset it)."""
    from mototest import MotoServer

    server = MotoServer(log=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- running on several workers (pytest-xdist, `make test`) ------------------------------
#
# Tests that share a module-scoped fixture (a cluster brought up once for the module) are
# one unit of work, so each such cluster is made once, on one worker; every other test is
# scheduled on its own. Units go out longest first, so the suite does not end waiting on
# one slow module started last. Everything a test makes on this machine is its own:
# a state dir per test, local clusters' subnets from the machine-wide registry
# (providers/local), test hosts' bridges claimed by creating them (testhosts.py), and a
# moto server per worker.
#
# xdist's own `loadgroup` renames node ids, which pytest 9 no longer allows; so the workers
# write which tests go together (they collect; the controller does not) and the controller's
# scheduler reads it.

GROUPS_ENV = "GPUCTL_TEST_GROUPS_DIR"
# The modules whose units take longest (measured: `make test` prints the slowest tests).
SLOW_FIRST = (  # by the length of their longest unit (a module-fixture module is one unit)
    "integration/test_aws_moto.py",
    "integration/test_terraform_aws_module.py",
    "integration/test_e2e_local.py",
    "integration/test_playbooks.py",
    "integration/test_faults_local.py",
    "integration/test_jobs_local.py",
    "integration/test_bringup_local.py",
    "integration/test_jobplane_local.py",
    "integration/test_ansible_collection.py",
    "integration/test_buckets_local.py",
    "integration/test_cluster_ssh.py",
    "integration/test_remote_state.py",
    "integration/test_dashboard_local.py",
    "integration/test_autostop_local.py",
    "integration/test_ci_example.py",
    "integration/test_health_local.py",
    "integration/test_check_local.py",
    "integration/test_managed_local.py",
    "integration/test_hostkeys_local.py",
    "integration/test_api_local.py",
    "integration/test_containers_local.py",
    "integration/test_autostop_aws.py",
)


def _module_fixture_groups(items: list[pytest.Item]) -> dict[str, str]:
    """nodeid -> unit: tests of one module joined when they share a module-scoped fixture."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    shared: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        module = item.nodeid.split("::", 1)[0]
        names = [f"{module}::{name}" for name in item.fixturenames
                 if (defs := info.name2fixturedefs.get(name)) and defs[-1].scope in ("module", "package", "class")]
        if names:
            shared[item.nodeid] = names
            for other in names[1:]:
                parent[find(other)] = find(names[0])
    return {nodeid: find(names[0]) for nodeid, names in shared.items()}


def _rank(nodeid: str) -> int:
    path = nodeid.split("::", 1)[0].removeprefix("tests/")
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        import tempfile

        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="gpuctl-test-groups-")  # the workers inherit it


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or GROUPS_ENV not in os.environ:
        return  # one process: collection order, nothing to group
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (_rank(item.nodeid), order[item.nodeid]))
    groups = Path(os.environ[GROUPS_ENV])
    scratch = groups / f".{worker}.json"
    scratch.write_text(json.dumps(_module_fixture_groups(items)))
    scratch.rename(groups / f"{worker}.json")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class FixtureScopeScheduling(LoadScopeScheduling):
        """Units of work: the tests sharing a module fixture, else each test alone; in collection order."""

        _units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:
                found = sorted(Path(os.environ[GROUPS_ENV]).glob("gw*.json"))
                self._units = json.loads(found[0].read_text()) if found else {}
            return self._units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the slow-first order of the collection
    return FixtureScopeScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and GROUPS_ENV in os.environ:
        shutil.rmtree(os.environ.pop(GROUPS_ENV), ignore_errors=True)
