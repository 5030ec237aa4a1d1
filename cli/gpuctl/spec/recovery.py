"""`resources.job_recovery` (alias `spot_recovery`), as SkyPilot reads it, for `gpuctl jobs launch`.

SkyPilot's spellings: a strategy name (`FAILOVER`, `EAGER_NEXT_REGION`), `none`, or a mapping
{strategy, max_restarts_on_errors, recover_on_exit_codes}. Their meaning is SkyPilot's: a lost or
preempted node is always recovered; a rank that exits non-zero restarts the job at most
`max_restarts_on_errors` times; an exit code listed in `recover_on_exit_codes` restarts it every
time and is not counted. gpuctl replaces only the lost nodes under either strategy; the strategy
decides where a whole new cluster goes when capacity runs out (FAILOVER: the same zone first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STRATEGIES = ("EAGER_NEXT_REGION", "FAILOVER")
_FIELDS = ("strategy", "max_restarts_on_errors", "recover_on_exit_codes")


class RecoveryError(ValueError):
    """What is wrong, and the key below `job_recovery` it concerns ("" for the value itself)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class JobRecovery:
    """How a managed job recovers; the default is SkyPilot's (EAGER_NEXT_REGION, no restarts on errors)."""

    strategy: str = "EAGER_NEXT_REGION"
    max_restarts_on_errors: int = 0
    recover_on_exit_codes: tuple[int, ...] = ()

    def describe(self) -> str:
        codes = f", always on exit codes {', '.join(map(str, self.recover_on_exit_codes))}" \
            if self.recover_on_exit_codes else ""
        return f"{self.strategy}, {self.max_restarts_on_errors} restart(s) on errors{codes}"

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "max_restarts_on_errors": self.max_restarts_on_errors,
                "recover_on_exit_codes": list(self.recover_on_exit_codes)}


def _strategy(value: Any) -> str:
    if not isinstance(value, str) or value.upper() not in STRATEGIES:
        raise RecoveryError(f"{value!r} is not a strategy; write {' or '.join(STRATEGIES)}", "strategy")
    return value.upper()


def _exit_codes(value: Any) -> tuple[int, ...]:
    codes = list(value) if isinstance(value, (list, tuple)) else [value]
    for code in codes:
        if isinstance(code, bool) or not isinstance(code, int) or not 0 < code < 256:
            raise RecoveryError(f"{code!r} is not an exit code; give whole numbers from 1 to 255",
                                "recover_on_exit_codes")
    return tuple(dict.fromkeys(codes))


def parse_job_recovery(value: Any) -> JobRecovery | None:
    """The task's recovery setting (None when not written); RecoveryError saying what to write."""
    if value is None:
        return None
    if isinstance(value, JobRecovery):
        return value
    if isinstance(value, str):
        return JobRecovery() if value.lower() == "none" else JobRecovery(strategy=_strategy(value))
    if not isinstance(value, dict):
        raise RecoveryError("write a strategy name or a mapping {strategy, max_restarts_on_errors, "
                            "recover_on_exit_codes}")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise RecoveryError(f"unknown key; known: {', '.join(_FIELDS)}", unknown[0])
    restarts = value.get("max_restarts_on_errors")
    if restarts is None:
        restarts = 0
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise RecoveryError("give a whole number, 0 or more", "max_restarts_on_errors")
    codes = value.get("recover_on_exit_codes")
    strategy = value.get("strategy")
    return JobRecovery(strategy=_strategy(strategy) if strategy is not None else JobRecovery.strategy,
                       max_restarts_on_errors=restarts,
                       recover_on_exit_codes=_exit_codes(codes) if codes is not None else ())
