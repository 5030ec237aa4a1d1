"""README's command table and `gpuctl --help` name the same commands (and `jobs`' sub-commands):
a command added, renamed or removed shows in both or fails here."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from gpuctl import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands() -> set[str]:
    table = README.read_text().split("## Commands\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        cell = re.split(r"(?<!\\)\|", row)[1]  # a cell may hold an escaped \| itself
        for code in re.findall(r"`([^`]+)`", cell):
            words = code.replace("\\|", "|").split()
            if words[0] == "jobs":
                names.update(f"jobs {sub}" for sub in words[1].split("|"))
            else:
                names.add(words[0])
        names.update(re.findall(r"\(`([a-z-]+)`\)", cell))  # an alias named beside its command
    return names


def help_commands() -> set[str]:
    group = typer.main.get_command(cli.app)
    names = set()
    for name, command in group.commands.items():
        if command.hidden or name.startswith("_"):
            continue
        subs = getattr(command, "commands", None)
        names |= {f"{name} {sub}" for sub, c in subs.items() if not c.hidden} if subs else {name}
    return names


def test_readme_lists_exactly_the_commands_of_gpuctl_help() -> None:
    documented, real = readme_commands(), help_commands()
    assert documented == real, (f"in README only: {sorted(documented - real)}; "
                                f"in gpuctl --help only: {sorted(real - documented)}")
