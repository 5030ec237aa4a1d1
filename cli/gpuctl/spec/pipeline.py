"""A SkyPilot pipeline: several tasks in one YAML file, one `---` document each, run in order.

SkyPilot's format (`sky jobs launch pipeline.yaml`, sky/utils/dag_utils.py): an optional header
document that holds only `name:` (and `execution:`), then one task per document. Without a header
every document is a stage. `execution: serial` (the default) runs the stages one after another;
`execution: parallel` (job groups) is refused here.

Each stage is loaded by `load_task` from the file's own text with the other documents blanked out,
so every line number in a message is the file's; each message also names the stage (`stage 2
(eval)`), as one looks for it in the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from gpuctl.common.errors import UserError
from gpuctl.common.yamlfile import read_text

HEADER_KEYS = frozenset({"name", "execution"})
EXECUTIONS = ("serial", "parallel")


@dataclass(frozen=True)
class Document:
    """One `---` document of the file: where it starts (1-based line) and the file's text with every
    other document blanked out (so its line numbers are the file's)."""

    number: int  # 1-based, in the file
    line: int
    text: str
    data: Any


@dataclass(frozen=True)
class Stage:
    index: int  # 1-based: GPUCTL_STAGE
    name: str  # the task's name, else stage-K
    line: int  # where its document starts in the file
    text: str  # the file's text with only this stage's document (the task as loaded)
    task: Any  # spec.models.Task


@dataclass(frozen=True)
class Pipeline:
    name: str | None
    stages: tuple[Stage, ...]
    header_line: int | None


def documents(text: str, source: str) -> list[Document]:
    """The file's documents in order, empty ones left out (as SkyPilot's read_yaml_all does)."""
    lines = text.splitlines(keepends=True)
    starts: list[tuple[int, int]] = []  # (first line index, end line index) per document
    try:
        events = list(yaml.parse(text, Loader=yaml.SafeLoader))
        datas = list(yaml.safe_load_all(text))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise UserError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
    begin = 0
    for event in events:
        if isinstance(event, yaml.DocumentStartEvent):
            begin = event.start_mark.line
        elif isinstance(event, yaml.DocumentEndEvent):
            starts.append((begin, event.end_mark.line + (1 if event.end_mark.column else 0)))
    found = []
    for number, ((first, end), data) in enumerate(zip(starts, datas), start=1):
        if data is None:
            continue
        # the first line of the document's content, past a `---` marker line
        content = next((i for i in range(first, min(end, len(lines)))
                        if lines[i].strip() and not lines[i].lstrip().startswith(("---", "#"))), first)
        blanked = "".join("\n" if not first <= i < max(end, first + 1) else (
            "\n" if lines[i].lstrip().startswith("---") else lines[i]) for i in range(len(lines)))
        found.append(Document(number, content + 1, blanked, data))
    return found


def is_pipeline(text: str) -> bool:
    """Whether the text holds more than one YAML document (cheap: no parse of a single task)."""
    if not re.search(r"^---", text, re.M):
        return False
    try:
        return sum(1 for data in yaml.safe_load_all(text) if data is not None) > 1
    except yaml.YAMLError:
        return True  # the loader says what is wrong, in the file's words


def _header(doc: Document, source: str) -> str | None:
    """The header's name; a refusal for `execution: parallel` or an unknown value."""
    data = doc.data
    execution = data.get("execution", "serial")
    if execution not in EXECUTIONS:
        raise UserError(f"{source}:{doc.line}: execution: {execution!r}; use serial (stages one after another)")
    if execution == "parallel":
        raise UserError(f"{source}:{doc.line}: execution: parallel (SkyPilot's job groups) is not supported by "
                        "gpuctl; use execution: serial (the stages one after another), or launch each task as "
                        "a job of its own")
    name = data.get("name")
    return None if name is None else str(name)


def _labelled(message: str, source: str, label: str) -> str:
    """`FILE:LINE: ...` lines of a stage's error with the stage named after the place."""
    pattern = re.compile(rf"^(\s*){re.escape(source)}(:\d+(?::\d+)?)?: ")
    out = []
    for i, line in enumerate(message.split("\n")):
        labelled, hits = pattern.subn(lambda m: f"{m.group(1)}{source}{m.group(2) or ''}: {label}: ", line, count=1)
        out.append(labelled if hits else (f"{source}: {label}: {line}" if i == 0 else line))
    return "\n".join(out)


def load_pipeline(path: str | Path, *, text: str | None = None,
                  load_stage: Callable[[str, str], Any], check_stage: Callable[[Any, str], None] | None = None,
                  ) -> Pipeline:
    """Every stage of the pipeline in `path`, loaded by `load_stage(source, text)` (spec.load_task with
    the command line's overrides) and checked by `check_stage(task, text)`; a problem in any stage is a
    UserError naming the stage, every failing stage's lines in file order."""
    source = str(path)
    text = read_text(Path(path).expanduser(), what="task YAML file", source=source) if text is None else text
    docs = documents(text, source)
    header: Document | None = None
    if docs and isinstance(docs[0].data, dict) and docs[0].data and set(docs[0].data) <= HEADER_KEYS \
            and len(docs) > 1:
        header, docs = docs[0], docs[1:]
    name = _header(header, source) if header is not None else None
    stages: list[Stage] = []
    problems: list[str] = []
    for index, doc in enumerate(docs, start=1):
        given = doc.data.get("name") if isinstance(doc.data, dict) else None
        label = f"stage {index}" + (f" ({given})" if given else "")
        try:
            task = load_stage(source, doc.text)
            if check_stage is not None:
                check_stage(task, doc.text)
        except UserError as exc:
            problems.append(_labelled(exc.message, source, label))
            continue
        stages.append(Stage(index, str(given) if given else f"stage-{index}", doc.line, doc.text, task))
    if problems:
        raise UserError("\n  ".join(problems))
    names = [s.name for s in stages]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{source}: stage name(s) {', '.join(twice)} given to more than one stage; name each "
                        "stage once (`gpuctl jobs logs ID --stage` and the queue tell them apart by name)")
    return Pipeline(name, tuple(stages), header.line if header is not None else None)


def stage_env(index: int, name: str) -> Mapping[str, str]:
    """What a stage's ranks are told of it (beside SKYPILOT_TASK_ID)."""
    return {"GPUCTL_STAGE": str(index), "GPUCTL_STAGE_NAME": name}
