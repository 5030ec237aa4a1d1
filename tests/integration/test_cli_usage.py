"""Mistyped commands through the installed `gpuctl` console script, as a user
types them: the usage line, one `error:` line naming what was wrong, exit 2,
no traceback. Runs on whatever typer/click the environment resolved, so
`make test-min` and `make test-latest` check every bound of the ranges."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

GPUCTL = Path(sys.executable).parent / "gpuctl"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert GPUCTL.exists(), f"the console script is not installed next to {sys.executable}"
    return subprocess.run([str(GPUCTL), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=os.environ.copy(), stdin=subprocess.DEVNULL)


# argv -> fragments the error line must contain
USAGE_ERRORS = {
    "unknown-option": (["--bogus"], ["--bogus"]),
    "unknown-command": (["nosuchcmd"], ["nosuchcmd"]),
    "apply-without-file": (["apply"], ["FILE"]),
    "exec-without-name": (["exec"], ["NAME"]),
    "apply-unknown-option": (["apply", "--bogus", "x.yaml"], ["--bogus"]),
    "logs-too-many-arguments": (["logs", "a", "1", "c", "d"], ["unexpected extra argument"]),
    "logs-job-not-an-int": (["logs", "a", "b", "c", "d"], ["JOB"]),
    "num-nodes-not-an-int": (["apply", "--num-nodes", "two", "x.yaml"], ["--num-nodes"]),
    "rank-not-an-int": (["ssh", "c", "--rank", "x"], ["--rank"]),
    "flag-given-a-value": (["status", "--refresh=yes"], ["--refresh"]),
    "option-missing-value": (["apply", "x.yaml", "--infra"], ["--infra"]),
    "dashes-alone": (["--"], ["--"]),
    "dashes-after-apply": (["apply", "x.yaml", "--", "echo"], ["apply", "--"]),
    "dashes-after-queue": (["queue", "c", "--", "x"], ["queue", "--"]),
    "exec-dashes-without-name": (["exec", "--", "true"], ["NAME"]),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_is_usage_line_and_one_error_line(case: str, tmp_path: Path):
    argv, fragments = USAGE_ERRORS[case]
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("Usage: gpuctl"), lines
    assert lines[1].startswith("error: "), lines
    for fragment in fragments:
        assert fragment.lower() in lines[1].lower(), lines[1]
    assert not (tmp_path / "gpuctl-state").exists() or not any((tmp_path / "gpuctl-state").rglob("*.tfstate"))


def test_version_comes_from_package_metadata(tmp_path: Path):
    proc = run("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"gpuctl {version('gpuctl')}"


@pytest.mark.parametrize("argv", [["--help"], ["apply", "--help"], ["exec", "--help"], ["logs", "--help"]])
def test_help_names_values_not_python_types(argv: list[str], tmp_path: Path):
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: gpuctl")
    options = proc.stdout[proc.stdout.index("Options:"):]
    for python_type in ("<bool>", "<str>", "<int>", "<list[str]>"):
        assert python_type not in options, options
    if argv == ["apply", "--help"]:
        assert "--env K=V" in proc.stdout and "--num-nodes N" in proc.stdout


def test_no_arguments_prints_help_not_an_error(tmp_path: Path):
    proc = run(cwd=tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Usage: gpuctl" in proc.stdout + proc.stderr
    assert proc.returncode in (0, 2)
