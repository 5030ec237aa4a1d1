#!/usr/bin/env python3
"""How fast gpuctl starts: `gpuctl --version`, `gpuctl --help` and a warm `gpuctl exec`,
beside the floors they sit on, in one run on this machine.

Every command is `python -m gpuctl ...` as a subprocess, R times (`--repeats`, default 10),
round-robin with the order rotated each repeat; the table gives medians of wall time and of
CPU (user+sys of the command's process tree: the RUSAGE_CHILDREN delta around it).

  start   `gpuctl --version` and `gpuctl --help`, beside `python -c pass` and
          `python -c 'import typer'` (what any typer CLI pays before its own code runs).
          Python reads bytecode from a private PYTHONPYCACHEPREFIX filled by one unmeasured
          run, as an installed gpuctl reads the .pyc files pip wrote. Where the environment
          sets PYTHONDONTWRITEBYTECODE (some images and sandboxes do), a source tree's modules
          are compiled on every run instead: the same two commands are measured that way too
          ("compiled each run": the library .pyc files kept, gpuctl's own left out).
  exec    for N in `--nodes` (default 1,8): a local cluster (`gpuctl apply --provision-only`),
          one unmeasured `gpuctl exec NAME -- true` (it prepares the nodes), then R repeats of
            gpuctl  gpuctl exec NAME -- true
            pdsh    pdsh -R ssh -S -f N -w <every node> true (jobplane.py's command: the
                    cluster's key, no ControlMaster)
            ssh     ssh <the head> true (N = 1 only)
          and once more, unmeasured, under `python -X importtime`: the modules a warm exec
          loads, checked against the ones it must not need (pydantic, Ansible, Terraform's
          wrapper, boto3, rich).

Goals (PASS / MISS at the end): `--version` and `--help` <= 0.15 s wall (median, bytecode
cached); a warm exec <= 2x pdsh on the same nodes in the same run; a warm exec imports none of
the modules above.

    .venv/bin/python benchmarks/start.py [--nodes 1,8] [--repeats 10] [--plot start.png] [--json start.json]
    .venv/bin/python benchmarks/start.py --nodes 0      # only --version and --help: no nodes, no root
    .venv/bin/python benchmarks/start.py --baseline /tmp/before   # git archive OLD | tar -x -C /tmp/before

The gpuctl measured is the one this interpreter imports. `--baseline TREE` measures another
checkout's gpuctl (TREE/cli) beside it, interleaved, its rows marked "(baseline)": a before and
after under the same load (its exec runs on the same warm clusters). Local nodes need what
jobplane.py's need (root for netns mode, terraform, sshd, rsync) and pdsh (`apt-get install -y
pdsh`); every cluster is torn down and checked to be gone, also when the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import jobplane as jp  # noqa: E402

# Goals
GOAL_START_S = 0.15  # s wall: `gpuctl --version`, `gpuctl --help`
GOAL_VS_PDSH = 2.0  # warm exec / pdsh on the same nodes
# What a warm exec must not import: the spec's models, provisioning, Ansible, the clouds' SDKs, rich.
NOT_FOR_EXEC = ("pydantic", "ansible", "ansible_runner", "boto3", "botocore", "rich",
                "gpuctl.spec.models", "gpuctl.provision.provisioner", "gpuctl.provision.terraform")


@dataclass
class Sample:
    rep: int
    rc: int
    wall: float
    cpu: float
    error: str | None = None


@dataclass
class Row:
    """One command measured R times."""

    label: str
    argv: list[str]
    n: int | None = None  # nodes (exec and its baselines)
    kind: str = "start"  # start, compiled, floor, exec, tool (pdsh, ssh), before (the --baseline tree's)
    samples: list[Sample] = field(default_factory=list)

    def median(self, what: str = "wall") -> float | None:
        vals = [getattr(s, what) for s in self.samples if s.error is None]
        return statistics.median(vals) if vals else None

    def least(self) -> float | None:
        vals = [s.wall for s in self.samples if s.error is None]
        return min(vals) if vals else None


@dataclass
class Results:
    gpuctl: str  # the package measured, and its commit
    baseline: str | None  # --baseline's
    machine_before: str
    args: dict
    machine_after: str = ""
    bytecode_note: str = ""
    rows: list[Row] = field(default_factory=list)
    exec_imports: dict[int, list[str]] = field(default_factory=dict)  # N -> modules of NOT_FOR_EXEC loaded
    notes: list[str] = field(default_factory=list)


# -- bytecode --------------------------------------------------------------------------------


def gpuctl_package() -> Path:
    out = subprocess.run([bl.gpuctl_python(), "-c", "import gpuctl; print(gpuctl.__file__)"], capture_output=True,
                         text=True, check=True, env=os.environ).stdout.strip()
    return Path(out).resolve().parent


def describe_gpuctl(package: Path) -> str:
    head = subprocess.run(["git", "-C", str(package), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", "."], capture_output=True,
                           text=True).stdout.strip()
    return f"{package} at {head[:72] or '(not a git checkout)'}" + (" (with uncommitted changes)" if dirty else "")


def cached_env(env: dict[str, str], prefix: Path) -> dict[str, str]:
    """`env` with bytecode read from and written to a private PYTHONPYCACHEPREFIX, filled here by one
    run of each start command (exec's modules: by its warm-up run)."""
    cached = {**env, "PYTHONPYCACHEPREFIX": str(prefix)}
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    for args in (["-m", "gpuctl", "--help"], ["-m", "gpuctl", "--version"], ["-c", "import typer"]):
        subprocess.run([bl.gpuctl_python(), *args], env=cached, capture_output=True)
    return cached


def bytecode_envs(root: Path, env: dict[str, str], package: Path) -> tuple[dict[str, str], dict[str, str] | None]:
    """(cached, compiled each run or None): the environments the start rows run in. Cached: a private
    PYTHONPYCACHEPREFIX that Python fills on the first run and reads after. Compiled each run: the
    same cache without gpuctl's own modules, and PYTHONDONTWRITEBYTECODE, as a source tree runs where
    the environment sets it (only measured where it does)."""
    cached = cached_env(env, root / "pyc-cached")
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return cached, None
    compiled_prefix = root / "pyc-compiled"
    shutil.copytree(root / "pyc-cached", compiled_prefix, symlinks=True)
    shutil.rmtree(compiled_prefix / str(package).lstrip("/"), ignore_errors=True)
    return cached, {**env, "PYTHONPYCACHEPREFIX": str(compiled_prefix), "PYTHONDONTWRITEBYTECODE": "1"}


# -- measuring -------------------------------------------------------------------------------


def run_row(row: Row, env: dict[str, str], rep: int, timeout: float, expect_rc: int = 0) -> Sample:
    t = bl.timed_command(row.argv, env, timeout=timeout)
    s = Sample(rep, t.rc, t.wall, t.cpu)
    if t.rc != expect_rc:
        s.error = f"exit code {t.rc}: " + " | ".join(t.output.strip().splitlines()[-3:])
    elif jp.PREPARING in t.output:  # the agent or the prepare roles changed under the run: not a warm exec
        s.error = "prepared the nodes again (left out)"
    row.samples.append(s)
    return s


def interleaved(rows: list[tuple[Row, dict[str, str]]], repeats: int, timeout: float) -> None:
    """R rounds over `rows`, the order rotated each round (no row always runs first after a pause)."""
    for rep in range(repeats):
        k = rep % len(rows)
        for row, env in rows[k:] + rows[:k]:
            s = run_row(row, env, rep, timeout)
            where = f" N={row.n}" if row.n is not None else ""
            print(f"  rep {rep} {row.label}{where}: {s.wall:6.3f} s  cpu {s.cpu * 1000:5.0f} ms"
                  + (f"  ERROR {s.error}" if s.error else ""), flush=True)


def start_rows(cached: dict[str, str], compiled: dict[str, str] | None,
               before: dict[str, str] | None) -> list[tuple[Row, dict[str, str]]]:
    py = bl.gpuctl_python()
    rows = [(Row("python -c pass", [py, "-c", "pass"], kind="floor"), cached),
            (Row("python -c 'import typer'", [py, "-c", "import typer"], kind="floor"), cached),
            (Row("gpuctl --version", [py, "-m", "gpuctl", "--version"]), cached),
            (Row("gpuctl --help", [py, "-m", "gpuctl", "--help"]), cached)]
    if before is not None:
        rows += [(Row(f"{row.label} (baseline)", row.argv, kind="before"), before) for row, _ in rows[2:4]]
    if compiled is not None:
        rows += [(Row("gpuctl --version (compiled each run)", [py, "-m", "gpuctl", "--version"], kind="compiled"),
                  compiled),
                 (Row("gpuctl --help (compiled each run)", [py, "-m", "gpuctl", "--help"], kind="compiled"),
                  compiled)]
    return rows


def ssh_row(cluster: bl.LocalCluster) -> Row:
    head = bl.read_inventory(cluster.cdir)[0]
    options = [a for o in jp.SSH_OPTIONS for a in ("-o", o)]
    return Row("ssh HEAD true", ["ssh", "-i", head["ansible_ssh_private_key_file"], *options, "-p",
                                 str(head.get("ansible_port", 22)), f"{head['ansible_user']}@{head['ansible_host']}",
                                 "true"], n=cluster.num_nodes, kind="tool")


def imported_modules(cluster: bl.LocalCluster, env: dict[str, str], timeout: float) -> list[str]:
    """The modules of NOT_FOR_EXEC that a warm `gpuctl exec NAME -- true` loads (-X importtime)."""
    argv = [bl.gpuctl_python(), "-X", "importtime", "-m", "gpuctl", "exec", cluster.name, "--", "true"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=bl.REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"gpuctl exec under -X importtime: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    names = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)}
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in NOT_FOR_EXEC))


def one_size(n: int, args: argparse.Namespace, root: Path, env: dict[str, str], res: Results,
             before: dict[str, str] | None) -> None:
    name = f"bst{os.getpid() % 100000}n{n}"
    print(f"N={n}: bringing up {n} local node(s) ({bl.machine_note()})", flush=True)
    with bl.LocalCluster(name, n, root, env) as cluster:
        jp.warm_exec(cluster, env, args.timeout)
        tools = jp.tool_commands(cluster, env, root)
        rows = [(Row("gpuctl exec NAME -- true", tools["gpuctl"].argv, n=n, kind="exec"), env)]
        if before is not None:  # the same warm cluster: the job plane is the same in both trees
            rows.append((Row("gpuctl exec NAME -- true (baseline)", tools["gpuctl"].argv, n=n, kind="before"), before))
        if "pdsh" in tools:
            rows.append((Row("pdsh -w NODES true", tools["pdsh"].argv, n=n, kind="tool"), tools["pdsh"].env))
        else:
            res.notes.append(f"N={n}: no pdsh row (the nodes do not share one ssh port: loopback mode)")
        if n == 1:
            rows.append((ssh_row(cluster), env))
        for row, row_env in rows[1:]:  # unmeasured: the first ssh to the nodes of each (and the baseline's bytecode)
            run_row(Row(row.label, row.argv), row_env, -1, args.timeout)
        interleaved(rows, args.repeats, args.timeout)
        res.rows += [row for row, _ in rows]
        res.exec_imports[n] = imported_modules(cluster, env, args.timeout)


# -- report ------------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def pdsh_of(res: Results, row: Row) -> Row | None:
    """pdsh on the same nodes, for an exec row."""
    return next((r for r in res.rows if r.n == row.n and r.label.startswith("pdsh")), None)


def table(res: Results) -> str:
    version = next((r for r in res.rows if r.label == "gpuctl --version"), None)
    rows = []
    for r in res.rows:
        before = next((b for b in res.rows if b.label == f"{r.label} (baseline)" and b.n == r.n), None)
        vs = []
        if before is not None:
            vs.append(f"{jp.fmt_x(jp.ratio(r.median(), before.median()))} baseline")
        if r.kind in ("exec", "before") and (b := pdsh_of(res, r)) is not None:
            vs.append(f"{jp.fmt_x(jp.ratio(r.median(), b.median()))} pdsh")
        elif r.kind in ("compiled", "floor") and version is not None:
            vs.append(f"{jp.fmt_x(jp.ratio(r.median(), version.median()))} --version")
        errors = sum(1 for s in r.samples if s.error)
        rows.append([r.label, "-" if r.n is None else str(r.n), bl.fmt_s(r.median(), 3), bl.fmt_s(r.least(), 3),
                     ms(r.median("cpu")), ", ".join(vs), f"{errors} failed" if errors else ""])
    return bl.table(["command", "N", "wall s (median)", "wall s (min)", "cpu ms (median)", "ratio", ""], rows)


def goals(res: Results) -> list[tuple[str, str, bool | None]]:
    out: list[tuple[str, str, bool | None]] = []
    for label in ("gpuctl --version", "gpuctl --help"):
        row = next((r for r in res.rows if r.label == label), None)
        if row is not None and (w := row.median()) is not None:
            out.append((f"`{label}` <= {GOAL_START_S:g} s wall", f"{w:.3f} s", w <= GOAL_START_S))
    for row in (r for r in res.rows if r.kind == "exec"):
        b = pdsh_of(res, row)
        ratio = jp.ratio(row.median(), b.median() if b else None)
        out.append((f"warm exec on {row.n} node(s) <= {GOAL_VS_PDSH:g}x pdsh", jp.fmt_x(ratio),
                    None if ratio is None else ratio <= GOAL_VS_PDSH))
    for n, found in res.exec_imports.items():
        out.append((f"warm exec on {n} node(s) imports no pydantic, Ansible, Terraform, boto3, rich",
                    ", ".join(found) if found else "none of them", not found))
    return out


def report(res: Results) -> str:
    out = ["gpuctl start-up", f"gpuctl: {res.gpuctl}"] + ([f"baseline: {res.baseline}"] if res.baseline else [])
    out += [f"machine before: {res.machine_before}",
           f"machine after:  {res.machine_after}", res.bytecode_note, "",
           f"medians of {res.args['repeats']} runs each, interleaved; cpu = the command's process tree "
           "(ssh ControlMaster daemons not counted)", table(res), ""]
    g = goals(res)
    if g:
        out += ["goals:", bl.table(["goal", "measured", ""], [[a, b, jp.verdict(c)] for a, b, c in g])]
    out += [f"note: {n}" for n in res.notes]
    return "\n".join(out)


def plot(res: Results, path: Path) -> None:
    plt = bl.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(res.rows) + 1.5))
    labels = [r.label + ("" if r.n is None else f" (N={r.n})") for r in res.rows][::-1]
    for ax, what, title in ((axes[0], "wall", "wall s (median)"), (axes[1], "cpu", "CPU s (median)")):
        ax.barh(labels, [r.median(what) or 0 for r in res.rows][::-1],
                color=[{"start": "tab:blue", "exec": "tab:blue", "before": "tab:orange"}.get(r.kind, "tab:gray")
                       for r in res.rows][::-1])
        ax.set(title=title)
    axes[0].axvline(GOAL_START_S, color="tab:red", linestyle="--", linewidth=1, label=f"{GOAL_START_S:g} s goal")
    axes[0].legend(fontsize=8)
    axes[1].set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=lambda text: [n for n in jp.int_list(text) if n > 0], default=[1, 8],
                    help="cluster sizes N for the exec rows; default 1,8; 0: none (no nodes needed)")
    ap.add_argument("--repeats", "-r", type=int, default=10, help="runs of each command; default 10")
    ap.add_argument("--baseline", type=Path, metavar="TREE",
                    help="also measure the gpuctl of this checkout (TREE/cli), interleaved: a before/after")
    ap.add_argument("--timeout", type=float, default=600, help="per-command limit in seconds")
    ap.add_argument("--plot", type=Path, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write every sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp state dir after teardown")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.nodes:
        bl.preflight()
        jp.check_pdsh(["pdsh"])
    bl.sigterm_as_interrupt()
    package = gpuctl_package()
    baseline = args.baseline.resolve() / "cli" if args.baseline else None
    if baseline is not None and not (baseline / "gpuctl" / "cli.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: no gpuctl in {baseline}")
    res = Results(describe_gpuctl(package), describe_gpuctl(baseline / "gpuctl") if baseline else None,
                  bl.machine_note(),
                  {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    netns_before = bl.netns_names()
    with bl.state_dir("gpuctl-bench-start-", keep=args.keep) as (root, env):
        cached, compiled = bytecode_envs(root, env, package)
        before = cached_env({**env, "PYTHONPATH": str(baseline)}, root / "pyc-baseline") if baseline else None
        res.bytecode_note = ("bytecode: cached (a private PYTHONPYCACHEPREFIX, filled by one unmeasured run)"
                             + ("; `compiled each run`: PYTHONDONTWRITEBYTECODE is set here, so a source tree's "
                                "modules are compiled by every run (the libraries' .pyc kept)" if compiled else ""))
        print(f"start: --version and --help, {args.repeats} runs each ({bl.machine_note()})", flush=True)
        rows = start_rows(cached, compiled, before)
        interleaved(rows, args.repeats, args.timeout)
        res.rows += [row for row, _ in rows]
        for n in args.nodes:
            one_size(n, args, root, cached, res, before)
    res.machine_after = bl.machine_note()
    left = sorted(n for n in bl.netns_names() - netns_before if n.startswith("gnbst"))
    if left:
        res.notes.append(f"network namespaces left behind: {', '.join(left)}")
    print()
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(asdict(res), indent=1, default=str))
        print(f"json: {args.json}")
    if args.plot:
        plot(res, args.plot)
    failed = [s for r in res.rows for s in r.samples if s.error]
    return 1 if failed or left else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # clusters are already down (every `finally` ran)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
