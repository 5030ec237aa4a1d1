"""Reading a user's YAML file (config, inventory) with one-line errors.

cluster.yaml has its own loader (spec.py) because it maps every field to its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuctl.errors import UserError


def load_yaml(path: Path, *, what: str) -> Any:
    """The parsed document (None for an empty file); a syntax error names the
    file, line and column, and `what` the file is."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: YAML syntax error{pos}; fix the {what}") from None
