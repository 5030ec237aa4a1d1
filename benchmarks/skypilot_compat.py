#!/usr/bin/env python3
"""SkyPilot compatibility: `gpuctl validate` over SkyPilot's own example task YAMLs.

gpuctl takes SkyPilot's task format, and SkyPilot's examples are what users
copy. Issue 9's goal: >= 75% of those task YAMLs validate, no tracebacks, and
every rejection names the unsupported feature. This measures the first two and
groups the rejections so a person can check the third.

The corpus is a folder outside this repository (default /tmp/skypilot-examples)
holding SkyPilot's public repository's examples/ and llm/ with their paths
(see README.md; it is public reference data and never committed here). Every
*.yaml / *.yml under it is read; a task YAML is one that

  - parses as YAML, every document a mapping (or empty);
  - has no key outside SkyPilot's task schema (get_task_schema() in
    sky/utils/schemas.py) and the header of a pipeline / job group
    (name, execution, primary_tasks, termination_delay): this leaves out
    SkyPilot config and admin-policy files, volume specs, Kubernetes
    manifests, Helm values, docker-compose, cog.yaml, GitHub Actions and
    framework configs (axolotl, accelerate, LLaMA-Factory, torchtune, ...);
  - has, in some document, a key that makes a task: run, setup, resources,
    num_nodes, file_mounts, workdir, service or pool.

Pipelines and job groups (several documents), services (`service:`) and pools
(`pool:`) are task YAMLs. A file that does not parse counts as one when a line
starts with one of those keys at the top level (gpuctl then has to say why).

Each is checked with the real command, by default `gpuctl validate examples/.../NAME`
from the corpus root, as SkyPilot's docs run many examples (`--cwd file`: run in
the file's directory): SkyPilot resolves relative
workdir / file_mounts paths from the current directory. Each runs in a clean
environment: PATH and LANG from here, HOME and
GPUCTL_STATE_DIR in a private temp dir (nothing of this machine's ~ or
~/.gpuctl counts, so `~/...` file_mounts sources do not exist). validate
provisions and contacts nothing.

  accepted    exit 0
  rejected    exit 2 (a UserError: one `error:` line)
  traceback   "Traceback" in the output, any other exit code, or a timeout

Rejections are grouped by their error line with the `FILE:LINE:` prefix, quoted
values, mount destinations and absolute paths taken out (a file with several
problems is grouped by its first, the `error:` line; the others follow it on
lines of their own); the quoted values are listed beside each group.

    .venv/bin/python benchmarks/skypilot_compat.py [--corpus DIR] [--cwd file|root] [--floor 0.75] [--json PATH]

Exits 1 when the accepted share is below --floor or any traceback happened.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

DEFAULT_CORPUS = Path("/tmp/skypilot-examples")

# Top-level properties of SkyPilot's task schema (sky/utils/schemas.py, get_task_schema).
TASK_KEYS = frozenset({
    "name", "workdir", "event_callback", "num_nodes", "resources", "file_mounts", "service", "pool", "setup",
    "run", "envs", "secrets", "managed_secrets", "inputs", "outputs", "file_mounts_mapping", "config", "volumes",
    "volume_mounts", "api_server_access", "_metadata",
})
# The first document of a pipeline or a job group (sky/dag.py).
DAG_HEADER_KEYS = frozenset({"name", "execution", "primary_tasks", "termination_delay"})
# Keys only a task has: a file with none of them is not a task.
DEFINING_KEYS = frozenset({"run", "setup", "resources", "num_nodes", "file_mounts", "workdir", "service", "pool"})
TOP_LEVEL_DEFINING = re.compile(rf"^(?:{'|'.join(sorted(DEFINING_KEYS))}):", re.MULTILINE)

TIMEOUT_S = 120.0


def not_a_task(text: str) -> str | None:
    """None for a task YAML, else why it is not one (see the module docstring)."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return None if TOP_LEVEL_DEFINING.search(text) and not re.search(r"^apiVersion:", text, re.MULTILINE) \
            else "does not parse, and no top-level task key"
    if any(d is not None and not isinstance(d, dict) for d in docs):
        return "a document is not a mapping"
    maps = [d for d in docs if isinstance(d, dict)]
    extra = sorted({str(k) for d in maps for k in d} - TASK_KEYS - DAG_HEADER_KEYS)
    if extra:
        return "keys outside the task schema: " + ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
    if not any(DEFINING_KEYS & set(d) for d in maps):
        return "no task key (" + ", ".join(sorted(DEFINING_KEYS)) + ")"
    return None


def find_yamls(corpus: Path) -> list[Path]:
    return sorted(p for p in corpus.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


# -- one `gpuctl validate` ----------------------------------------------------------

QUOTED = re.compile(r"""(?<![\w'"`])('[^'\n]*'|"[^"\n]*"|`[^`\n]*`)(?![\w'"`])""")
KEY_PATH = re.compile(r"\b(file_mounts|envs|secrets)\.\S+?(?=: )")
ABS_PATH = re.compile(r"(?<![\w:/.])[~/][^\s,;()]*")


def reason_of(error_line: str, name: str) -> tuple[str, list[str]]:
    """(the error line normalised so that rejections group, the quoted values taken out)."""
    text = re.sub(r"^(?:error|Error): ", "", error_line.strip())
    if text.startswith(name + ":"):
        text = re.sub(r"^(?::\d+)*: ?", "", text[len(name):])
    values = [m.group(1)[1:-1] for m in QUOTED.finditer(text)]
    text = QUOTED.sub("'…'", text)
    text = KEY_PATH.sub(r"\1.<dst>", text)
    text = ABS_PATH.sub("<path>", text)
    return text, values


@dataclass
class Result:
    path: str  # relative to the corpus
    outcome: str  # accepted | rejected | traceback
    exit_code: int
    seconds: float
    error_line: str = ""
    reason: str = ""
    values: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    output: str = ""  # stdout + stderr for a traceback, else empty


def validate(path: Path, corpus: Path, env: dict[str, str], home: str, from_root: bool = False) -> Result:
    rel = str(path.relative_to(corpus))
    name, cwd = (rel, corpus) if from_root else (path.name, path.parent)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([bl.gpuctl_python(), "-m", "gpuctl", "validate", name], check=False, cwd=cwd,
                              env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=TIMEOUT_S)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, str(exc.stdout or ""), f"{exc.stderr or ''}\ntimed out after {TIMEOUT_S:g}s"
    seconds = time.perf_counter() - t0
    out, err = out.replace(home, "~"), err.replace(home, "~")
    lines = (out + err).splitlines()
    res = Result(rel, "accepted", rc, seconds,
                 warnings=[ln for ln in lines if ln.startswith(("warning:", "note:"))])
    if "Traceback" in out + err or rc not in (0, 2):
        res.outcome, res.output = "traceback", out + err
        res.error_line = next((ln for ln in reversed(lines) if ln.strip()), f"exit {rc}, no output")
    elif rc == 2:
        res.outcome = "rejected"
        res.error_line = next((ln for ln in lines if re.match(r"(?:error|Error):", ln)), "")
        res.reason, res.values = reason_of(res.error_line, name) if res.error_line else \
            ("(exit 2 without an error line)", [])
    return res


def clean_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
    env.update(HOME=str(root / "home"), GPUCTL_STATE_DIR=str(root / "state"), GPUCTL_PLAIN="1")
    (root / "home").mkdir()
    return env


def gpuctl_tree() -> str:
    """The commit gpuctl runs from, and whether the working tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(bl.REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(bl.REPO), "status", "--porcelain", "--", "cli"],
                               check=False, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head + (" + uncommitted changes under cli/" if dirty else "")


def corpus_note(corpus: Path) -> str:
    src = corpus / "SOURCE.txt"
    m = re.search(r"\b[0-9a-f]{40}\b", src.read_text()) if src.exists() else None
    return f"{corpus} (SkyPilot commit {m.group(0)[:12]})" if m else str(corpus)


# -- the report ------------------------------------------------------------------------


def pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def report(results: list[Result], scanned: int, excluded: dict[str, str], corpus: Path, floor: float,
           cwd: str) -> bool:
    total = len(results)
    by = Counter(r.outcome for r in results)
    warned = sum(1 for r in results if r.outcome == "accepted" and r.warnings)
    print(f"corpus: {corpus_note(corpus)}")
    where = "the corpus root" if cwd == "root" else "each file's directory"
    print(f"gpuctl: {gpuctl_tree()}; `gpuctl validate` run in {where}")
    print(f"{scanned} YAML files, {total} task YAMLs ({len(excluded)} others are not task YAMLs)\n")
    print(bl.table(["task YAMLs", "files", "share"], [
        ["accepted", str(by["accepted"]), pct(by["accepted"], total)],
        ["  of which with warnings", str(warned), pct(warned, total)],
        ["rejected", str(by["rejected"]), pct(by["rejected"], total)],
        ["tracebacks", str(by["traceback"]), pct(by["traceback"], total)],
        ["total", str(total), ""],
    ]))
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.outcome == "rejected":
            groups[r.reason].append(r)
    if groups:
        print(f"\nRejections by reason ({by['rejected']} files, {len(groups)} reasons)\n")
        rows = []
        for reason, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            vals = Counter(v for r in rs for v in r.values)
            shown = ", ".join(f"{v} ×{n}" if n > 1 else v for v, n in vals.most_common(6))
            rows.append([str(len(rs)), reason, shown + (", …" if len(vals) > 6 else ""),
                         ", ".join(r.path for r in rs[:3]) + (", …" if len(rs) > 3 else "")])
        print(bl.table(["files", "reason", "quoted values", "examples"], rows))
    tracebacks = [r for r in results if r.outcome == "traceback"]
    if tracebacks:
        print(f"\nTracebacks ({len(tracebacks)})\n")
        print(bl.table(["file", "exit", "last line"], [[r.path, str(r.exit_code), r.error_line] for r in tracebacks]))
    share = by["accepted"] / total if total else 0.0
    ok_share, ok_tb = share >= floor, not tracebacks
    print(f"\ngoal: accepted >= {floor:.0%}: {'PASS' if ok_share else 'MISS'} ({pct(by['accepted'], total)}); "
          f"tracebacks = 0: {'PASS' if ok_tb else 'MISS'} ({len(tracebacks)})")
    return ok_share and ok_tb and total > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                    help=f"folder with SkyPilot's examples/ and llm/; default {DEFAULT_CORPUS}")
    ap.add_argument("--cwd", choices=("file", "root"), default="root",
                    help="run validate in the corpus root (default, as SkyPilot's docs run examples) or in each file's directory")
    ap.add_argument("--floor", type=float, default=0.75, help="least accepted share to pass; default 0.75")
    ap.add_argument("--json", type=Path, help="write every file's result (and the files left out) as JSON")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 2, help="validations at once")
    args = ap.parse_args()
    corpus = args.corpus.resolve()
    if not corpus.is_dir():
        raise SystemExit(f"{corpus}: no such folder; see benchmarks/README.md (skypilot_compat.py) for the corpus")

    yamls = find_yamls(corpus)
    excluded: dict[str, str] = {}
    tasks: list[Path] = []
    for p in yamls:
        why = not_a_task(p.read_text(errors="replace"))
        if why is None:
            tasks.append(p)
        else:
            excluded[str(p.relative_to(corpus))] = why

    root = Path(tempfile.mkdtemp(prefix="gpuctl-bench-compat-"))
    try:
        env = clean_env(root)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda p: validate(p, corpus, env, env["HOME"], args.cwd == "root"), tasks))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ok = report(results, len(yamls), excluded, corpus, args.floor, args.cwd)
    if args.json:
        args.json.write_text(json.dumps({
            "corpus": str(corpus), "gpuctl": gpuctl_tree(), "cwd": args.cwd, "floor": args.floor,
            "results": [asdict(r) for r in results],
            "not_task_yamls": [{"path": k, "why": v} for k, v in sorted(excluded.items())],
        }, indent=1, ensure_ascii=False) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
