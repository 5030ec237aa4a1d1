"""A Terraform provider served by one process for many terraform commands (its debug mode).

Terraform starts a provider process of its own for each step of a command (the schema,
validate, plan, apply: four for one `terraform apply`), and hashicorp/aws is a 700 MB binary
that builds its schemas again in each. `serving(binary, env)` starts the provider once with
`-debug` and yields the TF_REATTACH_PROVIDERS value with which terraform uses that process
instead. It is the same provider speaking the same protocol; only who starts it changes.

Two things follow from one process serving many commands:
- the provider reads its environment (AWS credentials, shared config files) when it is
  configured, so it gets the environment terraform would have given it (`env`);
- it holds one configuration at a time: commands that configure it (plan, apply) must
  not overlap, while commands that never configure it (validate, mocked `terraform test`) can.

Its garbage collector runs less often than Go's default (GOGC below, unless `env` sets one).
"""

from __future__ import annotations

import ctypes
import queue
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping


# Go's garbage collector for terraform and the provider in tests: terraform decodes the provider's
# 13 MB schema in every command, and the provider builds it, keeping little of what it allocates; at
# the default (100) a plan against moto costs a quarter more CPU than at 400, which costs each
# process ~200 MB more.
GOGC = "400"


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a killed test worker leaves no provider behind."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


@contextmanager
def serving(binary: Path, env: Mapping[str, str], timeout: float = 120) -> Iterator[str]:
    """Run the provider `binary` in debug mode with `env`; yield its TF_REATTACH_PROVIDERS value."""
    proc = subprocess.Popen([str(binary), "-debug"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env={"GOGC": GOGC, **env}, preexec_fn=_die_with_parent)
    try:
        lines: queue.Queue[str] = queue.Queue()  # read all along: its logs must never fill the pipe
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
        reattach, deadline = None, time.monotonic() + timeout
        while reattach is None:  # it prints the setting once it listens
            try:
                found = re.search(r"TF_REATTACH_PROVIDERS='([^']+)'", lines.get(timeout=1))
            except queue.Empty:
                if proc.poll() is None and time.monotonic() < deadline:
                    continue
                raise RuntimeError(f"{binary} -debug printed no TF_REATTACH_PROVIDERS (exit code "
                                   f"{proc.poll()}, waited up to {timeout:.0f}s)") from None
            reattach = found[1] if found else None
        yield reattach
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def installed_binary(workdir: Path, source: str = "hashicorp/aws") -> Path:
    """The provider binary `terraform init` installed in `workdir` (what its commands would start)."""
    # (a path pattern: init may link the version directory to a mirror or cache, which rglob would not enter)
    namespace, name = source.split("/")
    return next((workdir / ".terraform" / "providers").glob(
        f"registry.terraform.io/{namespace}/{name}/*/*/terraform-provider-{name}_*"))
