"""What the words after `exec NAME` and `apply`/`launch` are: a task file, or a command, as SkyPilot reads them.

SkyPilot takes a command wherever it takes a task YAML (`sky exec mycluster python train.py
--lr 1e-3`, `sky launch 'echo hi'`) and tells the two apart by one rule, which gpuctl shares
(cliargs.names_task_file). Unquoted command words are joined with spaces into one shell command,
as `sky exec` joins them; the words after `--` stay an exact argv (gpuctl's own form).

Options: gpuctl's own options go before the command. Once the command's first word is a bare word
(`python`), the words after it are the command's, so `--lr 1e-3` reaches the program. One of them
that is also an option of gpuctl's (`-d`, `--env`, `--dry-run`) is refused with a line saying how to
write it: `sky exec` would silently take it as its own, and a launch that silently ran with
`--dry-run` as the command's word would make a cluster. A task file or a quoted command string
(one word with spaces) may still be followed by gpuctl's options, as before.
"""

from __future__ import annotations

import getpass
import re
from pathlib import Path
from typing import Any

from gpuctl import usage
from gpuctl.cliargs import names_task_file, shortened
from gpuctl.common.errors import UserError

COMMAND_SOURCE = "(command)"  # how messages name the task `launch 'CMD'` makes


def takes_options_after(word: str) -> bool:
    """Whether gpuctl's options may follow `word`, the command's first word (exec's after NAME): a
    task file, a whole quoted command string, or a directory (refused as no task file); after a
    bare word the rest is the command's."""
    return names_task_file(word) or any(c.isspace() for c in word) or Path(word).expanduser().is_dir()


def exec_argv(args: list[str], options: dict[str, bool], at: int = 2) -> list[str]:
    """A command's words as click should parse them: a `--` put before the `at`-th positional word
    (exec: NAME, then the command; apply: the command) when it is a bare one (`exec NAME python
    train.py --lr 1e-3`), so nothing after it is read as an option. `options`: gpuctl's own option
    names, True for those that take the next word as their value (`--env K=V`). One of them among
    the command's words could be meant for either: refused, saying how to write it."""
    positional, i = 0, 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return args
        if word.startswith("-") and word != "-":
            i += 2 if options.get(word) else 1
            continue
        positional += 1
        if positional == at:
            if takes_options_after(word):
                return args
            _refuse_ambiguous(word, args[i + 1:], options)
            return [*args[:i], "--", *args[i:]]
        i += 1
    return args


def _refuse_ambiguous(first: str, rest: list[str], options: dict[str, bool]) -> None:
    for word in rest:
        if word == "--":
            return  # what follows is an argv, the command's
        if word != "--help" and (word in options or word.split("=", 1)[0] in options and "=" in word):
            raise UserError(f"{word!r} after the command's first word {first!r} could be gpuctl's option or the "
                            f"command's: put gpuctl's options before the command, or quote the whole command "
                            f"('{shortened(' '.join([first, *rest]))}')")


def _options(command: Any, ctx: Any) -> dict[str, bool]:
    return {name: not (param.is_flag or param.count) for param in command.get_params(ctx)
            if param.param_type_name == "option" for name in (*param.opts, *param.secondary_opts)}


class ExecCommand(usage.DashCommand):
    """`gpuctl exec NAME ...`: its command's words are not parsed as options (exec_argv)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, exec_argv(list(args), _options(self, ctx), at=2))


class LaunchCommand(usage.HelpCommand):
    """`gpuctl apply|launch ...`: a command's words after its first are not parsed as options."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, exec_argv(list(args), _options(self, ctx), at=1))


def exec_entrypoint(words: list[str], after_dashes: list[str]) -> tuple[str | None, list[str]]:
    """(a task file or a command string, an argv) from exec's words and those after `--` (one of the
    two, or neither). Bare words are one command, joined with spaces as `sky exec` joins them: a
    `--` among them is theirs (`exec NAME torchrun train.py -- --lr 1`)."""
    if not words:
        return None, after_dashes
    first = words[0]
    if takes_options_after(first):
        _refuse_words_after(words)
        if after_dashes:
            raise UserError("give either a task FILE, a command string or `-- COMMAND...`, not two of them")
        return first, []
    return " ".join([*words, *(["--", *after_dashes] if after_dashes else [])]), []


def launch_entrypoint(words: list[str]) -> str:
    """apply/launch's FILE|COMMAND from its words: one word as it is, bare words joined with spaces
    (`gpuctl launch python train.py --lr 1e-3`, as `sky launch`)."""
    if words and takes_options_after(words[0]):
        _refuse_words_after(words)
    return " ".join(words)


def _refuse_words_after(words: list[str]) -> None:
    """A task file or a quoted command takes no words after it: one line saying how to write them."""
    if len(words) > 1:
        what = "a task file" if names_task_file(words[0]) else "a quoted command"
        raise UserError(f"{shortened(words[0])!r} is {what}, so {shortened(' '.join(words[1:]))!r} after it "
                        "cannot be its words: quote the whole command, or give its words unquoted")


def is_command(entrypoint: str) -> bool:
    """Whether apply/launch's FILE is a command to run (`gpuctl launch 'echo hi'`): not a task file
    (cliargs.names_task_file) nor a directory (which is refused as a file)."""
    if not entrypoint.strip():
        return True  # an empty command: refused as one (command_task_text)
    return not names_task_file(entrypoint) and not Path(entrypoint).expanduser().is_dir()


def command_note(entrypoint: str, cluster: str) -> str | None:
    """The line apply says before it makes a cluster for a command (a mistyped file name reads as one)."""
    if not is_command(entrypoint):
        return None
    return f"note: {shortened(entrypoint)!r} is no task file: running it as a command on cluster '{cluster}'"


def command_task_text(command: str) -> str:
    """The task YAML a command stands for: its `run`, named by the command (as `queue` shows exec's).
    Everything else is the task defaults and the flags: one node on the default infra (local),
    unless --infra/--num-nodes say otherwise."""
    import yaml  # only `launch 'CMD'` writes YAML: `exec` and `--help` go without it

    if not command.strip():
        raise UserError("the command is empty: give a task FILE or a command, such as `gpuctl launch 'hostname'`")
    return yaml.safe_dump({"name": shortened(" ".join(command.split())), "run": command}, sort_keys=False)


def generated_cluster_name() -> str:
    """A new cluster's name when a command was given without -c (as SkyPilot's `sky-3f2a-alice`):
    `gpuctl-<4 hex>-<user>`, in the characters a cluster name allows."""
    import secrets

    from gpuctl.spec.request import PORTABLE_NAME_MAX

    try:
        user = re.sub(r"[^a-z0-9-]+", "-", getpass.getuser().lower()).strip("-")
    except (OSError, KeyError):  # no login name anywhere (a container without USER or a passwd entry)
        user = ""
    # never longer than every provider takes (a name gpuctl makes up must not fail on AWS)
    return f"gpuctl-{secrets.token_hex(2)}{'-' + user if user else ''}"[:PORTABLE_NAME_MAX].rstrip("-")
