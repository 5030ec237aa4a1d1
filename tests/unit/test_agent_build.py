"""The node agent ships as one file built from its modules (jobplane/agent/build.py): the committed
file is what the modules build, it is standard library only and Python 3.6 syntax, and every
module keeps to one job in at most 800 lines."""

from __future__ import annotations

import ast
import os
import sys

import pytest

from gpuctl.jobplane.agent import build


def test_the_committed_agent_is_what_its_modules_build():
    fresh = build.build()
    assert build.ARTIFACT.read_text() == fresh, (
        f"{build.ARTIFACT} differs from its modules (jobplane/agent/, protocol.py, spec/reserved.py): "
        f"run `{build.REGENERATE}` and commit the result")
    assert os.access(build.ARTIFACT, os.X_OK)
    assert fresh.startswith("#!/usr/bin/env python3\n") and "do not edit; run `make agent`" in fresh


def test_the_agent_is_stdlib_only_and_python36_syntax():
    source = build.ARTIFACT.read_text()
    tree = ast.parse(source, feature_version=(3, 6))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "capture_output" not in source and "text=True" not in source  # 3.7+
    for rel in build.MODULES:  # each module on its own too (the package is what people read)
        ast.parse((build.PACKAGE / rel).read_text(), feature_version=(3, 6))


def test_every_module_is_short_and_says_why():
    for rel in build.MODULES + ("jobplane/agent/__init__.py",):
        text = (build.PACKAGE / rel).read_text()
        assert len(text.splitlines()) <= 800, rel
        assert ast.get_docstring(ast.parse(text)), rel


def test_the_build_refuses_what_would_not_survive_the_join(tmp_path, monkeypatch):
    package = tmp_path / "gpuctl"
    for rel in build.MODULES + (build.OVERVIEW,):
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text((build.PACKAGE / rel).read_text())
    monkeypatch.setattr(build, "PACKAGE", package)
    main = package / "jobplane/agent/main.py"
    original = main.read_text()
    for extra, says in [("import yaml\n", "standard library only"),
                        ("from gpuctl.jobplane import payload\n", "not a module joined before"),
                        ("def ev(*fields):\n    return b''\n", "defined in both"),
                        ("def later():\n    return nowhere\n", "defined nowhere in the agent: nowhere")]:
        main.write_text(original + "\n\n" + extra)
        with pytest.raises(build.BuildError, match=says):
            build.build()
    main.write_text(original)
    assert build.build() == build.ARTIFACT.read_text()
