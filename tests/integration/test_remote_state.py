"""Shared state in S3 (moto on loopback): a runner that never saw a cluster takes it over.

Runner A (its own GPUCTL_STATE_DIR) applies a 2-node local cluster and runs a
job; runner B, with a fresh state dir and only GPUCTL_STATE_BUCKET set, sees it
in `status`, runs on it with `exec` (host keys still verified), lists both
runners' jobs with ids that never collide, is refused or waits while another
runner holds the cluster's lock, and takes it down; A then no longer lists it.
On AWS (moto EC2), `down` from a fresh state dir terminates what another one
provisioned (tests/integration/test_aws_moto.py, in its one apply).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import boto3
import gpuctlfork
import pytest
from e2e import cluster_netns
from mototest import MotoServer, fake_aws_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUCKET = "gpuctl-ci-state"
PREFIX = "runners"


@pytest.fixture()
def moto(moto_server: MotoServer) -> MotoServer:
    """The session's moto server (tests/conftest.py) with the state bucket in it."""
    try:
        s3(moto_server).create_bucket(Bucket=BUCKET)
    except s3(moto_server).exceptions.BucketAlreadyOwnedByYou:
        pass
    return moto_server


def s3(moto: MotoServer):
    return boto3.client("s3", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def keys(moto: MotoServer, prefix: str) -> list[str]:
    return [o["Key"] for o in s3(moto).list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def runner_env(moto: MotoServer, state_dir: Path, tf_cli_config: Path, **extra: str) -> dict[str, str]:
    env = fake_aws_env(moto.url)
    env.update(GPUCTL_STATE_DIR=str(state_dir), GPUCTL_STATE_BUCKET=BUCKET, GPUCTL_STATE_PREFIX=PREFIX,
               GPUCTL_STATE_ENDPOINT_URL=moto.url, TF_CLI_CONFIG_FILE=str(tf_cli_config), TF_IN_AUTOMATION="1",
               **extra)
    env.pop("GPUCTL_LOCAL_MODE", None)
    return env


def gpuctl(*args: str, env: dict[str, str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    try:
        return gpuctlfork.run(args, env=env, cwd=cwd, timeout=timeout, new_session=True)
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"gpuctl {' '.join(args)} ran over {timeout}s:\n{late.stdout}\n{late.stderr}")


def ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, f"{res.args}\n{res.stdout}\n{res.stderr}"
    return res.stdout


HOLD = """
import select, sys
from gpuctl.state import remotestate
from gpuctl.state.remotestate.store import cluster_lock
remote = remotestate.current()
with cluster_lock(remote.store, sys.argv[1], command="gpuctl apply", on_wait=print):
    print("held", flush=True)
    select.select([sys.stdin], [], [], float(sys.argv[2]))  # until the test lets go (closes stdin), at most this
"""


def hold_lock(name: str, seconds: float, env: dict[str, str]) -> subprocess.Popen[str]:
    """Another runner in the middle of changing the cluster: gpuctl's own lock, held until its stdin
    closes (at most `seconds`)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, name, str(seconds)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def release(holder: subprocess.Popen[str]) -> None:
    if holder.stdin is not None and not holder.stdin.closed:
        holder.stdin.close()
    holder.wait(timeout=30)


def apply_waiting_on(holder: subprocess.Popen[str], *args: str, env: dict[str, str],
                     cwd: Path) -> subprocess.CompletedProcess[str]:
    """`gpuctl ARGS` started while `holder` has the lock, which it gives back once gpuctl says it waits
    (not after a fixed time, which a loaded machine can outlast before gpuctl even reaches the lock)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", *args], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(120, release, (holder,))  # never wait forever on a gpuctl that does not wait
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Waiting up to " in line:
                break
        release(holder)
        out, err = proc.communicate(timeout=240)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines) + out, err)


def test_a_fresh_runner_takes_over_a_local_cluster(moto: MotoServer, tmp_path: Path, tf_cli_config: Path) -> None:
    name = f"rs-{uuid.uuid4().hex[:6]}"
    task = tmp_path / "task.yaml"
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "train.py").write_text("print('hi')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "kept.txt").write_text("mounted by runner A\n")
    task.write_text(textwrap.dedent(f"""\
        name: {name}
        num_nodes: 2
        resources: {{infra: local}}
        workdir: ./wd
        file_mounts:
          ~/gpuctl_workdir/data: ./data
        run: echo "rank $SKYPILOT_NODE_RANK says hello"
        """))
    # runner B's exec copies the workdir again, without the file_mounts: what A mounted inside stays
    b_task = tmp_path / "b.yaml"
    b_task.write_text("num_nodes: 2\nworkdir: ./wd\nrun: echo b-was-here; cat data/kept.txt\n")
    env_a = runner_env(moto, tmp_path / "runner-a", tf_cli_config)
    env_b = runner_env(moto, tmp_path / "runner-b", tf_cli_config)
    before = cluster_netns(name)
    try:
        # runners A and C apply the same new cluster at once: one provisions, the other waits for its
        # lock and then reuses what the first made (Terraform never runs twice on one state)
        env_c = runner_env(moto, tmp_path / "runner-c", tf_cli_config)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            applied_a = pool.submit(gpuctl, "apply", str(task), env=env_a, cwd=tmp_path)
            applied_c = pool.submit(gpuctl, "apply", str(task), "--provision-only", env=env_c, cwd=tmp_path)
            out, out_c = ok(applied_a.result()), ok(applied_c.result())
        assert "rank 1 says hello" in out
        waited = [o for o in (out, out_c) if "Waiting up to 600s for " in o]
        assert len(waited) == 1, out + out_c
        assert "terraform apply: no changes, reusing the existing nodes" in waited[0]
        assert len(cluster_netns(name) - before) == 2, cluster_netns(name) - before  # two nodes, not four
        stored = keys(moto, f"{PREFIX}/clusters/{name}/")
        assert f"{PREFIX}/clusters/{name}/terraform.tfstate" in stored  # Terraform's S3 backend
        assert f"{PREFIX}/clusters/{name}/record.json" in stored
        assert f"{PREFIX}/clusters/{name}/files/ssh/id_ed25519" in stored
        assert not any("/files/nodes/" in k or "/files/cm/" in k for k in stored)

        # runner B never saw the cluster
        status = ok(gpuctl("status", name, env=env_b, cwd=tmp_path))
        assert f"{name}: UP, 2 node(s) on local" in status and "rank=1" in status
        ran = ok(gpuctl("exec", name, str(b_task), env=env_b, cwd=tmp_path))
        assert ran.count("b-was-here") == 2 and ran.count("mounted by runner A") == 2, ran
        queue = ok(gpuctl("queue", name, env=env_b, cwd=tmp_path)).splitlines()
        assert [line.split()[0] for line in queue[1:]] == ["1", "2"]
        assert all("SUCCEEDED" in line for line in queue[1:])
        assert gpuctl("logs", name, "1", "--status", env=env_b, cwd=tmp_path).returncode == 0
        assert "rank 1 says hello" in ok(gpuctl("logs", name, "1", env=env_b, cwd=tmp_path))  # A's job, from the head
        assert ok(gpuctl("queue", name, env=env_a, cwd=tmp_path)).count("SUCCEEDED") == 2  # A sees B's job

        # another runner is changing the cluster: refused at once with lock_timeout 0, naming it
        holder = hold_lock(name, 300, env_a)
        try:
            refused = gpuctl("apply", str(task), env={**env_b, "GPUCTL_STATE_LOCK_TIMEOUT": "0"}, cwd=tmp_path)
            assert refused.returncode == 3, refused.stdout + refused.stderr
            line = refused.stderr.strip()
            assert "\n" not in line and "Traceback" not in line
            assert f"error: cluster '{name}' is locked by " in line and "`gpuctl apply`" in line
            assert f"gpuctl force-unlock {name}" in line
            # ... or waited for, with the default timeout
            waited = ok(apply_waiting_on(holder, "apply", str(task), "--provision-only", env=env_b, cwd=tmp_path))
            assert "Waiting up to 600s for " in waited
            assert "terraform apply: no changes, reusing the existing nodes" in waited
        finally:
            release(holder)

        # a runner that died holding the lock: force-unlock
        hold_lock(name, 60, env_a).kill()
        unlocked = ok(gpuctl("force-unlock", name, env=env_b, cwd=tmp_path))
        assert f"Removed the lock of cluster '{name}' held by " in unlocked
        assert keys(moto, f"{PREFIX}/locks/") == []

        ok(gpuctl("down", name, env=env_b, cwd=tmp_path))
        assert keys(moto, f"{PREFIX}/clusters/{name}/") == []
        assert cluster_netns(name) - before == set()
        assert "No clusters." in ok(gpuctl("status", env=env_a, cwd=tmp_path))
    finally:
        if keys(moto, f"{PREFIX}/clusters/{name}/record.json"):
            gpuctl("down", name, env=env_a, cwd=tmp_path)
