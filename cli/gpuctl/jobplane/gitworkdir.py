"""A git `workdir` (`workdir: {url: ..., ref: ...}`): cloned here, synced like a local one.

SkyPilot clones on every node; gpuctl clones once on the controller, which
holds the credentials (GIT_TOKEN for https, GIT_SSH_KEY_PATH or your ssh
agent for ssh), and then copies the checkout like any workdir: nodes need no
git, no route to the git host and no token. Jobs see SkyPilot's variables:
GIT_URL and one of GIT_BRANCH / GIT_TAG / GIT_COMMIT_HASH.

The token never reaches an argv or a URL: it travels to git as an
http.extraHeader through GIT_CONFIG_* environment variables.
"""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuctl.common.errors import UserError

TOKEN_ENV = "GIT_TOKEN"
SSH_KEY_PATH_ENV = "GIT_SSH_KEY_PATH"
CLONE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Checkout:
    path: Path
    envs: Mapping[str, str]  # GIT_URL and GIT_BRANCH | GIT_TAG | GIT_COMMIT_HASH


def git_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment git runs with: no prompts, and the token or key from the user's environment."""
    environ = os.environ if environ is None else environ
    env = {**environ, "GIT_TERMINAL_PROMPT": "0"}
    token = environ.get(TOKEN_ENV)
    if token:
        basic = base64.b64encode(f"{token}:".encode()).decode()
        count = int(env.get("GIT_CONFIG_COUNT", "0") or 0)
        env.update({"GIT_CONFIG_COUNT": str(count + 1), f"GIT_CONFIG_KEY_{count}": "http.extraHeader",
                    f"GIT_CONFIG_VALUE_{count}": f"Authorization: Basic {basic}"})
    key = environ.get(SSH_KEY_PATH_ENV)
    if key:
        env["GIT_SSH_COMMAND"] = f"ssh -i {shlex.quote(os.path.expanduser(key))} -o IdentitiesOnly=yes"
    return env


def _interactive() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _git(args: list[str], env: Mapping[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # When stdin is not a terminal (CI, a pipe, a cron job) nothing may prompt: git then runs in a
    # session of its own, with no controlling terminal to open, and ssh's askpass is off, so an
    # unknown host key or a key's passphrase fails with ssh's message instead of waiting on /dev/tty.
    interactive = _interactive()
    if not interactive:
        env = {**env, "SSH_ASKPASS_REQUIRE": "never"}
    try:
        return subprocess.run(["git", *args], cwd=cwd, env=dict(env), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=CLONE_TIMEOUT_S, start_new_session=not interactive)
    except FileNotFoundError:
        raise UserError("workdir: a git workdir needs git on this machine; install git") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"workdir.url: git did not finish in {CLONE_TIMEOUT_S} s") from None


def shown(url: str) -> str:
    """`url` without a password or token written into it, for messages."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {proc.returncode}"


def _ref_env(repo: Path, ref: str | None, env: Mapping[str, str]) -> dict[str, str]:
    if not ref:
        return {}
    for kind, name in (("tags", "GIT_TAG"), ("remotes/origin", "GIT_BRANCH")):
        if _git(["rev-parse", "--verify", "--quiet", f"refs/{kind}/{ref}"], env, repo).returncode == 0:
            return {name: ref}
    return {"GIT_COMMIT_HASH": ref}


@contextmanager
def checkout(url: str, ref: str | None, *, parent: Path | None = None,
             environ: Mapping[str, str] | None = None) -> Iterator[Checkout]:
    """Clone `url` at `ref` (a branch, tag or commit; default branch when None) into a
    private temporary directory, removed on exit. Raises UserError naming the field."""
    env = git_env(environ)
    tmp = Path(tempfile.mkdtemp(prefix="gpuctl-git-", dir=parent))
    repo = tmp / "workdir"
    try:
        shallow = ["clone", "--quiet", "--depth", "1", *(["--branch", ref] if ref else []), "--", url, str(repo)]
        proc = _git(shallow, env)
        if proc.returncode != 0 and ref:  # a commit: fetch everything, then check it out
            shutil.rmtree(repo, ignore_errors=True)
            proc = _git(["clone", "--quiet", "--no-checkout", "--", url, str(repo)], env)
            if proc.returncode == 0:
                proc = _git(["checkout", "--quiet", "--detach", f"{ref}^{{commit}}", "--"], env, repo)
                if proc.returncode != 0:
                    raise UserError(f"workdir.ref '{ref}': no such branch, tag or commit in {shown(url)}")
        if proc.returncode != 0:
            raise UserError(f"workdir.url '{shown(url)}': git clone failed: {_last_line(proc).replace(url, shown(url))}")
        yield Checkout(path=repo, envs={"GIT_URL": url, **_ref_env(repo, ref, env)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
