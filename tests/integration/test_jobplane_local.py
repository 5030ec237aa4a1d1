"""The job plane on a real 5-node local cluster whose fan-out is forced to a
depth-2 tree (GPUCTL_FANOUT=2: the head feeds worker1 and worker3, which feed
worker2 and worker4), through the real `gpuctl` command:

- a job on a prepared cluster starts no ansible-playbook, and the controller
  opens one ssh session for it whatever the number of nodes;
- ranks, output and exit codes are right through the tree;
- argv after `--` is kept as given;
- a node whose prepared state differs, or whose agent is missing, is prepared
  again by itself; a rotated internal key too;
- file_mounts to a directory every node shares are copied once (to the head)
  and never race, ten applies in a row; a node's own directory gets its copy;
- Ctrl-C during the copy, during setup and during run ends everything and
  records CANCELLED;
- a detached job whose gpuctl (and watcher) are gone still fails fast, and
  `queue` shows the true outcome;
- output lines of several MiB (binary, with and without a final newline, and
  lines that are events themselves) arrive through the tree byte for byte.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e import (Cluster, NodeInfo, Result, Watched, gpuctl_env, needs_local_nodes, pids_matching, queue_row_once_ended,
                 queue_rows)
from gpuctl.common.console import Reporter
from gpuctl.common.ranklines import RankLines
from gpuctl.jobplane.events import decode

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "jp5"
MOD = f"jp{uuid.uuid4().hex[:10]}"  # every marker of this module starts with it
SHARED = Path(f"/tmp/{MOD}-shared")  # outside ~: every netns node sees this machine's /tmp

TASK = f"""\
name: {NAME}
num_nodes: 5
resources:
  infra: local
workdir: ./proj
file_mounts:
  {SHARED}/data: ./data
  ~/own/data: ./data
setup: |
  echo "setup on $GPUCTL_NODE_RANK"
run: |
  echo "rank $GPUCTL_NODE_RANK sees $(cat {SHARED}/data/blob.txt) and $(cat ~/own/data/blob.txt)"
  ls -a {SHARED}/data ~/own/data | grep -c gpuctl-claim || true
"""


@dataclass
class JP:
    cluster: Cluster
    project: Path
    yaml: Path
    nodes: list[NodeInfo]
    shim_log: Path
    env_extra: dict[str, str]

    def gpuctl(self, *args: str, timeout: float = 300, shim: bool = False) -> Result:
        env_before = dict(os.environ)
        os.environ.update(self.env_extra)
        if shim:
            os.environ["PATH"] = f"{self.shim_log.parent}:{os.environ['PATH']}"
        try:
            return self.cluster.gpuctl(*args, timeout=timeout)
        finally:
            os.environ.clear()
            os.environ.update(env_before)

    def controller_ssh_calls(self) -> list[str]:
        """ssh invocations made with the cluster's access key (the controller's, not the nodes')."""
        key = str(self.cluster.cdir / "ssh" / "id_ed25519")
        if not self.shim_log.exists():
            return []
        return [line for line in self.shim_log.read_text().splitlines() if key in line]

    def artifacts(self) -> set[str]:
        root = self.cluster.cdir / "runner" / "artifacts"
        return {p.name for p in root.iterdir()} if root.is_dir() else set()


def job_id_of(res: Result, word: str = "running") -> int:
    m = re.search(rf"^Job (\d+) {word}\b", res.stdout, re.M)
    assert m, f"no 'Job N {word}' line\n" + res.describe()
    return int(m.group(1))


def shell(script: str) -> list[str]:
    return ["--env", f"JP_SCRIPT={script}", "--", "bash", "-c", 'eval "$JP_SCRIPT"']


@pytest.fixture(scope="module")
def jp(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("jobplane")
    project = root / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "code.txt").write_text("code v1\n")
    (project / "data").mkdir()
    (project / "data" / "blob.txt").write_text("blob v1\n")
    yaml_path = project / "cluster.yaml"
    yaml_path.write_text(TASK)
    shim_dir = root / "shim"
    shim_dir.mkdir()
    shim_log = shim_dir / "ssh.log"
    (shim_dir / "ssh").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shim_log}\nexec /usr/bin/ssh "$@"\n')
    (shim_dir / "ssh").chmod(0o755)
    cluster = Cluster(NAME, root / "state")
    env_extra = {"GPUCTL_FANOUT": "2"}
    jp = JP(cluster, project, yaml_path, [], shim_log, env_extra)
    try:
        res = jp.gpuctl("apply", str(yaml_path)).check()
        jp.nodes = cluster.nodes()
        jp.first = res  # type: ignore[attr-defined]
        yield jp
    finally:
        cluster.down_quietly()
        subprocess.run(["rm", "-rf", str(SHARED)], check=False)
        for pid in pids_matching(MOD):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_first_apply_prepares_then_runs_through_the_tree(jp: JP):
    res = jp.first  # type: ignore[attr-defined]
    assert "Preparing 5 node(s)" in res.stdout, res.describe()
    lines = res.stdout.splitlines()
    for n in jp.nodes:
        assert f"({n.name}, rank={n.rank}) rank {n.rank} sees blob v1 and blob v1" in lines, res.describe()
        assert f"({n.name}, rank={n.rank}) setup on {n.rank}" in lines
    # the markers of the shared-filesystem claim are gone from both destinations on every node
    assert sum(1 for line in lines if line.endswith(") 0")) == 5, res.describe()


def test_fanout_tree_has_depth_two(jp: JP):
    """Who fed whom: each relay records the address its parent connected from."""
    res = jp.gpuctl("exec", NAME, "--", "true").check()
    job = job_id_of(res)
    head, w1, w2, w3, w4 = jp.nodes
    node_job = jp.cluster.node_job(job)
    parent = {n.name: jp.cluster.read(n, f"~/.gpuctl/jobs/{node_job}/relay.from").split()[0]
              for n in (w1, w2, w3, w4)}
    assert parent == {"worker1": head.address, "worker2": w1.address, "worker3": head.address,
                      "worker4": w3.address}, parent


def test_ranks_output_and_exit_codes_through_the_tree(jp: JP):
    # rank 4 fails only once the others have ended (their marks, in a directory every node sees), so
    # that each one's own code is read, not the 143 of being stopped after the first failure
    marks = Path(tempfile.mkdtemp(prefix="gpuctl-jp-", dir="/tmp"))
    marks.chmod(0o777)
    try:
        res = jp.gpuctl("exec", NAME, *shell(
            'echo "out $GPUCTL_NODE_RANK"; echo "err $GPUCTL_NODE_RANK" >&2; '
            f'if [ "$GPUCTL_NODE_RANK" = 4 ]; then for _ in $(seq 600); do [ "$(ls {marks} | wc -l)" -ge 4 ] && break; '
            f'sleep 0.05; done; sleep 0.5; exit 7; fi; trap "touch {marks}/$GPUCTL_NODE_RANK" EXIT'))
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    assert res.returncode == 1, res.describe()
    lines = res.stdout.splitlines()
    for n in jp.nodes:
        assert f"({n.name}, rank={n.rank}) out {n.rank}" in lines
        assert f"({n.name}, rank={n.rank}) err {n.rank}" in lines
    assert re.search(r"rank 4 \(worker4, [0-9.]+\) failed first with exit code 7; "
                     r"return codes: rank 0: 0, rank 1: 0, rank 2: 0, rank 3: 0, rank 4: 7$", res.stderr, re.M), \
        res.describe()


def test_warm_job_runs_no_playbook_and_one_ssh_session(jp: JP):
    jp.gpuctl("exec", NAME, "--", "true").check()  # warm: the ControlMaster is up
    before = jp.artifacts()
    jp.shim_log.unlink(missing_ok=True)
    all5 = jp.gpuctl("exec", NAME, "--", "true", shim=True).check()
    calls_all = jp.controller_ssh_calls()
    jp.shim_log.unlink(missing_ok=True)
    one = jp.gpuctl("exec", NAME, "--num-nodes", "1", "--", "true", shim=True).check()
    calls_one = jp.controller_ssh_calls()
    assert jp.artifacts() == before, "an ansible-playbook ran for a job on a prepared cluster"
    assert "Preparing" not in all5.stdout + one.stdout
    # One session carries the job; the workdir remembered from the last apply adds its rsync (one more
    # session over the same ControlMaster), whatever the number of nodes.
    assert len([c for c in calls_all if "gpuctl-node submit" in c]) == 1, calls_all
    assert len(calls_all) == 2 and "rsync" in calls_all[0], calls_all
    assert len(calls_one) == len(calls_all), (calls_one, calls_all)


def test_argv_after_dashes_is_kept(jp: JP):
    res = jp.gpuctl("exec", NAME, "--num-nodes", "2", "--", "printf", "[%s]", "a b", "$HOME", "it's",
                    '"q"', "--flag").check()
    for n in jp.nodes[:2]:
        assert f"({n.name}, rank={n.rank}) [a b][$HOME][it's][\"q\"][--flag]" in res.stdout.splitlines(), \
            res.describe()


def test_node_with_other_prepared_state_is_prepared_again(jp: JP):
    w3 = jp.nodes[3]
    jp.cluster.ssh(w3, "echo stale > ~/.gpuctl/prepared")
    res = jp.gpuctl("exec", NAME, "--", "true").check()
    assert "Preparing 1 of 5 node(s) (worker3: prepared state " in res.stdout, res.describe()  # that one, and why
    records = json.loads((jp.cluster.cdir / "prepared.json").read_text())
    assert jp.cluster.read(w3, "~/.gpuctl/prepared").strip() in records.values() and len(set(records.values())) == 1


def test_node_without_agent_is_prepared_again(jp: JP):
    w4 = jp.nodes[4]
    jp.cluster.ssh(w4, "rm ~/.gpuctl/bin/gpuctl-node")
    res = jp.gpuctl("exec", NAME, "--", "echo", "back").check()
    assert "Preparing 1 of 5 node(s) (worker4: no gpuctl agent: " in res.stdout, res.describe()
    assert f"({w4.name}, rank=4) back" in res.stdout.splitlines()


def test_rotated_internal_key_is_prepared_again(jp: JP):
    key = jp.cluster.cdir / "ssh" / "internal_ed25519"
    old = key.with_suffix(".pub").read_text()
    key.unlink()
    key.with_suffix(".pub").unlink()
    res = jp.gpuctl("exec", NAME, "--", "true").check()
    assert "Preparing 5 node(s) (gpuctl or the cluster changed)" in res.stdout, res.describe()
    new = key.with_suffix(".pub").read_text()
    assert new != old
    head, *workers = jp.nodes
    authorized = jp.cluster.read(workers[1], "~/.ssh/authorized_keys")
    assert new.split()[1] in authorized and old.split()[1] not in authorized
    # nor does sshd's own file hold it (the key authorized at boot is the one the install step replaces)
    for n in jp.nodes:
        boot = (jp.cluster.cdir / "nodes" / f"node{n.rank}" / "sshd" / "authorized_keys").read_text()
        assert old.split()[1] not in boot and new.split()[1] not in boot


def test_shared_destination_ten_applies_in_a_row(jp: JP):
    """Every node shares /tmp: the head gets the bytes, nobody else copies into it, nothing races.
    ~/own is each node's own: each gets its copy from the tree."""
    for i in range(10):
        (jp.project / "data" / "blob.txt").write_text(f"blob v{i + 2}\n")
        res = jp.gpuctl("apply", str(jp.yaml), "--no-setup").check()
        assert "File exists" not in res.stdout + res.stderr
        for n in jp.nodes:
            assert f"({n.name}, rank={n.rank}) rank {n.rank} sees blob v{i + 2} and blob v{i + 2}" in \
                res.stdout.splitlines(), res.describe()
        assert "Copying from the head to 4 node(s)" in res.stdout.splitlines(), res.describe()  # ~/own/data
        assert f"  {SHARED}/data: to none of them (they share its filesystem with the head)" in \
            res.stdout.splitlines(), res.describe()
    assert not list(SHARED.rglob(".gpuctl-claim-*"))


# -- Ctrl-C at each stage --------------------------------------------------------------


def interrupt_when(jp: JP, args: list[str], trigger: str, marker: str,
                   env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run gpuctl in its own process group, SIGINT the group when a stdout line contains
    `trigger`; (exit code, output)."""
    run = Watched([sys.executable, "-m", "gpuctl", *args], {**gpuctl_env(jp.cluster.state_dir), **jp.env_extra,
                                                           **(env or {})},
                  lambda line: trigger in line)
    try:
        assert run.seen.wait(120), "never saw " + trigger + "\n" + run.text
        run.interrupt(timeout=60)
    finally:
        run.close()
    proc = run.proc
    text = run.text
    deadline = time.monotonic() + 15
    while pids_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids_matching(marker), f"processes of {marker} survived Ctrl-C\n{text}"
    return proc.returncode, text


def last_job(jp: JP) -> tuple[int, str]:
    last = queue_rows(jp.gpuctl("queue", NAME).check().stdout)[-1]
    return int(last[0]), last[2]


@pytest.mark.parametrize("stage", ["copy", "setup", "run"])
def test_ctrl_c_at_each_stage_ends_everything_and_records_cancelled(jp: JP, stage: str, tmp_path: Path):
    marker = f"{MOD}-ctrlc-{stage}"
    project = tmp_path / "p"
    (project / "w").mkdir(parents=True)
    if stage == "copy":  # a workdir large enough that Ctrl-C lands while rsync copies it
        with open(project / "w" / "big.bin", "wb") as fh:
            fh.write(os.urandom(256 << 20))
    task = (f"name: ctrlc\nnum_nodes: 5\nresources:\n  infra: local\nworkdir: ./w\n"
            f"setup: |\n  echo setup-started\n  (exec -a {marker} sleep 120)\n"
            f"run: |\n  echo run-started\n  (exec -a {marker} sleep 120)\n")
    (project / "c.yaml").write_text(task)
    trigger = {"copy": "Copying the workdir to the head", "setup": "setup-started", "run": "run-started"}[stage]
    args = ["apply", str(project / "c.yaml"), "-c", NAME] + (["--no-setup"] if stage == "run" else [])
    # Ctrl-C ends a job the head took only when asked (as a CI step that wants it asks: the flag, or
    # the variable); one it has not taken yet (the copy) ends anyway: nothing of it runs
    env = {"GPUCTL_CANCEL_ON_INTERRUPT": "1"} if stage == "setup" else None
    args += ["--cancel-on-interrupt"] if stage == "run" else []
    rc, text = interrupt_when(jp, args, trigger, marker, env)
    assert rc == 130, text
    assert "Traceback" not in text
    _, status = last_job(jp)
    assert status == "CANCELLED", text


def test_detached_job_fails_fast_without_gpuctl(jp: JP):
    marker = f"{MOD}-orphan"
    res = jp.gpuctl("exec", NAME, "-d", *shell(
        f'if [ "$GPUCTL_NODE_RANK" == "3" ]; then sleep 3; exit 9; fi; (exec -a {marker} sleep 120)')).check()
    job = job_id_of(res, "detached")
    for pid in pids_matching(f"_watch\0{NAME}\0{job}\0"):  # gpuctl is gone: the head alone decides
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pids_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not pids_matching(marker), "the other ranks were not stopped"
    mine = queue_row_once_ended(lambda: jp.gpuctl("queue", NAME), job)
    assert mine[2] == "FAILED" and mine[-1].split(",")[3] == "9", mine


# Every rank prints lines no hop may cut or read as events: 3 MiB of every byte but the
# newline (invalid UTF-8, \r), event lines of its own, a 1 MiB line ending in one (where the
# old controller cut), and last 5 MiB without a newline.
AWKWARD = (
    "import os, sys; r = int(os.environ['GPUCTL_NODE_RANK']); noise = bytes(b for b in range(256) if b != 10); "
    "lines = [noise * (12288 + r), b'D SUCCEEDED {}', b'y' * (1 << 20) + b'D SUCCEEDED {}', b'X %d run 1' % r, "
    "b'__GPUCTL_EXIT__ 0', b'progress\\rdone\\r', 'w\u00e9rld'.encode()]; "
    "sys.stdout.buffer.write(b'\\n'.join(lines) + b'\\n' + b'z' * (5 << 20) + b'no newline %d' % r)")


def test_long_binary_and_event_looking_lines_arrive_byte_for_byte(jp: JP):
    """Through the depth-2 tree (worker2 and worker4 pass through a relay): the live output,
    each rank's log and `gpuctl logs` (the saved copy, and rebuilt from the head) hold exactly
    what every rank printed."""
    expected = {n.rank: subprocess.run([sys.executable, "-c", AWKWARD], capture_output=True, check=True,
                                       env={**os.environ, "GPUCTL_NODE_RANK": str(n.rank)}).stdout
                for n in jp.nodes}
    live = subprocess.run([sys.executable, "-m", "gpuctl", "exec", NAME, "--", "python3", "-c", AWKWARD],
                          env={**gpuctl_env(jp.cluster.state_dir), **jp.env_extra}, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=300)
    assert live.returncode == 0, live.stderr.decode(errors="replace")
    job = re.search(rb"^Job (\d+) running", live.stdout, re.M)
    assert job, live.stdout[-2000:]

    def by_rank(out: bytes) -> dict[int, bytes]:
        """Each rank's printed lines, prefix taken off (the console ends the last line)."""
        return {n.rank: b"".join(line[len(f"({n.name}, rank={n.rank}) "):] + b"\n" for line in out.split(b"\n")
                                 if line.startswith(f"({n.name}, rank={n.rank}) ".encode()))
                for n in jp.nodes}

    # What a reader without a terminal sees of those bytes: each \r redraw a line of its own (live
    # rate-limited, all of it after the fact; common/ranklines.py); the rank logs keep the bytes.
    # Where a line arrives in pieces (its 5 MiB tail, on a loaded machine) each piece that waited shows
    # as it comes: which breaks appear depends on timing, what is printed, in order, does not.
    printed = by_rank(b"".join(rendered(n, expected[n.rank], live=True) for n in jp.nodes))
    assert {r: b.replace(b"\n", b"") for r, b in by_rank(live.stdout).items()} == \
        {r: b.replace(b"\n", b"") for r, b in printed.items()}
    logs = jp.cluster.logs_dir(job.group(1).decode())
    assert {n.rank: (logs / f"run-rank{n.rank}.log").read_bytes() for n in jp.nodes} == expected
    saved = subprocess.run([sys.executable, "-m", "gpuctl", "logs", NAME, job.group(1).decode()],
                           env=gpuctl_env(jp.cluster.state_dir), capture_output=True, timeout=120)
    printed = by_rank(b"".join(rendered(n, expected[n.rank], live=False) for n in jp.nodes))
    assert saved.returncode == 0 and by_rank(saved.stdout) == printed, saved.stderr.decode(errors="replace")
    for path in logs.glob("*-rank*.log"):
        path.unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "gpuctl", "logs", NAME, job.group(1).decode()],
                             env=gpuctl_env(jp.cluster.state_dir), capture_output=True, timeout=120)
    assert rebuilt.returncode == 0 and by_rank(rebuilt.stdout) == printed, rebuilt.stderr.decode(errors="replace")
    assert {n.rank: (logs / f"run-rank{n.rank}.log").read_bytes() for n in jp.nodes} == expected


def rendered(node: NodeInfo, data: bytes, *, live: bool) -> bytes:
    """A rank's bytes as gpuctl prints them off a terminal, arriving at once (ranklines.py)."""
    raw = io.BytesIO()
    reporter = Reporter(stream=io.TextIOWrapper(raw, encoding="utf-8", write_through=True), plain=True)
    lines = RankLines(reporter, clock=lambda: 0.0, **({} if live else {"interval": 0, "in_place": 0}))
    *whole, last = decode(data).split("\n")
    prefix = f"({node.name}, rank={node.rank})"
    for text in whole:
        lines.line(node.rank, "run", prefix, text)
    lines.line(node.rank, "run", prefix, last, eol=False)
    lines.end()
    return raw.getvalue()


# Every rank leaves a line unfinished for a while, then redraws one with \r, an update every 1.3 s.
PROGRESS = ("printf 'waiting> '; sleep 1.5; echo ok; "
            "for i in 0 50 100; do {gate}printf 'progress %3d%%\\r' $i; sleep 1.3; done; echo")
# a detached job's last update waits (at most 60 s) for the follower to have shown the ones before
GATE = 'if [ $i = 100 ]; then for _ in $(seq 600); do [ -e {mark} ] && break; sleep 0.1; done; fi; '


def test_progress_bars_and_unfinished_lines_show_live_an_update_a_line(jp: JP):
    """Through the tree, with `exec` and with `gpuctl logs` following a detached job: a prompt shows
    before its answer comes, and each \r redraw reaches gpuctl's stdout as a prefixed line of its
    own when it happens (not all at the newline, never glued); `gpuctl logs` afterwards shows the
    same updates from the saved logs."""
    def check(res: Result, what: str, live_from: int = 0) -> None:
        """Each rank's lines; from its `live_from`th on, each came when the rank wrote it."""
        for n in jp.nodes:
            prefix = f"({n.name}, rank={n.rank})"
            mine = [(t, line[len(prefix) + 1:]) for t, line in res.stdout_lines if line.startswith(prefix + " ")]
            said = [text for _, text in mine]
            assert said == ["waiting> ", "ok", "progress   0%", "progress  50%", "progress 100%"], (what, said)
            at = [t for t, _ in mine]
            gaps = {1: 1.0, 3: 0.8, 4: 0.8}  # after the prompt 1.5 s, between updates 1.3 s
            assert all(at[i] - at[i - 1] > gap for i, gap in gaps.items() if i > live_from), (what, prefix, at)
        assert "\r" not in res.stdout, what

    live = jp.gpuctl("exec", NAME, *shell(PROGRESS.format(gate=""))).check()
    check(live, "exec")
    mark = Path(f"/tmp/gpuctl-progress-{uuid.uuid4().hex}")  # nodes share /tmp with this machine
    detached = jp.gpuctl("exec", NAME, "-d", *shell(PROGRESS.format(gate=GATE.format(mark=mark)))).check()
    job = job_id_of(detached, "detached")
    # what came before the follower: at once, and a burst may hold an update back (one a second); the
    # last one, written once the follower showed the one before, must come when it is written
    follower = Watched([sys.executable, "-m", "gpuctl", "logs", NAME, str(job)], gpuctl_env(jp.cluster.state_dir),
                       lambda line: "progress  50%" in line)
    try:
        assert follower.seen.wait(120), follower.text
        released = time.time()
        mark.touch()
        following = follower.result(timeout=120)
    finally:
        follower.close()
        mark.unlink(missing_ok=True)
    assert following.returncode == 0, following.describe()
    check(following, "logs, following", live_from=4)
    for n in jp.nodes:
        last = following.first_time(lambda line: line == f"({n.name}, rank={n.rank}) progress 100%")
        assert last is not None and last > released, (n.name, following.describe())
    saved = jp.gpuctl("logs", NAME, str(job_id_of(live))).check()
    for n in jp.nodes:
        prefix = f"({n.name}, rank={n.rank}) "
        assert [line[len(prefix):] for line in saved.stdout.splitlines() if line.startswith(prefix)] == [
            "waiting> ok", "progress   0%", "progress  50%", "progress 100%"], saved.describe()


@pytest.mark.parametrize("rank", [2, 0])  # a worker behind a relay, the head
def test_a_full_disk_fails_the_job_at_once_naming_the_node_and_path(jp: JP, rank: int):
    """The node's ~/.gpuctl/jobs is a full tmpfs: the job fails in one line naming the node and
    the path, without preparing again, and `queue` says FAILED at once (not PENDING)."""
    node = jp.nodes[rank]
    jobs = "$HOME/.gpuctl/jobs"
    # the login user's own tmpfs (a normal user with sudo, as on a cloud image)
    jp.cluster.ssh(node, f'sudo -n mount -t tmpfs -o size=64k,mode=0700,uid="$(id -u)",gid="$(id -g)" tmpfs "{jobs}" '
                         f'&& {{ dd if=/dev/zero of="{jobs}/fill" bs=4k 2>/dev/null; true; }}')
    try:
        res = jp.gpuctl("exec", NAME, "--", "true")
    finally:
        jp.cluster.ssh(node, f'sudo -n umount "{jobs}"')
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and re.search(rf"\b{node.name}: cannot write /\S+/\.gpuctl/jobs/\d+-\w+(/\S+)?: "
                                          r"No space left on device$", errors[0]), res.describe()
    assert "Preparing" not in res.stdout, res.describe()
    job = int(re.search(r"job (\d+):", errors[0]).group(1))  # type: ignore[union-attr]
    row = next(r for r in queue_rows(jp.gpuctl("queue", NAME).check().stdout) if r[0] == str(job))
    assert row[2] == "FAILED", row
