"""gitworkdir: a git `workdir` cloned on the controller, at a branch, tag or commit."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest

from gpuctl.common.errors import UserError
from gpuctl.jobplane import gitworkdir


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
                          ).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """file:// URL of a repo whose main has v1 (tagged) then v2; also returns v1's commit."""
    root = tmp_path_factory.mktemp("repo")
    _git("init", "-q", "-b", "main", cwd=root)
    (root / "VERSION").write_text("v1\n")
    _git("add", "VERSION", cwd=root)
    _git("commit", "-qm", "v1", cwd=root)
    _git("tag", "v1", cwd=root)
    first = _git("rev-parse", "HEAD", cwd=root)
    (root / "VERSION").write_text("v2\n")
    _git("commit", "-qam", "v2", cwd=root)
    _git("branch", "feature", first, cwd=root)
    return f"file://{root}", first


@pytest.mark.parametrize(("ref", "version", "env"), [
    (None, "v2", {}),
    ("main", "v2", {"GIT_BRANCH": "main"}),
    ("feature", "v1", {"GIT_BRANCH": "feature"}),
    ("v1", "v1", {"GIT_TAG": "v1"}),
])
def test_checkout_at_branch_or_tag(repo: tuple[str, str], tmp_path: Path, ref: str | None, version: str,
                                   env: dict[str, str]) -> None:
    url, _ = repo
    with gitworkdir.checkout(url, ref, parent=tmp_path) as clone:
        assert (clone.path / "VERSION").read_text() == f"{version}\n"
        assert clone.envs == {"GIT_URL": url, **env}
        path = clone.path
    assert not path.exists()  # removed once the job's copy is done


def test_checkout_at_a_commit(repo: tuple[str, str], tmp_path: Path) -> None:
    url, first = repo
    with gitworkdir.checkout(url, first, parent=tmp_path) as clone:
        assert (clone.path / "VERSION").read_text() == "v1\n"
        assert clone.envs["GIT_COMMIT_HASH"] == first


def test_unknown_ref_and_unreachable_url_are_one_line(repo: tuple[str, str], tmp_path: Path) -> None:
    url, _ = repo
    with pytest.raises(UserError, match=r"^workdir.ref 'nope': no such branch, tag or commit"):
        with gitworkdir.checkout(url, "nope", parent=tmp_path):
            pass
    with pytest.raises(UserError, match=r"^workdir.url 'file:///nowhere': git clone failed: "):
        with gitworkdir.checkout("file:///nowhere", None, parent=tmp_path):
            pass
    assert list(tmp_path.iterdir()) == []


def test_token_goes_to_git_as_a_header_in_the_environment_never_in_a_url() -> None:
    env = gitworkdir.git_env({"GIT_TOKEN": "s3cr3t", "PATH": "/bin"})
    assert env["GIT_CONFIG_KEY_0"] == "http.extraHeader"
    assert env["GIT_CONFIG_VALUE_0"] == "Authorization: Basic " + base64.b64encode(b"s3cr3t:").decode()
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    assert gitworkdir.shown("https://user:s3cr3t@github.com/org/repo.git") == "https://***@github.com/org/repo.git"


def test_nothing_prompts_when_stdin_is_not_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # git's ssh is a script that records whether it could ask anyone: a controlling terminal to
    # open (where ssh asks for a passphrase or a host key) and ssh's askpass setting
    probe = tmp_path / "fake-ssh"
    seen = tmp_path / "seen"
    probe.write_text(f"#!/bin/sh\nif (exec </dev/tty) 2>/dev/null; then t=tty; else t=no-tty; fi\n"
                     f"echo \"$t askpass=$SSH_ASKPASS_REQUIRE\" > {seen}\nexit 255\n")
    probe.chmod(0o755)
    monkeypatch.setattr(gitworkdir, "_interactive", lambda: False)
    with pytest.raises(UserError, match=r"^workdir.url 'ssh://git.example/x.git': git clone failed"):
        with gitworkdir.checkout("ssh://git.example/x.git", None, parent=tmp_path,
                                 environ={"GIT_SSH_COMMAND": str(probe), "PATH": "/usr/bin:/bin"}):
            pass
    assert seen.read_text().strip() == "no-tty askpass=never"
