"""The package's shape, checked: folders depend one way, no import cycles, small modules,
provider names branched on only inside providers/, event letters only in the protocol.

docs/architecture.md ("Where code lives") states the order these tests hold the code to.
Every import counts, the ones inside functions too: a cycle hidden in a function is
still a cycle for a reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cli" / "gpuctl"

# Lowest first: a module may import from its own folder and from folders before it.
LAYERS = ("node", "common", "spec", "providers", "state", "provision", "configplane", "jobplane", "healthcheck", "managed",
          "api", "dashboard", "cli")
# Top-level modules and the layer they belong to.
TOP_LEVEL = {"__init__": "common", "__main__": "cli", "cli": "cli", "clistart": "cli", "cliargs": "cli", "autostopcli": "cli",
             "costcli": "cli", "healthcli": "cli", "jobscli": "cli", "usage": "cli", "entrypoints": "cli",
             "logscli": "cli", "powercli": "cli", "dashboardcli": "cli",
             "pipelinecli": "cli"}
MAX_LINES = 800


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "common"  # the package itself: version and the lazy API table
    head = parts[1]
    return TOP_LEVEL.get(head, head) if len(parts) == 2 and head in TOP_LEVEL else head


def imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """Every gpuctl module `path` imports, anywhere in it (functions included), with the line."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name.startswith("gpuctl") and name != module:
                found.append((name, node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    known = set(mods)
    return {m: imports(p, m, known) for m, p in mods.items()}


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = sorted(m for m in modules() if layer_of(m) not in LAYERS)
    assert not unknown, f"modules outside the layers of docs/architecture.md: {unknown}"


def test_folders_depend_one_way() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for importer, targets in graph().items():
        for target, line in targets:
            if target == "gpuctl":
                continue  # `from gpuctl import __version__`
            if rank[layer_of(target)] > rank[layer_of(importer)]:
                upward.append(f"{importer}:{line} imports {target} ({layer_of(importer)} -> {layer_of(target)})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    edges = {m: sorted({t for t, _ in targets if t != "gpuctl"}) for m, targets in graph().items()}
    # A package's __init__ importing its own submodules is how a package exposes them, not a cycle
    # between rules; count it only when the submodule imports the package back by name.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_is_over_the_size_limit() -> None:
    big = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they do): {big}"


# A comparison of something naming a cloud (cloud, infra, provider) with a provider's name.
PROVIDER_NAME = re.compile(r"""\b(cloud|infra|provider)\w*\b.*?(==|!=|\bin)\s*[(\[{]?\s*["'](aws|local|ssh)["']"""
                           r"""|["'](aws|local|ssh)["']\s*(==|!=)\s*\S*\b(cloud|infra|provider)""")
# Outside providers/ only the infra-string parser may branch on a provider's name, and a few
# others at most (issue 21): each is listed here with its reason, so a new one is a decision.
ALLOWED_NAME_BRANCHES = 3


def test_provider_names_are_branched_on_inside_providers_only() -> None:
    found = []
    for m, p in modules().items():
        if layer_of(m) == "providers" or m == "gpuctl.spec.infra":
            continue
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if PROVIDER_NAME.search(line.split("#", 1)[0]):
                found.append(f"{p.relative_to(PACKAGE)}:{lineno}: {line.strip()}")
    assert len(found) <= ALLOWED_NAME_BRANCHES, "provider-name branches outside providers/:\n" + "\n".join(found)


@pytest.mark.parametrize("letter", ["H", "C", "Y", "B", "S", "O", "o", "X", "L", "P", "D"])
def test_event_letters_live_in_the_protocol_module(letter: str) -> None:
    compared = re.compile(rf"""(==|!=|\bin\s*[(\[{{])\s*["']{letter}["']|["']{letter}["']\s*(==|!=|,\s*["'][A-Za-z]["'])""")
    found = []
    for m, p in modules().items():
        if layer_of(m) == "node":  # both ends' own words: protocol.py defines them, the agent speaks them
            continue
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if compared.search(line.split("#", 1)[0]):
                found.append(f"{p.relative_to(PACKAGE)}:{lineno}: {line.strip()}")
    assert not found, f"event letter {letter!r} outside node/protocol.py:\n" + "\n".join(found)


def test_the_checker_sees_function_local_imports(tmp_path: Path) -> None:
    """The graph is only as good as its reader: an import inside a function is an edge."""
    source = tmp_path / "gpuctl" / "spec" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from gpuctl.jobplane import runner\n    return runner\n")
    assert imports(source, "gpuctl.spec.x", {"gpuctl.jobplane.runner", "gpuctl.jobplane"}) == \
        [("gpuctl.jobplane.runner", 2)]


# What the node's programs may import besides the standard library and gpuctl.node: the all-reduce
# probe's torch (the node's own) and ncclperf beside it; the launcher's agent, lib/gpuctl_node.py.
NODE_EXTRA_IMPORTS = {"gpuctl.node.allreduceprobe": {"torch", "ncclperf"}, "gpuctl.node.launcher": {"gpuctl_node"}}


def test_the_node_package_is_the_lowest_layer_and_standard_library_only() -> None:
    """Everything under node/ runs on nodes that have nothing but python3."""
    import sys

    found = []
    for m, p in modules().items():
        if layer_of(m) != "node":
            continue
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if name == "__future__" or name.startswith("gpuctl.node") or top in sys.stdlib_module_names:
                    continue
                if top not in NODE_EXTRA_IMPORTS.get(m, set()):
                    found.append(f"{p.relative_to(PACKAGE)}:{node.lineno} imports {name}")
    assert not found, "node/ imports outside the standard library and itself:\n" + "\n".join(found)


def test_no_node_module_has_a_copy_or_a_build_in_the_tree() -> None:
    """node/ is the one place of node code: no built agent and no copy of a node module elsewhere."""
    import subprocess

    repo = PACKAGE.parents[1]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=False).stdout
    if not tracked:
        pytest.skip("not a git checkout")
    node_files = {p.read_bytes(): p for p in (PACKAGE / "node").glob("*.py")}
    copies, built = [], []
    for rel in tracked.decode().split("\0"):
        path = repo / rel
        if not rel or path.is_symlink() or not path.is_file() or path.parent == PACKAGE / "node":
            continue
        data = path.read_bytes()
        if data in node_files:
            copies.append(f"{rel} is a copy of {node_files[data].relative_to(repo)}")
        if b"Built by gpuctl (configplane/bundle.py)" in data[:8000] and rel.endswith(".py") and \
                "configplane/bundle.py" not in rel:
            built.append(rel)
    links = [rel for rel in tracked.decode().split("\0") if rel and (repo / rel).is_symlink()]
    assert not copies and not built and not links, (copies, built, links)


# The controller reaches the node agent through one door (jobplane/agentcall.py): only it may write a
# `gpuctl-node` command line. Other mentions of the agent's name, each with its reason:
AGENT_DOOR = "gpuctl.jobplane.agentcall"
PATHS_ON_NODES = ("AGENT", "NODE_JOBS_DIR")  # protocol's paths that only the door puts in a command line
AGENT_NAME_ALLOWED = {
    ("gpuctl.configplane.bundle", "bin/gpuctl-node"),  # the launcher's file name in the bundle prepare installs
}


def agent_lines_outside_the_door(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """Where `tree` builds an agent command itself: protocol.AGENT (the agent's path) used or imported,
    protocol.NODE_JOBS_DIR (a job's files on a node, which only the agent reads), or 'gpuctl-node' in a
    string that is not a docstring (a literal, an f-string, a concatenation)."""
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PATHS_ON_NODES:
            found.append((node.lineno, f"protocol.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("protocol") and \
                (names := [alias.name for alias in node.names if alias.name in PATHS_ON_NODES]):
            found.append((node.lineno, f"imports {', '.join(names)}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "gpuctl-node" in node.value and \
                id(node) not in docstrings and (module, node.value) not in AGENT_NAME_ALLOWED:
            found.append((node.lineno, repr(node.value[:60])))
    return found


def test_only_the_door_writes_agent_command_lines() -> None:
    found = []
    for m, p in modules().items():
        if layer_of(m) == "node" or m == AGENT_DOOR:
            continue
        found += [f"{p.relative_to(PACKAGE)}:{line}: {what}"
                  for line, what in agent_lines_outside_the_door(ast.parse(p.read_text(), str(p)), m)]
    assert not found, ("gpuctl-node command lines outside jobplane/agentcall.py (use agentcall.command and "
                       "its calls):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    'from gpuctl.node import protocol\nline = f"{protocol.AGENT} status"\n',
    'from gpuctl.node.protocol import AGENT\n',
    'from gpuctl.node import protocol\nline = f"cat {protocol.NODE_JOBS_DIR}/{job}/events.log"\n',
    'line = "~/.gpuctl/bin/gpuctl-node " + word\n',
    'line = f"gpuctl-node kill {job}"\n',
    'line = " ".join(["gpuctl-node", "cancel", job])\n',
])
def test_the_door_checker_sees_a_command_line_built_elsewhere(source: str) -> None:
    assert agent_lines_outside_the_door(ast.parse(source), "gpuctl.jobplane.x")


def test_the_door_checker_leaves_docstrings_and_the_bundle_alone() -> None:
    source = '"""Calls `gpuctl-node submit`."""\n\ndef f():\n    """`gpuctl-node kill` too."""\n'
    assert not agent_lines_outside_the_door(ast.parse(source), "gpuctl.jobplane.x")
    assert not agent_lines_outside_the_door(ast.parse('FILES = {"bin/gpuctl-node": 1}\n'), "gpuctl.configplane.bundle")
