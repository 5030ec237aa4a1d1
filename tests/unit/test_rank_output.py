"""A rank's progress bars and unfinished lines, from the node to the screen (issue 34, item 6):
the agent's `u` events (a line left unfinished goes out at once), the controller's joiner (shown
now, whole in the log), and common/ranklines.py with console.Reporter drawing them on a terminal
(in place) and elsewhere (a prefixed line per update, rate-limited, never glued)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from gpuctl.common.console import Reporter
from gpuctl.common.ranklines import UPDATE_S, RankLines
from gpuctl.node import protocol
from gpuctl.jobplane.events import Event, LineJoiner, parse_event

P0, P1 = "(head, rank=0)", "(worker1, rank=1)"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def plain(interval: float = UPDATE_S) -> tuple[RankLines, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return RankLines(Reporter(stream=out, plain=True), interval=interval, clock=clock), out, clock


def terminal() -> tuple[RankLines, Reporter, Tty, Clock]:
    out, clock = Tty(), Clock()
    reporter = Reporter(stream=out)
    reporter.console.no_color = True  # the bytes of the layout, without colour codes
    return RankLines(reporter, clock=clock), reporter, out, clock


# -- no terminal: every update a line of its own ------------------------------------------------


def test_each_progress_update_is_a_prefixed_line_of_its_own_never_glued() -> None:
    """`printf 'progress %3d%%\\r'` a second apart, then `echo`: five lines, as they came."""
    lines, out, clock = plain()
    for pct in (0, 25, 50, 75, 100):
        lines.line(0, "run", P0, f"progress {pct:3d}%\r", eol=False)
        clock.now += 1.1
    lines.line(0, "run", P0, "")  # the newline
    assert out.getvalue() == "".join(f"{P0} progress {p:3d}%\n" for p in (0, 25, 50, 75, 100))


def test_fast_updates_are_rate_limited_and_the_state_a_line_ends_with_always_shows() -> None:
    """tqdm redraws ten times a second: a line a second at most, the last state at the end; an
    update held back shows when its time comes even if the rank says nothing more (tick)."""
    lines, out, clock = plain()
    for pct in range(0, 101, 5):  # a \r first, as tqdm writes it
        lines.line(0, "run", P0, f"\r{pct:3d}%|{'#' * (pct // 10):<10}|", eol=False)
        clock.now += 0.1
    assert out.getvalue().splitlines() == [f"{P0}   0%|          |", f"{P0}  50%|#####     |"]
    lines.tick()  # 0.6 s after the last shown: not yet
    assert len(out.getvalue().splitlines()) == 2
    clock.now += 0.5
    lines.tick()
    assert out.getvalue().splitlines()[-1] == f"{P0} 100%|##########|"
    lines.line(0, "run", P0, "\n".rstrip("\n"))  # tqdm's close: the newline, the state already shown
    assert len(out.getvalue().splitlines()) == 3


def test_a_line_of_redraws_that_arrives_whole() -> None:
    """All at once (a replay, or a burst): live, its first and last states; with no rate limit
    (`gpuctl logs` of saved logs) every state, each once."""
    lines, out, _ = plain()
    lines.line(0, "run", P0, "a\rb\rb\rc\r")
    assert out.getvalue() == f"{P0} a\n{P0} c\n"
    lines, out, _ = plain(interval=0)
    lines.line(0, "run", P0, "a\rb\rb\rc\r")
    assert out.getvalue() == f"{P0} a\n{P0} b\n{P0} c\n"


def test_an_unfinished_line_shows_at_once_and_its_rest_when_it_comes() -> None:
    lines, out, _ = plain()
    lines.line(0, "run", P0, "Continue? [y/N] ", eol=False)
    assert out.getvalue() == f"{P0} Continue? [y/N] \n"
    lines.line(0, "run", P0, "n")
    assert out.getvalue() == f"{P0} Continue? [y/N] \n{P0} n\n"


def test_the_stage_end_shows_a_held_update_and_other_ranks_lines_stay_whole() -> None:
    lines, out, clock = plain()
    lines.line(0, "run", P0, "step 1\r", eol=False)
    lines.line(1, "run", P1, "hello")
    clock.now += 0.2
    lines.line(0, "run", P0, "step 2\r", eol=False)  # too soon: held
    lines.end(0, "run")  # its X: what waits shows
    assert out.getvalue() == f"{P0} step 1\n{P1} hello\n{P0} step 2\n"
    assert not lines.lines


def test_a_redraw_that_is_not_utf8_goes_out_as_its_bytes() -> None:
    raw = io.BytesIO()
    rep = Reporter(stream=io.TextIOWrapper(raw, encoding="utf-8", write_through=True), plain=True)
    lines = RankLines(rep, interval=0)
    lines.line(0, "run", P0, b"\xff 1\r\xfe 2\r".decode("utf-8", "surrogateescape"))
    assert raw.getvalue() == P0.encode() + b" \xff 1\n" + P0.encode() + b" \xfe 2\n"


# -- a terminal: redrawn in place --------------------------------------------------------------


def test_a_terminal_redraws_the_rank_line_in_place() -> None:
    lines, _, out, clock = terminal()
    lines.line(0, "run", P0, "progress   0%\r", eol=False)
    clock.now += 0.3
    lines.line(0, "run", P0, "progress  50%\r", eol=False)
    clock.now += 0.3
    lines.line(0, "run", P0, "")
    assert out.getvalue() == f"{P0} progress   0%\r\x1b[K{P0} progress  50%\n"


def test_a_prompt_stays_open_and_its_answer_completes_the_line() -> None:
    lines, _, out, _ = terminal()
    lines.line(0, "run", P0, "Continue? [y/N] ", eol=False)
    assert out.getvalue() == f"{P0} Continue? [y/N] "
    lines.line(0, "run", P0, "n")
    assert out.getvalue() == f"{P0} Continue? [y/N] n\n"


def test_when_ranks_interleave_each_update_is_a_line_of_its_own() -> None:
    """Another rank's line ends the open one; the next update then starts a new line (a second
    after the last shown, as off a terminal), never a rewrite of a line above."""
    lines, _, out, clock = terminal()
    lines.line(0, "run", P0, "\r 10%", eol=False)
    lines.line(1, "run", P1, "hello")
    clock.now += 0.5
    lines.line(0, "run", P0, "\r 20%", eol=False)  # not the last line, too soon: held
    assert out.getvalue() == f"{P0}  10%\n{P1} hello\n"
    clock.now += 0.6
    lines.tick()
    lines.line(0, "run", P0, "")
    assert out.getvalue() == f"{P0}  10%\n{P1} hello\n{P0}  20%\n"


def test_a_redraw_is_cut_to_one_row_so_the_carriage_return_reaches_its_start() -> None:
    lines, reporter, out, clock = terminal()
    width = reporter.console.width
    lines.line(0, "run", P0, "x" * (2 * width) + "\r", eol=False)
    clock.now += 0.3
    lines.line(0, "run", P0, "y" * (2 * width) + "\r", eol=False)
    shown = out.getvalue().split("\n")
    assert len(shown) == 2 and shown[0] == f"{P0} " + "x" * (2 * width)  # appended text wraps as it would
    assert shown[1] == f"{P0} " + "y" * (width - 3 - len(P0)) + "…"  # a new line: the open one had wrapped
    clock.now += 0.3
    lines.line(0, "run", P0, "z" * (2 * width) + "\r", eol=False)  # this one fits its row: redrawn in place
    assert out.getvalue().endswith("…\r\x1b[K" + f"{P0} " + "z" * (width - 3 - len(P0)) + "…")


def test_gpuctls_own_lines_end_an_open_rank_line_first() -> None:
    lines, reporter, out, _ = terminal()
    lines.line(0, "run", P0, "loading... ", eol=False)
    reporter.info("Job 3 running")
    assert out.getvalue() == f"{P0} loading... \nJob 3 running\n"
    lines.line(0, "run", P0, "done")
    assert out.getvalue().endswith(f"Job 3 running\n{P0} done\n")


# -- the wire: the agent's u events and the controller's joiner -------------------------------


def _stage(tmp_path: Path, agent):
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    (jobdir / "run.supervisor").write_text(str(os.getpid()))  # a live supervisor: the stage runs
    (jobdir / "run.log").write_bytes(b"")
    return agent.LocalStage(agent.Stage(str(jobdir), "run")), jobdir / "run.log"


def test_the_agent_sends_a_line_left_unfinished_at_once_and_whole_lines_whole(tmp_path: Path) -> None:
    from test_jobplane_agent import load_agent

    agent = load_agent()
    stage, log = _stage(tmp_path, agent)
    sent: list[bytes] = []
    with open(log, "ab", buffering=0) as fh:
        fh.write(b"whole line\nhalf ")
        stage.poll(sent.append, 0)
        fh.write(b"and the rest\nprompt> ")
        stage.poll(sent.append, 0)  # the half line was read a moment ago: still held
        assert b"".join(sent) == b"O 0 run whole line\nO 0 run half and the rest\n"
        time.sleep(protocol.SHOW_AFTER_S + 0.05)
        stage.poll(sent.append, 0)  # the rank waits mid-line: sent as it is
        assert sent[-1] == b"u 0 run prompt> \n"
        fh.write(b"yes\nprogress  50%\r")
        stage.poll(sent.append, 0)
        time.sleep(protocol.SHOW_AFTER_S + 0.05)
        stage.poll(sent.append, 0)
    assert b"".join(sent[-2:]) == b"O 0 run yes\nu 0 run progress  50%\r\n"
    events = [parse_event(line) for line in b"".join(sent).decode().splitlines()]
    assert [e.kind for e in events if e] == ["O", "O", "u", "O", "u"]


def test_the_joiner_hands_a_shown_piece_on_at_once_and_keeps_the_line_whole() -> None:
    j = LineJoiner()
    shown = Event("u", 0, stage="run", text="progress  50%\r")
    assert j.feed(shown) == [shown]
    end = j.feed(Event("O", 0, stage="run", text="progress 100%\r"))
    assert end == [Event("O", 0, stage="run", text="progress  50%\rprogress 100%\r", shown=14)]
    # a long line's o pieces come with the u that follows them: nothing of it goes unshown
    assert j.feed(Event("o", 1, stage="run", text="a" * 5)) == []
    assert j.feed(Event("u", 1, stage="run", text="b")) == [Event("u", 1, stage="run", text="aaaaab")]
    x = Event("X", 1, stage="run", code=0)
    assert j.feed(x) == [Event("O", 1, stage="run", text="aaaaab", eol=False, shown=6), x]
    assert j.held == 0 and not j.pending and not j.shown


@pytest.mark.parametrize("line", ["u 0 run \x1b]0;x\x07 kept", "u 3 setup "])
def test_a_shown_piece_keeps_the_ranks_bytes(line: str) -> None:
    event = parse_event(line)
    assert event is not None and event.kind == "u" and event.text == line.split(" ", 3)[3]


# -- the controller's view of a job: screen and saved log ---------------------------------------


def test_the_job_view_shows_pieces_live_and_saves_the_ranks_bytes_whole(tmp_path: Path) -> None:
    """Events as the joiner hands them on: the `u` pieces are shown as they come, the O that ends
    the line shows only its rest, the rank log gets the line once, whole (`gpuctl logs` replays
    it); the agent's own line (stage gpuctl) and a lost rank's reason are printable."""
    from gpuctl.jobplane import joblogs
    from gpuctl.jobplane.jobview import JobView
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.inventory import Inventory, Node
    from gpuctl.state.registry import Registry

    nodes = tuple(Node(name=n, rank=r, node_id=f"n{r}", address=f"10.0.0.{r + 2}", ssh_host=f"10.0.0.{r + 2}")
                  for r, n in enumerate(("head", "worker1")))
    out = io.StringIO()
    runner = JobRunner(Inventory(cluster="c", cloud="local", nodes=nodes), reporter=Reporter(stream=out, plain=True),
                       registry=Registry())
    view = JobView(runner, 7, nodes, "t", echo=True)
    joiner = LineJoiner()
    wire = ["u 0 run progress   0%\r", "O 1 run hello", "u 0 run progress 100%\r", "O 0 run ",
            "O 1 gpuctl gpuctl-node: start failed: \x1b]0;owned\x07", "u 1 run Continue? ", "X 1 run 0",
            "L 0 connection ended: \x1b[31mred"]
    for line in wire:
        event = parse_event(line)
        assert event is not None
        for whole in joiner.feed(event):
            view.on_event(whole)
    assert out.getvalue().splitlines() == [
        f"{P0} progress   0%", f"{P1} hello", f"{P0} progress 100%",
        f"{P1} gpuctl-node: start failed: \\x1b]0;owned\\x07", f"{P1} Continue? ",
        "rank 0 (head) lost: connection ended: \\x1b[31mred"]
    assert "\x1b" not in out.getvalue()
    view.logs.close()
    assert joblogs.local_log("c", "7", "run", 0).read_bytes() == b"progress   0%\rprogress 100%\r\n"
    assert joblogs.local_log("c", "7", "run", 1).read_bytes() == (
        b"hello\ngpuctl-node: start failed: \\x1b]0;owned\\x07\nContinue? ")
