"""What an attempt's end means for a managed job: finish, restart the ranks, or recover nodes.

Pure functions over what the supervisor learned, so each rule is tested on its own:

- an attempt whose every rank exited 0 ends the job, whatever happens to the nodes afterwards
  (ranks that checkpoint on a spot notice's SIGTERM should exit non-zero, as 143);
- lost nodes (the cloud says gone, a spot notice, a node that never answered within the grace)
  are always recovered, as SkyPilot does; only those nodes are replaced;
- ranks lost while every node is there again (a network blip, a killed agent) restart the job on
  the same nodes, from a budget of their own, so a flaky network cannot loop for ever;
- a rank's non-zero exit restarts the job when its code is in `recover_on_exit_codes` (not
  counted), or while `max_restarts_on_errors` allows; otherwise the job ends FAILED (or
  FAILED_SETUP when setup failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from gpuctl.spec.recovery import JobRecovery

DEFAULT_TRANSIENT_BUDGET = 3


@dataclass(frozen=True)
class AttemptEnd:
    """What the supervisor knows once an attempt ended (or was stopped)."""

    status: str  # the cluster job's: SUCCEEDED, FAILED, FAILED_SETUP, CANCELLED, or ABORTED (stopped by us)
    codes: Mapping[int, int | None] = field(default_factory=dict)  # rank -> exit code (None: lost)
    first_failed: int | None = None
    lost: Mapping[int, str] = field(default_factory=dict)  # rank -> why the node is gone
    unreachable: tuple[int, ...] = ()  # nodes that did not answer but were not declared lost


@dataclass(frozen=True)
class Decision:
    action: str  # "finish", "restart" (same nodes), "recover" (replace `replace`, then restart)
    status: str | None = None  # the final state when finishing
    kind: str = ""  # the event's kind: recovery, transient, restart
    cause: str = ""
    replace: tuple[int, ...] = ()
    counted: bool = False  # a restart counted against max_restarts_on_errors
    exit_code: int | None = None
    failed_rank: int | None = None


def decide(end: AttemptEnd, recovery: JobRecovery, *, restarts_so_far: int, transient_so_far: int,
           transient_budget: int = DEFAULT_TRANSIENT_BUDGET) -> Decision:
    if end.status == "SUCCEEDED":  # every rank exited 0: done, whatever happens to the nodes now
        return Decision("finish", status="SUCCEEDED")
    if end.lost:
        ranks = tuple(sorted(end.lost))
        cause = "; ".join(f"rank {r} lost ({end.lost[r]})" for r in ranks)
        return Decision("recover", kind="recovery", cause=cause, replace=ranks)
    if end.status == "CANCELLED":
        return Decision("finish", status="CANCELLED", cause="cancelled on the cluster")
    failed = {r: c for r, c in end.codes.items() if c not in (0, None)}
    # fail-fast stops the other ranks once one is lost: the first to fail says what happened
    lost_first = end.first_failed is not None and end.first_failed in end.codes \
        and end.codes[end.first_failed] is None
    if end.status == "ABORTED" or lost_first or not failed:
        # ranks lost, yet every node is there: not the user's code
        if transient_so_far >= transient_budget:
            return Decision("finish", status="FAILED", cause=f"ranks lost {transient_so_far + 1} times while "
                            f"every node was up; the budget for such recoveries is {transient_budget}")
        return Decision("restart", kind="transient", cause="ranks lost while every node stayed up")
    rank = end.first_failed if end.first_failed in failed else min(failed)
    code = failed[rank]
    stage = "setup" if end.status == "FAILED_SETUP" else "run"
    what = f"rank {rank} exited with code {code} in {stage}"
    if code in recovery.recover_on_exit_codes:
        return Decision("restart", kind="restart", cause=f"{what} (in recover_on_exit_codes)", exit_code=code,
                        failed_rank=rank)
    if restarts_so_far < recovery.max_restarts_on_errors:
        return Decision("restart", kind="restart", cause=f"{what} (restart {restarts_so_far + 1} of "
                        f"{recovery.max_restarts_on_errors})", counted=True, exit_code=code, failed_rank=rank)
    final = "FAILED_SETUP" if end.status == "FAILED_SETUP" else "FAILED"
    return Decision("finish", status=final, cause=what, exit_code=code, failed_rank=rank)
