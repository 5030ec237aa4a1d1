"""The cluster's job queue (issue 37) through the real `gpuctl` on one 2-node local cluster named
with H100:8: each node's capacity is 8 GPUs (local nodes have none; the queue counts what the task
named), so the queue and CUDA_VISIBLE_DEVICES are tested without a GPU.

A job that asks for GPUs waits on the head until they are free on its nodes (first come, first
served), then sees only its own; a CPU job runs at once; cancel takes a waiting job out of the
queue; the controller gone changes nothing; a job whose head coordinator was killed holds nothing.

Each job's run waits for a file on its node (~/gq/NAME.stop) before it ends, and writes when it
started and ended (time.time() on the nodes, this machine's clock) beside it, so the tests end
jobs when they want and time the queue from the nodes' side.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import uuid
from pathlib import Path

import pytest

from e2e import (Cluster, NodeInfo, Result, Watched, gpuctl_env, needs_local_nodes, pids_matching, queue_rows,
                 wait_for)

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "gq2"
MOD = f"gq{uuid.uuid4().hex[:8]}"  # in every job's processes: what outlives a test is found by it

TASK = f"""\
name: {NAME}
num_nodes: 2
resources:
  infra: local
  accelerators: H100:8
run: echo up
"""

# $1: the job's name here. Started and ended times on each node; the devices it was given.
JOB = (f'mkdir -p ~/gq; echo "$CUDA_VISIBLE_DEVICES $SKYPILOT_NUM_GPUS_PER_NODE" > ~/gq/"$1".gpus; echo "$1 runs"; '
       f'python3 -c "import time; print(repr(time.time()))" > ~/gq/"$1".start; '
       f'while [ ! -e ~/gq/"$1".stop ]; do (exec -a {MOD}-"$1" sleep 0.05); done; '
       f'python3 -c "import time; print(repr(time.time()))" > ~/gq/"$1".end')


@pytest.fixture(scope="module")
def gq(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("queue-local")
    cluster = Cluster(NAME, root / "state")
    task = root / "cluster.yaml"
    task.write_text(TASK)
    try:
        cluster.gpuctl("apply", str(task)).check()
        yield cluster
    finally:
        cluster.down_quietly()
        strays = pids_matching(MOD)
        for pid in strays:
            os.kill(pid, signal.SIGKILL)
        assert strays == [], f"processes of this module outlived the cluster: {strays}"


def submit(gq: Cluster, job: str, *flags: str) -> tuple[int, Result]:
    """`gpuctl exec -d` of JOB named `job`; (job id, its output)."""
    res = gq.gpuctl("exec", NAME, "-d", *flags, "--", "bash", "-c", JOB, "job", job).check()
    m = re.search(r"^Job (\d+) (detached|waits in the queue)\.", res.stdout + res.stderr, re.M)
    assert m, res.describe()
    return int(m.group(1)), res


def release(gq: Cluster, *jobs: str) -> None:
    for node in gq.nodes():
        gq.ssh(node, "mkdir -p ~/gq && touch " + " ".join(f"~/gq/{j}.stop" for j in jobs))


def read(gq: Cluster, node: NodeInfo, job: str, what: str) -> str | None:
    res = gq.ssh(node, f"cat ~/gq/{job}.{what} 2>/dev/null || true")
    return res.stdout.strip() or None


def rows(gq: Cluster) -> dict[int, list[str]]:
    return {int(r[0]): r for r in queue_rows(gq.gpuctl("queue", NAME).check().stdout)}


def status(gq: Cluster, job_id: int) -> str:
    return rows(gq)[job_id][2]


def wait_status(gq: Cluster, job_id: int, wanted: str, timeout: float = 60) -> None:
    wait_for(f"job {job_id} {wanted}", lambda: status(gq, job_id) == wanted, timeout, interval=0.5)


def watches(pid: int, cluster: str) -> bool:
    """Whether the process is gpuctl's background watcher of a job of `cluster` (`gpuctl _watch NAME ID`)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"_watch" in args and args[args.index(b"_watch") + 1:args.index(b"_watch") + 2] == [cluster.encode()]


def head_queue(gq: Cluster) -> str:
    return gq.ssh(gq.nodes()[0], "cat ~/.gpuctl/queue/state.json 2>/dev/null || true").stdout


def test_a_job_waits_for_the_gpus_a_running_job_holds_and_a_cpu_job_does_not(gq: Cluster) -> None:
    head, worker = gq.nodes()
    a, _ = submit(gq, "a", "--gpus", "8")
    wait_for("a started", lambda: read(gq, head, "a", "start"), 30)
    b, said = submit(gq, "b", "--gpus", "H100:8")
    assert f"Job {b} is pending: it waits for 8 GPU(s) on head held by job {a}" in said.stdout, said.describe()
    row = rows(gq)[b]
    assert row[2] == "PENDING" and f"waits for 8 GPU(s) on head held by job {a}" in " ".join(row), row
    doc = gq.gpuctl("queue", NAME, "-o", "json").check().stdout
    assert f'"detail": "waits for 8 GPU(s) on head held by job {a}"' in doc and '"status": "PENDING"' in doc

    # `logs` of the waiting job says what it waits for, then follows it once it runs
    follower = Watched([sys.executable, "-m", "gpuctl", "logs", NAME, str(b)], gpuctl_env(gq.state_dir),
                       lambda line: "b runs" in line)
    cpu = gq.gpuctl("exec", NAME, "--", "bash", "-c", 'echo "cpu [$CUDA_VISIBLE_DEVICES] $SKYPILOT_NUM_GPUS_PER_NODE"')
    cpu.check()  # beside a job holding every GPU: a CPU job asks none and runs at once
    assert "cpu [] 0" in cpu.stdout, cpu.describe()
    assert read(gq, head, "b", "start") is None and status(gq, b) == "PENDING"

    release(gq, "a")
    wait_for("b started", lambda: read(gq, head, "b", "start"), 30)
    for node in (head, worker):
        assert read(gq, node, "a", "gpus") == read(gq, node, "b", "gpus") == "0,1,2,3,4,5,6,7 8"
    # from a's end (its last rank's) to b's ranks running (the last one's start): the GPUs handed on at once
    wait_for("b started on every node", lambda: all(read(gq, n, "b", "start") for n in (head, worker)), 30)
    handover = (max(float(read(gq, n, "b", "start")) for n in (head, worker))
                - max(float(read(gq, n, "a", "end")) for n in (head, worker)))
    print(f"queue hand-over: {handover:.3f} s")
    assert 0 < handover < 1.0, handover
    release(gq, "b")
    followed = follower.result(60)
    assert followed.returncode == 0, followed.describe()
    lines = followed.stdout.splitlines()
    waits = lines.index(f"Job {b} is pending: it waits for 8 GPU(s) on head held by job {a}")
    assert waits < lines.index(f"({head.name}, rank=0) b runs"), followed.stdout
    wait_status(gq, a, "SUCCEEDED")
    wait_status(gq, b, "SUCCEEDED")
    wait_for("the head's queue empty", lambda: '"entries": []' in head_queue(gq), 10)


def test_jobs_that_fit_side_by_side_run_together_on_their_own_gpus(gq: Cluster) -> None:
    c, _ = submit(gq, "c", "--gpus", "4")
    d, said = submit(gq, "d", "--gpus", "4")
    assert "pending" not in said.stdout, said.describe()
    head, worker = gq.nodes()
    for node in (head, worker):
        wait_for(f"c and d started on {node.name}", lambda n=node: read(gq, n, "c", "gpus") and read(gq, n, "d", "gpus"),
                 30)
        assert {read(gq, node, "c", "gpus"), read(gq, node, "d", "gpus")} == {"0,1,2,3 4", "4,5,6,7 4"}
    assert status(gq, c) == status(gq, d) == "RUNNING"
    release(gq, "c", "d")
    wait_status(gq, c, "SUCCEEDED")
    wait_status(gq, d, "SUCCEEDED")


def test_cancel_and_the_controller_gone_while_jobs_wait(gq: Cluster, tmp_path: Path) -> None:
    head = gq.nodes()[0]
    e, _ = submit(gq, "e", "--gpus", "8")
    wait_for("e started", lambda: read(gq, head, "e", "start"), 30)
    f, _ = submit(gq, "f", "--gpus", "8")
    g, _ = submit(gq, "g", "--gpus", "2")
    assert f"its turn: job {f} came first and waits too" in " ".join(rows(gq)[g]), rows(gq)[g]
    # apply of the cluster's task while it is busy: queued the same way, its setup waiting too
    task = tmp_path / "busy.yaml"
    task.write_text(TASK.replace("run: echo up\n", "setup: mkdir -p ~/gq && touch ~/gq/h.setup\nrun: echo h\n"))
    applied = gq.gpuctl("apply", str(task), "-d", "-o", "json").check()
    said = re.search(rf"^Job (\d+) is pending: it waits for its turn: job {f} came first", applied.stderr, re.M)
    assert said, applied.describe()
    h = int(said.group(1))
    doc = json.loads(applied.stdout)
    assert doc["ok"] is True and (doc["job"]["id"], doc["job"]["status"]) == (h, "PENDING"), doc
    assert "Running setup" not in applied.stderr, applied.describe()

    cancelled = gq.gpuctl("cancel", NAME, str(h)).check()
    assert status(gq, h) == "CANCELLED", cancelled.describe()
    assert f'"label": "job {h}"' not in head_queue(gq)

    # The controller's side of the waiting jobs goes (their background watchers killed): the head
    # runs them in their order all the same.
    watchers = [pid for pid in pids_matching("_watch") if watches(pid, NAME)]
    assert len(watchers) >= 3, watchers  # e's, f's and g's
    for pid in watchers:
        os.kill(pid, signal.SIGKILL)
    release(gq, "e")
    wait_for("f started", lambda: read(gq, head, "f", "start"), 30)
    row = rows(gq)[f]  # nobody watches f: `queue` asks the head, which says it runs now
    assert row[2] == "RUNNING" and "waits for" not in " ".join(row), row
    release(gq, "f", "g")
    wait_for("g ended", lambda: read(gq, head, "g", "end"), 60)
    f_start, g_start = float(read(gq, head, "f", "start")), float(read(gq, head, "g", "start"))
    assert float(read(gq, head, "e", "end")) < f_start < g_start
    assert not gq.exists_on(head, "~/gq/h.setup")  # cancelled while it waited: its setup never ran
    for job in (e, f, g):
        wait_status(gq, job, "SUCCEEDED")
    assert status(gq, h) == "CANCELLED"


def test_a_job_whose_coordinator_was_killed_holds_nothing(gq: Cluster) -> None:
    head = gq.nodes()[0]
    k, _ = submit(gq, "k", "--gpus", "8")
    wait_for("k started", lambda: read(gq, head, "k", "start"), 30)
    m, _ = submit(gq, "m", "--gpus", "8")
    assert status(gq, m) == "PENDING"
    coordinator = int(gq.ssh(head, f"cat ~/.gpuctl/jobs/{gq.node_job(k)}/events.supervisor").stdout)
    os.kill(coordinator, signal.SIGKILL)  # the head's agent for job k dies: its ranks go with it
    wait_for("m started", lambda: read(gq, head, "m", "start"), 60)
    assert not pids_matching(f"{MOD}-k")  # k's GPUs were handed on only once its ranks were stopped
    assert read(gq, head, "k", "end") is None
    wait_for(f"job {k} no longer RUNNING", lambda: status(gq, k) not in ("RUNNING", "PENDING"), 60)
    assert status(gq, m) == "RUNNING"
    release(gq, "m")
    wait_status(gq, m, "SUCCEEDED")
    assert not pids_matching(f"{MOD}-k")


def test_a_job_asking_more_than_a_node_has_is_refused(gq: Cluster, tmp_path: Path) -> None:
    res = gq.gpuctl("exec", NAME, "--gpus", "16", "--", "true")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"error: --gpus 16: cluster '{NAME}' has 8 GPU(s) per node; a job there asks for at most 8 (it would wait "
        "in the cluster's queue for ever)"), res.describe()
    res = gq.gpuctl("exec", NAME, "--gpus", "A100:1", "--", "true")
    assert res.returncode == 2 and f"cluster '{NAME}' has H100 GPUs, not A100" in res.stderr, res.describe()
    task = tmp_path / "big.yaml"
    task.write_text("resources:\n  accelerators: H100:9\nrun: 'true'\n")
    res = gq.gpuctl("exec", NAME, str(task))
    assert res.returncode == 2 and "resources.accelerators H100:9" in res.stderr, res.describe()
    assert "Traceback" not in res.stderr
