"""`image_id: docker:IMAGE` in the node agent, without a container runtime: the
commands it builds (nothing user-given where an option could be read, no secret
on any command line, GPUs only where the node has them), the payload the
controller sends, the one-line problem when a node has no runtime, and the
container's lifecycle through `submit` against a stand-in runtime (a script that
keeps containers as files and runs `exec` on this machine): created once,
reused, re-created when the image changes, refused while another job uses it,
and a cancelled stage stopped through the runtime. Real containers on real
nodes: tests/integration/test_containers_local.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuctl.provision import containers
from test_jobplane_agent import AGENT_PATH, agent, node_home, payload, submit  # noqa: F401 (a fixture)

SECRET = "s3cr3t-in-env-only"

# A stand-in for docker: each container is NAME.label / NAME.running / NAME.created under
# $FAKE_RT; `exec` runs the command here (options: --env=K=V, --workdir=DIR); every call
# is appended to $FAKE_RT/calls, one argument per line, calls separated by a line "--end--".
FAKE_RUNTIME = r"""#!/bin/bash
st=${FAKE_RT:?}
printf '%s\n' "$@" --end-- >>"$st/calls"
cmd=$1; shift
case $cmd in
  version) exit 0 ;;
  inspect)
    name=${*: -1}
    [[ -f $st/$name.label ]] || { echo "no such container $name" >&2; exit 1; }
    printf '%s|%s\n' "$(cat "$st/$name.running")" "$(cat "$st/$name.label")" ;;
  run)
    for a in "$@"; do
      case $a in --name=*) name=${a#--name=} ;; --label=gpuctl.spec=*) label=${a#--label=gpuctl.spec=} ;; esac
    done
    printf '%s' "$label" >"$st/$name.label"; echo true >"$st/$name.running"; echo x >>"$st/$name.created"
    echo "0123456789ab" ;;
  start) echo true >"$st/${*: -1}.running" ;;
  rm) rm -f "$st/${*: -1}.label" "$st/${*: -1}.running" ;;
  exec)
    while [[ $1 == --* ]]; do
      case $1 in --env=*) export "${1#--env=}" ;; --workdir=*) cd "${1#--workdir=}" || exit 126 ;; esac
      shift
    done
    shift  # the container's name
    exec "$@" ;;
  *) echo "fake runtime: $cmd?" >&2; exit 2 ;;
esac
"""


# -- what the controller sends ------------------------------------------------------


def test_container_plan_rejects_option_like_images_and_keeps_mounts_once():
    plan = containers.container_plan("nvcr.io/nvidia/pytorch:24.10-py3", "c1",
                                      ["~/gpuctl_workdir", "/data", "~/gpuctl_workdir"])
    assert plan == {"image": "nvcr.io/nvidia/pytorch:24.10-py3", "name": "gpuctl-c1", "runtime": None,
                    "mounts": ["~/gpuctl_workdir", "/data"]}
    for bad in ("-v/:/host", "--privileged", "img with space", "img;rm", ""):
        with pytest.raises(ValueError, match="not a container image"):
            containers.container_plan(bad, "c1", [])


@pytest.mark.parametrize("value,expected", [("", None), ("docker", "docker"), ("podman", "podman"),
                                            ("/opt/bin/podman", "/opt/bin/podman")])
def test_container_runtime_setting(value: str, expected: str | None):
    assert containers.container_runtime(value) == expected


@pytest.mark.parametrize("value", ["nerdctl", "-x", "/opt/bin/podman --root=/", "docker;id", "bin/docker"])
def test_container_runtime_setting_refuses_other_values(value: str):
    with pytest.raises(ValueError, match="GPUCTL_CONTAINER_RUNTIME"):
        containers.container_runtime(value)


# -- the commands the agent builds ---------------------------------------------------------


def cfg(flavor: str = "docker", gpus: bool = False) -> dict:
    return {"runtime": f"/usr/bin/{flavor}", "flavor": flavor, "name": "gpuctl-c1-head", "image": "repo/img:1",
            "mounts": ["/data", "/root/gpuctl_workdir"], "gpus": gpus, "home": "/root",
            "workdir": "/root/gpuctl_workdir"}


@pytest.mark.parametrize("flavor,gpus,flag", [("docker", True, "--gpus=all"),
                                              ("podman", True, "--device=nvidia.com/gpu=all"),
                                              ("docker", False, None)])
def test_run_argv_host_network_ipc_gpus_and_image_after_dashes(flavor: str, gpus: bool, flag: str | None):
    c = cfg(flavor, gpus)
    want = {"image": c["image"], "gpus": gpus, "mounts": {"/data": "1:2", "/root/gpuctl_workdir": "1:3"}}
    argv = agent.container_run_argv(c, want)
    assert argv[:2] == [f"/usr/bin/{flavor}", "run"]
    assert "--network=host" in argv and "--ipc=host" in argv
    assert ("--gpus=all" in argv or "--device=nvidia.com/gpu=all" in argv) == gpus
    if flag:
        assert flag in argv
    assert {"--volume=/data:/data", "--volume=/root/gpuctl_workdir:/root/gpuctl_workdir"} <= set(argv)
    dashes = argv.index("--")
    assert argv[dashes + 1] == "repo/img:1" and argv[dashes + 2:] == ["-c", agent.KEEPALIVE]
    # Before `--` every value rides in its option's own argument (--opt=value).
    assert all(a.startswith("--") for a in argv[2:dashes])
    label = next(a for a in argv if a.startswith("--label="))
    assert json.loads(label.split("=", 2)[2]) == want


def test_run_argv_passes_the_fabric_devices_where_the_node_has_them():
    want = {"image": "repo/img:1", "gpus": True, "mounts": {}}
    assert "--device=/dev/infiniband" not in agent.container_run_argv(cfg(gpus=True), want)
    argv = agent.container_run_argv({**cfg(gpus=True), "fabric": True}, want)
    assert {"--device=/dev/infiniband", "--ulimit=memlock=-1:-1"} <= set(argv[:argv.index("--")])


def test_exec_argv_reads_env_and_secrets_from_files(tmp_path: Path):
    st = agent.Stage(str(tmp_path), "run")
    argv = agent.container_exec_argv(cfg(), st)
    name = argv.index("gpuctl-c1-head")
    assert argv[:2] == ["/usr/bin/docker", "exec"] and all(a.startswith("--") for a in argv[2:name])
    assert "--env=HOME=/root" in argv and "--workdir=/root/gpuctl_workdir" in argv
    assert argv[name + 1:name + 3] == ["bash", "-c"]
    assert argv[-6:] == [st.cpid, st.killed, str(tmp_path / "fabric.env"), st.env, st.secrets, st.script]


def test_container_wrapper_runs_the_stage_in_its_own_group_and_keeps_its_code(tmp_path: Path):
    script = tmp_path / "run.sh"
    script.write_text('echo "$A $B $(cut -d" " -f5 /proc/$$/stat)"; exit 5\n')
    (tmp_path / "env.sh").write_text("A=from-env\n")
    (tmp_path / "secrets.sh").write_text("B=from-secrets\n")
    out = subprocess.run(["bash", "-c", agent.CONTAINER_WRAPPER, "gpuctl-run", str(tmp_path / "cpid"),
                          str(tmp_path / "killed"), str(tmp_path / "none"), str(tmp_path / "env.sh"),
                          str(tmp_path / "secrets.sh"), str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 5, out.stderr
    cpid = (tmp_path / "cpid").read_text().strip()
    assert out.stdout == f"from-env from-secrets {cpid}\n" and out.stderr == ""


def test_config_binds_each_tree_once_and_refuses_paths_a_bind_cannot_take(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(agent, "find_runtime", lambda wanted=None, prefix=(): ("/usr/bin/podman", None))
    c, problem = agent.container_config({"image": "img", "name": "gpuctl-c1",
                                         "mounts": ["~/gpuctl_workdir/sub", "/data/", "/data/x"]}, "worker 3",
                                        "~/gpuctl_workdir")
    assert problem is None
    home = os.path.expanduser("~")
    assert c["mounts"] == sorted(["/data", f"{home}/gpuctl_workdir", agent.JOBS_DIR])
    assert c["name"] == "gpuctl-c1-worker-3" and c["flavor"] == "podman"
    for dest in ("/a:b", "/a,b", "/"):
        _, problem = agent.container_config({"image": "img", "mounts": [dest]}, "head", "~/gpuctl_workdir")
        assert problem and "cannot be bound" in problem
    _, problem = agent.container_config({"image": "-v/:/x"}, "head", "~/gpuctl_workdir")
    assert problem and "not a container image" in problem


def test_no_runtime_names_what_is_missing_and_what_to_install(tmp_path: Path, monkeypatch):
    broken = tmp_path / "docker"
    broken.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    path, problem = agent.find_runtime()
    assert path is None
    assert "`docker version` failed: Cannot connect to the Docker daemon" in problem
    assert "podman is not installed (not on PATH)" in problem and "install Docker" in problem
    _, problem = agent.find_runtime("/nowhere/podman")
    assert problem == ("GPUCTL_CONTAINER_RUNTIME=/nowhere/podman: /nowhere/podman is not installed; install it on "
                       "the node or unset GPUCTL_CONTAINER_RUNTIME")


# -- through submit ----------------------------------------------------------------------


@pytest.fixture
def fake_rt(tmp_path: Path, monkeypatch) -> Path:
    state = tmp_path / "rt"
    state.mkdir()
    rt = tmp_path / "bin" / "docker"
    rt.parent.mkdir()
    rt.write_text(FAKE_RUNTIME)
    rt.chmod(0o755)
    monkeypatch.setenv("FAKE_RT", str(state))
    return state


def boxed(job: str, run: str | None, setup: str | None = None, image: str = "repo/img:1", runtime: str = "") -> dict:
    body = payload(job, run, setup)
    body["container"] = {"image": image, "name": "gpuctl-c1", "runtime": runtime or None, "mounts": []}
    return body


def calls(state: Path) -> list[list[str]]:
    text = (state / "calls").read_text() if (state / "calls").exists() else ""
    return [c.strip("\n").split("\n") for c in text.split("--end--\n") if c.strip()]


def test_missing_runtime_is_one_problem_and_nothing_runs(node_home: Path):
    events, outcome, _ = submit(node_home, boxed("20", "touch ~/ran", setup="touch ~/setup-ran",
                                                 runtime="/nowhere/docker"))
    assert outcome is not None and outcome.status == "FAILED" and outcome.ranks == (0,)
    assert outcome.detail == ("head: GPUCTL_CONTAINER_RUNTIME=/nowhere/docker: /nowhere/docker is not installed; "
                              "install it on the node or unset GPUCTL_CONTAINER_RUNTIME")
    assert [e.kind for e in events if e.kind in "SOX"] == []
    assert not (node_home / "ran").exists() and not (node_home / "setup-ran").exists()


def test_one_container_created_reused_and_recreated_for_another_image(node_home: Path, fake_rt: Path):
    rt = str(fake_rt.parent / "bin" / "docker")
    secret = f"export TOKEN={SECRET}\n"
    _, outcome, _ = submit(node_home, boxed("21", 'echo "run $TOKEN $FABRIC_VAR $GPUCTL_NODE_RANK $HOME $PWD"', setup="echo setup",
                                            runtime=rt), secrets_text=secret)
    assert outcome is not None and outcome.status == "SUCCEEDED", outcome
    run_log = (node_home / ".gpuctl" / "jobs" / "21" / "run.log").read_text()
    assert run_log == f"run {SECRET} from-fabric 0 {node_home} {node_home}/gpuctl_workdir\n"
    setup_log = (node_home / ".gpuctl" / "jobs" / "21" / "setup.log").read_text()
    assert setup_log == "gpuctl-node: starting container gpuctl-c1-head from repo/img:1\nsetup\n"
    assert (fake_rt / "gpuctl-c1-head.created").read_text() == "x\n"

    _, outcome, _ = submit(node_home, boxed("22", "exit 3", runtime=rt), secrets_text=secret)
    assert outcome is not None and outcome.status == "FAILED" and outcome.run == {0: 3}
    assert (fake_rt / "gpuctl-c1-head.created").read_text() == "x\n"  # reused

    _, outcome, _ = submit(node_home, boxed("23", "true", image="repo/img:2", runtime=rt))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    assert (fake_rt / "gpuctl-c1-head.created").read_text() == "x\nx\n"  # re-created
    assert json.loads((fake_rt / "gpuctl-c1-head.label").read_text())["image"] == "repo/img:2"
    made = calls(fake_rt)
    assert ["rm", "--force", "gpuctl-c1-head"] in made
    assert not any(SECRET in arg for call in made for arg in call)


def test_container_in_use_is_not_recreated_under_a_running_job(node_home: Path, fake_rt: Path):
    rt = str(fake_rt.parent / "bin" / "docker")
    _, outcome, _ = submit(node_home, boxed("24", "true", runtime=rt))
    assert outcome is not None and outcome.status == "SUCCEEDED"
    with open(node_home / ".gpuctl" / "containers" / "gpuctl-c1-head.use") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # as a stage of another job holds it
        _, outcome, _ = submit(node_home, boxed("25", "true", image="repo/img:2", runtime=rt))
    assert outcome is not None and outcome.status == "FAILED" and outcome.run == {0: 125}
    assert "runs another job's stage with another image or other mounts" in \
        (node_home / ".gpuctl" / "jobs" / "25" / "run.log").read_text()
    assert (fake_rt / "gpuctl-c1-head.created").read_text() == "x\n"


def test_cancel_stops_the_stage_through_the_runtime(node_home: Path, fake_rt: Path):
    rt = str(fake_rt.parent / "bin" / "docker")
    marker = f"gpuctl-ctr-cancel-{os.getpid()}"
    body = boxed("26", f"echo started; (exec -a {marker} sleep 60); echo survived", runtime=rt)
    env = {**os.environ, "HOME": str(node_home)}
    proc = subprocess.Popen([sys.executable, str(AGENT_PATH), "submit"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(body) + "\n\"\"\n").encode())
    proc.stdin.close()
    proc.stdin = None
    seen = b""
    while b"started" not in seen:
        seen += proc.stdout.readline()
    answer = subprocess.run([sys.executable, str(AGENT_PATH), "cancel", "26", "--wait", "20"], env=env,
                            capture_output=True, text=True, timeout=60)
    out, _ = proc.communicate(timeout=30)
    assert json.loads(answer.stdout)["status"] == "CANCELLED"
    assert b"survived" not in seen + out
    # The kill went into the "container" (the stage's own group, by the id it wrote), not only to `exec`.
    assert any(c[:3] == ["exec", "gpuctl-c1-head", "bash"] and c[-2] == "15" for c in calls(fake_rt))
    deadline = time.monotonic() + 10
    while any(marker.encode() in _cmdline(p) for p in Path("/proc").glob("[0-9]*/cmdline")) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(marker.encode() in _cmdline(p) for p in Path("/proc").glob("[0-9]*/cmdline"))


def _cmdline(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


# -- `down`: the cluster's containers, by name ---------------------------------------------


@pytest.mark.parametrize("cluster,node", [("a", "head"), ("a-b", "worker1"), ("x.y_z", "worker12")])
def test_the_controller_names_a_nodes_container_as_the_agent_does(cluster: str, node: str,
                                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(agent, "find_runtime", lambda wanted=None, prefix=(): ("/usr/bin/podman", None))
    box = containers.container_plan("ubuntu:22.04", cluster, ["~/gpuctl_workdir"])
    cfg, problem = agent.container_config(box, node, "~/gpuctl_workdir")
    assert problem is None and cfg["name"] == containers.container_name(cluster, node)


@pytest.mark.parametrize("runtimes", [("podman",), ("docker",), ("docker", "podman")])
def test_down_removes_exactly_the_named_containers(tmp_path: Path, runtimes: tuple[str, ...]):
    """Fake runtimes holding this cluster's containers and another cluster's that shares the prefix
    (gpuctl-a-b-head vs gpuctl-a-head): only the named ones are asked for, nothing by pattern."""
    store = tmp_path / "store"
    store.write_text("gpuctl-a-head\ngpuctl-a-worker1\ngpuctl-a-b-head\n")
    log = tmp_path / "calls"
    for rt in runtimes:
        (tmp_path / rt).write_text(
            f'#!/bin/bash\necho "{rt} $*" >> {log}\n'
            f'if [ "$1 $2" = "container inspect" ]; then grep -qx -- "$4" {store}; fi\n')
        (tmp_path / rt).chmod(0o755)
    names = [containers.container_name("a", n) for n in ("head", "worker1", "worker2")]
    command = containers.remove_containers_command(names)
    proc = subprocess.run(["bash", "-c", command], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    removed = [c for c in calls if " rm " in f" {c} "]
    if "podman" in runtimes:
        assert "podman rm --force --ignore -- gpuctl-a-head gpuctl-a-worker1 gpuctl-a-worker2" in removed
    if "docker" in runtimes:  # docker has no --ignore: only the containers it has
        assert [c for c in removed if c.startswith("docker")] == ["docker rm --force -- gpuctl-a-head",
                                                                   "docker rm --force -- gpuctl-a-worker1"]
    assert not any("gpuctl-a-b" in c or "*" in c or "filter" in c for c in calls), calls
