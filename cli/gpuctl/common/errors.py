"""Errors users can act on.

Everything a user can fix (bad YAML, a missing file, a type without EFA) is a
`UserError`: the CLI prints its one-line message and exits 2, with no
traceback, before anything is provisioned. Failures of the job itself (a rank
exiting non-zero) are `JobFailed`, which exits 1.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: one clear line naming the field or file and what to do."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClusterNotFound(UserError):
    """No cluster of that name here (nor in the shared state bucket): the one message every
    command and the Python API give for it. `why` follows "not found"; `hint` ends the line."""

    def __init__(self, name: str, *, why: str = "", hint: str = "") -> None:
        super().__init__(f"cluster '{name}' not found{why}; `gpuctl status` lists the clusters you have{hint}")
        self.name = name


class JobFailed(Exception):
    """The job ran but some stage or rank failed; the message names them. `job_id`: the cluster's
    job that failed (None where no job was made yet, or none was being run: a prepare on its own)."""

    exit_code = 1

    def __init__(self, message: str, *, job_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.job_id = job_id


class PrepareFailed(JobFailed):
    """The prepare play failed on some node before the job ran; the message names them."""


class JobCancelled(JobFailed):
    """The user interrupted the job (Ctrl-C, SIGTERM); shell convention 128+SIGINT."""

    exit_code = 130


class JobDetached(Exception):
    """The user stopped following a job (Ctrl-C) that goes on running on its cluster, as SkyPilot's
    Ctrl-C only stops following; the message says how to follow it again and how to cancel it."""

    exit_code = 130

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ProvisionError(Exception):
    """Terraform or the cloud refused; the message carries the tool's reason."""

    exit_code = 1

    def __init__(self, message: str, *, insufficient_capacity: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.insufficient_capacity = insufficient_capacity
