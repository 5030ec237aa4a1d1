"""`--env K=V` and `--secret K` from the command line (no pydantic: `exec` imports this fast)."""

from __future__ import annotations

import os
import re
from typing import Iterable, Mapping

from gpuctl.common.errors import UserError

ENV_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ENV_NAME_RULE = "use letters, digits and '_', not starting with a digit"


def parse_env_assignments(
    items: Iterable[str], *, flag: str = "--env", secret: bool = False, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The CLI's repeated `--env K=V` (later ones win). A bare `--env K` takes K's
    value from the current environment, as SkyPilot does. With `secret=True`
    (for `--secret`) a malformed item is named by its position, never quoted,
    since it may be the secret itself."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for position, item in enumerate(items, start=1):
        name, sep, value = item.partition("=")
        label = f"{flag} #{position}" if secret else f"{flag} {item}"
        if not name:
            raise UserError(f"{label}: missing NAME before '='; write {flag} NAME=VALUE")
        if not ENV_NAME_RE.fullmatch(name):
            raise UserError(f"{label}: not NAME=VALUE with a valid NAME; {_ENV_NAME_RULE}")
        if not sep:
            if name not in env:
                raise UserError(f"{flag} {name}: {name} is not set in your environment; write {flag} {name}=VALUE")
            value = env[name]
        out[name] = value
    return out
