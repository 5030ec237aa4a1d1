"""spec/pipeline.py: a SkyPilot pipeline file split into its documents, each at the file's own lines
(so the loader's messages point where the user looks), the header told from a stage as SkyPilot
tells it, and every stage's problems named with the stage."""

from __future__ import annotations

import pytest

from gpuctl.common.errors import UserError
from gpuctl.spec import load_task
from gpuctl.spec.pipeline import documents, is_pipeline, load_pipeline, stage_env


def load(text: str):
    return load_pipeline("p.yaml", text=text, load_stage=lambda source, stage: load_task(source, text=stage))


def test_documents_keep_the_files_line_numbers():
    text = "# a pipeline\nname: p\n---\n\nname: a\nrun: x\n...\n---\n# second\nname: b\nrun: |\n  echo ---\n"
    docs = documents(text, "p.yaml")
    assert [(d.number, d.line, d.data) for d in docs] == [
        (1, 2, {"name": "p"}), (2, 5, {"name": "a", "run": "x"}), (3, 10, {"name": "b", "run": "echo ---\n"})]
    assert all(len(d.text.splitlines()) <= len(text.splitlines()) for d in docs)
    assert docs[1].text.splitlines()[4] == "name: a" and "name: b" not in docs[1].text
    assert is_pipeline(text) and not is_pipeline("name: a\nrun: |\n  echo ---\n---\n")  # one non-empty document
    assert not is_pipeline("---\nname: a\nrun: x\n")  # one document after a leading marker


def test_the_header_and_the_stages():
    pipe = load("name: p\nexecution: serial\n---\nname: train\nrun: x\n---\nrun: y\n")
    assert pipe.name == "p" and pipe.header_line == 1
    assert [(s.index, s.name, s.line, s.task.run) for s in pipe.stages] == [(1, "train", 4, "x"), (2, "stage-2", 7, "y")]
    assert stage_env(pipe.stages[1].index, pipe.stages[1].name) == {"GPUCTL_STAGE": "2", "GPUCTL_STAGE_NAME": "stage-2"}
    headless = load("name: a\nrun: x\n---\nname: b\nrun: y\n")  # a task first: no header
    assert headless.name is None and [s.name for s in headless.stages] == ["a", "b"]
    assert [s.name for s in load("name: p\n---\n---\n").stages] == ["p"]  # one document: a task, no header


def test_every_stages_problems_are_said_with_the_stage():
    with pytest.raises(UserError) as err:
        load("name: p\n---\nname: a\nnum_nodes: 0\nrun: x\n---\nname: b\nenvs: [1]\nrun: y\n")
    lines = err.value.message.split("\n")
    assert lines[0].startswith("p.yaml:4: stage 1 (a): num_nodes:") and lines[1].startswith("  p.yaml:8: stage 2 (b): envs:")
    with pytest.raises(UserError, match=r"p.yaml:1: execution: 'sometimes'; use serial"):
        load("name: p\nexecution: sometimes\n---\nrun: x\n---\nrun: y\n")
    with pytest.raises(UserError, match=r"p.yaml:\d+:\d+: YAML syntax error"):
        documents("name: p\n---\nrun: [x\n---\nrun: y\n", "p.yaml")
