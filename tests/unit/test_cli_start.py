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
NOT_FOR_HELP = ("pydantic", "yaml", "boto3", "botocore", "ansible", "ansible_runner", "jinja2",
                "rich", "cloudpickle", "importlib.metadata", "gpuctl.state", "gpuctl.providers", "gpuctl.provision",
                "gpuctl.configplane", "gpuctl.jobplane", "gpuctl.healthcheck", "gpuctl.managed", "gpuctl.api",
                "gpuctl.spec.models", "gpuctl.spec.loader", "gpuctl.spec.request", "gpuctl.common.config",
                "gpuctl.common.console", "gpuctl.dashboard", "starlette", "uvicorn")
# A job on a running cluster: the job plane, and none of the spec's models, Terraform, Ansible (a
# warm cluster is prepared already), the clouds' SDKs or rich (its output here is plain).
NOT_FOR_EXEC = ("pydantic", "boto3", "botocore", "ansible", "ansible_runner", "jinja2", "rich",
                "cloudpickle", "importlib.metadata", "gpuctl.spec.models", "gpuctl.spec.loader",
                "gpuctl.provision.provisioner", "gpuctl.provision.lifecycle", "gpuctl.provision.terraform",
                "gpuctl.provision.taskchecks", "gpuctl.managed.supervisor", "gpuctl.healthcheck", "gpuctl.api",
                "gpuctl.configplane.playbooks", "concurrent.futures", "logging")


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


# The program as installed: gpuctl.clistart.main (pyproject's [project.scripts]), which answers
# --version and a kept help before typer loads.
ENTRY_MODULES_AT_EXIT = MODULES_AT_EXIT.replace("import gpuctl.cli\n", "import gpuctl.clistart\n").replace(
    "gpuctl.cli.main()", "gpuctl.clistart.main()")


def entry_at_exit(tmp_path: Path, *argv: str, cache: Path, columns: int = 100,
                  ) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / f"modules-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_STATE_BUCKET")}
    env.update(PYTHONPATH=str(Path(gpuctl.__file__).resolve().parents[1]), HOME=str(tmp_path), COLUMNS=str(columns),
               GPUCTL_STATE_DIR=str(tmp_path / "state"), GPUCTL_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", ENTRY_MODULES_AT_EXIT, str(out), *argv], capture_output=True,
                          text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=60)
    assert out.exists(), f"no module list: exit {proc.returncode}\n{proc.stderr}"
    return proc, set(json.loads(out.read_text()))


def test_the_scripts_entry_is_clistart() -> None:
    project = (REPO / "pyproject.toml").read_text()
    assert 'gpuctl = "gpuctl.clistart:main"' in project
    assert "gpuctl.clistart" in (REPO / "cli" / "gpuctl" / "__main__.py").read_text()


def test_version_loads_no_command_tree(tmp_path: Path) -> None:
    proc, modules = entry_at_exit(tmp_path, "--version", cache=tmp_path / "cache")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"gpuctl {gpuctl.__version__}\n", "")
    assert not loaded(modules, ("typer", "click", "gpuctl.cli", *NOT_FOR_HELP)), sorted(modules)


@pytest.mark.parametrize("argv", [["--help"], [], ["jobs", "launch", "--help"], ["cost-report", "--help"]], ids=repr)
def test_a_help_once_rendered_is_printed_again_without_typer(tmp_path: Path, argv: list[str]) -> None:
    cache = tmp_path / "cache"
    first, first_modules = entry_at_exit(tmp_path, *argv, cache=cache)
    assert first.returncode == 0 and first.stdout.startswith("Usage: gpuctl"), first.stderr
    assert "typer" in first_modules  # rendered by click the first time
    [entry] = cache.glob("help-*.json")
    assert oct(entry.stat().st_mode & 0o777) == "0o600" and oct(cache.stat().st_mode & 0o777) == "0o700"
    again, modules = entry_at_exit(tmp_path, *argv, cache=cache)
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, first.stderr)
    assert not loaded(modules, ("typer", "click", "gpuctl.cli", *NOT_FOR_HELP)), sorted(modules)


def test_a_kept_help_follows_the_code_and_the_width(tmp_path: Path) -> None:
    """A module that made the help changed since (its mtime or size differs): rendered again; a
    terminal of another width has its own help."""
    cache = tmp_path / "cache"
    wide, _ = entry_at_exit(tmp_path, "exec", "--help", cache=cache, columns=120)
    [entry] = cache.glob("help-*.json")
    kept = json.loads(entry.read_text())
    cli_py = next(p for p in kept["made_by"] if p.endswith(os.path.join("gpuctl", "cli.py")))
    kept["made_by"][cli_py][0] -= 1  # as if cli.py had been edited since
    kept["text"] = "stale help\n"
    entry.write_text(json.dumps(kept))
    again, modules = entry_at_exit(tmp_path, "exec", "--help", cache=cache, columns=120)
    assert again.stdout == wide.stdout and "typer" in modules
    assert json.loads(entry.read_text())["text"] == wide.stdout  # kept again, as rendered now
    narrow, _ = entry_at_exit(tmp_path, "exec", "--help", cache=cache, columns=60)
    assert narrow.returncode == 0 and narrow.stdout != wide.stdout
    assert len(narrow.stdout.splitlines()[0]) <= 60 < len(wide.stdout.splitlines()[0])  # the usage line, wrapped
    assert len(list(cache.glob("help-*.json"))) == 2


def test_a_help_that_fails_or_cannot_be_kept_is_still_the_commands_own(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    helped, _ = entry_at_exit(tmp_path, "--help", cache=blocked / "cache")  # under a file: cannot be made
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: gpuctl") and helped.stderr == ""
    cache = tmp_path / "cache"
    wrong, _ = entry_at_exit(tmp_path, "nosuch", "--help", cache=cache)
    assert wrong.returncode == 2 and "error: no such command 'nosuch'" in wrong.stderr, wrong.stderr
    assert not list(cache.glob("help-*.json"))  # only a help that printed and exited 0 is kept
    options, _ = entry_at_exit(tmp_path, "status", "-o", "json", "--help", cache=cache)
    assert options.returncode == 0 and options.stdout.startswith("Usage: gpuctl status")
    assert not list(cache.glob("help-*.json"))  # words beyond command names: never from the cache
