"""Usage errors and help pages of the command line, whichever click the installed typer uses.

typer up to 0.28 raises the `click` package's exceptions; typer 0.29 vendors
its own copy (`typer._click`) whose exceptions are unrelated classes. Catching
`click.ClickException` by name therefore misses every usage error on a newer
typer and the user sees a traceback. Here the exception classes are taken from
the module that defines the command classes typer actually builds, so the CLI
catches what the library raises on every version the ranges allow.
"""

from __future__ import annotations

import copy
import importlib
import sys
from types import ModuleType
from typing import Any

import typer
import typer.core


def click_module() -> ModuleType:
    """The click package (or typer's vendored copy) behind `typer.core.TyperGroup`."""
    for base in typer.core.TyperGroup.__mro__[1:]:
        module = base.__module__
        if module.endswith(".core") and module != "typer.core":
            return importlib.import_module(module.rsplit(".", 1)[0])
    return importlib.import_module("click")


_CLICK = click_module()
ClickException: type[Exception] = _CLICK.exceptions.ClickException
UsageError: type[Exception] = _CLICK.exceptions.UsageError
# typer 0.29 keeps Abort in typer.exceptions, older ones re-export click's.
Abort: type[BaseException] = getattr(_CLICK.exceptions, "Abort", typer.Abort)


def report(exc: Exception, root: object, argv: list[str], prog: str = "gpuctl") -> int:
    """Print the usage line (for usage errors) and one `error:` line; return the exit code.

    click's own rendering adds a "Try --help" line and a capitalised "Error:";
    gpuctl prints every error as one `error: ...` line, so the help hint goes
    at the end of that line. Some parser errors carry no context (typer 0.29's
    option parser), so the usage line is rebuilt from the command in argv.
    """
    message = exc.format_message().rstrip(".")  # type: ignore[attr-defined]
    if isinstance(exc, UsageError):
        ctx = getattr(exc, "ctx", None) or _context_for(root, argv, prog)
        print(ctx.get_usage(), file=sys.stderr)
        message = f"{message} (see `{ctx.command_path} --help`)"
    print(f"error: {message[:1].lower() + message[1:]}", file=sys.stderr)
    return int(getattr(exc, "exit_code", 2) or 2)


def reachable(app: typer.Typer, argv: list[str]) -> typer.Typer:
    """`app` with only the commands `argv` can reach, for click to build: the one its first word
    names (`gpuctl exec ...`: exec alone), none for a lone `--version`, else all of them (`--help`,
    a mistyped command). typer reads every command's signature and makes its options when the app
    is called, about 1 ms a command; one command should not pay for all the others."""
    first = argv[0] if argv else None
    commands = [c for c in app.registered_commands if first is not None and c.name == first]
    groups = [g for g in app.registered_groups if first is not None and g.name == first]
    if not commands and not groups and argv != ["--version"]:
        return app
    only = copy.copy(app)
    only.registered_commands, only.registered_groups = commands, groups
    return only


def _context_for(root: object, argv: list[str], prog: str) -> Any:
    """A parse-free context for the subcommand named in argv (else the root)."""
    import typer.main

    group = typer.main.get_command(root)  # type: ignore[arg-type]
    ctx = group.make_context(prog, [], resilient_parsing=True)
    for word in argv:
        if word.startswith("-"):
            continue
        sub = group.get_command(ctx, word)  # type: ignore[attr-defined]
        if sub is not None:
            return sub.make_context(word, [], parent=ctx, resilient_parsing=True)
        break
    return ctx


# -- help pages ----------------------------------------------------------------------------------

class HelpCommand(typer.core.TyperCommand):
    """A command's help as users of other CLIs read it: `gpuctl exec [OPTIONS] NAME [FILE|COMMAND]`
    (no braces, no type beside each argument), and its examples (the epilog) kept line by line."""

    usage_tail: tuple[str, ...] = ()

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument" and not getattr(param, "hidden", False):
                name = _argument_name(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces + list(self.usage_tail)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                if not getattr(param, "hidden", False):
                    args.append((_argument_name(param), getattr(param, "help", None) or ""))
            else:
                record = param.get_help_record(ctx)
                if record is not None:
                    opts.append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        if opts:
            with formatter.section("Options"):
                formatter.write_dl(opts)


class DashCommand(HelpCommand):
    """`exec` and `ssh`, which take the words after `--` as a command."""

    usage_tail = ("[-- COMMAND...]",)


class HelpGroup(typer.core.TyperGroup):
    """The command list with each command's whole first sentence, not cut at 45 characters."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            rows.append((name, cmd.get_short_help_str(limit=200)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _argument_name(param: Any) -> str:
    return str(param.metavar or param.name.upper())


# Two or three per command, shown at the end of its help page.
EXAMPLES = {
    'validate': (
        'gpuctl validate cluster.yaml',
        'gpuctl validate cluster.yaml --infra local',
        'gpuctl validate train.yaml --env LR=3e-4 -o json',
    ),
    'apply': (
        'gpuctl apply cluster.yaml',
        'gpuctl apply cluster.yaml -c demo --infra local --num-nodes 2',
        'gpuctl apply cluster.yaml --dry-run',
        'gpuctl apply cluster.yaml -d; gpuctl logs NAME',
        'gpuctl apply cluster.yaml -i 30 --down   (down after 30 idle minutes)',
        'gpuctl apply train.yaml --down -y   (CI: down when the job ends, even if the runner dies)',
    ),
    'status': (
        'gpuctl status',
        'gpuctl status demo',
        'gpuctl status demo -o json',
    ),
    'exec': (
        "gpuctl exec demo 'echo hi from $(hostname)'",
        'gpuctl exec demo -d python train.py --lr 1e-3   (as sky exec: gpuctl\'s options first)',
        'gpuctl exec demo train.yaml',
        'gpuctl exec demo --num-nodes 1 -- nvidia-smi',
        'gpuctl exec demo -d --gpus H100:4 -- python eval.py   (waits in the queue for 4 free GPUs per node)',
    ),
    'queue': (
        'gpuctl queue   (every cluster\'s jobs)',
        'gpuctl queue demo',
        'gpuctl queue demo -o json',
    ),
    'logs': (
        'gpuctl logs demo',
        'gpuctl logs demo 3 --tail 100',
        'gpuctl logs demo 3 --rank 1 --no-follow',
        'gpuctl logs demo 3 --by-rank   (grouped; default: in the order the lines came)',
        'gpuctl logs demo --status   (exit 100: failed)',
        'gpuctl logs demo --purge   (remove the logs kept after `down`)',
    ),
    'cancel': (
        'gpuctl cancel demo 3',
        'gpuctl cancel demo --all',
    ),
    'ssh-config': (
        'gpuctl ssh-config demo',
        'ssh demo   (with `Include ~/.gpuctl/ssh/config` in ~/.ssh/config)',
    ),
    'inventory': (
        'gpuctl inventory demo',
        'gpuctl inventory demo -f hostfile',
        'ansible-playbook -i <(gpuctl inventory demo) site.yml',
    ),
    'ssh': (
        'gpuctl ssh demo',
        'gpuctl ssh demo worker2',
        'gpuctl ssh demo 1 -- nvidia-smi',
    ),
    'forget-host-key': (
        'gpuctl forget-host-key demo worker1',
    ),
    'force-unlock': (
        'gpuctl force-unlock demo',
    ),
    'check': (
        'gpuctl check demo',
        'gpuctl check demo --sizes 64M,1G --min-busbw 100',
        'gpuctl check demo --health   (exit 1: a node is unhealthy)',
        'gpuctl check demo --health --level 2 -o json',
    ),
    'replace': (
        'gpuctl replace demo worker3',
        'gpuctl replace demo --unhealthy',
        'gpuctl replace demo 2 5 -o json',
        'gpuctl replace demo worker3 --force -y   (cancels the running job first, asks nothing)',
    ),
    'down': (
        'gpuctl down demo',
        'gpuctl down demo train-2 -o json',
        'gpuctl down -a   (asks first, naming the clusters; -y: does not ask)',
    ),
    'stop': (
        'gpuctl stop demo',
        'gpuctl stop demo train-2 -y -o json   (cancels jobs that still run)',
    ),
    'start': (
        'gpuctl start demo',
        'gpuctl start demo -o json',
    ),
    'autostop': (
        'gpuctl autostop demo -i 10',
        'gpuctl autostop demo -i 30 --down',
        'gpuctl autostop demo --cancel',
    ),
    'dashboard': (
        'gpuctl dashboard',
        'gpuctl dashboard --port 9000 --no-browser',
        'ssh -L 8642:127.0.0.1:8642 controller  # then open the URL it printed, on your laptop',
    ),
    'cost-report': (
        'gpuctl cost-report',
        'gpuctl cost-report -o json',
    ),
    'jobs': (
        'gpuctl jobs launch train.yaml',
        'gpuctl jobs queue',
        'gpuctl jobs logs 3',
    ),
    'jobs launch': (
        'gpuctl jobs launch train.yaml',
        'gpuctl jobs launch train.yaml -n llm -d --secret WANDB_API_KEY',
    ),
    'jobs queue': (
        'gpuctl jobs queue',
        'gpuctl jobs queue -o json',
    ),
    'jobs logs': (
        'gpuctl jobs logs 3',
        'gpuctl jobs logs 3 --attempt 2 --no-follow',
        'gpuctl jobs logs 3 --supervisor',
        'gpuctl jobs logs 3 --stage 2',
    ),
    'jobs supervise': (
        'gpuctl jobs supervise --for 9m   (a scheduled CI job, every 10 minutes, with shared state)',
        'gpuctl jobs supervise --for 1h --poll 30s -o json',
    ),
    'jobs cancel': (
        'gpuctl jobs cancel 3',
    ),
    'jobs resume': (
        'gpuctl jobs resume 3',
        'gpuctl jobs resume 3 -d',
    ),
    'version': (
        'gpuctl version',
        'gpuctl --version',
        'gpuctl version -o json',
    ),
    'launch': (
        'gpuctl launch cluster.yaml',
        'gpuctl launch cluster.yaml -c demo --infra local',
        "gpuctl launch 'echo hi'   (a new 1-node local cluster, as sky launch 'echo hi')",
        'gpuctl launch -c demo --num-nodes 2 --infra local python train.py --lr 1e-3',
    ),
}


def examples_of(command: str) -> str:
    """A help page's examples: `\\b` keeps click from rewrapping them into one paragraph."""
    return "Examples:\n\n\b\n" + "\n".join("  " + line for line in EXAMPLES[command])
