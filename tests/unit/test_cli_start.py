"""gpuctl starts fast: what a command loads before it runs is what it needs (issue 36).

Timing is benchmarks/start.py's job; these check the shape that makes it fast: which modules a
fresh interpreter holds once `gpuctl --help`, `--version` or `exec` ran, and that `--version`
needs no package metadata.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuctl

REPO = Path(__file__).resolve().parents[2]


def test_version_is_pyprojects() -> None:
    """`gpuctl --version` prints gpuctl.__version__ instead of reading the installed metadata
    (importlib.metadata costs every run some 16 ms): the two must be the same version."""
    project = (REPO / "pyproject.toml").read_text().split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert found is not None, "pyproject.toml's [project] has no version"
    assert gpuctl.__version__ == found.group(1), "set gpuctl.__version__ (cli/gpuctl/__init__.py) to pyproject's version"


def names(app: object) -> list[str]:
    return [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]  # type: ignore[attr-defined]


def test_click_builds_only_the_command_argv_reaches() -> None:
    from gpuctl import usage
    from gpuctl.cli import app

    everything = names(app)
    assert names(usage.reachable(app, ["exec", "demo", "--", "true"])) == ["exec"]
    assert names(usage.reachable(app, ["jobs", "queue"])) == ["jobs"]
    assert names(usage.reachable(app, ["--version"])) == []
    for argv in (["--help"], ["--version", "--help"], ["--help", "exec"], ["exce", "demo"], []):
        assert names(usage.reachable(app, argv)) == everything, argv
    assert names(app) == everything  # the app itself is left as it was


def test_a_command_reached_alone_has_the_same_help() -> None:
    import typer.main

    from gpuctl import usage
    from gpuctl.cli import app

    def help_of(root: object, word: str) -> str:
        group = typer.main.get_command(root)  # type: ignore[arg-type]
        ctx = group.make_context("gpuctl", [], resilient_parsing=True)
        command = group.get_command(ctx, word)  # type: ignore[attr-defined]
        return command.get_help(command.make_context(word, [], parent=ctx, resilient_parsing=True))

    for word in ("exec", "apply", "logs", "autostop", "jobs"):
        assert help_of(usage.reachable(app, [word, "--help"]), word) == help_of(app, word)


# What a fresh `python -m gpuctl ...` holds in sys.modules at its exit: the script runs gpuctl's own
# main() (its exit codes, its streams) and writes the module names to the file given first.
MODULES_AT_EXIT = """
import atexit, json, sys
out, sys.argv = sys.argv[1], ["gpuctl", *sys.argv[2:]]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
import gpuctl.cli
if sys.argv[1:] == ["import-only"]:
    sys.exit(0)
gpuctl.cli.main()
"""

# Heavy or beside the point for a command that only reads its arguments: the libraries
# (pydantic 60 ms, yaml, boto3, ansible, Terraform's wrapper, rich) and every layer below the CLI.
NOT_FOR_HELP = ("pydantic", "yaml", "boto3", "botocore", "ansible", "ansible_runner", "python_terraform", "jinja2",
                "rich", "cloudpickle", "importlib.metadata", "gpuctl.state", "gpuctl.providers", "gpuctl.provision",
                "gpuctl.configplane", "gpuctl.jobplane", "gpuctl.healthcheck", "gpuctl.managed", "gpuctl.api",
                "gpuctl.spec.models", "gpuctl.spec.loader", "gpuctl.spec.request", "gpuctl.common.config",
                "gpuctl.common.console")
# A job on a running cluster: the job plane, and none of the spec's models, Terraform, Ansible (a
# warm cluster is prepared already), the clouds' SDKs or rich (its output here is plain).
NOT_FOR_EXEC = ("pydantic", "boto3", "botocore", "ansible", "ansible_runner", "python_terraform", "jinja2", "rich",
                "cloudpickle", "importlib.metadata", "gpuctl.spec.models", "gpuctl.spec.loader",
                "gpuctl.provision.provisioner", "gpuctl.provision.lifecycle", "gpuctl.provision.terraform",
                "gpuctl.provision.taskchecks", "gpuctl.managed.supervisor", "gpuctl.healthcheck", "gpuctl.api")


def modules_at_exit(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / f"modules-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_STATE_BUCKET")}
    env.update(PYTHONPATH=str(Path(gpuctl.__file__).resolve().parents[1]), HOME=str(tmp_path),
               GPUCTL_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.run([sys.executable, "-c", MODULES_AT_EXIT, str(out), *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=60)
    assert out.exists(), f"no module list: exit {proc.returncode}\n{proc.stderr}"
    return proc, set(json.loads(out.read_text()))


def loaded(modules: set[str], heavy: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in heavy))


@pytest.mark.parametrize("argv", [["import-only"], ["--help"], ["--version"], []], ids=repr)
def test_help_and_version_load_no_layer_below_the_cli(tmp_path: Path, argv: list[str]) -> None:
    proc, modules = modules_at_exit(tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr
    assert "gpuctl.cli" in modules
    assert not loaded(modules, NOT_FOR_HELP), f"gpuctl {' '.join(argv)} loaded {loaded(modules, NOT_FOR_HELP)}"


def test_exec_loads_the_job_plane_and_nothing_of_provisioning(tmp_path: Path) -> None:
    proc, modules = modules_at_exit(tmp_path, "exec", "nosuch", "--", "true")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == ["error: cluster 'nosuch' not found; `gpuctl status` lists the clusters you have"]
    # What exec runs a job with (imported before the cluster is looked up), so this is its whole import graph.
    assert {"gpuctl.jobplane.runner", "gpuctl.state.registry", "gpuctl.provision.inventory"} <= modules
    assert not loaded(modules, NOT_FOR_EXEC), f"gpuctl exec loaded {loaded(modules, NOT_FOR_EXEC)}"
