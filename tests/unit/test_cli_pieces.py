"""Pieces of the command line and the state dir that need no nodes: the once-only hint to include
gpuctl's ssh config, `exec`'s task-file-or-command decision, and a cluster lock removed by `down`
while another gpuctl waits on it."""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from pathlib import Path

import pytest
import typer

from gpuctl import cliargs
from gpuctl.common.console import Reporter
from gpuctl.provision import sshconfig
from gpuctl.state.lock import cluster_lock


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state" / "ssh").mkdir(parents=True)
    return tmp_path / "home"


def on_terminal(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A terminal on stdin and stderr, where any question is recorded (and none must be asked)."""
    asked: list[str] = []
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(typer, "confirm", lambda text, **kw: asked.append(text) or True)
    return asked


def test_the_ssh_include_is_hinted_once_never_asked_and_added_on_request(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]):
    """`make demo` runs unattended: apply never asks; at a terminal it says once how `ssh NAME` can
    work, and `gpuctl ssh-config --include` adds the line, first, keeping the user's own."""
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host work\n  User me\n")
    asked = on_terminal(monkeypatch)
    cliargs.hint_ssh_include(Reporter())
    cliargs.hint_ssh_include(Reporter())
    out = capsys.readouterr().out
    assert asked == [] and out.count("gpuctl ssh-config --include") == 1, out  # said once, asked never
    assert (home / ".ssh" / "config").read_text() == "Host work\n  User me\n"  # nothing edited unasked
    cliargs.add_ssh_include(Reporter())
    cliargs.add_ssh_include(Reporter())  # once
    include = f"Include {Path(os.environ['GPUCTL_STATE_DIR']) / 'ssh' / 'config'}"
    text = (home / ".ssh" / "config").read_text()
    # first: after a Host line it would apply to that host only; the user's own lines kept
    assert [ln for ln in text.splitlines() if ln and not ln.startswith("#")][0] == include
    assert text.count(include) == 1 and text.endswith("Host work\n  User me\n")


def test_nothing_is_hinted_off_a_terminal(home: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)  # CI, a pipe
    cliargs.hint_ssh_include(Reporter())
    assert capsys.readouterr().out == "" and not (Path(os.environ["GPUCTL_STATE_DIR"]) / "ssh" / ".include-asked").exists()


def test_exec_tells_a_task_file_from_a_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task").write_text("run: hostname\n")  # a YAML mapping without the suffix
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert cliargs.names_task_file("missing.yaml") and cliargs.names_task_file("x/TASK.YML")
    assert cliargs.names_task_file("task")
    assert not cliargs.names_task_file("train.py")  # an existing file that is not a task: a command
    assert not cliargs.names_task_file("echo hi from $(hostname)")
    assert not cliargs.names_task_file("curl http://example.com/")  # kept whole: no path normalising
    assert not cliargs.names_task_file("python train.py --cfg conf.yaml")  # more than one word: a command
    assert not cliargs.names_task_file("python -c '" + "x" * 300 + "/y'")  # too long for a path: no traceback
    assert not cliargs.names_task_file("echo 'unbalanced")


def test_accelerator_names_are_checked_where_nothing_else_would():
    from types import SimpleNamespace

    from gpuctl.providers import get_provider
    from gpuctl.providers.aws.catalog import AWS_DEFAULT_TYPES
    from gpuctl.spec.accelerators import KNOWN_ACCELERATORS, unknown_accelerator_message

    assert set(AWS_DEFAULT_TYPES) <= set(KNOWN_ACCELERATORS)  # what AWS sells is never called unknown
    assert unknown_accelerator_message("H1000") == "'H1000' is not a known accelerator; did you mean H100?"
    assert unknown_accelerator_message("zzz").startswith("'zzz' is not a known accelerator; known: B200, ")
    local = get_provider("local")
    assert local.resources_problem(SimpleNamespace(accelerators={"h100": 8.0})) is None  # any case
    assert local.resources_problem(SimpleNamespace(accelerators={"H1000": 8.0})) == (
        "accelerators", "'H1000' is not a known accelerator; did you mean H100?")
    task = SimpleNamespace(resources=SimpleNamespace(accelerators={"RTX2080Ti": 4.0, "RTX2090": 4.0}),
                           where=lambda *keys: "t.yaml:4")
    # existing hosts may hold GPUs newer than the list: said, not refused
    assert get_provider("ssh").task_warnings(task, None) == [  # type: ignore[arg-type]
        f"t.yaml:4: resources.accelerators: {unknown_accelerator_message('RTX2090')} (the hosts' GPUs are taken "
        "as named)"]


def test_a_lock_removed_by_down_is_never_held_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    events: list[str] = []
    holding, waiting = threading.Event(), threading.Event()

    def on_wait(line: str) -> None:
        events.append(line)
        waiting.set()

    def waiter() -> None:
        holding.wait()
        with cluster_lock("c", on_wait):
            events.append("waiter holds")
            path = tmp_path / "locks" / "c.lock"
            fd = os.open(path, os.O_RDWR)
            try:  # the file at the path is the one held: a third gpuctl waits on it
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            events.append("third refused")

    thread = threading.Thread(target=waiter)
    thread.start()
    with cluster_lock("c") as held:
        holding.set()
        assert waiting.wait(10)  # the waiter is blocked on this file
        held.discard()  # `down`: the cluster is gone
    thread.join(10)
    assert events[0].startswith("Waiting for another gpuctl") and events[1:] == ["waiter holds", "third refused"]
    with cluster_lock("c") as held:
        held.discard()
    assert not (tmp_path / "locks" / "c.lock").exists()


def test_an_include_written_with_a_tilde_counts_and_a_read_only_config_is_said_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from gpuctl.common.errors import UserError

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(home / ".gpuctl"))
    (home / ".gpuctl" / "ssh").mkdir(parents=True)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text("Include ~/.gpuctl/ssh/config\n")
    on_terminal(monkeypatch)
    cliargs.hint_ssh_include(Reporter())
    cliargs.add_ssh_include(Reporter())
    out = capsys.readouterr().out
    assert "tip:" not in out and "already includes" in out  # already there, as the help page tells users to write it
    assert (home / ".ssh" / "config").read_text() == "Include ~/.gpuctl/ssh/config\n"
    (home / ".ssh" / "config").write_text("Host x\n")

    def read_only(*args: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(sshconfig, "add_include", read_only)
    with pytest.raises(UserError, match=r"^could not add `Include .*` to .*/\.ssh/config \(Read-only file system\); "
                                        r"add it there yourself, or use `gpuctl ssh NAME`$"):
        cliargs.add_ssh_include(Reporter())


def test_a_cluster_that_removed_itself_or_is_removing_itself_is_said_at_once(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """Issue 34.5: commands that need the nodes answer in one line, with when and what to do: a local
    cluster whose head began removing it (its word: one line) is going, one that finished is gone."""
    import time

    from gpuctl.common.errors import UserError
    from gpuctl.common.paths import cluster_dir
    from gpuctl.state.registry import Registry

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path))
    registry = Registry(remote=None)
    registry.upsert_cluster("lc", cloud="local", region=None, zone=None, num_nodes=2, status="UP", request={})
    nodes = cluster_dir("lc") / "nodes"
    nodes.mkdir(parents=True)
    cliargs.refuse_gone("lc", registry)  # nothing said: it is there
    began = time.time() - 30
    (nodes / "autodown").write_text(f"{began:.0f}\n")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(round(began)))
    with pytest.raises(UserError, match=rf"^cluster 'lc' is going: it began taking itself down \(autodown\) at "
                                        rf"{stamp}; `gpuctl apply` brings it up again once it is gone$"):
        cliargs.refuse_gone("lc", registry)
    (nodes / "autodown").write_text(f"{began:.0f}\n{began + 5:.0f}\n")
    done = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(round(began) + 5))
    with pytest.raises(UserError, match=rf"^cluster 'lc' is gone: it took itself down \(autodown\) at {done}; "
                                        r"`gpuctl apply` brings it up again, `gpuctl down lc` forgets it$"):
        cliargs.refuse_gone("lc", registry)
    assert registry.cluster("lc").status == "AUTODOWNED"  # recorded, as status records it


@pytest.mark.parametrize("asked, task, want", [
    (None, None, 0),  # a CPU job, as `sky exec CLUSTER CMD`
    ("4", None, 4),
    ("H100:8", None, 8),
    ("h100:2", ("A100", 8.0), 2),  # the flag wins over the task file; the type's case is not the user's problem
    ("0.5", None, 1),  # a fraction of a GPU: a whole one (as SKYPILOT_NUM_GPUS_PER_NODE rounds it up)
    ("0", None, 0),
    (None, ("H100", 4.0), 4),
    (None, (None, 0.0), 0),
])
def test_what_a_job_asks_of_each_node(asked: str | None, task: tuple | None, want: int) -> None:
    assert cliargs.gpus_asked(asked, task, cluster="c", cluster_accelerator="H100", capacity=8) == want


@pytest.mark.parametrize("asked, task, capacity, says", [
    ("9", None, 8, "--gpus 9: cluster 'c' has 8 GPU(s) per node; a job there asks for at most 8"),
    ("1", None, 0, "--gpus 1: cluster 'c' has no GPUs; a job there asks for at most 0"),
    ("A100:1", None, 8, "--gpus A100:1: cluster 'c' has H100 GPUs, not A100; ask for H100:N or a count alone"),
    ("many", None, 8, "--gpus many: give a GPU count per node (as --gpus 4) or TYPE:COUNT (as --gpus H100:4)"),
    ("H100:-1", None, 8, "--gpus H100:-1: give a GPU count per node"),
    (":2", None, 8, "--gpus :2: give a GPU count per node"),
    ("nan", None, 8, "--gpus nan: give a GPU count per node"),
    (None, ("H100", 16.0), 8, "t.yaml: resources.accelerators H100:16: cluster 'c' has 8 GPU(s) per node"),
])
def test_a_job_that_could_never_get_its_gpus_is_refused(asked: str | None, task: tuple | None, capacity: int,
                                                        says: str) -> None:
    flag = "--gpus" if asked is not None else "t.yaml: resources.accelerators"
    with pytest.raises(cliargs.UserError) as err:
        cliargs.gpus_asked(asked, task, cluster="c", cluster_accelerator="H100", capacity=capacity, flag=flag)
    assert str(err.value).startswith(says), str(err.value)
