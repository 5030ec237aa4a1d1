"""Drive the `terraform` CLI for one rendered root module.

Every command is spelled out here (`_argv`: options as keyword arguments, FLAG for a bare
`-flag`), so nothing adds flags current Terraform rejects or defaults gpuctl does not want.
The process environment passes through, with the provider's additions on top (`env`, e.g.
an emulator's endpoints): TF_CLI_CONFIG_FILE (provider mirrors), TF_PLUGIN_CACHE_DIR and
friends work as for the user's own runs.

plan/apply/destroy run with `-json`, so change counts come from Terraform's
`change_summary` message and errors from its diagnostics rather than from
scraping text; text errors on stderr (init, argument errors) are parsed too.
Each command's full output is kept in `<workdir>/logs/<command>.log`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import STATE_SNAPSHOT_FILE, readable_state_file

ROOT_FILE = "main.tf.json"
# Long enough to wait out another gpuctl run on the same cluster, short enough
# that a stale lock is reported instead of hanging forever.
LOCK_TIMEOUT = "120s"
CAPACITY_MARKERS = ("InsufficientInstanceCapacity",)
MAX_ERROR_LINES = 15
FLAG = object()  # an option given as a bare `-flag` (see _argv)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BOX = re.compile(r"^\s*[│╷╵]\s?")
# Source context Terraform prints under a diagnostic: not the reason.
_CONTEXT = re.compile(r"^\s*(with .*,$|on .* line \d+.*:$|\d+:\s)")


@dataclass(frozen=True)
class PlanSummary:
    """What `terraform plan` would do (a replacement counts as one add and one destroy)."""

    add: int
    change: int
    destroy: int
    text: str

    @property
    def changed(self) -> bool:
        return bool(self.add or self.change or self.destroy)

    def describe(self) -> list[str]:
        """Lines for `--dry-run`: the planned changes, then the totals."""
        lines = [line for line in self.text.splitlines() if line.strip()]
        total = f"Plan: {self.add} to add, {self.change} to change, {self.destroy} to destroy."
        if not lines or lines[-1] != total:
            lines.append(total if self.changed else "No changes.")
        return lines


@dataclass(frozen=True)
class PlannedChange:
    """One resource change of a plan, as Terraform's JSON stream says it (`planned_change`)."""

    address: str  # module.cluster.aws_instance.node[2]
    action: str  # create, update, delete, replace, move, read
    reason: str = ""  # why a delete or replace: tainted (a create that failed or was cut short), ...

    @property
    def destroys(self) -> bool:
        return self.action in ("delete", "replace")


def planned_changes(stdout: str) -> list[PlannedChange]:
    """Every `planned_change` of a `terraform plan -json` run, in its order."""
    changes = []
    for msg in _json_messages(stdout):
        change = msg.get("change") if msg.get("type") == "planned_change" else None
        if isinstance(change, dict) and isinstance(change.get("resource"), dict):
            changes.append(PlannedChange(str(change["resource"].get("addr", "")), str(change.get("action", "")),
                                         str(change.get("reason") or "")))
    return changes


class TerraformRoot:
    """One root module directory (`clusters/<name>/terraform/`) and its local state."""

    def __init__(self, workdir: Path, *, terraform_bin: str | None = None, lock_timeout: str = LOCK_TIMEOUT,
                 env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.env = dict(env or {})  # over this process's environment, for every command
        self._outputs: dict[str, Any] | None = None  # as the last command (an apply) printed them
        self.terraform_bin = terraform_bin
        self.lock_timeout = lock_timeout
        self._initialised: str | None = None  # the root file's text when init last ran here

    # -- files -------------------------------------------------------------

    @property
    def root_file(self) -> Path:
        return self.workdir / ROOT_FILE

    def write(self, config: Mapping[str, Any]) -> Path:
        """Write the root module as Terraform JSON (rewritten only when it changed)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        if self.root_file.exists() and self.root_file.read_text() == text:
            return self.root_file
        tmp = self.root_file.with_name(ROOT_FILE + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.root_file)
        return self.root_file

    def read(self) -> dict[str, Any]:
        return json.loads(self.root_file.read_text())

    def _root_text(self) -> str | None:
        try:
            return self.root_file.read_text()
        except OSError:
            return None

    def has_state(self) -> bool:
        """Whether the state records any resource (something may exist): the local state, or a
        remote backend's last snapshot (snapshot_state)."""
        try:
            return bool(json.loads(self.state_file().read_text()).get("resources"))
        except (OSError, ValueError, AttributeError):
            return False

    @property
    def snapshot_file(self) -> Path:
        """A read-only copy of a remote backend's state (snapshot_state), for code that reads the state."""
        return self.workdir / STATE_SNAPSHOT_FILE

    def state_file(self) -> Path:
        """The local state, else the last snapshot of the remote one."""
        return readable_state_file(self.workdir)

    # -- commands ----------------------------------------------------------

    def snapshot_state(self) -> Path:
        """`terraform state pull` into snapshot_file (the backend's current state; after init)."""
        _, out, _ = self._run("state", "pull")
        tmp = self.snapshot_file.with_name(self.snapshot_file.name + ".tmp")
        tmp.write_text(out or "{}")
        tmp.replace(self.snapshot_file)
        return self.snapshot_file

    def init(self) -> None:
        """`terraform init` (modules and providers; honours the CLI config's mirrors)."""
        text, self._initialised = self._root_text(), None
        self._run("init", input=False, no_color=FLAG)
        self._initialised = text

    @property
    def initialised(self) -> bool:
        """Whether init already ran through this object on the root file as it is now: the modules,
        providers and backend it names are in place, so another init would change nothing."""
        return self._initialised is not None and self._initialised == self._root_text()

    def plan(self, replace: Sequence[str] = ()) -> PlanSummary:
        """`terraform plan`: what apply would change (with `replace`, as apply(replace=) would). Creates nothing."""
        rc, out, _ = self._run(
            "plan", ok=(0, 2), input=False, no_color=FLAG, json=FLAG,
            detailed_exitcode=FLAG, lock_timeout=self.lock_timeout, replace=list(replace),
        )
        summary = parse_plan_json(out)
        if summary is None:
            raise ProvisionError(f"terraform plan in {self.workdir} printed no change summary (exit code {rc})")
        return summary

    def plan_to(self, plan_file: Path) -> list[PlannedChange]:
        """`terraform plan -out=PLAN_FILE`: the changes apply(plan_file=) would make, and nothing
        else, so a caller may refuse some before any is made; [] (and no file) when there are none."""
        plan_file.unlink(missing_ok=True)
        rc, out, _ = self._run(
            "plan", ok=(0, 2), input=False, no_color=FLAG, json=FLAG, detailed_exitcode=FLAG,
            lock_timeout=self.lock_timeout, out=str(plan_file),
        )
        if rc == 0:
            plan_file.unlink(missing_ok=True)
            return []
        return planned_changes(out)

    def apply(self, on_count: Callable[[int, int], None] | None = None, replace: Sequence[str] = (),
              plan_file: Path | None = None) -> bool:
        """`terraform apply`; True when something was created, changed or destroyed. `on_count(done,
        total)` as each resource's change completes (Terraform's JSON stream: planned_change, then
        apply_complete), for a live "12 of 64" while nodes are made. `replace`: resource addresses
        (`module.cluster.aws_instance.node[1]`) rebuilt even though nothing about them changed
        (`-replace=ADDR` each): a lost node made again, what depends on it with it. `plan_file`:
        apply exactly that saved plan (plan_to), which is then removed."""
        args = [str(plan_file)] if plan_file is not None else []
        options: dict[str, Any] = {"auto_approve": FLAG, "replace": list(replace)} if plan_file is None else {}
        options.update(input=False, no_color=FLAG, json=FLAG, lock_timeout=self.lock_timeout)
        try:
            if on_count is None:
                _, out, _ = self._run("apply", *args, **options)
            else:
                out = self._stream_apply(self._argv("apply", *args, **options), on_count)
        finally:
            if plan_file is not None:
                plan_file.unlink(missing_ok=True)
        self._outputs = applied_outputs(out)
        counts = _change_summary(out, operation="apply")
        return bool(counts and any(counts.get(k) for k in ("add", "change", "remove")))

    def refresh(self) -> None:
        """`terraform apply -refresh-only`: the state, and so the outputs, as the cloud has it now,
        nothing changed; for nodes that just started, whose public addresses are new."""
        _, out, _ = self._run("apply", input=False, no_color=FLAG, json=FLAG, auto_approve=FLAG,
                              refresh_only=FLAG, lock_timeout=self.lock_timeout, log_as="refresh")
        self._outputs = applied_outputs(out)

    def outputs(self) -> dict[str, Any]:
        """`terraform output -json`, as output name -> value; right after an apply (or refresh) of this
        object, the values that apply printed, which are the same and cost no terraform run.

        Terraform leaves outputs whose value is null out of the state, so a
        null output (the local module's `bastion`) is absent here, not None.
        """
        if self._outputs is not None:
            return dict(self._outputs)
        _, out, _ = self._run("output", no_color=FLAG, json=FLAG)
        try:
            raw = json.loads(out or "{}")
        except ValueError:
            raise ProvisionError(f"terraform output -json in {self.workdir} printed no JSON") from None
        return {k: (v.get("value") if isinstance(v, Mapping) else v) for k, v in raw.items()}

    def destroy(self, *, refresh: bool = True) -> None:
        """`terraform destroy` of everything in this root's state. `refresh=False` (`-refresh=false`):
        nothing is read back from the cloud first, for a state that an apply read or made moments ago."""
        self._run(
            "destroy", input=False, no_color=FLAG, json=FLAG,
            auto_approve=FLAG, lock_timeout=self.lock_timeout, **({} if refresh else {"refresh": False}),
        )

    # -- plumbing ----------------------------------------------------------

    def _binary(self) -> str:
        found = self.terraform_bin or shutil.which("terraform")
        if not found:
            raise UserError("terraform is not on PATH; install Terraform >= 1.5 and try again")
        return found

    def _run(self, command: str, *args: str, ok: Iterable[int] = (0,), log_as: str | None = None,
             **options: Any) -> tuple[int, str, str]:
        """Run one terraform command in the workdir; raise ProvisionError on failure. Its log is
        logs/COMMAND.log, or logs/LOG_AS.log."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._outputs = None  # whatever this command does to the state, they may no longer be the state's
        try:
            done = subprocess.run(self._argv(command, *args, **options), cwd=self.workdir, env=self._environ(),
                                  stdin=subprocess.DEVNULL, capture_output=True, encoding="utf-8",
                                  errors="replace")
        except OSError as exc:
            raise UserError(f"could not run terraform ({exc.strerror or exc}); check that it is installed") from None
        rc, out, err = done.returncode, done.stdout or "", done.stderr or ""
        self._log(log_as or command, rc, out, err)
        if rc not in tuple(ok):
            raise self._failure(log_as or command, rc, out, err)
        return rc, out, err

    def _argv(self, command: str, *args: str, **options: Any) -> list[str]:
        """`terraform COMMAND -option=value... ARGS`: an option's underscores become dashes; FLAG is a
        bare `-option`, a bool `=true`/`=false`, a list one `-option=item` per item, None nothing."""
        argv = [self._binary(), *command.split()]
        for name, value in options.items():
            flag = "-" + name.replace("_", "-")
            if value is FLAG:
                argv.append(flag)
            elif isinstance(value, list):
                argv += [f"{flag}={item}" for item in value]
            elif isinstance(value, bool):
                argv.append(f"{flag}={'true' if value else 'false'}")
            elif value is not None:
                argv.append(f"{flag}={value}")
        return [*argv, *args]

    def _environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _failure(self, command: str, rc: int, out: str, err: str) -> ProvisionError:
        """What a failed command says: its error lines, and whether capacity ran out."""
        lines = error_lines(out, err)
        capacity = any(m in err or m in out for m in CAPACITY_MARKERS)
        detail = "\n  ".join(lines) if lines else f"exit code {rc}, no error message"
        return ProvisionError(f"terraform {command} failed in {self.workdir}:\n  {detail}",
                              insufficient_capacity=capacity)

    def _stream_apply(self, argv: list[str], on_count: Callable[[int, int], None]) -> str:
        """`argv`, a `terraform apply -json`, read as it runs; its stdout. Failures as _run reports them."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._outputs = None
        lines: list[str] = []
        planned = done = 0
        with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err_file:
            try:
                proc = subprocess.Popen(argv, cwd=self.workdir, env=self._environ(), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=err_file, encoding="utf-8",
                                        errors="replace")
            except OSError as exc:
                raise UserError(f"could not run terraform ({exc.strerror or exc}); check that it is installed") \
                    from None
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                kind = _message_type(line)
                if kind == "planned_change":
                    planned += 1
                elif kind == "apply_complete":
                    done += 1
                    on_count(done, max(planned, done))
            rc = proc.wait()
            err_file.seek(0)
            err = err_file.read()
        out = "".join(lines)
        self._log("apply", rc, out, err)
        if rc != 0:
            raise self._failure("apply", rc, out, err)
        return out

    def _log(self, command: str, rc: int, out: str, err: str) -> None:
        logs = self.workdir / "logs"
        try:
            logs.mkdir(exist_ok=True)
            (logs / f"{command}.log").write_text(f"# exit code {rc}\n# stdout\n{out}\n# stderr\n{err}")
        except OSError:
            pass  # the log is a convenience; never fail a run over it


def _json_messages(stdout: str) -> Iterable[dict[str, Any]]:
    for raw in stdout.splitlines():
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(msg, dict):
                yield msg


def _message_type(line: str) -> str | None:
    """The `type` of one line of Terraform's JSON stream (None: not such a line)."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg.get("type") if isinstance(msg, dict) else None


def _change_summary(stdout: str, *, operation: str | None = None) -> dict[str, int] | None:
    found = None
    for msg in _json_messages(stdout):
        changes = msg.get("changes")
        if msg.get("type") == "change_summary" and isinstance(changes, dict):
            if operation is None or changes.get("operation") == operation:
                found = changes
    return found


def applied_outputs(stdout: str) -> dict[str, Any] | None:
    """name -> value from the `outputs` message an apply's JSON stream ends with (null outputs are
    absent there, as in `terraform output -json`); None where it has none, or where one is sensitive
    (the stream leaves its value out, `terraform output` does not)."""
    found = None
    for msg in _json_messages(stdout):
        if msg.get("type") == "outputs" and isinstance(msg.get("outputs"), dict):
            found = msg["outputs"]  # a plan's come first, without values; the applied ones last
    if found is None or not all(isinstance(o, dict) and "value" in o and not o.get("sensitive")
                                for o in found.values()):
        return None
    return {name: o["value"] for name, o in found.items()}


def parse_plan_json(stdout: str) -> PlanSummary | None:
    """PlanSummary from `terraform plan -json` output, or None if it has no change summary."""
    counts = _change_summary(stdout, operation="plan") or _change_summary(stdout)
    if counts is None:
        return None
    text = [
        str(msg.get("@message", "")).strip()
        for msg in _json_messages(stdout)
        if msg.get("type") in ("planned_change", "resource_drift", "change_summary")
        or (msg.get("type") == "diagnostic" and msg.get("@level") in ("warning", "error"))
    ]
    return PlanSummary(
        add=int(counts.get("add", 0)),
        change=int(counts.get("change", 0)),
        destroy=int(counts.get("remove", 0)),
        text="\n".join(t for t in text if t),
    )


def error_lines(stdout: str, stderr: str, *, limit: int = MAX_ERROR_LINES) -> list[str]:
    """The meaningful error lines of a failed run: JSON error diagnostics
    (stdout of -json runs) and `Error:` blocks of stderr, without warnings,
    box drawing or source context; the last `limit` of them."""
    lines: list[str] = []
    for msg in _json_messages(stdout):
        if msg.get("type") == "diagnostic" and msg.get("@level") == "error":
            diag = msg.get("diagnostic") or {}
            lines.append(f"Error: {diag.get('summary') or msg.get('@message', '')}".rstrip())
            if diag.get("address"):
                lines.append(f"({diag['address']})")
            lines.extend(str(diag.get("detail") or "").splitlines())
    block: list[str] | None = None
    for raw in _ANSI.sub("", stderr).splitlines():
        boxed = _BOX.match(raw) is not None
        text = _BOX.sub("", raw).rstrip()
        if raw.lstrip().startswith("╵"):
            block = None
        elif text.startswith("Error:"):
            block = [text]
            lines.extend(block)
        elif text.startswith("Warning:") or (not boxed and text.startswith("There are some problems")):
            block = None
        elif block is not None:
            lines.append(text)
    meaningful = [ln.strip() for ln in lines if ln.strip() and not _CONTEXT.match(ln)]
    if not meaningful:
        # Not in Terraform's diagnostic format: fall back to the tail of stderr.
        meaningful = [ln.strip() for ln in _ANSI.sub("", stderr).splitlines() if ln.strip()]
    deduped = [ln for i, ln in enumerate(meaningful) if i == 0 or ln != meaningful[i - 1]]
    if len(deduped) <= limit:
        return deduped
    # Keep the first error's summary line and the end, where scripts put their reason.
    head = next((ln for ln in deduped if ln.startswith("Error:")), deduped[0])
    return [head, "..."] + deduped[-(limit - 2):]

