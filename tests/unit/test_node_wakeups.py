"""The head wakes at the moment something happens instead of at its next poll: a stage's exit
reaches its relay through the supervisor's notice pipe (stages.start_stage_watched), and the
forked coordinator's events reach `submit` through a wake pipe (follow.Wake). Functional checks;
their latency is benchmarks/start.py's and benchmarks/jobplane.py's."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

from test_jobplane_agent import load_agent


def test_a_stages_exit_makes_its_notice_pipe_readable(tmp_path: Path) -> None:
    agent = load_agent()
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    stage = agent.Stage(str(jobdir), "run")
    Path(stage.script).write_text("exit 3\n")
    code, err, fd = agent.start_stage_watched(stage, str(tmp_path))
    assert (code, err) == (0, "") and fd is not None
    try:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready == [fd]
        assert os.read(fd, 100).startswith(b"exit 3")  # "started" was read by the starter: only the exit is left
        assert stage.exit_code() == 3  # recorded before the notice
        local = agent.LocalStage(stage, fd)
        events: list[bytes] = []
        local.poll(events.append, 0)
        assert local.done and local.exit_notice.fd is None and events[-1] == b"X 0 run 3\n"
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def test_a_follower_wakes_on_news_and_polls_again_once_the_writer_is_gone() -> None:
    agent = load_agent()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    wake = agent.Wake(wake_read)
    out = agent.Out()
    os.write(wake_write, b"...")
    started = time.monotonic()
    assert out.idle(30, wake) is True
    assert time.monotonic() - started < 20 and wake.fd == wake_read  # woken, not timed out; still open
    os.close(wake_write)
    assert out.idle(30, wake) is True
    assert wake.fd is None  # the writer's end: closed here, and the follower polls as before
    assert out.idle(0.01, wake) is True
