"""examples/managed: train.py resumes from its own checkpoint after a SIGTERM, and its YAML validates.

Two ranks under torchrun (CPU, gloo), as every attempt of a managed job runs them: the first run is
sent SIGTERM once a checkpoint exists (what a spot notice does), saves and exits 143; the second
resumes at the saved step and finishes where an uninterrupted run does.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gpuctlfork
import pytest

# torch runs in the ranks' processes only: found, not imported (3 CPU-s in every test worker)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (make test installs it)")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "managed"
STEPS = 30


def torchrun(ckpt: Path, *extra: str, attempt: int = 1) -> subprocess.Popen:
    # --standalone rendezvous on localhost:0: the launcher takes a free port, so parallel tests never clash.
    env = {**os.environ, "CKPT_DIR": str(ckpt), "GPUCTL_ATTEMPT": str(attempt), "GPUCTL_TASK_ID": "test-task",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(EXAMPLE / "train.py"), "--steps", str(STEPS), "--ckpt-every", "5", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not end within {timeout} s:\n{out}")
    return out


def final_loss(out: str) -> str:
    found = re.search(r"^done: \d+ steps, final loss (\S+);", out, re.MULTILINE)
    assert found, out
    return found.group(1)


def test_a_sigtermed_run_saves_and_the_next_attempt_resumes_from_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = torchrun(ckpt, "--step-seconds", "0.1")
    deadline = time.monotonic() + 60
    while not (ckpt / "checkpoint.pt").exists():
        assert first.poll() is None, f"the first run ended before its first checkpoint:\n{finish(first)}"
        assert time.monotonic() < deadline, "no checkpoint within 60 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
    out = finish(first)
    assert first.returncode != 0, out
    saved = re.search(r"^SIGTERM: checkpoint saved at step (\d+); exiting 143$", out, re.MULTILINE)
    assert saved, out
    step = int(saved.group(1))
    assert 5 <= step < STEPS, out
    assert "attempt 1 resumes at step 0 " in out, out
    assert [p.name for p in ckpt.iterdir()] == ["checkpoint.pt"], "a temporary file was left behind"

    second = torchrun(ckpt, attempt=2)
    out2 = finish(second)
    assert second.returncode == 0, out2
    resumed = re.search(r"^attempt 2 resumes at step (\d+) of \d+ \(its checkpoint in .*\); task id test-task;",
                        out2, re.MULTILINE)
    assert resumed, out2
    assert int(resumed.group(1)) == step > 0

    # The checkpoint holds the optimizer's momentum and the data follows the step: the resumed run
    # ends exactly where one that was never interrupted does.
    reference = torchrun(tmp_path / "reference")
    out3 = finish(reference)
    assert reference.returncode == 0, out3
    assert final_loss(out2) == final_loss(out3)


def test_the_example_yaml_validates() -> None:
    r = gpuctlfork.run(["validate", str(EXAMPLE / "train.yaml")], cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in r.stderr, r.stderr  # job_recovery and every other field are acted on
