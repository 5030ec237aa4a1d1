"""`resources.autostop` and `-i/--down`, as SkyPilot reads them.

SkyPilot's spellings: `true` (5 idle minutes), `false`, a number of minutes, a duration (`10m`,
`2h`, `1d`), or a mapping {idle_minutes, down, wait_for, hook, hook_timeout}. The unit users see
stays minutes; the cluster's watcher (node/autostop.py) acts on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_IDLE_MINUTES = 5  # SkyPilot's `autostop: true` and `sky autostop NAME`
DEFAULT_HOOK_TIMEOUT_S = 3600
WAIT_FOR = ("jobs_and_ssh", "jobs", "none")
_DURATION = re.compile(r"\s*(\d+)\s*([mhdw]?)\s*", re.IGNORECASE)
_MINUTES_PER = {"": 1, "m": 1, "h": 60, "d": 24 * 60, "w": 7 * 24 * 60}
_FIELDS = ("idle_minutes", "down", "wait_for", "hook", "hook_timeout")


class AutostopError(ValueError):
    """What is wrong, and the key below `autostop` it concerns ("" for the value itself)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Autostop:
    """When an idle cluster stops (or, with `down`, removes) itself."""

    idle_minutes: int = DEFAULT_IDLE_MINUTES
    down: bool = False
    wait_for: str = "jobs_and_ssh"
    hook: str | None = None
    hook_timeout: int = DEFAULT_HOOK_TIMEOUT_S

    def describe(self) -> str:
        what = "autodown" if self.down else "autostop"
        waits = {"jobs_and_ssh": "no job and no ssh session", "jobs": "no job", "none": "from now, jobs or not"}
        return f"{what} after {self.idle_minutes} idle minute(s) ({waits[self.wait_for]})"

    def as_dict(self) -> dict[str, Any]:
        return {"idle_minutes": self.idle_minutes, "down": self.down, "wait_for": self.wait_for,
                "hook": self.hook, "hook_timeout": self.hook_timeout}


def idle_minutes(value: Any, key: str = "") -> int:
    """A whole number of minutes, or a duration with m, h, d or w."""
    if isinstance(value, bool):
        raise AutostopError(f"give minutes (10) or a duration (10m, 2h, 1d), not {value}", key)
    if isinstance(value, int):
        if value < 0:
            raise AutostopError("minutes must be 0 or more (to turn autostop off, use false or --cancel)", key)
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _DURATION.fullmatch(value)
        if m:
            return int(m.group(1)) * _MINUTES_PER[m.group(2).lower()]
    raise AutostopError(f"{value!r} is not a number of minutes; write 10, 10m, 2h or 1d", key)


def parse_autostop(value: Any) -> Autostop | None:
    """The task's autostop, None when off; AutostopError saying what to write."""
    if value is None or value is False:
        return None
    if value is True:
        return Autostop()
    if isinstance(value, Autostop):
        return value
    if not isinstance(value, dict):
        return Autostop(idle_minutes=idle_minutes(value))
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise AutostopError(f"unknown key; known: {', '.join(_FIELDS)}", unknown[0])
    setting = Autostop()
    if value.get("idle_minutes") is not None:
        setting = replace(setting, idle_minutes=idle_minutes(value["idle_minutes"], "idle_minutes"))
    if value.get("down") is not None:
        if not isinstance(value["down"], bool):
            raise AutostopError("write true or false", "down")
        setting = replace(setting, down=value["down"])
    if value.get("wait_for") is not None:
        if value["wait_for"] not in WAIT_FOR:
            raise AutostopError(f"{value['wait_for']!r} is not one of {', '.join(WAIT_FOR)}", "wait_for")
        setting = replace(setting, wait_for=value["wait_for"])
    if value.get("hook") is not None:
        if not isinstance(value["hook"], str) or not value["hook"].strip():
            raise AutostopError("give the shell commands to run on the head, as a string", "hook")
        setting = replace(setting, hook=value["hook"])
    if value.get("hook_timeout") is not None:
        timeout = value["hook_timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            raise AutostopError("give whole seconds, 1 or more", "hook_timeout")
        setting = replace(setting, hook_timeout=timeout)
    return setting


def with_flags(task_setting: Autostop | None, idle: int | None, down: bool) -> Autostop | None:
    """`apply -i MIN [--down]` over the task's setting, as `sky launch -i/--down` over the YAML's.
    `--down` alone means: down once the job is done (0 idle minutes) unless the task says when."""
    if idle is None and not down:
        return task_setting
    base = task_setting or Autostop(idle_minutes=0 if idle is None else idle)
    if idle is not None:
        base = replace(base, idle_minutes=idle)
    return replace(base, down=True) if down else base
