"""The node bundle (configplane/bundle.py): the agent's modules under cli/gpuctl/node/ joined into
one file when gpuctl needs it, cached by the hash of its sources, standard library only and
Python 3.6 syntax; every node module keeps to one job in at most 800 lines."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuctl.common.paths import CACHE_ENV
from gpuctl.configplane import bundle


def test_the_agent_is_built_from_the_node_package_and_cached_by_its_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    bundle._agent_for.cache_clear()
    text = bundle.agent_text()
    assert text == bundle.build_agent()  # the same bytes each time: the fingerprint hashes them
    assert text.startswith("#!/usr/bin/env python3\n") and "edit those" in text
    (cached,) = (tmp_path / "cache").glob("agent-*.py")
    assert cached.read_text() == text and cached.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    # a later process reads the cache instead of building again
    cached.write_text(text + "# from the cache\n")
    bundle._agent_for.cache_clear()
    assert bundle.agent_text().endswith("# from the cache\n")
    # an edited module is another key: built again, never served stale
    monkeypatch.setattr(bundle, "sources_hash", lambda: hashlib.sha256(b"edited").hexdigest())
    assert bundle.agent_text() == text
    assert len(list((tmp_path / "cache").glob("agent-*.py"))) == 2
    bundle._agent_for.cache_clear()


def test_an_unwritable_cache_still_gives_the_agent(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "cache"))  # under a file: cannot be made
    bundle._agent_for.cache_clear()
    try:
        assert bundle.agent_text() == bundle.build_agent()
        assert bundle.agent_file().read_text() == bundle.build_agent()
    finally:
        bundle._agent_for.cache_clear()


def test_the_bundle_holds_the_agent_its_launcher_and_the_node_probes():
    files = bundle.files()
    assert sorted(files) == ["bin/gpuctl-node", "lib/allreduceprobe.py", "lib/gpuctl-fabric-probe",
                             "lib/gpuctl_node.py", "lib/ncclperf.py", "lib/nodehealth.py"]
    assert files["lib/gpuctl_node.py"] == (bundle.agent_text().encode(), "0644")
    assert files["bin/gpuctl-node"] == ((bundle.NODE / "launcher.py").read_bytes(), "0755")


def test_the_agent_is_stdlib_only_and_python36_syntax():
    source = bundle.agent_text()
    tree = ast.parse(source, feature_version=(3, 6))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "capture_output" not in source and "text=True" not in source  # 3.7+
    for path in sorted(bundle.NODE.glob("*.py")):  # each module on its own too (the package is what people read)
        ast.parse(path.read_text(), feature_version=(3, 6))


def test_every_node_module_is_short_and_says_why():
    for path in sorted(bundle.NODE.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 800, path.name
        assert ast.get_docstring(ast.parse(text)), path.name
    assert set(bundle.AGENT_MODULES) | {bundle.OVERVIEW} | {src for src, _ in bundle.PROGRAMS.values()} == \
        {p.name for p in bundle.NODE.glob("*.py")}, "a module of node/ that the bundle does not ship"


def test_the_build_refuses_what_would_not_survive_the_join(tmp_path, monkeypatch):
    node = tmp_path / "node"
    node.mkdir()
    for path in bundle.NODE.glob("*.py"):
        (node / path.name).write_text(path.read_text())
    monkeypatch.setattr(bundle, "NODE", node)
    main = node / "main.py"
    original = main.read_text()
    for extra, says in [("import yaml\n", "standard library only"),
                        ("from gpuctl.jobplane import payload\n", "not a module joined before"),
                        ("def ev(*fields):\n    return b''\n", "defined in both"),
                        ("def later():\n    return nowhere\n", "defined nowhere in the agent: nowhere")]:
        main.write_text(original + "\n\n" + extra)
        with pytest.raises(bundle.BuildError, match=says):
            bundle.build_agent()
    main.write_text(original)
    monkeypatch.setattr(bundle, "NODE", bundle.NODE.parent / "node")
    assert (node / "main.py").read_text() == original and bundle.build_agent() == bundle.agent_text()


def test_python_m_bundle_writes_the_files_a_role_reads(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpuctl.configplane.bundle", str(tmp_path / "files")],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = {p.name: p for p in (tmp_path / "files").iterdir()}
    for rel, (data, mode) in bundle.files().items():
        path = written[Path(rel).name]
        assert path.read_bytes() == data and os.access(path, os.X_OK) == (mode == "0755")
    bad = subprocess.run([sys.executable, "-m", "gpuctl.configplane.bundle", "--check"],
                         capture_output=True, text=True, check=False, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
