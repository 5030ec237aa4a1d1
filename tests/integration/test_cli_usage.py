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

import gpuctlfork
import pytest

GPUCTL = Path(sys.executable).parent / "gpuctl"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """What the console script runs (gpuctl.clistart.main), forked (tests/gpuctlfork.py);
    test_the_console_script_runs_the_same_program checks the script itself."""
    return gpuctlfork.run(args, cwd=cwd, timeout=60, env=os.environ.copy())


@pytest.mark.parametrize("argv", [["--bogus"], ["apply"], ["--version"]])
def test_the_console_script_runs_the_same_program(argv: list[str], tmp_path: Path) -> None:
    assert GPUCTL.exists(), f"the console script is not installed next to {sys.executable}"
    script = subprocess.run([str(GPUCTL), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env=os.environ.copy(), stdin=subprocess.DEVNULL)
    forked = run(*argv, cwd=tmp_path)
    assert (script.returncode, script.stdout, script.stderr) == (forked.returncode, forked.stdout, forked.stderr)


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
    "logs-tail-negative": (["logs", "c", "--tail", "-1"], ["--tail"]),
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
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)  # as `sky` does
    assert proc.stdout.startswith("Usage: gpuctl [OPTIONS] COMMAND") and "error" not in proc.stdout


def commands(tmp_path: Path) -> list[str]:
    text = run("--help", cwd=tmp_path).stdout
    listed = text[text.index("Commands:"):].splitlines()[1:]
    return [line.split()[0] for line in listed if line.startswith("  ") and not line.startswith("   ")]


def test_every_help_page_has_examples_and_plain_argument_names(tmp_path: Path):
    names = commands(tmp_path)
    assert {"apply", "launch", "exec", "ssh", "down", "check"} <= set(names), names
    for name in names:
        page = run(name, "--help", cwd=tmp_path)
        assert page.returncode == 0, (name, page.stderr)
        usage_line = page.stdout.splitlines()[0]
        assert "{" not in usage_line and "}" not in usage_line, usage_line  # NAME, not {NAME}
        examples = page.stdout[page.stdout.index("Examples:"):].splitlines()[1:]
        shown = [line.strip() for line in examples if line.strip()]
        assert len(shown) >= 1 and all(line.startswith(("gpuctl ", "ssh ", "ansible-playbook ")) for line in shown), \
            (name, shown)
        if "Arguments:" in page.stdout:
            arguments = page.stdout[page.stdout.index("Arguments:"):page.stdout.index("Options:")]
            assert "<str>" not in arguments and "<int>" not in arguments and "[required]" not in arguments, arguments
    assert run("exec", "--help", cwd=tmp_path).stdout.startswith(
        "Usage: gpuctl exec [OPTIONS] NAME [FILE|COMMAND...] [-- COMMAND...]")
    assert run("ssh", "--help", cwd=tmp_path).stdout.startswith("Usage: gpuctl ssh [OPTIONS] NAME [NODE] [-- COMMAND...]")


def test_command_descriptions_are_whole_sentences(tmp_path: Path):
    text = run("--help", cwd=tmp_path).stdout
    listed = " ".join(text[text.index("Commands:"):].split())
    assert "..." not in listed, listed  # no description cut short
    assert "Provision (or reuse) a cluster, sync, run setup, and run the job on every node." in listed


def test_launch_is_apply(tmp_path: Path):
    (tmp_path / "ok.yaml").write_text("name: dr\nnum_nodes: 2\nresources:\n  infra: local\nrun: hostname\n")
    plans = [run(command, "ok.yaml", "--dry-run", cwd=tmp_path) for command in ("launch", "apply")]
    assert all(p.returncode == 0 for p in plans), [p.stderr for p in plans]
    assert sorted(plans[0].stdout.splitlines()) == sorted(plans[1].stdout.splitlines())  # in whatever order
    assert "Plan: 3 to add, 0 to change, 0 to destroy." in plans[0].stdout
    (tmp_path / "c.yaml").write_text("resources:\n  infra: local\n  accelerators: H1000:8\nrun: hostname\n")
    for command in ("launch", "apply"):
        proc = run(command, "c.yaml", cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == ("error: c.yaml:3: resources.accelerators: 'H1000' is not a "
                                       "known accelerator; did you mean H100?"), proc.stderr


# -- --output json: one document on stdout, also for errors (README: "Machine-readable output") --

VALIDATE_KEYS = {"schema", "command", "ok", "file", "cluster", "num_nodes", "cloud", "region", "zone",
                 "instance_type", "accelerator", "gpus_per_node", "container_image", "warnings", "autostop",
                 "price"}
ERROR_KEYS = {"schema", "command", "ok", "error", "exit_code"}


def json_doc(proc: subprocess.CompletedProcess) -> dict:
    """stdout is exactly one JSON object (json.loads refuses anything around it)."""
    import json

    doc = json.loads(proc.stdout)
    assert isinstance(doc, dict) and doc["schema"] == 1, proc.stdout
    return doc


def test_validate_json_document(tmp_path: Path):
    (tmp_path / "cluster.yaml").write_text("name: ci-check\nnum_nodes: 2\nresources:\n  infra: local\n"
                                           "  instance_type: p5.48xlarge\nrun: echo hi\n")
    proc = run("validate", "cluster.yaml", "-o", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json_doc(proc)
    assert set(doc) == VALIDATE_KEYS
    assert (doc["command"], doc["ok"], doc["cluster"], doc["num_nodes"], doc["cloud"]) == \
        ("validate", True, "ci-check", 2, "local")
    # the warning is in the document and on stderr, never on stdout outside the document
    assert len(doc["warnings"]) == 1 and "resources.instance_type" in doc["warnings"][0], doc
    assert proc.stderr.startswith("warning: ") and "resources.instance_type" in proc.stderr


# argv -> exit code and a fragment of the error; each also prints its `error:` line on stderr
JSON_ERRORS = {
    "unknown-cluster": (["status", "nosuch", "-o", "json"], 2, "cluster 'nosuch' not found"),
    "missing-file": (["validate", "nope.yaml", "--output=json"], 2, "nope.yaml"),
    "usage-error": (["cancel", "-o", "json"], 2, "NAME"),
    "logs-without-status": (["logs", "c", "-o", "json"], 2, "--status"),
    "exec-unknown-cluster": (["exec", "nosuch", "-o", "json", "--", "true"], 2, "cluster 'nosuch' not found"),
    "cancel-unknown-cluster": (["cancel", "nosuch", "-o", "json"], 2, "cluster 'nosuch' not found"),
}


@pytest.mark.parametrize("case", sorted(JSON_ERRORS))
def test_json_error_document(case: str, tmp_path: Path):
    argv, code, fragment = JSON_ERRORS[case]
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    doc = json_doc(proc)
    assert set(doc) == ERROR_KEYS
    assert (doc["command"], doc["ok"], doc["exit_code"]) == (argv[0], False, code)
    assert fragment in doc["error"], doc
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and fragment in error_lines[0], proc.stderr


def test_bad_output_and_format_values_name_the_flag_and_choices(tmp_path: Path):
    bad_output = run("status", "--output", "yaml", cwd=tmp_path)
    assert bad_output.returncode == 2 and bad_output.stdout == ""
    assert bad_output.stderr.strip() == "error: --output yaml: use text or json"
    bad_format = run("inventory", "nosuch", "--format", "yaml", cwd=tmp_path)
    assert bad_format.returncode == 2 and bad_format.stdout == ""
    assert bad_format.stderr.strip() == "error: --format yaml: use one of ansible, json, hostfile, ssh-config"


def test_version_command_text_and_json(tmp_path: Path):
    assert run("version", cwd=tmp_path).stdout.strip() == f"gpuctl {version('gpuctl')}"
    doc = json_doc(run("version", "-o", "json", cwd=tmp_path))
    assert doc == {"schema": 1, "command": "version", "ok": True, "version": version("gpuctl")}
