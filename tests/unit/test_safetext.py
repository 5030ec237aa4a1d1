"""Node text in gpuctl's own lines and files (issue 34, item 14): common/safetext.py, and each
border where what a node said is read (the job plane's events and outcome, fabric.json and
`status`, Ansible's failures, the head's install of the workers). The checks' borders are
tested with their parsers (test_nodehealth.py, test_healthcheck.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from gpuctl.common.safetext import clean, finite_number, printable, whole_number
from gpuctl.configplane import fabricrecord, playbooks
from gpuctl.jobplane.events import Outcome, parse_event
from gpuctl.provision.inventory import Inventory, Node

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
HOSTILE = "GPU \x1b]0;TITLE\x07 \x1b[31mred\x1b[0m\rhidden\x00\x7f\x9b\u202eevil"


def test_printable_shows_every_control_character_as_an_escape() -> None:
    shown = printable(HOSTILE)
    assert shown == "GPU \\x1b]0;TITLE\\x07 \\x1b[31mred\\x1b[0m\\rhidden\\x00\\x7f\\x9b\\u202eevil"
    assert not CONTROL.search(shown)
    assert printable("tab\there\nnext") == "tab here\\nnext"
    assert printable(b"not \xff utf-8".decode("utf-8", "surrogateescape")) == "not \\xff utf-8"
    plain = "wérld ✓ 10.0.0.1 [0]eth0"
    assert printable(plain) is plain  # text that needs nothing is returned as it is


def test_clean_reaches_every_string_of_a_document_keys_too() -> None:
    doc = {"k\x1b": [HOSTILE, {"n": 3, "f": 1.5, "b": True, "z": None}], "t": ("\r",)}
    assert clean(doc) == {"k\\x1b": [printable(HOSTILE), {"n": 3, "f": 1.5, "b": True, "z": None}], "t": ["\\r"]}


@pytest.mark.parametrize("value, whole, finite", [
    (3, 3, 3.0), ("8", 8, 8.0), (" 8 ", 8, 8.0), (2.0, 2, 2.0), (2.5, None, 2.5), (-1, None, -1.0),
    ("0\x1b]0;TITLE\x07", None, None), ("٣", None, None), (True, None, None), (None, None, None),
    ("nan", None, None), (float("inf"), None, None), ([1], None, None), ("1e3", None, 1000.0),
])
def test_numbers_are_taken_only_when_they_are_numbers(value: object, whole: int | None,
                                                      finite: float | None) -> None:
    assert whole_number(value) == whole
    got = finite_number(value)
    assert got == finite and (got is None or math.isfinite(got))


# -- the job plane: the agent's own events and the outcome --------------------------------------


def test_the_agents_own_events_and_the_outcome_are_printable_a_ranks_output_is_not() -> None:
    lost = parse_event(f"L 2 connection to worker2 ended: {HOSTILE}")
    assert lost is not None and lost.text == f"connection to worker2 ended: {printable(HOSTILE)}"
    hello = parse_event(f"H 1 problem no docker: {HOSTILE}")
    assert hello is not None and not CONTROL.search(hello.text)
    synced = parse_event(f"Y 1 23 rsync: {HOSTILE}")
    assert synced is not None and synced.code == 23 and not CONTROL.search(synced.text)
    output = parse_event(f"O 0 run {HOSTILE}")
    assert output is not None and output.text == HOSTILE  # the rank's own bytes: a terminal's business
    done = parse_event("D FAILED " + json.dumps({"detail": f"rank 1: {HOSTILE}", "lost": {"1": HOSTILE},
                                                   "run": {"0": 0, "1": None}}))
    assert done is not None
    outcome = Outcome.from_data(done.text, done.data)
    assert outcome.detail == f"rank 1: {printable(HOSTILE)}" and outcome.lost == {1: printable(HOSTILE)}


# -- fabric.json and `status` ----------------------------------------------------------------------


def _inv() -> Inventory:
    return Inventory(cluster="c", cloud="local", nodes=tuple(
        Node(name=n, rank=r, node_id=f"i-{r}", address=f"10.0.0.{r + 2}", ssh_host=f"h{r}")
        for r, n in enumerate(("head", "worker1"))))


def test_a_nodes_fabric_probe_result_is_recorded_and_shown_printable(tmp_path: Path) -> None:
    raw = {"head": json.dumps({"kind": "roce", "interface": "eth0\x1b]0;TITLE\x07", "gid_index": "3\x1b[2J",
                               "devices": [{"kind": "roce", "name": "mlx5_0", "ports": [1]}],
                               "active_ports": ["mlx5_0:1\r"], "warnings": [f"port down: {HOSTILE}"],
                               "env": {"NCCL_IB_HCA": "=mlx5_0:1"}}),
           "worker1": {"kind": "socket", "interface": "eth0", "error": f"probe: {HOSTILE}", "hostname": "ip\x1b-1"}}
    doc = fabricrecord.record(tmp_path, _inv(), raw)
    assert doc is not None
    text = (tmp_path / fabricrecord.FABRIC_FILE).read_text()
    assert not CONTROL.search(text.replace("\n", ""))
    lines = fabricrecord.status_lines(tmp_path)
    assert lines[0] == "roce mlx5_0:1\\r (eth0\\x1b]0;TITLE\\x07) 1/1 ports active; port down: " + printable(HOSTILE)
    assert not [s for s in [*lines.values(), *fabricrecord.warnings(doc, "roce")] if CONTROL.search(s)]
    assert fabricrecord.hostnames(tmp_path) == {"worker1": "ip\\x1b-1"}
    # a fabric.json an older gpuctl wrote, escapes and all: read printable
    (tmp_path / fabricrecord.FABRIC_FILE).write_text(json.dumps(
        {"kind": "socket", "nodes": [{"rank": 0, "name": "head", "kind": "socket", "interface": HOSTILE}]}))
    assert fabricrecord.status_lines(tmp_path) == {0: f"socket ({printable(HOSTILE)})"}


# -- prepare: Ansible's failures and the head's install of the workers ----------------------------


def test_a_failed_tasks_stderr_in_the_prepare_failure_line_is_printable() -> None:
    events = [{"event": "runner_on_failed", "event_data": {"host": "head", "task": "Install", "res": {
        "msg": "non-zero return code", "rc": 1, "stderr": f"apt: {HOSTILE}\n"}}},
        {"event": "runner_on_unreachable", "event_data": {"host": "worker1", "res": {"msg": f"ssh: {HOSTILE}"}}}]
    result = playbooks.build_result(events, ranks={"head": 0, "worker1": 1}, rc=2, status="failed")
    said = [result.failures[0].message, result.unreachable_reasons["worker1"]]
    assert said[0].startswith("Install: exit code 1: apt: GPU \\x1b]0;TITLE\\x07 \\x1b[31mred")
    assert said[1].startswith("ssh: GPU \\x1b]0;TITLE\\x07") and not [s for s in said if CONTROL.search(s)]
    broken = playbooks.build_result([], ranks={}, rc=4, status="failed", stdout_tail=f"ERROR! {HOSTILE}")
    assert broken.error is not None and not CONTROL.search(broken.error)


def test_the_heads_word_on_a_worker_it_installed_is_printable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuctl.jobplane import headinstall

    (tmp_path / "out").write_text(json.dumps({"node": "worker1", "ok": False, "error": f"install: {HOSTILE}"}) + "\n")
    (tmp_path / "err").write_text(f"ssh: {HOSTILE}\n")
    script = f"cat >/dev/null; cat {tmp_path}/out; cat {tmp_path}/err >&2; exit 255"
    monkeypatch.setattr("gpuctl.provision.ssh.ssh_argv", lambda *a, **kw: ["sh", "-c", script])
    head, worker1, worker2 = (Node(name=n, rank=r, node_id=f"i-{r}", address=f"10.0.0.{r + 2}", ssh_host=f"h{r}")
                              for r, n in enumerate(("head", "worker1", "worker2")))
    got = headinstall.install_through_head(head, [worker1, worker2], bundle={}, bootstrap="", python=None, view={},
                                           control_dir=None)
    assert got["worker1"].error == f"install: {printable(HOSTILE)}"
    assert got["worker2"].unreachable and not CONTROL.search(got["worker2"].error)
