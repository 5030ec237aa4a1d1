"""A pydantic ValidationError as the lines the user reads: `FILE:LINE: FIELD: MESSAGE` per problem.

Why a module of its own: ordering several problems (file order, each named, none
hidden behind a count), naming the field as the file spells it, guessing the
field an unknown key meant, and keeping secret values out of every message are
one rule, applied to every task error in one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from gpuctl.spec.compose import _as_written, _Path
from gpuctl.spec.fields import _kind, _show
from gpuctl.spec.models import Resources, Task, _Model

# Words people type for a field, when difflib's spelling match cannot know them.
_SYNONYMS = {"nodes": "num_nodes", "gpus": "accelerators", "gpu": "accelerators", "env": "envs",
             "environment": "envs", "command": "run", "cmd": "run", "image": "image_id", "spot": "use_spot",
             "disk": "disk_size"}


def _public_fields(model: type[_Model]) -> list[str]:
    names = [*model.model_fields, *model.IGNORED_FIELDS, *model.UNSUPPORTED_FIELDS]
    return [n for n in names if n != "ignored" and not n.startswith("_")]


def _suggestion(key: str, in_resources: bool) -> str | None:
    """The field the user probably meant, at this level or at the other one."""
    task_fields, resource_fields = _public_fields(Task), _public_fields(Resources)
    levels = [(resource_fields, "'{}'"), (task_fields, "the top-level '{}'")] if in_resources else \
             [(task_fields, "'{}'"), (resource_fields, "'resources.{}'")]
    wanted = _SYNONYMS.get(key.lower(), key)
    for fields, label in levels:
        if wanted in fields:
            return label.format(wanted)
    for fields, label in levels:
        close = difflib.get_close_matches(key.lower(), fields, n=1, cutoff=0.6)
        if close:
            return label.format(close[0])
    return None


def _message(error: Mapping[str, Any], loc: _Path) -> str:
    kind = error["type"]
    if kind == "gpuctl":
        return error["ctx"]["message"]
    if kind == "extra_forbidden":
        guess = _suggestion(loc[-1], in_resources=len(loc) > 1)
        return f"unknown field; did you mean {guess}?" if guess else "unknown field"
    expected = {"string_type": "expected a string", "bool_type": "expected true or false",
                "int_type": "expected a whole number", "float_type": "expected a number",
                "dict_type": "expected a mapping (key: value)", "model_type": "expected a mapping (key: value)",
                "list_type": "expected a list"}.get(kind)
    if expected is None:
        return str(error["msg"])
    shown = _kind(error["input"]) if loc[:1] == ("secrets",) else _show(error["input"])
    return f"{expected}, got {shown}"


def _problem_lines(err: pydantic.ValidationError, source: str, lines: Mapping[_Path, int]) -> str:
    """Every problem as `FILE:LINE: FIELD: MESSAGE`, in file order: the first on the first line (the
    line a single problem gives), each further one on a line of its own, indented by two spaces.
    The first line alone still says what to fix first; the others keep nothing hidden."""
    problems: list[tuple[int, _Path, str]] = []
    for error in err.errors(include_url=False):
        loc = tuple(str(p) for p in error["loc"]) + tuple((error.get("ctx") or {}).get("at", ()))
        if loc[:1] == ("bucket_mounts",):  # written under file_mounts
            loc = ("file_mounts",) + loc[1:]
        if loc[:1] == ("workdir_git",):  # written as workdir
            loc = ("workdir",) + loc[1:]
        loc = _as_written(lines, loc)
        line = next(lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines)
        problem = (line, loc, _message(error, loc))
        if problem not in problems:  # one problem pydantic reports twice (a union's branches) is said once
            problems.append(problem)
    problems.sort(key=lambda p: (p[0], p[1]))
    return "\n  ".join(f"{source}:{line}: {'.'.join(loc) + ': ' if loc else ''}{message}"
                        for line, loc, message in problems)


def _redact(message: str, secret_values: Iterable[str]) -> str:
    """Belt and braces: no secret value leaves in a message, even through a path that expanded it."""
    for value in sorted(secret_values, key=len, reverse=True):
        if len(value) >= 4:
            message = message.replace(value, "***")
    return message
