"""Which detached jobs still have a watcher: `queue` asks the head only for the others."""

from __future__ import annotations

import os
import signal
import subprocess

from gpuctl.jobplane import joblogs


def test_the_watcher_is_this_process_while_marked() -> None:
    path = joblogs.mark_watching("c", 1)
    assert joblogs.is_watched("c", 1)
    joblogs.unmark_watching("c", 1)
    assert not path.exists() and not joblogs.is_watched("c", 1)


def test_a_killed_watchers_pid_taken_by_another_process_is_not_a_watcher() -> None:
    """The watcher died by SIGKILL or a reboot and left its file; the PID now
    belongs to someone else (here: this process, started at another time)."""
    path = joblogs.mark_watching("c", 2)
    pid, start = path.read_text().split()
    path.write_text(f"{pid} {int(start) + 1}")
    assert not joblogs.is_watched("c", 2)


def test_a_watcher_that_ended_is_not_one_even_before_it_is_reaped() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        path = joblogs.watcher_pidfile("c", 3)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(child.pid))  # as written before start times were recorded
        assert joblogs.is_watched("c", 3)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, still a zombie
        assert not joblogs.is_watched("c", 3)
    finally:
        child.kill()
        child.wait()
    assert not joblogs.is_watched("c", 3)


def test_an_unreadable_record_is_no_watcher() -> None:
    path = joblogs.watcher_pidfile("c", 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    for text in ("", "x", "-"):
        path.write_text(text)
        assert not joblogs.is_watched("c", 4)
