"""gpuctl starts fast: what a command loads before it runs is what it needs (issue 36).

Timing is benchmarks/start.py's job; these check the shape that makes it fast: which modules a
fresh interpreter holds once `gpuctl --help`, `--version` or `exec` ran, and that `--version`
needs no package metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

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
