"""Usage errors of the command line, whichever click the installed typer uses.

typer up to 0.28 raises the `click` package's exceptions; typer 0.29 vendors
its own copy (`typer._click`) whose exceptions are unrelated classes. Catching
`click.ClickException` by name therefore misses every usage error on a newer
typer and the user sees a traceback. Here the exception classes are taken from
the module that defines the command classes typer actually builds, so the CLI
catches what the library raises on every version the ranges allow.
"""

from __future__ import annotations

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
