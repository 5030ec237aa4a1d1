"""Reading a user's YAML file (config, inventory) with one-line errors.

cluster.yaml has its own loader (spec.py) because it maps every field to its line;
both check the text first with `check_printable`, so a NUL or another control
byte is one clear line instead of PyYAML's ReaderError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.reader import Reader

from gpuctl.errors import UserError


def check_printable(text: str, source: str) -> None:
    """One line naming the first character YAML does not allow (NUL, other control bytes)."""
    match = Reader.NON_PRINTABLE.search(text)
    if match is None:
        return
    pos = match.start()
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    raise UserError(f"{source}:{line}:{column}: control character U+{ord(match.group()):04X} is not allowed in "
                    f"YAML; remove it (was the file saved as binary or UTF-16?)")


def read_text(path: Path, *, what: str, source: str | None = None) -> str:
    """The file's text as UTF-8; a missing, unreadable or binary file is one line
    naming `source` (the path as the user wrote it; default `path`)."""
    name = source or str(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{name}: no such file; {what} expected there") from None
    except IsADirectoryError:
        raise UserError(f"{name}: is a directory; give the {what}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{name}: byte {exc.start} is not UTF-8; the {what} must be UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot read it ({exc.strerror})") from None


def load_yaml(path: Path, *, what: str) -> Any:
    """The parsed document (None for an empty file); a syntax error names the
    file, line and column, and `what` the file is."""
    text = read_text(path, what=what)
    check_printable(text, str(path))
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: YAML syntax error{pos}; fix the {what}") from None
