"""The node agent as tests run it on this machine: built from cli/gpuctl/node/ as prepare builds it,
and installed as prepare installs it on a node (bin/gpuctl-node, lib/gpuctl_node.py, ...).

`COMMAND` is the installed bin/gpuctl-node, which imports the agent as on a node; `AGENT_PATH` is
the installed lib/gpuctl_node.py, for the tests that load it as a module. Its bytecode is written
with the tree: running or loading the source itself would compile its 4,700 lines at every call
(a tenth of a CPU-second each, and the unit tests make hundreds of calls).
"""

from __future__ import annotations

import py_compile
import shutil
import tempfile
from pathlib import Path

from gpuctl.common.paths import cache_dir
from gpuctl.configplane import bundle


def _installed() -> Path:
    """~/.gpuctl's tree of these sources, made once per sources (the name holds their hash) and
    whole: written aside, then renamed into place, so test workers racing to make it all get one."""
    root = cache_dir() / f"node-{bundle.sources_hash()[:32]}"
    command = root / "bin" / "gpuctl-node"
    if command.is_file():
        return command
    try:
        root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = Path(tempfile.mkdtemp(prefix=".node-", dir=root.parent))
    except OSError:  # no cache here: a tree of this process's own
        root = Path(tempfile.mkdtemp(prefix="gpuctl-node-"))
        scratch, command = root / "tree", root / "tree" / "bin" / "gpuctl-node"
    for rel, (data, mode) in bundle.files().items():
        path = scratch / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(int(mode, 8))
    py_compile.compile(str(scratch / bundle.AGENT), doraise=True)
    if scratch.parent == root:
        return command
    try:
        scratch.rename(root)
    except OSError:  # another worker's tree is there already
        shutil.rmtree(scratch, ignore_errors=True)
    return command


COMMAND = _installed()
AGENT_PATH = COMMAND.parent.parent / bundle.AGENT
