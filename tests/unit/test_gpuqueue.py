"""The head's GPU queue (gpuctl/node/gpuqueue.py): first come, first served, disjoint GPUs, nothing
held by a job whose coordinator is gone, and a waiting job woken at once by a release.

Each "coordinator" is a real process (a sleeping child), since the queue tells live holders from
dead ones by pid and process start time."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from gpuctl.node import gpuqueue
from gpuctl.node.stages import stage_env_text

CAPACITY = {0: 8, 1: 8}
NAMES = {0: "head", 1: "worker1"}


@pytest.fixture
def coordinators() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def coordinator(procs: list[subprocess.Popen]) -> int:
    p = subprocess.Popen(["sleep", "300"])
    procs.append(p)
    return p.pid


def enqueue(queue: Path, procs: list[subprocess.Popen], job: str, per_node: int, ranks=(0, 1)) -> int:
    pid = coordinator(procs)
    gpuqueue.gpu_enqueue(job, f"job {job}", per_node, list(ranks), CAPACITY, NAMES, pid=pid, queue_dir=str(queue))
    return pid


def admit(queue: Path, job: str):
    return gpuqueue.gpu_try_admit(job, queue_dir=str(queue))


def test_first_come_first_served_with_disjoint_gpus(tmp_path: Path, coordinators) -> None:
    q = tmp_path / "queue"
    enqueue(q, coordinators, "1", 8)
    enqueue(q, coordinators, "2", 8)
    enqueue(q, coordinators, "3", 4)  # would not fit either while 1 runs, and must not overtake 2 later
    assert admit(q, "1") == ({0: list(range(8)), 1: list(range(8))}, None)
    assert admit(q, "2") == (None, "8 GPU(s) on head held by job 1")
    assert admit(q, "3") == (None, "its turn: job 2 came first and waits too (first come, first served)")
    assert gpuqueue.gpu_waiting_reason("2", queue_dir=str(q)) == "8 GPU(s) on head held by job 1"
    assert gpuqueue.gpu_waiting_reason("1", queue_dir=str(q)) is None  # holding: not waiting

    gpuqueue.gpu_release("1", queue_dir=str(q))
    assert admit(q, "2")[0] == {0: list(range(8)), 1: list(range(8))}
    assert admit(q, "3") == (None, "4 GPU(s) on head held by job 2")
    gpuqueue.gpu_release("2", queue_dir=str(q))
    enqueue(q, coordinators, "4", 4)
    assert admit(q, "3")[0] == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert admit(q, "4")[0] == {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}  # beside 3, on the other four
    assert admit(q, "3")[0] == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # asked again: the same, nothing more
    gpuqueue.gpu_release("3", queue_dir=str(q))
    enqueue(q, coordinators, "5", 2, ranks=(0,))
    assert admit(q, "5")[0] == {0: [0, 1]}  # the lowest free ones
    assert admit(q, "gone") == (None, None)


def test_a_dead_coordinator_holds_nothing_and_waits_for_nothing(tmp_path: Path, coordinators,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    q = tmp_path / "queue"
    holder = enqueue(q, coordinators, "1", 8)
    enqueue(q, coordinators, "2", 8)
    waiter = enqueue(q, coordinators, "3", 8)
    assert admit(q, "1")[0] is not None
    assert admit(q, "3")[1].startswith("its turn: job 2")
    for pid in (holder, coordinators[1].pid):  # 1 held (SIGKILLed head agent), 2 waited ahead of 3
        os.kill(pid, 9)
    for p in coordinators[:2]:
        p.wait()
    # the dead waiter is gone at once; the dead holder's ranks are still being stopped: its GPUs
    # stay held a while, said so
    assert admit(q, "3") == (None, "8 GPU(s) on head held by job 1 (ended; its ranks are being stopped)")
    assert [e["job"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]] == ["1", "3"]
    monkeypatch.setattr(gpuqueue, "GPU_QUEUE_DEAD_HOLD_S", 0.0)
    assert admit(q, "3")[0] == {0: list(range(8)), 1: list(range(8))}
    assert [e["job"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]] == ["3"]
    assert waiter in {e["pid"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]}


def test_an_entry_of_another_boot_or_an_earlier_try_is_no_coordinator(tmp_path: Path, coordinators,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    q = tmp_path / "queue"
    enqueue(q, coordinators, "1", 8)
    assert admit(q, "1")[0] is not None
    boot = tmp_path / "boot_id"
    boot.write_text("another-boot\n")
    monkeypatch.setattr(gpuqueue, "BOOT_ID_FILE", str(boot))  # the head rebooted: no entry runs
    enqueue(q, coordinators, "2", 8)
    assert admit(q, "2")[0] is not None
    assert [e["job"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]] == ["2"]
    # the same job submitted again after its coordinator died: it queues anew, not "place lost"
    coordinators[-1].kill()
    coordinators[-1].wait()
    monkeypatch.setattr(gpuqueue, "GPU_QUEUE_DEAD_HOLD_S", 0.0)
    enqueue(q, coordinators, "2", 8)
    assert admit(q, "2")[0] is not None


def test_the_first_jobs_of_a_fresh_head_queue_at_once(tmp_path: Path, coordinators) -> None:
    q = tmp_path / "queue"
    pids = [coordinator(coordinators) for _ in range(8)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            gpuqueue.gpu_enqueue(str(i), f"job {i}", 1, [0], CAPACITY, NAMES, pid=pids[i], queue_dir=str(q))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(e["job"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]) == [str(i) for i in range(8)]
    in_order = [e["job"] for e in sorted(gpuqueue.read_gpu_queue(str(q))["entries"], key=lambda e: e["seq"])]
    assert [admit(q, job)[0] for job in in_order] == [{0: [i]} for i in range(8)]  # one GPU each, in turn


def test_a_pid_given_to_another_process_is_not_its_coordinator(tmp_path: Path, coordinators) -> None:
    q = tmp_path / "queue"
    enqueue(q, coordinators, "1", 8)
    state_file = q / "state.json"
    import json

    state = json.loads(state_file.read_text())
    state["entries"][0]["pid_start"] = "1"  # the same pid, started at another time: another process
    state_file.write_text(json.dumps(state))
    enqueue(q, coordinators, "2", 8)
    assert admit(q, "2")[0] is not None
    assert [e["job"] for e in gpuqueue.read_gpu_queue(str(q))["entries"]] == ["2"]


def test_a_release_wakes_the_waiting_job_at_once(tmp_path: Path, coordinators) -> None:
    q = tmp_path / "queue"
    enqueue(q, coordinators, "1", 8)
    enqueue(q, coordinators, "2", 8)
    assert admit(q, "1")[0] is not None
    waker = gpuqueue.GpuWaker("2", queue_dir=str(q))
    try:
        assert waker.wait(0.05) is False  # nothing yet
        threading.Timer(0.3, gpuqueue.gpu_release, ("1",), {"queue_dir": str(q)}).start()
        started = time.monotonic()
        assert waker.wait(10) is True
        assert time.monotonic() - started < 2
        assert admit(q, "2")[0] is not None
        assert waker.wait(0.05) is False  # the wake-up was read: no busy loop after it
    finally:
        waker.close()
    assert not (q / "2.wake").exists()
    gpuqueue.gpu_wake("2", queue_dir=str(q))  # a waiter gone: waking it is no error


def test_the_state_file_is_private_and_a_broken_one_is_an_empty_queue(tmp_path: Path, coordinators) -> None:
    q = tmp_path / "queue"
    enqueue(q, coordinators, "1", 8)
    assert oct((q / "state.json").stat().st_mode & 0o777) == "0o600"
    assert oct(q.stat().st_mode & 0o777) == "0o700"
    (q / "state.json").write_text("{not json")
    assert gpuqueue.read_gpu_queue(str(q)) == {"seq": 0, "entries": []}
    assert admit(q, "1") == (None, None)  # its place was lost: the coordinator says so (coordinator.py)


def test_the_stage_env_names_only_the_jobs_gpus(tmp_path: Path) -> None:
    spec = {"env": {"A": "1"}, "rank_vars": ["GPUCTL_NODE_RANK"], "hostfile": None}
    assert "CUDA_VISIBLE_DEVICES" not in stage_env_text("run", spec, 0, str(tmp_path))  # a CPU job: untouched
    text = stage_env_text("run", spec, 1, str(tmp_path), [4, 5, 6, 7])
    assert "export CUDA_VISIBLE_DEVICES=4,5,6,7" in text.splitlines()
