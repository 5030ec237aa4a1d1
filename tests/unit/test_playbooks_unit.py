"""playbooks.py without nodes: env.sh quoting through bash, extravars that must
not be templated, and PlaybookResult from recorded ansible-runner events."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from gpuctl.common.paths import ansible_dir
from gpuctl.configplane import playbooks

ENV_TEMPLATE = ansible_dir() / "roles" / "gpuctl_env" / "templates" / "env.sh.j2"

TRICKY_VALUES = {
    "SINGLE": "it's",
    "DOUBLE": 'say "hi"',
    "DOLLAR": "$HOME ${PATH} $(id) `id`",
    "BACKSLASH": "a\\b\\\\c\\",
    "NEWLINES": "10.0.0.1\n10.0.0.2\n",
    "JSON": json.dumps({"cluster_name": "c", "ips": ["1.1.1.1"], "zone": None, "q": "it's \"x\""}),
    "EMPTY": "",
    "SPACES": "  lead and trail  ",
    "GLOB": "*.py ? [a-z]",
    "JINJA": "{{ 1 + 1 }} {% raw %} {# c #}",
    "UNICODE": "héllo ✓",
    "SEMI": "a; rm -rf /; b && c || d | e > f < g",
    "TABS": "a\tb",
    "DASH": "-n",
}


def source_env(env_sh: Path) -> dict[str, str]:
    """Source env.sh in bash and read the resulting environment back."""
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    out = subprocess.run(["bash", "-c", f'set -e; . {shlex.quote(str(env_sh))}; exec "$0" -c "$1"', sys.executable,
                          dump], capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    return json.loads(out.stdout)


def render(**context: Any) -> str:
    env = jinja2.Environment(keep_trailing_newline=True, trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["quote"] = lambda v: shlex.quote("" if v is None else str(v))  # Ansible's quote filter
    return env.from_string(ENV_TEMPLATE.read_text()).render(**context)


def test_ansible_quote_filter_is_shlex_quote() -> None:
    from ansible.plugins.filter.core import quote

    for value in TRICKY_VALUES.values():
        assert quote(value) == shlex.quote(value)


def test_env_sh_round_trip_through_bash(tmp_path: Path) -> None:
    text = render(gpuctl_env_stage="run", gpuctl_job_id="7", gpuctl_env_vars=TRICKY_VALUES,
                  gpuctl_env_rank_vars=["GPUCTL_NODE_RANK", "SKYPILOT_NODE_RANK"], gpuctl_rank=3,
                  gpuctl_env_write_hostfile=True, gpuctl_env_hostfile_path="/home/u/.gpuctl/jobs/7/hostfile")
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(text)
    env = source_env(env_sh)
    for key, value in TRICKY_VALUES.items():
        assert env[key] == value, key
    assert env["GPUCTL_NODE_RANK"] == env["SKYPILOT_NODE_RANK"] == "3"
    assert env["GPUCTL_HOSTFILE"] == "/home/u/.gpuctl/jobs/7/hostfile"


def test_env_sh_without_hostfile(tmp_path: Path) -> None:
    text = render(gpuctl_env_stage="setup", gpuctl_job_id="7", gpuctl_env_vars={"A": "1"},
                  gpuctl_env_rank_vars=["SKYPILOT_SETUP_NODE_RANK"], gpuctl_rank=0, gpuctl_env_write_hostfile=False)
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(text)
    env = source_env(env_sh)
    assert env["A"] == "1" and env["SKYPILOT_SETUP_NODE_RANK"] == "0" and "GPUCTL_HOSTFILE" not in env


def test_extravars_keep_their_types_and_are_not_templates() -> None:
    ev = {"s": "plain", "e": "", "y": "yes", "n": None, "i": 3, "l": ["{{ x }}", "b"], "d": {"K": "{% raw %}"},
          "p": Path("/x"), "u": "ünï ✓ 'q' \"dq\"", "z": "eJzT0yMAAGTvBe8=" * 4000, "k": "a: b # c"}
    text = playbooks.dump_extravars(ev)
    assert '!unsafe "{{ x }}"' in text and '!unsafe "{% raw %}"' in text
    from ansible.parsing.yaml.loader import AnsibleLoader

    loaded = yaml.load(text, Loader=AnsibleLoader)  # noqa: S506 - Ansible's own loader, as -e @file uses
    assert loaded == {**ev, "p": "/x"}


def test_env_rendered_by_ansible_on_localhost(tmp_path: Path) -> None:
    """The real env role (Ansible's templating, !unsafe extravars) on a local-connection host."""
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpuctl_nodes": {"hosts": {"head": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable, "gpuctl_rank": 0}}}}}}))
    jobdir = tmp_path / "node" / "jobs" / "u1"
    secrets_file = tmp_path / "secrets.sh"
    secrets_file.write_text("export TOKEN='t'\n")
    secrets_file.chmod(0o600)
    ev = {
        "gpuctl_job_id": "u1",
        "gpuctl_run_env": TRICKY_VALUES,
        "gpuctl_run_rank_vars": ["GPUCTL_NODE_RANK"],
        "gpuctl_hostfile_lines": ["10.0.0.1 slots=8", "10.0.0.2 slots=8"],
        "gpuctl_run_hosts": ["head"],
        "gpuctl_secrets_file": str(secrets_file),
        "gpuctl_env_jobdir": str(jobdir),  # instead of the node's ~/.gpuctl/jobs/u1
    }
    result = playbooks.run_playbook("env", inventory=inventory, private_data_dir=tmp_path / "runner", extravars=ev)
    assert result.ok, result
    env = source_env(jobdir / "env.sh")
    for key, value in TRICKY_VALUES.items():
        assert env[key] == value, key
    assert env["GPUCTL_NODE_RANK"] == "0"
    assert env["GPUCTL_HOSTFILE"] == str(jobdir / "hostfile")
    assert (jobdir / "hostfile").read_text() == "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"
    assert (jobdir / "secrets.sh").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "runner" / "extravars").iterdir())  # the vars file is gone after the run
    command = json.loads(next((tmp_path / "runner" / "artifacts").glob("*/command")).read_text())
    assert set(command["env"]) <= {"PATH", "HOME", "LANG"} | {k for k in command["env"] if k.startswith("ANSIBLE_")}

    bad = playbooks.run_playbook("env", inventory=inventory, private_data_dir=tmp_path / "runner",
                                 extravars={**ev, "gpuctl_run_env": {"BAD NAME": "x"}})
    assert not bad.ok
    assert [(f.host, f.rank) for f in bad.failures] == [("head", 0)]
    assert "BAD NAME" in bad.failures[0].message


def test_playbook_names() -> None:
    assert playbooks.playbook_path("setup") == playbooks.playbook_path("setup.yml")
    for name in playbooks.PLAYBOOKS:
        assert playbooks.playbook_path(name).is_file()
    with pytest.raises(ValueError):
        playbooks.playbook_path("../../etc/passwd")


def test_inventory_ranks(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"vars": {"gpuctl_cluster": "c"}, "children": {"gpuctl_nodes": {"hosts": {
        "head": {"gpuctl_rank": 0}, "worker1": {"gpuctl_rank": 1}, "other": None}}}}}))
    assert playbooks.inventory_ranks(inv) == {"head": 0, "worker1": 1, "other": None}


# Recorded from a real setup.yml run (trimmed to the fields read): worker1's setup
# exited 3, worker2 was unreachable.
RECORDED_SETUP_EVENTS: list[dict[str, Any]] = [
    {"event": "runner_on_ok", "event_data": {"host": "head", "task": "Create the job directory",
                                             "res": {"changed": True}}},
    {"event": "runner_on_unreachable", "event_data": {"host": "worker2", "task": "Create the job directory", "res": {
        "msg": "Task failed: Failed to connect to the host via ssh: ssh: connect to host 10.214.1.200 port 22: "
               "No route to host", "changed": False, "unreachable": True}}},
    {"event": "runner_on_ok", "event_data": {"host": "worker1", "task": "Wait for setup to end on every node",
                                             "res": {"msg": "non-zero return code", "rc": 3, "stderr": "",
                                                     "changed": True}}},
    {"event": "runner_on_failed", "event_data": {"host": "worker1", "task": "Fail when setup failed",
                                                 "ignore_errors": None, "res": {
                                                     "msg": "setup failed on worker1 (rank 1): exit code 3; log: "
                                                            "~/.gpuctl/jobs/11/setup.log", "changed": False}}},
    {"event": "playbook_on_stats", "event_data": {"failures": {"worker1": 1}, "dark": {"worker2": 1},
                                                  "changed": {"head": 5, "worker1": 5},
                                                  "ok": {"worker1": 7, "head": 7, "worker2": 1}}},
]
RANKS = {"head": 0, "worker1": 1, "worker2": 2}


def test_result_from_recorded_setup_failure() -> None:
    r = playbooks.build_result(RECORDED_SETUP_EVENTS, ranks=RANKS, rc=2, status="failed")
    assert not r.ok
    assert r.failures == [playbooks.HostFailure(
        host="worker1", rank=1, rc=3,
        message="setup failed on worker1 (rank 1): exit code 3; log: ~/.gpuctl/jobs/11/setup.log")]
    assert r.unreachable == ["worker2"]
    assert "No route to host" in r.unreachable_reasons["worker2"]
    assert r.changed == ["head", "worker1"]
    assert r.error is None


def test_result_command_failure_and_loop_items() -> None:
    events = [
        {"event": "runner_on_failed", "event_data": {"host": "head", "task": "Sync the workdir", "res": {
            "msg": "non-zero return code", "rc": 23, "stderr": "rsync: [sender] change_dir failed\nrsync error: 23\n"}}},
        {"event": "runner_on_failed", "event_data": {"host": "worker1", "task": "Sync file_mounts", "res": {
            "msg": "One or more items failed", "results": [
                {"failed": False, "rc": 0},
                {"failed": True, "rc": 12, "msg": "non-zero return code", "stderr": "rsync: connection closed"}]}}},
        {"event": "runner_on_failed", "event_data": {"host": "worker2", "task": "ignored", "ignore_errors": True,
                                                     "res": {"msg": "x"}}},
        {"event": "playbook_on_stats", "event_data": {"failures": {"head": 1, "worker1": 1}}},
    ]
    r = playbooks.build_result(events, ranks=RANKS, rc=2, status="failed")
    assert [(f.host, f.rank, f.rc) for f in r.failures] == [("head", 0, 23), ("worker1", 1, 12)]
    assert r.failures[0].message == "Sync the workdir: exit code 23: rsync: [sender] change_dir failed | rsync error: 23"
    assert "connection closed" in r.failures[1].message


def test_result_success_and_global_error() -> None:
    ok = playbooks.build_result([{"event": "playbook_on_stats", "event_data": {"ok": {"head": 2}}}], ranks=RANKS,
                                rc=0, status="successful")
    assert ok.ok and ok.failures == [] and ok.unreachable == [] and ok.error is None
    err = playbooks.build_result([], ranks=RANKS, rc=4, status="failed", stdout_tail="ERROR! 'x' is undefined")
    assert not err.ok and err.error == "ansible-playbook failed (rc 4): ERROR! 'x' is undefined"
    timeout = playbooks.build_result([], ranks=RANKS, rc=254, status="timeout")
    assert not timeout.ok and "timeout" in (timeout.error or "")


def test_nofile_limit_is_raised() -> None:
    import resource

    playbooks.raise_nofile_limit(4096)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= min(4096, hard)


def test_ansible_ssh_never_prompts() -> None:
    """ansible-runner hides ssh's prompts and a CI runner has no one to answer them: BatchMode."""
    import configparser

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ansible_dir() / "ansible.cfg")
    assert "-o BatchMode=yes" in cfg["ssh_connection"]["ssh_args"]
