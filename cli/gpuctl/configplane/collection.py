"""The Ansible collection gpuctl.cluster, built: gpuctl's roles and playbooks with the node bundle.

The repository's ansible/ holds no built file: the role gpuctl_node's files/ (the agent, its
command, the node's probes) are made from cli/gpuctl/node/ (bundle.py) into a copy of ansible/,
which `ansible-galaxy collection build` then packs. `make collection` runs this.

    python -m gpuctl.configplane.collection OUTPUT_DIR
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuctl.common.paths import ansible_dir
from gpuctl.configplane import bundle

ROLE_FILES = Path("roles") / "gpuctl_node" / "files"


class CollectionError(Exception):
    pass


def build(output: Path, *, galaxy: str | None = None) -> Path:
    """The collection's tarball in `output` (made if missing); `galaxy`: the ansible-galaxy to use
    (default: the one beside this Python, else on PATH)."""
    galaxy = galaxy or _galaxy()
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuctl-collection-") as tmp:
        tree = Path(tmp) / "ansible"
        shutil.copytree(ansible_dir(), tree, ignore=shutil.ignore_patterns("__pycache__", ".ansible", "*.retry"))
        bundle.write(tree / ROLE_FILES)
        proc = subprocess.run([galaxy, "collection", "build", str(tree), "--output-path", str(output), "--force"],
                              capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode != 0:
        raise CollectionError((proc.stderr or proc.stdout).strip() or f"ansible-galaxy: exit code {proc.returncode}")
    built = sorted(output.glob("gpuctl-cluster-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not built:
        raise CollectionError(f"ansible-galaxy wrote no gpuctl-cluster-*.tar.gz into {output}")
    return built[-1]


def _galaxy() -> str:
    beside = Path(sys.executable).parent / "ansible-galaxy"
    return str(beside) if beside.exists() else (shutil.which("ansible-galaxy") or "ansible-galaxy")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m gpuctl.configplane.collection OUTPUT_DIR", file=sys.stderr)
        return 2
    try:
        print(build(Path(args[0])))
    except (CollectionError, OSError, bundle.BuildError) as exc:
        print(f"gpuctl collection: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
