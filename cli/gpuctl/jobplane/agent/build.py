"""Builds the node agent's one file, jobplane/gpuctl_node.py, from its modules (`make agent`).

A node gets the agent as ONE standard-library file (~/.gpuctl/bin/gpuctl-node,
copied by the prepare play), yet it is written as modules with one job each.
This joins them, in MODULES' order, into a single namespace: their docstrings
and bodies as they are, their standard-library imports once at the top, and
their imports of one another (gpuctl.*) dropped, since every name is then
defined above its use. The build refuses what would not survive the join: an
import of anything but the standard library or an earlier module, a `from
__future__` import, a name defined at the top of two modules, a name read
but defined nowhere. The result is committed (tests/unit/test_agent_build.py
fails when it differs from a fresh build); prepare's fingerprint hashes it.

    python -m gpuctl.jobplane.agent.build           # write jobplane/gpuctl_node.py
    python -m gpuctl.jobplane.agent.build --check   # exit 1 if it is stale
"""

from __future__ import annotations

import ast
import builtins
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # cli/gpuctl
# Dependency order: each module imports only from those before it.
MODULES = (
    "spec/reserved.py",
    "jobplane/protocol.py",
    "jobplane/agent/procs.py",
    "jobplane/agent/peerssh.py",
    "jobplane/agent/jobdir.py",
    "jobplane/agent/install.py",
    "jobplane/agent/peerinstall.py",
    "jobplane/agent/autostop.py",
    "jobplane/agent/containers.py",
    "jobplane/agent/stages.py",
    "jobplane/agent/spotnotice.py",
    "jobplane/agent/epochs.py",
    "jobplane/agent/follow.py",
    "jobplane/agent/destinations.py",
    "jobplane/agent/buckets.py",
    "jobplane/agent/relay.py",
    "jobplane/agent/coordinator.py",
    "jobplane/agent/main.py",
)
OVERVIEW = "jobplane/agent/__init__.py"  # its docstring is the artifact's
ARTIFACT = PACKAGE / "jobplane" / "gpuctl_node.py"
REGENERATE = "make agent"  # or: python -m gpuctl.jobplane.agent.build


class BuildError(Exception):
    pass


def _module_name(rel: str) -> str:
    return "gpuctl." + rel[:-len(".py")].replace("/", ".")


def _top_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name bound anywhere (scope-blind): enough to find one that is bound nowhere."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound


def build() -> str:
    """The artifact's text."""
    earlier: dict[str, str] = {}  # module name -> path, of the modules joined so far
    owner: dict[str, str] = {}  # top-level name -> the module defining it
    stdlib: list[str] = []
    bodies: list[str] = []
    for rel in MODULES:
        source = (PACKAGE / rel).read_text()
        tree = ast.parse(source, filename=rel)
        lines = source.split("\n")
        drop: set[int] = set()
        for node in tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            assert node.end_lineno is not None
            drop.update(range(node.lineno - 1, node.end_lineno))
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                raise BuildError(f"{rel}: {text}: the agent runs on Python 3.6")
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in modules:
                top = module.split(".")[0]
                if top == "gpuctl":
                    if module not in earlier:
                        raise BuildError(f"{rel}: {text}: {module} is not a module joined before this one")
                elif top not in sys.stdlib_module_names or getattr(node, "level", 0):
                    raise BuildError(f"{rel}: {text}: the agent uses the standard library only")
                elif text not in stdlib:
                    stdlib.append(text)
        for name in _top_names(tree):
            if name in owner:
                raise BuildError(f"{name} is defined in both {owner[name]} and {rel}: one namespace in the agent")
            owner[name] = rel
        earlier[_module_name(rel)] = rel
        kept = [line for i, line in enumerate(lines) if i not in drop]
        text = "\n".join(kept).strip("\n")
        while "\n\n\n\n" in text:  # where the imports were
            text = text.replace("\n\n\n\n", "\n\n\n")
        bodies.append(f"# {'-' * 20} {rel} {'-' * (75 - len(rel))}\n{text}\n")
    overview = ast.get_docstring(ast.parse((PACKAGE / OVERVIEW).read_text()), clean=False)
    header = (
        "#!/usr/bin/env python3\n"
        f'"""{overview}"""\n'
        f"# Generated by gpuctl.jobplane.agent.build from the modules named below -- do not edit; run "
        f"`{REGENERATE}`.\n\n"
        + "\n".join(sorted(stdlib, key=lambda s: (s.startswith("from "), s))) + "\n"
    )
    artifact = header + "\n\n" + "\n\n".join(bodies)
    tree = ast.parse(artifact)
    unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                     - _bound_names(tree) - set(dir(builtins)) - {"__file__", "__name__"})
    if unknown:
        raise BuildError(f"read but defined nowhere in the agent: {', '.join(unknown)}")
    return artifact


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        text = build()
    except BuildError as exc:
        print(f"gpuctl agent build: {exc}", file=sys.stderr)
        return 2
    if args == ["--check"]:
        if not ARTIFACT.exists() or ARTIFACT.read_text() != text:
            print(f"{ARTIFACT} is not what its modules build; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m gpuctl.jobplane.agent.build [--check]", file=sys.stderr)
        return 2
    if not ARTIFACT.exists() or ARTIFACT.read_text() != text:
        ARTIFACT.write_text(text)
    ARTIFACT.chmod(0o755)
    print(f"{ARTIFACT.relative_to(PACKAGE.parent)}: {len(text.splitlines())} lines from {len(MODULES)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
