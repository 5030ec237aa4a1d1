"""Run the packaged playbooks through ansible-runner; per-host outcome as values.

gpuctl itself runs one: prepare.yml (configplane/prepare.py), once per node. Jobs never go through
Ansible (the job plane: one ssh call to the head's agent). The stage playbooks (wait, sync, setup,
env, run, kill) are the collection's, for running a task with Ansible alone (the gpuctl.cluster
collection; tests/integration/test_playbooks.py drives them through this module), each a barrier
across the nodes (linear strategy). Their extravars contract:

    gpuctl_job_id          str
    gpuctl_workdir_src     local absolute dir, or None
    gpuctl_workdir_rsync_args  the workdir's rsync options, payload.workdir_rsync_args(gitignore.workdir_filter(src))
    gpuctl_file_mounts     [{src: local path, dest: "/abs" or "~/..."}]
    gpuctl_setup_env       {NAME: value} common to all nodes in setup (no secrets)
    gpuctl_run_env         {NAME: value} common to all nodes in run (no secrets)
    gpuctl_setup_rank_vars names set to the host's gpuctl_rank in setup
    gpuctl_run_rank_vars   names set to the host's gpuctl_rank in run
    gpuctl_secrets_file    local path of a 0600 file of `export K='v'` lines, or None
    gpuctl_setup_script    str, or None (no setup)
    gpuctl_run_script      str, or None (nothing to run)
    gpuctl_hostfile_lines  ["IP slots=N", ...], head first
    gpuctl_run_hosts       inventory names of the job's nodes
    gpuctl_internal_key    local path of the cluster's internal private key (wait.yml: node-to-node SSH), or None
  optional: gpuctl_wait_timeout (s, default 600), gpuctl_stages / gpuctl_grace (kill.yml),
            gpuctl_features (prepare.yml: [rclone, fuse], the bucket tools; default none),
            gpuctl_node_wait (prepare.yml: wait for SSH first; default true),
            gpuctl_agent_files / gpuctl_cluster_view (prepare.yml: the install step's files, read
            once, and the cluster view, configplane/prepare.py and clusterview.py)

Secrets never go through extravars: only the file's path does, and the copy
task is `no_log`. Extravars go in a 0600 YAML file (`-e @file`, deleted after
the run), where every string containing "{" is tagged `!unsafe`, so values and
scripts with `{{ }}` / `{% %}` reach the nodes literally instead of being
templated by Ansible. (Other strings stay plain: Ansible re-types an !unsafe
scalar from its text, "" -> None.) The process environment that ansible-runner
records in `artifacts/<ident>/command` is reduced to the variables gpuctl set.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping


import yaml

from gpuctl.common.paths import ansible_dir
from gpuctl.common.safetext import printable
from gpuctl.common.yamlfile import load_yaml
from gpuctl.configplane import bundle
from gpuctl.provision import ssh

PLAYBOOKS = ("prepare", "wait", "sync", "setup", "env", "run", "kill")
MAX_FORKS = 256
KEEP_ARTIFACTS = 40
_EXIT_CODE_RE = re.compile(r"exit code (-?\d+)")


@dataclass(frozen=True)
class HostFailure:
    host: str
    rank: int | None
    rc: int | None
    message: str


@dataclass(frozen=True)
class PlaybookResult:
    ok: bool
    failures: list[HostFailure] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    # ssh's reason per unreachable host ("Permission denied (publickey)", ...)
    unreachable_reasons: dict[str, str] = field(default_factory=dict)
    # Hosts where some task reported a change (from the play recap)
    changed: list[str] = field(default_factory=list)
    # A failure not tied to a host (syntax error, undefined variable, timeout...)
    error: str | None = None
    artifact_dir: str | None = None


class _Unsafe(str):
    """A string Ansible must not template (YAML tag !unsafe)."""


# libyaml's emitter where PyYAML has it: the same text, but the prepare play's vars carry the node
# bundle (120 kB of base64) that the Python emitter looks at character by character (0.12 CPU-s)
class _ExtravarsDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    pass


_ExtravarsDumper.add_representer(
    _Unsafe, lambda dumper, value: dumper.represent_scalar("!unsafe", str(value), style='"'))


def _mark_unsafe(value: Any) -> Any:
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        # Only strings that could hold template syntax ({{ }}, {% %}, {# #}) need
        # the tag. Ansible resolves an !unsafe scalar's type from its text ("" ->
        # None, "yes" -> True, "1e3" -> 1000.0), so tagging others would change them.
        return _Unsafe(value) if "{" in value else value
    if isinstance(value, Mapping):
        return {str(k): _mark_unsafe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_unsafe(v) for v in value]
    return value


def dump_extravars(extravars: Mapping[str, Any]) -> str:
    """YAML for `-e @file`; strings that could be templates are tagged !unsafe."""
    return yaml.dump(_mark_unsafe(dict(extravars)), Dumper=_ExtravarsDumper, sort_keys=True,
                     allow_unicode=True, width=1 << 20)


def playbook_path(name: str) -> Path:
    stem = name[:-4] if name.endswith(".yml") else name
    if stem not in PLAYBOOKS:
        raise ValueError(f"unknown playbook {name!r}; one of {', '.join(PLAYBOOKS)}")
    return ansible_dir() / "playbooks" / f"{stem}.yml"


def inventory_ranks(inventory: Path) -> dict[str, int | None]:
    """Host name -> gpuctl_rank from an Ansible YAML inventory (any group nesting)."""
    data = load_yaml(Path(inventory), what="Ansible inventory") or {}
    ranks: dict[str, int | None] = {}

    def walk(group: Mapping[str, Any]) -> None:
        for name, hv in (group.get("hosts") or {}).items():
            rank = (hv or {}).get("gpuctl_rank")
            if rank is not None or str(name) not in ranks:
                ranks[str(name)] = int(rank) if rank is not None else None
        for child in (group.get("children") or {}).values():
            walk(child or {})

    for top in data.values() if isinstance(data, Mapping) else ():
        walk(top or {})
    return ranks


def raise_nofile_limit(wanted: int = 65536) -> int:
    """Raise this process's soft RLIMIT_NOFILE (inherited by ansible-playbook).

    With more than ~74 forks ansible-core can run out of descriptors and
    silently skip hosts.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def _tail(text: str | None, lines: int = 3, chars: int = 400) -> str:
    if not text:
        return ""
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-chars:]


def _failure_message(res: Mapping[str, Any], task: str) -> tuple[int | None, str]:
    """(rc, one-line message) from a failed task result."""
    results = res.get("results")
    if isinstance(results, list):  # a loop: the first failed item says more
        failed_items = [r for r in results if isinstance(r, Mapping) and r.get("failed")]
        if failed_items:
            return _failure_message(failed_items[0], task)
    rc = res.get("rc")
    msg = str(res.get("msg") or "").strip()
    if rc is None:
        m = _EXIT_CODE_RE.search(msg)
        rc = int(m.group(1)) if m else None
    if not msg or msg == "non-zero return code":
        detail = _tail(res.get("stderr")) or _tail(res.get("stdout"))
        msg = f"{task}: " + (f"exit code {rc}" if rc is not None else "failed") + (f": {detail}" if detail else "")
    elif task and msg.startswith(("[Errno", "Unable", "Failed", "Could not", "MODULE FAILURE")):
        msg = f"{task}: {msg}"
    return (int(rc) if isinstance(rc, (int, str)) and str(rc).lstrip("-").isdigit() else None), msg


def build_result(events: Iterable[Mapping[str, Any]], *, ranks: Mapping[str, int | None], rc: int | None,
                 status: str, stdout_tail: str = "", artifact_dir: str | None = None) -> PlaybookResult:
    """PlaybookResult from ansible-runner events (pure; unit-tested with recorded events)."""
    failures: dict[str, HostFailure] = {}
    unreachable: dict[str, str] = {}
    stats: Mapping[str, Any] = {}
    for ev in events:
        kind = ev.get("event")
        data = ev.get("event_data") or {}
        host = data.get("host")
        res = data.get("res") or {}
        task = str(data.get("task") or "")
        if kind in ("runner_on_failed", "runner_on_async_failed") and host and not data.get("ignore_errors"):
            code, msg = _failure_message(res, task)  # a node's stderr: printable, it lands in our error line
            failures[host] = HostFailure(host=host, rank=ranks.get(host), rc=code, message=printable(msg))
        elif kind == "runner_on_unreachable" and host and not data.get("ignore_unreachable"):
            items = [r for r in res.get("results") or [] if isinstance(r, Mapping) and r.get("unreachable")]
            msg = (items[0] if items else res).get("msg") or "unreachable"
            unreachable[host] = printable(_tail(str(msg), lines=2))
        elif kind == "playbook_on_stats":
            stats = data
    # Hosts the stats count as failed but whose event we did not see (e.g. events dropped).
    for host, count in (stats.get("failures") or {}).items():
        if count and host not in failures:
            failures[host] = HostFailure(host=host, rank=ranks.get(host), rc=None, message="failed")
    for host, count in (stats.get("dark") or {}).items():
        if count and host not in unreachable:
            unreachable[host] = "unreachable"
    for host in unreachable:
        failures.pop(host, None)
    error = None
    if status != "successful" or (rc not in (0, None)):
        if not failures and not unreachable:
            error = f"ansible-playbook {status} (rc {rc})" + (f": {printable(stdout_tail)}" if stdout_tail else "")
    ok = status == "successful" and rc in (0, None) and not failures and not unreachable
    changed = [h for h, n in (stats.get("changed") or {}).items() if n]
    order = sorted(failures.values(), key=lambda f: (f.rank is None, f.rank if f.rank is not None else 0, f.host))
    return PlaybookResult(
        ok=ok,
        failures=order,
        unreachable=sorted(unreachable, key=lambda h: (ranks.get(h) is None, ranks.get(h) or 0, h)),
        unreachable_reasons=dict(unreachable),
        changed=sorted(changed, key=lambda h: (ranks.get(h) is None, ranks.get(h) or 0, h)),
        error=error,
        artifact_dir=artifact_dir,
    )


def merge_results(first: PlaybookResult, retry: PlaybookResult, retried: Iterable[str]) -> PlaybookResult:
    """`first` with the hosts run again (`retried`) replaced by their outcome in `retry`."""
    redone = set(retried)
    failures = [f for f in first.failures if f.host not in redone] + list(retry.failures)
    unreachable = [h for h in first.unreachable if h not in redone] + list(retry.unreachable)
    reasons = {h: r for h, r in {**first.unreachable_reasons, **retry.unreachable_reasons}.items() if h in unreachable}
    error = retry.error or first.error
    return PlaybookResult(ok=not failures and not unreachable and error is None, failures=failures,
                          unreachable=unreachable, unreachable_reasons=reasons,
                          changed=sorted(set(first.changed) | set(retry.changed)), error=error,
                          artifact_dir=retry.artifact_dir)


def _redact_command_artifact(artifact_dir: Path, keep: Iterable[str]) -> None:
    """ansible-runner records the whole process environment; keep only `keep` and PATH."""
    path = artifact_dir / "command"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    allowed = set(keep) | {"PATH", "HOME", "LANG"}
    env = data.get("env") or {}
    data["env"] = {k: v for k, v in env.items() if k in allowed or k.startswith("ANSIBLE_")}
    data["env_note"] = "reduced by gpuctl to the variables it set"
    tmp = path.with_name("command.tmp")
    tmp.write_text(json.dumps(data))
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _never() -> bool:
    return False


def _keeping(on_event: Callable[[Mapping[str, Any]], None]) -> Callable[[Mapping[str, Any]], bool]:
    """ansible-runner's event_handler: True keeps the event for `runner.events`."""
    def handler(event: Mapping[str, Any]) -> bool:
        on_event(event)
        return True
    return handler


def rotate_artifacts(artifacts: Path, keep: int = KEEP_ARTIFACTS) -> None:
    """Keep the newest `keep` run directories under `artifacts` (by name: each
    run's ident starts with its start time).

    Done here rather than by ansible-runner's `rotate_artifacts`, which removes
    the oldest by mtime and fails on a directory that vanishes in between: two
    gpuctl commands on one cluster (they share the private data dir) crashed
    each other with FileNotFoundError once `keep` runs existed. Names, unlike
    mtimes, do not change while another process empties a directory.
    """
    try:
        names = sorted(p.name for p in artifacts.iterdir())
    except FileNotFoundError:
        return
    for name in names[: max(0, len(names) - keep)]:
        shutil.rmtree(artifacts / name, ignore_errors=True)


def run_playbook(
    name: str,
    *,
    inventory: Path,
    private_data_dir: Path,
    extravars: Mapping[str, Any],
    forks: int | None = None,
    limit: list[str] | None = None,
    control_dir: Path | None = None,
    timeout: int | None = None,
    cancel: threading.Event | None = None,
    on_event: Callable[[Mapping[str, Any]], None] | None = None,
    skip_tags: Iterable[str] = (),
) -> PlaybookResult:
    """Run playbook `name` ("setup" or "setup.yml") against `inventory`.

    forks defaults to the number of target hosts, capped at 256. `control_dir`
    (default: `<private_data_dir>/../cm`, as jobplane/runner.py's follow uses) holds the
    ControlMaster sockets, shortened by ssh.control_dir_for if the path is too
    long. `timeout` (s) and `cancel` stop ansible-playbook (not processes it
    started on nodes: use kill.yml or jobplane.client.kill_stage for those).
    `on_event` sees each ansible-runner event as it arrives (progress, results). `skip_tags`: tasks
    left out before they reach any host (a task skipped by its `when` still costs a fork per host).
    """
    import ansible_runner  # here, not at import: a job on a prepared cluster never needs it

    playbook = playbook_path(name)
    inventory = Path(inventory).absolute()
    ranks = inventory_ranks(inventory)
    targets = [h for h in ranks if not limit or h in limit]
    forks = forks or max(1, min(len(targets) or 1, MAX_FORKS))
    raise_nofile_limit(max(4096, forks * 64))

    pdd = Path(private_data_dir).absolute()
    pdd.mkdir(parents=True, exist_ok=True, mode=0o700)
    control = ssh.control_dir_for(control_dir if control_dir is not None else pdd.parent / "cm")
    ident = f"{time.strftime('%Y%m%dT%H%M%S')}-{playbook.stem}-{uuid.uuid4().hex[:6]}"
    vars_dir = pdd / "extravars"
    vars_dir.mkdir(exist_ok=True, mode=0o700)
    vars_file = vars_dir / f"{ident}.yml"
    fd = os.open(vars_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    # The node's files for role gpuctl_node (wait.yml, prepare.yml): the repository's role has no files/
    # (a built collection has), so gpuctl gives the bundle it builds from cli/gpuctl/node/.
    given = {} if "gpuctl_agent_files" in extravars else {"gpuctl_agent_files": bundle.packed_files()}
    with os.fdopen(fd, "w") as fh:
        fh.write(dump_extravars({**extravars, **given, "gpuctl_control_dir": str(control)}))

    envvars = {
        "ANSIBLE_CONFIG": str(ansible_dir() / "ansible.cfg"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
        # ansible-playbook from this interpreter's environment, even when it is not activated
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        # Never a task's arguments in the events (ansible-runner copies them there when this is on):
        # the install step's carry the cluster's private key.
        "ANSIBLE_DISPLAY_ARGS_TO_STDOUT": "False",
    }
    try:
        runner = ansible_runner.run(
            private_data_dir=str(pdd),
            ident=ident,
            playbook=str(playbook),
            inventory=str(inventory),
            cmdline=f"-e @{vars_file}",
            envvars=envvars,
            forks=forks,
            limit=",".join(limit) if limit else None,
            quiet=True,
            rotate_artifacts=0,  # rotate_artifacts() below, safe with concurrent gpuctl commands
            suppress_env_files=True,
            timeout=timeout,
            # Always a callback: with none, ansible-runner installs SIGINT/SIGTERM
            # handlers of its own (main thread) and never restores ours.
            cancel_callback=cancel.is_set if cancel is not None else _never,
            event_handler=_keeping(on_event) if on_event is not None else None,
            skip_tags=",".join(skip_tags) or None,
        )
    finally:
        vars_file.unlink(missing_ok=True)
    artifact_dir = Path(runner.config.artifact_dir)
    _redact_command_artifact(artifact_dir, envvars)
    rotate_artifacts(artifact_dir.parent)
    stdout_tail = ""
    if runner.status != "successful":
        try:
            stdout_tail = _tail((artifact_dir / "stdout").read_text(errors="replace"), lines=4, chars=800)
        except OSError:
            pass
    return build_result(runner.events, ranks=ranks, rc=runner.rc, status=runner.status,
                        stdout_tail=stdout_tail, artifact_dir=str(artifact_dir))
