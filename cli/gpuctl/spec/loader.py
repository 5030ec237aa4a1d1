"""`load_task`: read a task YAML file, apply the command line's overrides and validate it.

Why a module of its own: this is the one entry point from a file to a `Task`:
compose with lines (compose.py), merge `--env`/`--secret`/`--infra`, validate
(models.py), turn its problems into lines, one each (messages.py), and list the
fields read and not acted on as warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pydantic

from gpuctl.common.envargs import _ENV_NAME_RULE, ENV_NAME_RE
from gpuctl.common.errors import UserError
from gpuctl.common.yamlfile import read_text
from gpuctl.spec.compose import _as_written, _compose, _line_of
from gpuctl.spec.fields import _WHERE_FIELDS, _kind
from gpuctl.spec.infra import CONFIG_ACTED_ON, parse_infra
from gpuctl.spec.messages import _problem_lines, _redact
from gpuctl.spec.models import ResourcesCheck, Task

SKYPILOT_IMAGE_PREFIX = "skypilot:"  # SkyPilot's own image tags (skypilot:gpu-ubuntu-2204)
# Read, kept, and not acted on: each gets a warning line saying so.
_KEPT_UNUSED = ("ports", "labels", "disk_tier")
_IGNORED_WHY = {
    "service": "gpuctl runs jobs, not SkyPilot services (no replicas, no load balancer)",
    "pool": "gpuctl has no worker pools; apply runs the task on one cluster",
    "ports": "gpuctl opens no ports (only SSH from your address); add security-group rules yourself",
    "labels": "gpuctl tags instances itself",
    "disk_tier": "gpuctl uses the default EBS volume type",
    "config": "SkyPilot config overrides are not read (only config.aws.remote_identity is)",
    "experimental": "SkyPilot's experimental overrides are not read",
    "accelerator_args": "gpuctl does not configure TPUs",
    "max_hourly_cost": "gpuctl does not shop by price",
    "event_callback": "gpuctl runs no callback",
    "skypilot_image": "SkyPilot's own images are not available to gpuctl; AWS nodes boot the Deep Learning AMI "
                      "(give an ami-... id to choose another)",
    "inputs": "gpuctl does not estimate data transfer",
    "outputs": "gpuctl does not estimate data transfer",
}


def _override_infra(data: dict[str, Any], infra: str) -> None:
    """`--infra`: one location for the task; the file's infra/cloud/region/zone go, alternatives' too."""
    parse_infra(infra, field="--infra")  # its own error names the flag, not the file
    resources = data.get("resources")
    if not isinstance(resources, dict):
        resources = {} if resources is None else resources
    if isinstance(resources, dict):
        resources = {k: v for k, v in resources.items() if k not in _WHERE_FIELDS}
        for group in ("any_of", "ordered"):
            if isinstance(resources.get(group), list):
                resources[group] = [{k: v for k, v in alt.items() if k not in _WHERE_FIELDS}
                                    if isinstance(alt, dict) else alt for alt in resources[group]]
        data["resources"] = {"infra": infra, **resources}


def _merge_overrides(data: dict[str, Any], section: str, overrides: Mapping[str, str] | None, flag: str) -> None:
    """`--env`/`--secret` values replace or extend the file's, validated like them."""
    if not overrides:
        return
    for name in overrides:
        if not ENV_NAME_RE.fullmatch(name):
            raise UserError(f"{flag} {name}: not a valid variable name; {_ENV_NAME_RULE}")
    current = data.get(section)
    if current is None or isinstance(current, dict):
        data[section] = {**(current or {}), **{k: str(v) for k, v in overrides.items()}}


def load_task(
    path: str | Path,
    *,
    env_overrides: Mapping[str, str] | None = None,
    secret_overrides: Mapping[str, str] | None = None,
    require_values: bool = True,
    infra_override: str | None = None,
    resources_check: ResourcesCheck | None = None,
    text: str | None = None,
) -> Task:
    """Read and validate a SkyPilot-format task YAML (`text`: its text, from no file; `path` then
    names it in messages, and relative paths resolve from the current directory).

    Relative `workdir` and `file_mounts` sources resolve against the YAML
    file's directory (not the current one). `env_overrides` (from `--env K=V`)
    and `secret_overrides` (from `--secret K=V`) replace or extend `envs` and
    `secrets` before validation, so they fill `null` values and are checked
    the same way. Any problem raises `UserError` with one line
    `FILE:LINE: FIELD: MESSAGE` (`FILE:LINE:COLUMN: ...` for YAML syntax); several
    validation problems give one such line each, in file order (messages.py).
    `infra_override` (`--infra`) replaces every location in the file, the
    alternatives' too, as SkyPilot's `--infra` does.
    `resources_check(cloud, resources)`: the provider's offline word on resources
    (gpuctl.providers.resources_problem; spec/ does not import providers/), which
    refuses them and skips any_of/ordered alternatives; without it only the cloud is checked.
    With `require_values=False` (validate) an env or secret still without a
    value is no error: it is listed in `Task.warnings` as needed at apply.
    Fields read but not acted on are listed there too, one line each.
    """
    source = str(path)
    file = Path(path).expanduser()
    text = read_text(file, what="task YAML file", source=source) if text is None else text

    data, lines, texts = _compose(text, source)
    if data is None:
        data = {}  # an empty file is an empty task, as in SkyPilot
    if not isinstance(data, dict):
        raise UserError(f"{source}:{lines[()]}: the top level must be a mapping of task fields "
                        f"(name, resources, run, ...), not {_kind(data)}")
    for section in ("envs", "secrets"):
        if isinstance(data.get(section), dict):
            data[section] = {k: texts.get((section, str(k)), v) for k, v in data[section].items()}
    raw_secrets = data.get("secrets") if isinstance(data.get("secrets"), dict) else {}
    secret_values = [str(v) for v in [*raw_secrets.values(), *(secret_overrides or {}).values()] if v is not None]

    _merge_overrides(data, "envs", env_overrides, "--env")
    _merge_overrides(data, "secrets", secret_overrides, "--secret")
    if infra_override:
        _override_infra(data, infra_override)
    unset: list[str] = []
    if not require_values:
        for section in ("envs", "secrets"):
            if isinstance(data.get(section), dict):
                unset += [f"{section}.{k}" for k, v in data[section].items() if v is None]
                data[section] = {k: "" if v is None else v for k, v in data[section].items()}
    try:
        notes: list[tuple[tuple[str, ...], str]] = []
        task = Task.model_validate(data, context={"base_dir": file.absolute().parent, "cwd": Path.cwd(),
                                                  "from_yaml": True, "unset": {u.split(".", 1)[1] for u in unset},
                                                  "notes": notes, "resources_check": resources_check})
    except pydantic.ValidationError as err:
        raise UserError(_redact(_problem_lines(err, source, lines), secret_values)) from None
    task._where = lambda *key: f"{source}:{_line_of(lines, _as_written(lines, key))}"
    task._warnings = [f"{task.where(*key)}: {'.'.join(key)}: {text}" for key, text in notes]
    task._warnings += _warnings(task, unset, task._where)
    return task


def _warnings(task: Task, unset: Iterable[str], where: Callable[..., str]) -> list[str]:
    """One line per field gpuctl reads and does not act on, and per value still to give."""
    out = []
    for name in unset:
        section, key = name.split(".", 1)
        flag = "--env" if section == "envs" else "--secret"
        out.append(f"{where(section, key)}: {name}: no value yet; pass {flag} {key}=VALUE at apply")
    ignored = [((k,), k) for k in task.ignored if not k.startswith("_")]
    ignored += [(("resources", k), k) for k in task.resources.ignored if not k.startswith("_")]
    ignored += [(("resources", k), k) for k in _KEPT_UNUSED if getattr(task.resources, k)]
    if (task.resources.image_id or "").startswith(SKYPILOT_IMAGE_PREFIX):
        ignored.append((("resources", "image_id"), "skypilot_image"))
    config = task.config or {}
    ignored += [(("config", str(k)), "config") for k in config if k not in CONFIG_ACTED_ON]
    for section, acted_on in CONFIG_ACTED_ON.items():  # config.<cloud>.<key>: spec/infra.py
        keys = config[section] if isinstance(config.get(section), dict) else {}
        ignored += [(("config", section, str(k)), "config") for k in keys if k not in acted_on]
    for key, field in ignored:
        out.append(f"{where(*key)}: {'.'.join(key)}: ignored; {_IGNORED_WHY.get(field, 'gpuctl does not act on it')}")
    return out
