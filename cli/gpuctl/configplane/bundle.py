"""The node bundle: what prepare puts under ~/.gpuctl on every node, built from gpuctl/node/.

Everything that runs on a node is written in one package, gpuctl/node/ (standard library only),
and reaches a node one way: this bundle, which the prepare play's install step writes (role
gpuctl_node) and a head hands its workers (jobplane/headinstall.py). Nothing of it is committed
as built: like Ansible's AnsiballZ payloads, it is made when gpuctl needs it and cached by the
hash of its sources, so a fresh checkout, an edited module and an installed wheel each get the
bundle their own sources make, byte for byte the same for the same sources (the fingerprint of
a prepared node hashes these bytes).

The agent is ONE file on a node (lib/gpuctl_node.py, imported by bin/gpuctl-node) yet written
as modules with one job each. `build_agent` joins them, in AGENT_MODULES' order, into a single
namespace: their docstrings and bodies as they are, their standard-library imports once at the
top, their imports of one another (gpuctl.node.*) dropped, since every name is then defined
above its use. It refuses what would not survive the join: an import of anything but the
standard library or an earlier module, a `from __future__` import, a name defined at the top of
two modules, a name read but defined nowhere. The node's standalone programs (the fabric probe,
the health probe, the all-reduce probe and its nccl-tests helper) go as the files they are.

    python -m gpuctl.configplane.bundle DIR   # write the bundle's files into DIR (make collection)
"""

from __future__ import annotations

import ast
import base64
import builtins
import hashlib
import sys
import tempfile
import zlib
from functools import lru_cache
from pathlib import Path

from gpuctl.common.paths import cache_dir, keep_in_cache

NODE = Path(__file__).resolve().parents[1] / "node"  # cli/gpuctl/node
# Dependency order: each module imports only from those before it.
AGENT_MODULES = (
    "reserved.py",
    "protocol.py",
    "procs.py",
    "peerssh.py",
    "jobdir.py",
    "install.py",
    "peerinstall.py",
    "autostop.py",
    "containers.py",
    "stages.py",
    "spotnotice.py",
    "epochs.py",
    "gpuqueue.py",
    "follow.py",
    "destinations.py",
    "buckets.py",
    "relay.py",
    "coordinator.py",
    "main.py",
)
OVERVIEW = "__init__.py"  # its docstring is the agent file's
AGENT = "lib/gpuctl_node.py"
# Where each file goes under ~/.gpuctl, from which module of gpuctl/node/, with its mode.
PROGRAMS = {
    "bin/gpuctl-node": ("launcher.py", "0755"),
    "lib/gpuctl-fabric-probe": ("fabricprobe.py", "0755"),
    "lib/nodehealth.py": ("nodehealth.py", "0644"),
    "lib/allreduceprobe.py": ("allreduceprobe.py", "0644"),
    "lib/ncclperf.py": ("ncclperf.py", "0644"),
}


class BuildError(Exception):
    pass


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


def build_agent() -> str:
    """The agent's one file, joined from AGENT_MODULES."""
    earlier: dict[str, str] = {}  # module name -> path, of the modules joined so far
    owner: dict[str, str] = {}  # top-level name -> the module defining it
    stdlib: list[str] = []
    bodies: list[str] = []
    for rel in AGENT_MODULES:
        source = (NODE / rel).read_text()
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
        earlier["gpuctl.node." + rel[:-len(".py")]] = rel
        kept = [line for i, line in enumerate(lines) if i not in drop]
        text = "\n".join(kept).strip("\n")
        while "\n\n\n\n" in text:  # where the imports were
            text = text.replace("\n\n\n\n", "\n\n\n")
        bodies.append(f"# {'-' * 20} {rel} {'-' * (75 - len(rel))}\n{text}\n")
    overview = ast.get_docstring(ast.parse((NODE / OVERVIEW).read_text()), clean=False)
    header = (
        "#!/usr/bin/env python3\n"
        f'"""{overview}"""\n'
        "# Built by gpuctl (configplane/bundle.py) from cli/gpuctl/node/, the modules named below: edit those.\n\n"
        + "\n".join(sorted(stdlib, key=lambda s: (s.startswith("from "), s))) + "\n"
    )
    artifact = header + "\n\n" + "\n\n".join(bodies)
    tree = ast.parse(artifact)
    unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                     - _bound_names(tree) - set(dir(builtins)) - {"__file__", "__name__"})
    if unknown:
        raise BuildError(f"read but defined nowhere in the agent: {', '.join(unknown)}")
    return artifact


def sources_hash() -> str:
    """sha256 over every module the bundle is made of: the cache key of the built agent."""
    h = hashlib.sha256()
    for rel in (OVERVIEW, *AGENT_MODULES, *sorted(src for src, _ in PROGRAMS.values())):
        h.update(rel.encode() + b"\0" + hashlib.sha256((NODE / rel).read_bytes()).digest())
    return h.hexdigest()


@lru_cache(maxsize=None)
def _agent_for(key: str) -> str:
    path = cache_dir() / f"agent-{key[:32]}.py"
    try:
        return path.read_text()
    except OSError:
        pass
    text = build_agent()
    keep_in_cache(path, text)
    return text


def agent_text() -> str:
    """The agent as one file, built from the sources as they are now (cached by their hash)."""
    return _agent_for(sources_hash())


def agent_file() -> Path:
    """The built agent as a file (tests load it and run it as a node would)."""
    text = agent_text()
    path = cache_dir() / f"agent-{sources_hash()[:32]}.py"
    if not path.is_file():  # the cache could not be written: a private copy
        path = Path(tempfile.mkdtemp(prefix="gpuctl-agent-")) / "gpuctl_node.py"
        path.write_text(text)
    return path


def files() -> dict[str, tuple[bytes, str]]:
    """{path under ~/.gpuctl: (bytes, mode)}: everything prepare installs on a node."""
    out = {AGENT: (agent_text().encode(), "0644")}
    out.update({rel: ((NODE / src).read_bytes(), mode) for rel, (src, mode) in PROGRAMS.items()})
    return out


def packed_files() -> dict[str, dict[str, str]]:
    """files() as the install step's bundle carries them: {path: {mode, zdata}} (zlib, then base64: 40%
    of the bytes in each node's module run). Role gpuctl_node reads them as `gpuctl_agent_files`.
    Compressed once per process and sources (a prepare asks for them for the play and the head's install)."""
    return {rel: dict(entry) for rel, entry in _packed_for(sources_hash()).items()}


@lru_cache(maxsize=None)
def _packed_for(key: str) -> dict[str, dict[str, str]]:
    return {rel: {"mode": mode, "zdata": base64.b64encode(zlib.compress(data, 6)).decode()}
            for rel, (data, mode) in files().items()}


def write(directory: Path) -> list[Path]:
    """The bundle's files into `directory` by their base names (the role's files/, for a collection)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, (data, mode) in files().items():
        path = directory / Path(rel).name
        path.write_bytes(data)
        path.chmod(int(mode, 8))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m gpuctl.configplane.bundle DIR", file=sys.stderr)
        return 2
    try:
        written = write(Path(args[0]))
    except BuildError as exc:
        print(f"gpuctl agent build: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
