"""Autostop's pieces without nodes: SkyPilot's spellings of the setting, the providers' power-off
plans, and the head's agent (its watcher run for real, detached, in a temporary HOME)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl.common.errors import UserError
from gpuctl.node import autostop as agent
from gpuctl.providers import get_provider
from gpuctl.providers.aws.provider import module_inputs
from gpuctl.provision import lifecycle, ssh
from gpuctl.spec.autostop import Autostop, AutostopError, parse_autostop, with_flags
from nodeagent import COMMAND as AGENT_COMMAND


@pytest.mark.parametrize("value, expected", [
    (True, Autostop(idle_minutes=5)),
    (False, None),
    (None, None),
    (10, Autostop(idle_minutes=10)),
    ("10m", Autostop(idle_minutes=10)),
    ("2h", Autostop(idle_minutes=120)),
    ("1d", Autostop(idle_minutes=1440)),
    ({"idle_minutes": 3, "down": True, "wait_for": "jobs", "hook": "echo bye", "hook_timeout": 30},
     Autostop(idle_minutes=3, down=True, wait_for="jobs", hook="echo bye", hook_timeout=30)),
    ({"down": True}, Autostop(idle_minutes=5, down=True)),
])
def test_skypilot_spellings(value: object, expected: Autostop | None) -> None:
    assert parse_autostop(value) == expected


@pytest.mark.parametrize("value, key, words", [
    (-1, "", "0 or more"),
    ("ten", "", "not a number of minutes"),
    ({"idle_minutes": "5x"}, "idle_minutes", "10m, 2h"),
    ({"wait_for": "forever"}, "wait_for", "jobs_and_ssh, jobs, none"),
    ({"down": "yes"}, "down", "true or false"),
    ({"hook": ""}, "hook", "shell commands"),
    ({"hook_timeout": 0}, "hook_timeout", "1 or more"),
    ({"idle": 5}, "idle", "known: idle_minutes"),
])
def test_bad_settings_say_what_to_write(value: object, key: str, words: str) -> None:
    with pytest.raises(AutostopError) as err:
        parse_autostop(value)
    assert err.value.key == key and words in str(err.value)


def test_apply_flags_over_the_task() -> None:
    assert with_flags(None, None, False) is None
    assert with_flags(None, None, True) == Autostop(idle_minutes=0, down=True)  # down when the job is done
    assert with_flags(None, 30, False) == Autostop(idle_minutes=30)
    assert with_flags(Autostop(idle_minutes=7, hook="x"), None, True) == Autostop(idle_minutes=7, down=True, hook="x")


def test_aws_nodes_shut_themselves_down_and_autodown_needs_terminating_nodes(tmp_path: Path) -> None:
    aws = get_provider("aws")
    plan = aws.power_off(tmp_path, [0, 1, 2], "ubuntu", {"autodown": True}, down=True)
    assert plan.workers == {1: ["sudo", "-n", "shutdown", "-h", "now"], 2: ["sudo", "-n", "shutdown", "-h", "now"]}
    assert plan.head == [["sudo", "-n", "shutdown", "-h", "now"]] and plan.removes
    stop = aws.power_off(tmp_path, [0], "root", {}, down=False)
    assert stop.head == [["shutdown", "-h", "now"]] and not stop.removes and "EBS" in stop.notes[0]
    with pytest.raises(UserError, match="apply its task with --down"):
        aws.power_off(tmp_path, [0], "ubuntu", {"autodown": False}, down=True)
    with pytest.raises(UserError, match="spot nodes cannot be stopped"):
        aws.power_off(tmp_path, [0], "ubuntu", {"use_spot": True}, down=False)
    with pytest.raises(UserError, match="yours to stop"):
        get_provider("ssh").power_off(tmp_path, [0], "me", {}, down=True)


def test_aws_module_terminates_on_shutdown_only_for_autodown() -> None:
    from gpuctl.common.config import aws_settings
    from gpuctl.spec.request import ClusterRequest

    req = ClusterRequest(name="c", num_nodes=2, cloud="aws", region="us-east-1", zone="us-east-1a",
                         instance_type="p5.48xlarge")
    settings = aws_settings()
    assert "shutdown_behavior" not in module_inputs(req, settings, ssh_public_key="k")  # the module's "stop"
    down = ClusterRequest(**{**req.__dict__, "autodown": True})
    assert module_inputs(down, settings, ssh_public_key="k")["shutdown_behavior"] == "terminate"


def test_active_jobs_and_terminal_sessions(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    for name, files in {"1-a": {"job.json": "{}"}, "2-b": {"events.supervisor": str(os.getpid())},
                        "3-c": {"events.supervisor": "999999999"}, "4-d": {}}.items():
        (jobs / name).mkdir(parents=True)
        for fname, text in files.items():
            (jobs / name / fname).write_text(text)
    # ended, running, coordinator gone, being submitted (fresh, no coordinator yet)
    assert agent.active_jobs(str(jobs)) == ["2-b", "4-d"]
    assert agent.active_jobs(str(jobs), now=time.time() + 3600) == ["2-b"]

    proc = tmp_path / "proc"
    own, other = "net:[4026531833]", "net:[4026532000]"
    # pid: (ppid, tty_nr, title, net namespace)
    here, elsewhere = "10.213.0.3", "10.213.0.4"
    # pid: (ppid, tty_nr, title, readable net namespace, local address in fib_trie)
    table = {"self": (1, 0, "", own, here), "10": (1, 0, "sshd: gpuctl@pts/0", None, here),
             "20": (10, 34816, "-bash", own, here), "21": (20, 34816, "vim", own, here),
             "11": (1, 0, "sshd: gpuctl@notty", None, here), "30": (11, 0, "bash", own, here),
             "12": (1, 0, "sshd: gpuctl@pts/1", None, elsewhere), "40": (12, 34817, "-bash", other, elsewhere),
             "13": (1, 0, "sshd: root@pts/2", None, here), "50": (13, 34818, "-bash", None, here),
             "14": (1, 0, "sshd: root@pts/3", None, elsewhere), "60": (14, 34819, "-bash", None, elsewhere)}
    for pid, (ppid, tty, title, net, address) in table.items():
        (proc / pid / "ns").mkdir(parents=True)
        (proc / pid / "net").mkdir()
        (proc / pid / "cmdline").write_bytes(title.encode() + b"\0")
        (proc / pid / "stat").write_text(f"{pid} (x y) S {ppid} 1 1 {tty} 1 0 0")
        (proc / pid / "net" / "fib_trie").write_text(
            f"Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- {address}\n        /32 host LOCAL\n"
            "     |-- 127.0.0.1\n        /32 host LOCAL\n")
        if net:
            os.symlink(net, proc / pid / "ns" / "net")
    # pts/0 here; not a command without a terminal (notty), not another node's login (pts/1, pts/3);
    # root's pts/2, whose namespace this user cannot read, is here by its addresses
    assert agent.terminal_sessions(str(proc)) == 2


def _agent(home: Path, *args: str, stdin: str = "") -> dict:
    proc = subprocess.run([sys.executable, str(AGENT_COMMAND), "autostop", *args], input=stdin, capture_output=True,
                          text=True, env={**os.environ, "HOME": str(home)}, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _wait(path: Path, timeout: float) -> float:
    start = time.monotonic()
    while not path.exists():
        assert time.monotonic() - start < timeout, f"{path} never appeared"
        time.sleep(0.05)
    return time.monotonic() - start


def _setting(tmp_path: Path, **extra: object) -> str:
    return json.dumps({"idle_minutes": 0, "down": True, "wait_for": "jobs", "minute_s": 0.5, "workers": [],
                       "head_off": [["touch", str(tmp_path / "off-1")], ["touch", str(tmp_path / "off-2")]], **extra})


def test_the_watcher_waits_for_the_lease_and_the_job_then_powers_off_in_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".gpuctl" / "jobs" / "7-x").mkdir(parents=True)
    holder = subprocess.Popen(["sleep", "30"])  # the job's coordinator
    try:
        (home / ".gpuctl" / "jobs" / "7-x" / "events.supervisor").write_text(str(holder.pid))
        shown = _agent(home, "set", stdin=_setting(tmp_path, lease_s=1.5, idle_minutes=1))
        assert shown["set"] and shown["down"] and 0 < shown["lease_left_s"] <= 1.5
        time.sleep(2.5)  # lease over, one minute (0.5 s) passed: the running job still holds the cluster
        assert not (tmp_path / "off-1").exists()
        assert _agent(home, "show")["busy"] == "job 7-x"
    finally:
        holder.kill()
        holder.wait()
    _wait(tmp_path / "off-2", 15)
    assert (tmp_path / "off-1").stat().st_mtime_ns <= (tmp_path / "off-2").stat().st_mtime_ns
    log = (home / ".gpuctl" / "autostop.log").read_text()
    assert "idle for" in log and "head: touch: exit code 0" in log
    assert oct((home / ".gpuctl" / "autostop.json").stat().st_mode & 0o777) == "0o600"


def test_cancel_stops_the_countdown_and_renew_extends_the_lease(tmp_path: Path) -> None:
    """Each window is a few seconds wider than the agent calls inside it take on a loaded machine,
    and each check waits until past the end the watcher would have acted at."""
    home = tmp_path / "home"
    (home / ".gpuctl").mkdir(parents=True)
    began = time.monotonic()
    _agent(home, "set", stdin=_setting(tmp_path, idle_minutes=3, minute_s=2.0))  # powers off 6 s from now
    assert _agent(home, "cancel") == {"set": False}
    assert time.monotonic() - began < 5, "the machine is too loaded for this test's windows"
    time.sleep(max(0.0, began + 7.5 - time.monotonic()))
    assert not (tmp_path / "off-1").exists()
    began = time.monotonic()
    _agent(home, "set", stdin=_setting(tmp_path, lease_s=3))
    assert _agent(home, "renew", "--lease", "9")["lease_left_s"] > 6
    assert time.monotonic() - began < 2.5, "the machine is too loaded for this test's windows"
    time.sleep(max(0.0, began + 4.5 - time.monotonic()))
    assert not (tmp_path / "off-1").exists()  # renewed past the first lease
    _agent(home, "release")
    _wait(tmp_path / "off-2", 15)


def test_a_job_that_came_during_the_hook_holds_the_cluster_until_it_ends(tmp_path: Path) -> None:
    """The hook runs while the cluster counts as idle; a job submitted meanwhile (here: by the hook
    itself, its coordinator a process this test holds) is seen after it, and the power-off waits
    for the job's end."""
    home = tmp_path / "home"
    (home / ".gpuctl").mkdir(parents=True)
    job = home / ".gpuctl" / "jobs" / "9-late"
    holder = subprocess.Popen(["sleep", "60"])  # the late job's coordinator
    try:
        hook = f"mkdir -p {job} && echo {holder.pid} > {job}/events.supervisor && touch {tmp_path}/hooked"
        _agent(home, "set", stdin=_setting(tmp_path, hook=hook, hook_timeout=30))
        _wait(tmp_path / "hooked", 15)
        log = home / ".gpuctl" / "autostop.log"
        deadline = time.monotonic() + 15
        while "busy again after the hook (job 9-late)" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no autostop log"
            time.sleep(0.1)
        time.sleep(1.5)  # three of the watcher's looks (minute_s 0.5)
        assert not (tmp_path / "off-1").exists(), "powered off under the job that came during the hook"
    finally:
        holder.kill()
        holder.wait()
    _wait(tmp_path / "off-2", 30)  # the job ended: idle again, the hook again, then the power-off


def test_a_cancel_during_the_power_off_says_it_came_too_late(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".gpuctl").mkdir(parents=True)
    slow = [["sleep", "4"], ["touch", str(tmp_path / "off-2")]]  # a power-off that takes a while
    _agent(home, "set", stdin=_setting(tmp_path, head_off=slow))
    deadline = time.monotonic() + 15
    while _agent(home, "show").get("phase") != "down":
        assert time.monotonic() < deadline, "the watcher never began its power-off"
        time.sleep(0.1)
    assert _agent(home, "cancel") == {"set": False, "too_late": True, "phase": "down"}
    _wait(tmp_path / "off-2", 15)  # the power-off went on, as the answer said


def test_the_controller_turns_a_late_cancel_into_one_line_and_keeps_the_setting(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpuctl.jobplane import autostop as controller
    from gpuctl.provision.inventory import Inventory, Node

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    node = Node(name="head", rank=0, node_id="n0", address="10.0.0.2", ssh_host="10.0.0.2", ssh_port=22,
                ssh_user="ubuntu")
    inv = Inventory(cluster="c1", cloud="aws", nodes=(node,))
    (tmp_path / "clusters" / "c1").mkdir(parents=True)
    controller.save("c1", Autostop(idle_minutes=5, down=True))
    late = subprocess.CompletedProcess([], 0, '{"set": false, "too_late": true, "phase": "down"}\n', "")
    monkeypatch.setattr(ssh, "run_ssh", lambda *a, **k: late)
    with pytest.raises(controller.AutostopTooLate) as err:
        controller.cancel(inv)
    assert err.value.exit_code == 1 and "\n" not in str(err.value)
    assert "too late to cancel; autostop already began to remove it" in str(err.value)
    assert controller.saved("c1") == Autostop(idle_minutes=5, down=True)  # status still asks the cloud


def test_set_refuses_a_bad_setting(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(AGENT_COMMAND), "autostop", "set"], input='{"idle_minutes": -1}',
                          capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)}, timeout=30)
    assert proc.returncode == 2 and "idle_minutes must be a whole number" in proc.stderr
    assert not (tmp_path / ".gpuctl" / "autostop.json").exists()


def test_lease_and_minute_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.jobplane import autostop as controller

    monkeypatch.delenv(controller.MINUTE_ENV, raising=False)
    monkeypatch.delenv(controller.LEASE_ENV, raising=False)
    assert controller.lease_seconds() == 600.0 and controller.lease_seconds(2) == 120.0
    monkeypatch.setenv(controller.LEASE_ENV, "3")
    assert controller.lease_seconds() == 180.0
    monkeypatch.setenv(controller.LEASE_ENV, "soon")
    with pytest.raises(UserError, match="GPUCTL_LEASE_MINUTES: give minutes"):
        controller.lease_seconds()
    with pytest.raises(UserError, match="more than 0 minutes"):
        controller.lease_seconds(0)
    monkeypatch.setenv(controller.MINUTE_ENV, "x")
    with pytest.raises(UserError, match="GPUCTL_TEST_MINUTE_SECONDS"):
        controller.minute_seconds()


def test_a_head_that_does_not_answer_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpuctl.jobplane import autostop as controller
    from gpuctl.provision.inventory import Inventory, Node

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    node = Node(name="head", rank=0, node_id="n0", address="10.0.0.2", ssh_host="10.0.0.2", ssh_port=22,
                ssh_user="ubuntu")
    inv = Inventory(cluster="c1", cloud="aws", nodes=(node,))
    answers = {"old agent": subprocess.CompletedProcess([], 2, "", "gpuctl-node: error: invalid choice: 'autostop'"),
               "unreachable": subprocess.CompletedProcess([], 255, "", "ssh: connect to host 10.0.0.2: timed out")}
    for case, proc in answers.items():
        monkeypatch.setattr(ssh, "run_ssh", lambda *a, _p=proc, **k: _p)
        with pytest.raises(controller.AutostopUnreachable) as err:
            controller.show(inv)
        text = str(err.value)
        assert "\n" not in text and "cluster 'c1': the head (head) did not answer `autostop show`" in text
        assert ("run `gpuctl apply` once" in text) if case == "old agent" else ("timed out" in text)


def test_local_nodes_remove_themselves_through_the_anchor_and_older_clusters_are_told(tmp_path: Path) -> None:
    local = get_provider("local")
    cdir = tmp_path / "c1"
    nodes = cdir / "nodes"
    nodes.mkdir(parents=True)
    (cdir / "local.json").write_text(json.dumps({"mode": "netns", "ssh_user": "gpuctl", "node_path": "/usr/bin"}))
    (nodes / "bridge.env").write_text("LN_BRIDGE=gb1\nLN_STATE_DIR=%s\n" % nodes)
    with pytest.raises(UserError, match="made by an older gpuctl"):
        local.power_off(cdir, [0, 1], "gpuctl", {}, down=True)
    (nodes / "bridge.env").write_text("LN_BRIDGE=gb1\nLN_STATE_DIR=%s\nLN_ANCHOR=42\nLN_ANCHOR_START=777\n" % nodes)
    plan = local.power_off(cdir, [0, 1, 2], "gpuctl", {}, down=False)
    assert plan.workers == {} and plan.removes and "cannot be stopped" in plan.notes[0]
    enter = ["sudo", "-n", "bash", "-c", (local.module_dir() / "scripts" / "hostns.sh").read_text(), "hostns.sh",
             "42", "777"]
    assert all(argv[:len(enter)] == enter for argv in plan.head)
    # word of the start, workers, the head's log and its jobs' outcomes kept, then the head, then the
    # bridge with word of the end
    targets = [argv[-3] if "down" in argv[len(enter) + 2] else argv[-1] for argv in plan.head]
    assert targets == [str(nodes / "autodown"), str(nodes / "node1" / "node.env"), str(nodes / "node2" / "node.env"),
                       str(nodes / "autodown.log"), str(nodes / "autodown-jobs"), str(nodes / "node0" / "node.env"),
                       str(nodes / "bridge.env")]
    assert plan.head[3][-2] == str(nodes / "node0" / "home" / ".gpuctl" / "autostop.log")
    assert plan.head[4][-2] == str(nodes / "node0" / "home" / ".gpuctl" / "jobs")
    assert local.removed_itself(cdir) is None
    (nodes / "autodown").write_text("100\n")
    assert local.removed_itself(cdir) is None and local.removed_itself(cdir, finished=False) == 100.0
    (nodes / "autodown").write_text("100\n160\n")
    assert local.removed_itself(cdir) == 160.0


def test_a_setting_the_cluster_cannot_act_on_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    task = tmp_path / "spot.yaml"
    task.write_text("resources:\n  infra: aws\n  accelerators: H100:8\n  use_spot: true\n  autostop: 10\nrun: x\n")
    for command in (["validate", str(task)], ["apply", str(task), "-y"]):
        proc = gpuctlfork.run([*command],
                              env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: {task}: resources.autostop (or -i/--down): spot nodes cannot be stopped (a one-time request "
            "ends when stopped); use autodown: --down, or autostop.down: true")
        assert "Traceback" not in proc.stderr and not (tmp_path / "state" / "clusters").exists()
    down = tmp_path / "spot-down.yaml"
    down.write_text(task.read_text().replace("autostop: 10", "autostop: {idle_minutes: 10, down: true}"))
    ok = gpuctlfork.run(["validate", str(down)],
                        env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path / "state")}, timeout=60)
    assert ok.returncode == 0 and "autodown after 10 idle minute(s)" in ok.stdout
    assert get_provider("ssh").autostop_problem({}, down=True) is not None
    assert get_provider("local").autostop_problem({}, down=False) is None


def test_a_killed_watcher_comes_back_with_the_next_show(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".gpuctl").mkdir(parents=True)
    setting = json.loads(_setting(tmp_path, idle_minutes=600))
    assert _agent(home, "set", stdin=json.dumps(setting))["set"]

    def watchers() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if b"autostop-watch" in argv and f"HOME={home}".encode() in environ.split(b"\0"):
                found.append(int(entry.name))
        return found

    deadline = time.monotonic() + 10
    while not (watchers() and _agent(home, "show")["watcher"]):  # started, and holding its lock
        assert time.monotonic() < deadline, "no watcher started"
        time.sleep(0.05)
    for pid in watchers():
        os.kill(pid, 9)
    while watchers():
        time.sleep(0.05)
    # a show (as `gpuctl status` makes) finds none running and starts one again
    _agent(home, "show")
    deadline = time.monotonic() + 10
    while not watchers():
        assert time.monotonic() < deadline, "the watcher was not started again"
        time.sleep(0.05)
    assert "started again" in (home / ".gpuctl" / "autostop.log").read_text()
    _agent(home, "cancel")
    deadline = time.monotonic() + 10
    while watchers():  # a cancelled setting ends the watcher
        assert time.monotonic() < deadline, "the watcher outlived its setting"
        time.sleep(0.05)


def test_status_asks_the_head_briefly_and_a_head_gone_meanwhile_is_autodowned(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """A head that removes itself while `status` asks it: the ask is bounded (not ssh's keepalive
    minute), and status looks again for the word the cluster left, and closes the dead masters."""
    from gpuctl import autostopcli
    from gpuctl.common.paths import cluster_dir
    from gpuctl.jobplane import autostop as controller
    from gpuctl.provision.inventory import Inventory, Node
    from gpuctl.state.registry import Registry

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    registry = Registry()
    registry.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=1, status="UP", request={})
    cdir = cluster_dir("c1")
    (cdir / "nodes").mkdir(parents=True)
    controller.save("c1", Autostop(idle_minutes=1, down=True))
    node = Node(name="head", rank=0, node_id="n0", address="10.0.0.2", ssh_host="10.0.0.2", ssh_user="gpuctl")
    inv = Inventory(cluster="c1", cloud="local", nodes=(node,))
    monkeypatch.setattr("gpuctl.provision.provisioner.load_inventory_of", lambda name: inv)
    asked, exited = [], []

    def head_goes(node_, command, control_dir, timeout=None, **kw):  # the head removes itself while asked
        asked.append(timeout)
        (cdir / "nodes" / "autodown").write_text("100\n160\n")
        return subprocess.CompletedProcess([], 124, "", "timed out")

    monkeypatch.setattr(ssh, "run_ssh", head_goes)
    monkeypatch.setattr(ssh, "exit_masters", exited.append)
    lines, fields = autostopcli.status_of("c1", "UP", registry)
    assert asked == [controller.SHOW_TIMEOUT_S] and controller.SHOW_TIMEOUT_S < 60
    assert fields["status"] == "AUTODOWNED" and fields["autodowned_at"] == 160.0 and "took itself down" in lines[0]
    assert registry.cluster("c1").status == "AUTODOWNED" and exited == [cdir / "cm"]
    (cdir / "nodes" / "autodown").unlink()  # a head that is only unreachable: said so, nothing recorded
    registry.set_cluster_status("c1", "UP")
    monkeypatch.setattr(ssh, "run_ssh", lambda *a, **k: subprocess.CompletedProcess([], 255, "", "no route"))
    lines, fields = autostopcli.status_of("c1", "UP", registry)
    assert "head not reachable" in lines[0] and fields == {"autostop": fields["autostop"], "idle_s": None}
    assert registry.cluster("c1").status == "UP"


def test_apply_down_does_not_remove_a_cluster_whose_job_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`apply --down` tears the cluster down when the job ends however it ends, but a Ctrl-C that only
    stopped following (JobDetached) leaves it to the head's watcher, which removes it once the job ends."""
    from gpuctl import autostopcli
    from gpuctl.common.console import Reporter
    from gpuctl.common.errors import JobDetached, JobFailed
    from gpuctl.spec.autostop import Autostop

    torn: list[str] = []
    monkeypatch.setattr(lifecycle, "tear_down", lambda name, **kw: torn.append(name))
    said: list[str] = []
    reporter = Reporter()
    monkeypatch.setattr(reporter, "info", said.append)
    setting = Autostop(idle_minutes=0, down=True)
    with pytest.raises(JobDetached):
        with autostopcli.down_after_job("c", setting, False, reporter=reporter, registry=None):  # type: ignore[arg-type]
            raise JobDetached("stopped following job 1")
    assert torn == [] and any("removes itself once the job ends" in line for line in said)
    with pytest.raises(JobFailed):
        with autostopcli.down_after_job("c", setting, False, reporter=reporter, registry=None):  # type: ignore[arg-type]
            raise JobFailed("rank 1 failed")
    assert torn == ["c"]


def test_jobs_of_a_cluster_that_removed_itself_unwatched_end_lost_and_a_poll_of_them_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No gpuctl watched the job when the cluster took itself down, and its head left no outcome:
    the record says LOST and why (not RUNNING for ever), and `logs --status` answers at once."""

    from gpuctl.jobplane import autostop as controller
    from gpuctl.state.registry import Registry

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    registry = Registry(remote=None)
    registry.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=1, status="UP", request={})
    job = registry.new_job("c1", name="train", num_nodes=1)
    registry.update_job("c1", job.job_id, status="RUNNING", started_at=time.time())
    nodes = tmp_path / "clusters" / "c1" / "nodes"
    nodes.mkdir(parents=True)
    (nodes / "autodown").write_text("100\n160\n")
    assert controller.reconcile("c1", "UP", registry) == ("AUTODOWNED", 160.0)
    ended = registry.job("c1", job.job_id)
    assert ended.status == "LOST" and "took itself down (autodown)" in ended.detail and "unknown" in ended.detail
    polled = gpuctlfork.run(["logs", "c1", str(job.job_id), "--status"],
                            timeout=60,
                            env={**os.environ, "GPUCTL_STATE_DIR": str(tmp_path)})
    assert polled.returncode == 100, polled.stderr
