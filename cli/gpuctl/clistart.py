"""The `gpuctl` program's entry point: what needs no command tree is answered before typer loads.

Importing typer and building the commands costs about 0.13 s, most of a short command's time.
`gpuctl --version` needs neither. Help (`gpuctl`, `gpuctl --help`, `gpuctl jobs launch --help`)
is the same text every time for the same words, the same code and the same terminal width: the
text click printed is kept in the cache dir with the size and mtime of every gpuctl module that
made it (as Python keys its bytecode), and printed again from there while they are unchanged.
Anything else, and a help not kept yet, is gpuctl.cli.main's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

HELP_FLAGS = ("--help", "-h")


def main() -> None:
    argv = sys.argv[1:]
    if argv == ["--version"]:
        from gpuctl import __version__

        print(f"gpuctl {__version__}")
        sys.exit(0)
    if not is_help(argv):
        _full_main()
    entry = help_entry(argv)
    kept = read_kept(entry) if entry is not None else None
    if kept is not None:
        sys.stdout.write(kept)
        sys.stdout.flush()
        sys.exit(0)
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        _full_main()
    except SystemExit as end:
        if end.code in (0, None) and entry is not None and tee.kept.getvalue():
            keep(entry, tee.kept.getvalue())
        raise
    finally:
        sys.stdout = tee.out


def _full_main() -> None:
    from gpuctl.cli import main as cli_main

    cli_main()


def is_help(argv: list[str]) -> bool:
    """Words that only ask for help: none (a bare `gpuctl`), or command names then one help flag."""
    if not argv:
        return True
    *words, last = argv
    return last in HELP_FLAGS and all(w[:1].isalpha() and w.replace("-", "_").isidentifier() for w in words)


def help_entry(argv: list[str]) -> Path | None:
    """The file a help for these words is kept in: named by the words, the width click wraps to, the
    interpreter and gpuctl's version; None where no cache dir can be named."""
    from shutil import get_terminal_size

    from gpuctl import __version__
    from gpuctl.common.paths import cache_dir

    try:
        folder = cache_dir()
    except (KeyError, RuntimeError):  # no home directory to name it by
        return None
    key = json.dumps([__version__, argv, get_terminal_size().columns, sys.stdout.isatty(), sys.executable,
                      sys.version])
    return folder / f"help-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_kept(entry: Path) -> str | None:
    """The kept help, while every module that made it is as it was then."""
    try:
        kept = json.loads(entry.read_text())
        for path, (mtime_ns, size) in kept["made_by"].items():
            stat = os.stat(path)
            if (stat.st_mtime_ns, stat.st_size) != (mtime_ns, size):
                return None
        text = kept["text"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) else None


def keep(entry: Path, text: str) -> None:
    """Keep the help just printed, with every gpuctl, typer and click module loaded to print it."""
    made_by: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and name.split(".", 1)[0] in ("gpuctl", "typer", "click"):
            try:
                stat = os.stat(path)
            except OSError:
                return  # a module gone since it loaded: nothing to key the help by
            made_by[path] = [stat.st_mtime_ns, stat.st_size]
    from gpuctl.common.paths import keep_in_cache

    keep_in_cache(entry, json.dumps({"made_by": made_by, "text": text}))


class _Tee(io.TextIOBase):
    """stdout as it was, with a copy of what is written."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return bool(self.out.isatty())

    def fileno(self) -> int:
        return int(self.out.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.out, "encoding", "utf-8"))
