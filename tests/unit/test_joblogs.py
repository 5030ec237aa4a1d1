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


# -- saved logs: where they live, their order, reading them back ----------------------------------

def _write(writer: joblogs.LogWriter, pieces: list[tuple[str, int, str, bool]]) -> None:
    for stage, rank, text, eol in pieces:
        writer.write(stage, rank, text, eol)
    writer.close()


# Setup on both ranks, then run lines as they came: rank 1 first, rank 0 between rank 1's two
# pieces of one line, a line with \r and bytes that are not UTF-8, a last line with no newline.
PIECES = [("setup", 0, "s0", True), ("setup", 1, "s1", True),
          ("run", 1, "b-1", True), ("run", 0, "a-1", True), ("run", 1, "b-2 first half ", False),
          ("run", 0, "a-2\rprogress \udcff", True), ("run", 1, "and its end", True), ("run", 0, "a-3 no newline", False)]


def test_saved_logs_are_private_and_outlive_the_cluster_directory(tmp_path) -> None:
    _write(joblogs.LogWriter("c", 7, node_job="7-abcd", names={0: "head", 1: "worker1"}), PIECES)
    directory = joblogs.job_log_dir("c", "7-abcd")
    assert directory == joblogs.logs_root() / "c" / "7-abcd"
    assert not str(directory).startswith(str(joblogs.local_job_dir("c", 7).parent.parent))  # not under clusters/c
    for path in [directory, directory.parent, joblogs.logs_root()]:
        assert path.stat().st_mode & 0o777 == 0o700, path
    assert sorted(p.name for p in directory.iterdir()) == ["nodes.json", "order", "run-rank0.log", "run-rank1.log",
                                                           "setup-rank0.log", "setup-rank1.log"]
    for path in directory.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert (directory / "run-rank0.log").read_bytes() == b"a-1\na-2\rprogress \xff\na-3 no newline"
    assert joblogs.saved_names(directory) == {0: "head", 1: "worker1"}
    assert joblogs.saved_dir("c", 7, "7-abcd") == directory
    assert joblogs.saved_dir("c", 8, "8-ffff") is None


def _texts(lines) -> list[tuple[int, str]]:
    return [(line.rank, line.text) for line in lines]


def test_saved_lines_come_back_in_the_order_they_came_or_by_rank() -> None:
    _write(joblogs.LogWriter("c", 7, node_job="7-abcd"), PIECES)
    directory = joblogs.job_log_dir("c", "7-abcd")
    in_order = [(0, "s0"), (1, "s1"), (1, "b-1"), (0, "a-1"), (0, "a-2\rprogress \udcff"),
                (1, "b-2 first half and its end"), (0, "a-3 no newline")]
    assert _texts(joblogs.read_saved(directory)) == in_order
    assert _texts(joblogs.read_saved(directory, by_rank=True)) == [
        (0, "s0"), (1, "s1"), (0, "a-1"), (0, "a-2\rprogress \udcff"), (0, "a-3 no newline"),
        (1, "b-1"), (1, "b-2 first half and its end")]
    assert _texts(joblogs.read_saved(directory, {1})) == [(1, "s1"), (1, "b-1"), (1, "b-2 first half and its end")]
    assert _texts(joblogs.read_saved(directory, tail=2)) == in_order[-2:]
    assert _texts(joblogs.read_saved(directory, {0}, by_rank=True, tail=1)) == [(0, "a-3 no newline")]
    assert _texts(joblogs.read_saved(directory, tail=100)) == in_order
    assert [line.stage for line in joblogs.read_saved(directory)] == ["setup", "setup"] + ["run"] * 5


def test_bytes_the_order_does_not_cover_are_read_after_it(tmp_path) -> None:
    """A writer stopped between a piece and its index line, or a torn index line: nothing is lost."""
    _write(joblogs.LogWriter("c", 3), [("run", 0, "one", True), ("run", 1, "two", True)])
    directory = joblogs.job_log_dir("c", 3)
    with open(directory / "run-rank0.log", "ab") as fh:
        fh.write(b"three\n")
    with open(directory / "order", "ab") as fh:
        fh.write(b"run 0")  # being written
    assert _texts(joblogs.read_saved(directory)) == [(0, "one"), (1, "two"), (0, "three")]


def test_logs_an_older_gpuctl_saved_are_still_read_by_rank() -> None:
    old = joblogs.local_job_dir("c", 5)
    old.mkdir(parents=True)
    (old / "run-rank1.log").write_bytes(b"r1\n")
    (old / "run-rank0.log").write_bytes(b"r0-a\nr0-b\n")
    (old / "watch.pid").write_text("1")
    assert joblogs.saved_dir("c", 5, "5-beef") == old
    assert _texts(joblogs.read_saved(old)) == [(0, "r0-a"), (0, "r0-b"), (1, "r1")]


def test_purge_keeps_unfinished_jobs_and_removes_the_rest() -> None:
    for node_job in ("1-aa", "2-bb", "3-cc"):
        _write(joblogs.LogWriter("c", node_job.split("-")[0], node_job=node_job), [("run", 0, "x", True)])
    old = joblogs.local_job_dir("c", 1)
    old.mkdir(parents=True)
    (old / "run-rank0.log").write_text("older gpuctl\n")
    assert joblogs.purge("c", keep={"3-cc"}, legacy=[1, 2]) == 2
    assert sorted(p.name for p in joblogs.cluster_logs_dir("c").iterdir()) == ["3-cc"]
    assert not (old / "run-rank0.log").exists()
    assert joblogs.purge("c") == 1 and not joblogs.cluster_logs_dir("c").exists()
    assert joblogs.purge("c") == 0


def test_a_failed_write_drops_the_partial_copy(monkeypatch) -> None:
    errors: list[str] = []
    writer = joblogs.LogWriter("c", 9, errors.append, node_job="9-ee")
    writer.write("run", 0, "kept until the disk fills")
    real = joblogs._create

    def full(path):
        if path.name.startswith("run-rank1"):
            raise OSError(28, "No space left on device")
        return real(path)

    monkeypatch.setattr(joblogs, "_create", full)
    writer.write("run", 1, "no room")
    writer.write("run", 0, "not written after the failure")
    assert len(errors) == 1 and "No space left on device" in errors[0] and "9-ee" in errors[0]
    assert joblogs.saved_dir("c", 9, "9-ee") is None and not (joblogs.job_log_dir("c", "9-ee") / "order").exists()
