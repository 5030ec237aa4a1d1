"""`gpuctl stop` / `gpuctl start` (SkyPilot's `sky stop` / `sky start`) without a cloud: what cannot
be stopped and kept is refused in one line naming `gpuctl down`, exit 2, before anything is changed
(spot nodes, local nodes, ssh hosts), and so are unknown, half-made and autodowned clusters. The whole
path against moto (stop through Terraform, status and cost while stopped, start without the task
file) runs on test_aws_moto.py's cluster, which pays for one apply and one down already."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl.state.registry import Registry

pytestmark = pytest.mark.integration

REGION = "us-east-1"
MOTO_UBUNTU_AMI = "ami-1e749f67"  # in moto's bundled image list
STOP_KEYS = {"schema", "command", "ok", "cluster", "status", "stopped_at", "cancelled"}
START_KEYS = {"schema", "command", "ok", "cluster", "status", "started", "nodes", "autostop"}


def gpuctl(*args: str, env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """The CLI (forked: tests/gpuctlfork.py) in its own process group (a timeout also ends its terraform), stdin closed: no terminal."""
    try:
        return gpuctlfork.run(args, env=env, cwd=cwd, timeout=timeout, new_session=True)
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"gpuctl {' '.join(args)} ran over {timeout}s:\n{late.stdout}\n{late.stderr}")


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `error:` line, and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- refusals: nothing to stop and keep ------------------------------------------------------------

def record(state: Path, name: str, cloud: str, **request: object) -> None:
    Registry(path=state / "state.db", remote=None).upsert_cluster(
        name, cloud=cloud, region=None, zone=None, num_nodes=2, status="UP", request={"name": name, **request})


@pytest.mark.parametrize("cloud, request_fields, says", [
    ("aws", {"use_spot": True, "region": REGION},
     "error: cluster 'c1': spot nodes cannot be stopped (a one-time spot request ends when its instance stops); "
     "`gpuctl down c1` removes the cluster"),
    ("local", {}, "error: cluster 'c1': local nodes cannot be stopped and kept (they are processes on this "
                  "machine); `gpuctl down c1` removes them and `gpuctl apply` makes them again"),
    ("ssh", {"inventory_path": "/nowhere/hosts.yml"},
     "error: cluster 'c1': gpuctl did not make these hosts, so it does not stop them: stop them yourself; "
     "`gpuctl down c1` forgets the cluster"),
])
def test_what_cannot_be_stopped_and_kept_is_refused(tmp_path: Path, _isolated_state: Path, cloud: str,
                                                    request_fields: dict, says: str) -> None:
    record(_isolated_state, "c1", cloud, **request_fields)
    env = {**os.environ, "GPUCTL_STATE_DIR": str(_isolated_state)}
    proc = gpuctl("stop", "c1", "-y", env=env, cwd=tmp_path)
    assert proc.returncode == 2 and error_line(proc) == says, proc.stderr
    as_json = gpuctl("stop", "c1", "-o", "json", env=env, cwd=tmp_path)
    doc = json.loads(as_json.stdout)
    assert (as_json.returncode, doc["command"], doc["ok"], doc["exit_code"]) == (2, "stop", False, 2)
    assert Registry(path=_isolated_state / "state.db", remote=None).cluster("c1").status == "UP"  # untouched


def test_stop_and_start_name_what_is_wrong(tmp_path: Path, _isolated_state: Path) -> None:
    env = {**os.environ, "GPUCTL_STATE_DIR": str(_isolated_state)}
    record(_isolated_state, "fine", "aws", region=REGION)
    cases = [
        (["stop"], "error: give the cluster to stop (gpuctl stop NAME [NAME...])"),
        (["stop", "nosuch"], "error: cluster 'nosuch' not found; `gpuctl status` lists the clusters you have"),
        (["stop", "fine", "nosuch"],  # checked before any is stopped: `fine` is not touched
         "error: cluster 'nosuch' not found; `gpuctl status` lists the clusters you have"),
        (["start", "nosuch"], "error: cluster 'nosuch' not found; `gpuctl status` lists the clusters you have"),
        (["stop", "Bad_Name"], None),
    ]
    for argv, says in cases:
        proc = gpuctl(*argv, env=env, cwd=tmp_path)
        assert proc.returncode == 2, (argv, proc.stderr)
        line = error_line(proc)
        assert says is None or line == says, (argv, line)
    assert Registry(path=_isolated_state / "state.db", remote=None).cluster("fine").status == "UP"
    registry = Registry(path=_isolated_state / "state.db", remote=None)
    registry.set_cluster_status("fine", "INIT")
    for verb in ("stop", "start"):
        half = gpuctl(verb, "fine", env=env, cwd=tmp_path)
        assert half.returncode == 2 and error_line(half) == (
            "error: cluster 'fine' is INIT (an apply or down did not finish): run `gpuctl apply` again, "
            "or `gpuctl down fine`"), half.stderr
    registry.set_cluster_status("fine", "AUTODOWNED")
    for verb in ("stop", "start"):
        gone = gpuctl(verb, "fine", env=env, cwd=tmp_path)
        assert gone.returncode == 2 and error_line(gone) == (
            f"error: cluster 'fine' took itself down (autodown): there is nothing to {verb}; `gpuctl apply` "
            "makes it again, `gpuctl down fine` forgets it"), gone.stderr
    assert registry.cluster("fine").status == "AUTODOWNED"
