#!/usr/bin/env python3
"""The cluster's job queue on local nodes: from a job's end to the next waiting job's ranks running.

For each cluster size N (`--nodes`, default 1,8): one local cluster named with H100:8 (8 GPUs per
node, as the queue counts them; local nodes need no GPU), then R rounds (`--repeats`, default 5):

  hold      `gpuctl exec -d --gpus 8`: on every node a rank that waits for a go-file, then
            writes time.time() and ends (all GPUs of every node held)
  waiting   `gpuctl exec -d --gpus 8`: on every node a rank that writes time.time() as it
            starts; it waits in the head's queue behind `hold`
  go        the go-files touched by a CPU job (`gpuctl exec -- ...`, which the queue never holds)
  hand-over the waiting job's last rank start minus the holding job's last rank end (the nodes
            share this machine's clock): GPUs freed, the head's queue woken, the next job's
            relays spawned and every rank started

Floors in the same run, on the same cluster while idle: `gpuctl exec NAME -- true` (the whole job
path from this machine: submit to every rank ended) and, where pdsh is installed, `pdsh -w
<every node> true` (the parallel-ssh floor): the hand-over starts a job's ranks from the head
alone, without the controller's part. Goal: hand-over <= 1 s at every N.

    .venv/bin/python benchmarks/queue.py [--nodes 1,8] [--repeats 5] [--plot queue.png] [--json queue.json]

Needs what the local nodes need (root for netns mode, terraform, sshd, rsync); pdsh is optional.
Everything lives in a temp GPUCTL_STATE_DIR; every cluster is torn down and checked to be gone.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

GOAL_S = 1.0
STAMP = 'python3 -c "import time; print(repr(time.time()))"'
SSH_OPTIONS = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes", "LogLevel=ERROR")


def job_status(name: str, job_id: int, env: dict[str, str]) -> str:
    doc = json.loads("".join(ln.text for ln in bl.run_gpuctl("queue", name, "-o", "json", env=env).stdout))
    return next(j["status"] for j in doc["jobs"] if j["id"] == job_id)


def wait_status(name: str, job_id: int, wanted: str, env: dict[str, str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (status := job_status(name, job_id, env)) != wanted:
        if time.monotonic() > deadline or status in ("FAILED", "CANCELLED", "FAILED_SETUP"):
            raise RuntimeError(f"job {job_id} of {name}: {status}, not {wanted}, after {timeout:g}s")
        time.sleep(0.2)


def submitted(run: bl.Gpuctl) -> int:
    line = run.first(r"^Job \d+ (detached|waits in the queue)")
    if line is None:
        raise RuntimeError("no job id in:\n" + run.describe())
    return int(line.text.split()[1])


def node_values(name: str, command: str, env: dict[str, str]) -> dict[str, list[float]]:
    """`gpuctl exec NAME -- bash -c COMMAND` (a CPU job: runs at once); each node's numbers printed."""
    run = bl.run_gpuctl("exec", name, "--", "bash", "-c", command, env=env)
    found: dict[str, list[float]] = {}
    for ln in run.stdout:
        m = re.match(r"^\(([^,]+), rank=\d+\) (\S+)$", ln.text)
        if m:
            found.setdefault(m.group(1), []).append(float(m.group(2)))
    return found


def handover(name: str, n: int, tag: str, env: dict[str, str]) -> float:
    hold = (f"mkdir -p ~/qb; while [ ! -e ~/qb/{tag}.go ]; do sleep 0.02; done; "
            f"{STAMP} > ~/qb/{tag}.end")
    holder = submitted(bl.run_gpuctl("exec", name, "-d", "--gpus", "8", "--", "bash", "-c", hold, env=env))
    wait_status(name, holder, "RUNNING", env)
    waiter = submitted(bl.run_gpuctl("exec", name, "-d", "--gpus", "8", "--", "bash", "-c",
                                     f"mkdir -p ~/qb; {STAMP} > ~/qb/{tag}.start", env=env))
    if job_status(name, waiter, env) != "PENDING":
        raise RuntimeError(f"job {waiter} did not wait behind job {holder}")
    node_values(name, f"touch ~/qb/{tag}.go", env)
    wait_status(name, waiter, "SUCCEEDED", env)
    ends = node_values(name, f"cat ~/qb/{tag}.end", env)
    starts = node_values(name, f"cat ~/qb/{tag}.start", env)
    if len(ends) != n or len(starts) != n:
        raise RuntimeError(f"times from {len(ends)}/{len(starts)} of {n} nodes")
    return max(v[0] for v in starts.values()) - max(v[0] for v in ends.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    bl.preflight()
    bl.sigterm_as_interrupt()
    results = []
    with bl.state_dir("gpuctl-queue-") as (root, env):
        for n in sizes:
            name = f"q{n}"
            with bl.LocalCluster(name, n, root, env, accelerators="H100:8", provision_only=False) as cluster:
                bl.run_gpuctl("exec", name, "--", "true", env=env)  # warm: prepared, ControlMaster up
                hand, exec_true, pdsh = [], [], []
                hosts = bl.read_inventory(cluster.cdir)
                ports = {int(h.get("ansible_port", 22)) for h in hosts}
                pdsh_argv = None
                if shutil.which("pdsh") and len(ports) == 1:
                    ssh_args = [f"-i {hosts[0]['ansible_ssh_private_key_file']}", *(f"-o {o}" for o in SSH_OPTIONS),
                                f"-p {ports.pop()}"]
                    pdsh_argv = (["pdsh", "-R", "ssh", "-S", "-f", str(n), "-l", hosts[0]["ansible_user"], "-w",
                                  ",".join(h["ansible_host"] for h in hosts), "true"],
                                 {**env, "PDSH_SSH_ARGS_APPEND": " ".join(ssh_args)})
                for i in range(args.repeats):
                    hand.append(handover(name, n, f"r{i}", env))
                    exec_true.append(bl.timed_command([bl.gpuctl_python(), "-m", "gpuctl", "exec", name, "--", "true"],
                                                      env).wall)
                    if pdsh_argv is not None:
                        pdsh.append(bl.timed_command(*pdsh_argv).wall)
                results.append({"nodes": n, "handover_s": hand, "exec_true_s": exec_true, "pdsh_s": pdsh})
    rows = [[str(r["nodes"]), bl.fmt_summary(r["handover_s"]), bl.fmt_summary(r["exec_true_s"]),
             bl.fmt_summary(r["pdsh_s"]) if r["pdsh_s"] else "-",
             f"{statistics.median(r['handover_s']) / statistics.median(r['pdsh_s']):.1f}x" if r["pdsh_s"] else "-",
             "PASS" if max(r["handover_s"]) <= GOAL_S else "FAIL"] for r in results]
    print(bl.machine_note())
    print(bl.table(["nodes", "hand-over s (min / median / max)", "exec -- true s", "pdsh true s",
                    "hand-over / pdsh", f"goal: max <= {GOAL_S:g} s"], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot and (plt := bl.pyplot()) is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.boxplot([r["handover_s"] for r in results], labels=[str(r["nodes"]) for r in results])
        ax.axhline(GOAL_S, color="red", linestyle="--", label="goal")
        ax.set_xlabel("nodes")
        ax.set_ylabel("job end -> next job's ranks running (s)")
        ax.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0 if all(max(r["handover_s"]) <= GOAL_S for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
