"""A SkyPilot user's habits through the installed `gpuctl` console script, with no nodes: what needs
none is checked here (the same commands against running nodes: test_e2e_local.py).

- `gpuctl launch 'CMD'` without a YAML makes the task of that command and plans it as any YAML;
- `gpuctl exec NAME python train.py --lr 1e-3`: the command's options are not gpuctl's;
- `gpuctl queue` without a name, in text and JSON;
- a cluster that is gone keeps its jobs and logs: `queue`, `logs` (in the order the lines came, by
  rank, `--tail`, `--status`) until `logs NAME --purge`;
- `down -a` asks first on a terminal, refuses without one, and goes on with -y.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl.jobplane import joblogs
from gpuctl.state.registry import Registry

GPUCTL = Path(sys.executable).parent / "gpuctl"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console script's program, forked (tests/gpuctlfork.py; test_cli_usage runs the script itself)."""
    return gpuctlfork.run(args, cwd=cwd, timeout=120, env=os.environ.copy())


def refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2 with one `error:` line holding every fragment, and no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_launch_without_a_yaml_plans_the_command_as_a_task(tmp_path: Path) -> None:
    plan = run("launch", "echo hi from $(hostname)", "--dry-run", "-o", "json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    assert set(doc) == {"schema", "command", "ok", "cluster", "dry_run", "plan", "lines"}
    assert re.fullmatch(r"gpuctl-[0-9a-f]{4}-[a-z0-9-]+", doc["cluster"]), doc
    assert doc["plan"]["add"] == 2  # one local node (and its bridge): SkyPilot's one node, gpuctl's default infra
    assert f"note: 'echo hi from $(hostname)' is no task file: running it as a command on cluster " \
           f"'{doc['cluster']}'" in plan.stderr
    named = run("launch", "-c", "demo", "--num-nodes", "2", "--infra", "local", "python train.py --lr 1e-3",
                "--dry-run", cwd=tmp_path)
    assert named.returncode == 0 and "Plan: 3 to add" in named.stdout, named.stderr
    assert "running it as a command on cluster 'demo'" in named.stderr
    words = run("launch", "-c", "demo", "--dry-run", "python", "train.py", "--lr", "1e-3", cwd=tmp_path)  # unquoted
    assert words.returncode == 0 and "note: 'python train.py --lr 1e-3' is no task file" in words.stderr, words.stderr
    # the same refusals as a YAML's, one line each, nothing planned
    refused(run("apply", "", cwd=tmp_path), "the command is empty")
    refused(run("launch", str(tmp_path), cwd=tmp_path), f"{tmp_path}: is a directory")
    refused(run("launch", "echo hi", "--env", "1X=2", cwd=tmp_path), "--env 1X=2")
    refused(run("launch", "echo hi", "--infra", "gcp", cwd=tmp_path), "--infra 'gcp'")
    refused(run("launch", "missing.yaml", cwd=tmp_path), "missing.yaml: no such file")  # a file, not a command
    assert not (tmp_path / "gpuctl-state" / "clusters").exists()


def test_exec_takes_the_commands_own_options_as_its_words(tmp_path: Path) -> None:
    """`--lr` after the command's first word is the program's: the cluster is looked up (and missing),
    where click would have refused `--lr` as an option of gpuctl's."""
    refused(run("exec", "nosuch", "python", "train.py", "--lr", "1e-3", cwd=tmp_path),
            "cluster 'nosuch' not found")
    refused(run("exec", "nosuch", "--num-nodes", "1", "-d", "torchrun", "x.py", "--", "-d", cwd=tmp_path),
            "cluster 'nosuch' not found")
    usage = run("exec", "nosuch", "python train.py", "--lr", "1e-3", cwd=tmp_path)  # quoted: options follow it
    assert usage.returncode == 2 and "no such option: --lr" in usage.stderr, usage.stderr
    # one of gpuctl's own options among the command's words: meant for which? Refused, nothing run.
    refused(run("exec", "nosuch", "python", "train.py", "-d", cwd=tmp_path),
            "'-d' after the command's first word 'python' could be gpuctl's option or the command's")
    refused(run("launch", "python", "train.py", "--lr", "1e-3", "--dry-run", cwd=tmp_path),
            "'--dry-run' after the command's first word 'python'", "quote the whole command")
    assert not (tmp_path / "gpuctl-state" / "clusters").exists()


def test_queue_without_a_name_lists_every_cluster(tmp_path: Path) -> None:
    empty = run("queue", cwd=tmp_path)
    assert empty.returncode == 0 and empty.stdout == "No clusters.\n", empty.stderr
    reg = Registry()
    for name in ("alpha", "beta"):  # recorded, never provisioned: nothing to ask a head
        reg.upsert_cluster(name, cloud="local", region=None, zone=None, num_nodes=2, status="INIT", request={})
    job = reg.new_job("beta", name="train", num_nodes=2)
    reg.update_job("beta", job.job_id, status="SUCCEEDED", returncodes={0: 0, 1: 0})
    text = run("queue", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    blocks = text.stdout.split("\n\n")
    assert blocks[0] == "Cluster alpha (INIT, 2 node(s)): no jobs", text.stdout
    assert blocks[1].splitlines()[0] == "Cluster beta (INIT, 2 node(s))"
    assert blocks[1].splitlines()[1].split()[:3] == ["ID", "NAME", "STATUS"]
    assert blocks[1].splitlines()[2].split()[:3] == ["1", "train", "SUCCEEDED"]
    doc = json.loads(run("queue", "-o", "json", cwd=tmp_path).stdout)
    assert set(doc) == {"schema", "command", "ok", "clusters"}
    assert [(c["cluster"], [j["id"] for j in c["jobs"]]) for c in doc["clusters"]] == [("alpha", []), ("beta", [1])]
    one = json.loads(run("queue", "beta", "-o", "json", cwd=tmp_path).stdout)  # unchanged with a name
    assert set(one) == {"schema", "command", "ok", "cluster", "jobs"} and one["jobs"][0]["status"] == "SUCCEEDED"


def _gone_cluster() -> dict[str, int]:
    """Cluster `gone`'s state after `down`: no record, its jobs kept (one succeeded with logs saved as
    they came, one failed with none saved), its logs under logs/gone."""
    reg = Registry()
    ok, failed = reg.new_job("gone", name="train", num_nodes=2), reg.new_job("gone", name="bad", num_nodes=2)
    reg.update_job("gone", ok.job_id, status="SUCCEEDED", returncodes={0: 0, 1: 0}, ended_at=time.time())
    reg.update_job("gone", failed.job_id, status="FAILED", returncodes={0: 0, 1: 3}, failed_rank=1,
                   ended_at=time.time())
    writer = joblogs.LogWriter("gone", ok.job_id, node_job=ok.node_job, names={0: "head", 1: "worker1"})
    for stage, rank, text in [("setup", 0, "setup 0"), ("setup", 1, "setup 1"), ("run", 1, "w-1"),
                              ("run", 0, "h-1"), ("run", 1, "w-2"), ("run", 0, "h-2")]:
        writer.write(stage, rank, text)
    writer.close()
    return {"ok": ok.job_id, "failed": failed.job_id}


def test_a_gone_clusters_jobs_and_logs_stay_readable_until_purged(tmp_path: Path) -> None:
    ids = _gone_cluster()
    ok = str(ids["ok"])
    queue = run("queue", "gone", cwd=tmp_path)
    assert queue.returncode == 0 and [r.split()[:3] for r in queue.stdout.splitlines()[1:]] == \
        [[ok, "train", "SUCCEEDED"], [str(ids["failed"]), "bad", "FAILED"]], queue.stdout
    assert "Cluster 'gone' is gone" in queue.stderr and "gpuctl logs gone --purge" in queue.stderr
    in_order = ["(head, rank=0) setup 0", "(worker1, rank=1) setup 1", "(worker1, rank=1) w-1", "(head, rank=0) h-1",
                "(worker1, rank=1) w-2", "(head, rank=0) h-2"]
    for args in ([], ["--no-follow"], ["--tail", "0"]):
        res = run("logs", "gone", ok, *args, cwd=tmp_path)
        assert res.returncode == 0 and res.stdout.splitlines() == in_order, (args, res.stdout, res.stderr)
    by_rank = run("logs", "gone", ok, "--by-rank", cwd=tmp_path)
    assert by_rank.stdout.splitlines() == in_order[:2] + ["(head, rank=0) h-1", "(head, rank=0) h-2",
                                                          "(worker1, rank=1) w-1", "(worker1, rank=1) w-2"]
    assert run("logs", "gone", ok, "--tail", "3", cwd=tmp_path).stdout.splitlines() == in_order[-3:]
    assert run("logs", "gone", ok, "--rank", "1", "--tail", "1", cwd=tmp_path).stdout.splitlines() == \
        ["(worker1, rank=1) w-2"]
    status = run("logs", "gone", "--status", cwd=tmp_path)  # the latest job: the failed one
    assert status.returncode == 100 and status.stdout.strip() == f"Job {ids['failed']}: FAILED; rank 1 exit code 3"
    refused(run("logs", "gone", str(ids["failed"]), cwd=tmp_path),
            f"job {ids['failed']} of cluster 'gone' has no saved logs, and the cluster is gone")
    refused(run("logs", "gone", ok, "--rank", "2", cwd=tmp_path), f"--rank 2: job {ok} ran on ranks 0..1")
    refused(run("logs", "gone", ok, "--purge", cwd=tmp_path), "--purge takes only the cluster")
    refused(run("logs", "gone", "--purge", "--tail", "2", cwd=tmp_path), "--purge takes only the cluster")
    tail = run("logs", "gone", "--tail", "-1", cwd=tmp_path)
    assert tail.returncode == 2 and "--tail" in tail.stderr and "Traceback" not in tail.stderr

    purged = run("logs", "gone", "--purge", cwd=tmp_path)
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == ("Removed the saved logs of 1 job(s) of cluster 'gone', and its 2 job "
                                     "record(s): the cluster is gone")
    assert not joblogs.cluster_logs_dir("gone").exists() and Registry().jobs("gone") == []
    refused(run("queue", "gone", cwd=tmp_path), "cluster 'gone' not found")
    refused(run("logs", "gone", "--purge", cwd=tmp_path), "cluster 'gone' not found")


def _answer_at_a_terminal(argv: list[str], answer: bytes, cwd: Path) -> tuple[int, str]:
    """Run gpuctl on a pseudo-terminal, typing `answer` once it asks; (exit code, what it printed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
        os.chdir(cwd)
        os.execv(str(GPUCTL), [str(GPUCTL), *argv])
    out, answered, deadline = b"", False, time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the child closed the terminal: it ended
            break
        if not data:
            break
        out += data
        if not answered and b"[y/N]" in out:
            os.write(fd, answer)
            answered = True
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_down_all_asks_on_a_terminal_refuses_without_one_and_goes_on_with_yes(tmp_path: Path) -> None:
    reg = Registry()
    for name in ("c-one", "c-two"):  # recorded, never provisioned: down forgets them without Terraform
        reg.upsert_cluster(name, cloud="local", region=None, zone=None, num_nodes=1, status="INIT", request={})
    line = refused(run("down", "-a", cwd=tmp_path), "down -a would tear down 2 cluster(s) (c-one, c-two)", "add -y")
    assert "nothing was torn down" in line
    as_json = run("down", "-a", "-o", "json", cwd=tmp_path)
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["ok"] is False
    code, text = _answer_at_a_terminal(["down", "-a"], b"n\n", tmp_path)
    assert code == 2 and "Tear down 2 cluster(s): c-one, c-two?" in text and "not confirmed" in text, text
    assert [c.name for c in Registry().clusters()] == ["c-one", "c-two"]
    code, text = _answer_at_a_terminal(["down", "-a"], b"y\n", tmp_path)
    assert code == 0 and "its record is removed" in text, text
    assert Registry().clusters() == []
    reg.upsert_cluster("c-three", cloud="local", region=None, zone=None, num_nodes=1, status="INIT", request={})
    yes = run("down", "-a", "-y", cwd=tmp_path)
    assert yes.returncode == 0 and Registry().clusters() == [], yes.stderr
    named = run("down", "c-four", cwd=tmp_path)  # `down NAME` never asks: CI scripts run it without a terminal
    assert named.returncode == 0 and "does not exist" in named.stdout + named.stderr


@pytest.mark.parametrize("argv", [["queue", "--help"], ["logs", "--help"], ["launch", "--help"]])
def test_help_says_what_the_new_forms_do(argv: list[str], tmp_path: Path) -> None:
    page = run(*argv, cwd=tmp_path).stdout
    assert {"queue": "every cluster's", "logs": "--by-rank", "launch": "FILE|COMMAND"}[argv[0]] in page, page
