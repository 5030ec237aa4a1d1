"""The workdir copy's filter (jobplane/gitignore.py) against git itself: the same trees and ignore
files, what real rsync copies with our rules must be what `git ls-files` calls not ignored."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from gpuctl.jobplane import gitignore, payload, upload
from gpuctl.jobplane.gitignore import WorkdirFilter

# Each case: {path: text} (files named .gitignore are ignore files; others get their own name as text).
CASES: list[dict[str, str]] = [
    # the audit's: a `**` in the middle, trailing spaces, an escaped '#', a negation
    {".gitignore": "deep/**/creds.json\n", "deep/creds.json": "", "deep/a/creds.json": "", "deep/a/b/c/creds.json": "",
     "other/creds.json": "", "deep/creds.jsonx": ""},
    {".gitignore": "secret.txt   \nspaced\\ \n", "secret.txt": "", "secret.txt   ": "", "spaced ": "", "spaced": ""},
    {".gitignore": "\\#notes\n#comment\n\\!bang\n", "#notes": "", "comment": "", "#comment": "", "!bang": "",
     "bang": ""},
    {".gitignore": "*.log\n!keep.log\n", "a.log": "", "keep.log": "", "sub/b.log": "", "sub/keep.log": ""},
    # negation cannot re-include a file of an excluded directory, but can under `dir/*`
    {".gitignore": "build/\n!build/keep.txt\nout/*\n!out/keep.txt\n", "build/keep.txt": "", "build/x": "",
     "out/keep.txt": "", "out/x": "", "out/sub/keep.txt": ""},
    # anchoring: a slash at the front or in the middle anchors, a trailing one means directories only
    {".gitignore": "/top.txt\na/b\nlogs/\n", "top.txt": "", "sub/top.txt": "", "a/b": "", "x/a/b": "",
     "logs/1": "", "sub/logs/2": "", "file/logs": ""},
    # nested ignore files: the deeper one wins, and its patterns are relative to its directory
    {".gitignore": "*.tmp\n", "sub/.gitignore": "!keep.tmp\n/local\n", "a.tmp": "", "keep.tmp": "",
     "sub/keep.tmp": "", "sub/x.tmp": "", "sub/local": "", "sub/deeper/local": "", "local": ""},
    {".gitignore": "**/cache\nfoo/**\n**/bar/**/baz\n", "cache": "", "a/b/cache": "", "foo/x": "", "foo/y/z": "",
     "bar/baz": "", "bar/q/r/baz": "", "x/bar/baz": "", "foobar": ""},
    {".gitignore": "a*b\n?.c\n[ab].d\n[!x].e\ndata[0-9]\nq**z\n", "ab": "", "axyb": "", "a.c": "", "ab.c": "",
     "a.d": "", "c.d": "", "x.e": "", "y.e": "", "data5": "", "datax": "", "qz": "", "qwz": ""},
    {"sub dir/.gitignore": "*.bin\n", "sub dir/x.bin": "", "sub dir/y.txt": "", "x.bin": "",
     "we*ird/.gitignore": "k\n", "we*ird/k": "", "weXird/k": ""},
    {".gitignore": "/*\n!/keep/\n!/top.txt\n", "keep/a": "", "top.txt": "", "gone.txt": "", "dir/x": ""},
    {".gitignore": "!\n/\n\\\nname\\\n*.py[co]\nnul\0x\n", "a.pyc": "", "a.py": "", "name": "", "nul": ""},
    # no wildcard crosses a '/' in a path pattern
    {".gitignore": "d/a[!x]b\ne/a?b\nf/a*b\n", "d/a/b": "", "d/ayb": "", "e/a/b": "", "f/a/b": "", "f/ab": ""},
]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if rel.endswith(".gitignore") else rel)


def _git_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": str(home / "gitconfig"), "XDG_CONFIG_HOME": str(home / "xdg")}


def _git(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["git", *args], env=env, check=True, capture_output=True, text=True).stdout


def git_kept(root: Path, home: Path, init: bool = True) -> set[str]:
    """The files git does not ignore (tracked or not) in `root`, a directory of a work tree (made one)."""
    env = _git_env(home)
    if init:
        _git(env, "init", "-q", str(root))
    out = _git(env, "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return {p for p in out.split("\0") if p}


def copied(args: list[str], src: Path, dst: Path, stdin: bytes | None = None) -> set[str]:
    """The files that real rsync with these options leaves in `dst`."""
    subprocess.run(["rsync", "--archive", *args, f"{src}/", f"{dst}/"], input=stdin or b"", check=True)
    return {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()}


def _compare(tmp_path: Path, files: dict[str, str]) -> None:
    plain, repo = tmp_path / "plain", tmp_path / "repo"
    _write(plain, files)
    _write(repo, files)
    rules = gitignore.workdir_filter(plain)  # not a git work tree: our translation alone
    assert not rules.ignored
    got = copied(payload.workdir_rsync_args(rules), plain, tmp_path / "dst")
    assert got == git_kept(repo, tmp_path), rules.rules


@pytest.mark.parametrize("files", CASES, ids=[str(i) for i in range(len(CASES))])
def test_outside_git_the_copy_keeps_what_git_keeps(tmp_path: Path, files: dict[str, str]) -> None:
    _compare(tmp_path, files)


_NAMES = ["a", "b", "ab", "x.log", "keep.log", "d e", "#h", "!n", "c*", "q?", "[x]", "\\s", "tr "]
_PATTERNS = ["a", "/a", "a/", "*.log", "!keep.log", "!*.log", "**/b", "a/**", "a/**/b", "*/b", "b/*", "\\#h",
             "\\!n", "d\\ e", "d e ", "c\\*", "q\\?", "[ab]", "!a/", "/*/x.log", "**", "!**/", "a/*/", "!d e",
             "a?", "a[!x]b", "*/*", "/a/*/b", "***", "a/***", "**/a/**", "a**", "[a-c]*", "\\[x]", "\\\\s",
             "tr\\ ", "tr ", "!/a", "/**", "a/**/**/b", "*.log/", "!*/", "b/**/"]


def test_outside_git_random_trees_and_patterns_match_git(tmp_path: Path) -> None:
    rng = random.Random(20)  # 700 such cases agreed with git when this was written; 30 stay in the suite
    for case in range(30):
        files: dict[str, str] = {}
        for _ in range(rng.randint(3, 12)):
            depth = rng.randint(1, 4)
            files["/".join(rng.choice(_NAMES) for _ in range(depth))] = ""
        for where in ("", "a/", "b/a/"):
            if rng.random() < (1 if not where else 0.4):
                lines = [rng.choice(_PATTERNS) for _ in range(rng.randint(1, 5))]
                files[where + ".gitignore"] = "\n".join(lines) + "\n"
        # a file where a directory of the same name is wanted: keep the directory
        names = sorted(files, key=lambda p: -p.count("/"))
        tree: dict[str, str] = {}
        for name in names:
            if not any(other.startswith(name + "/") for other in tree):
                tree[name] = files[name]
        _compare(tmp_path / str(case), tree)


def test_in_a_git_tree_git_decides_with_info_exclude_excludes_file_and_parents(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """The workdir is a subdirectory of a repository: the repository's .gitignore above it,
    .git/info/exclude and core.excludesFile apply, and a file git tracks stays although ignored."""
    home = tmp_path / "home"
    home.mkdir()
    env = _git_env(home)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (home / "global-ignore").write_text("*.global\n")
    _git(env, "config", "--global", "core.excludesFile", str(home / "global-ignore"))
    repo = tmp_path / "repo"
    _write(repo, {".gitignore": "project/creds/\n*.parent\n", "project/.gitignore": "deep/**/creds.json\n*.log\n",
                  "project/deep/x/creds.json": "", "project/creds/key": "", "project/a.parent": "",
                  "project/a.global": "", "project/b.info": "", "project/forced.log": "", "project/other.log": "",
                  "project/train.py": "", "project/sub/.gitignore": "!other.log\n", "project/sub/other.log": "",
                  "project/build/tracked.txt": "", "project/build/junk": "", "project/.gitignore.extra": "",
                  "project/cache/.gitignore": "*\n", "project/cache/c": "",
                  "project/self/.gitignore": "*.o\n.gitignore\n", "project/self/x.o": "", "project/self/y.c": ""})
    (repo / "project/.gitignore").write_text("deep/**/creds.json\n*.log\nbuild/\n*.extra\n")
    _git(env, "init", "-q", str(repo))
    (repo / ".git/info/exclude").write_text("*.info\n")
    _git(env, "-C", str(repo), "add", "-f", "project/forced.log", "project/build/tracked.txt")
    # Variables that would point git elsewhere are not followed.
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "nowhere"))
    workdir = repo / "project"
    rules = gitignore.workdir_filter(workdir)
    assert rules.ignored
    args, stdin = upload.workdir_args(rules)
    got = copied(list(args), workdir, tmp_path / "dst", stdin)
    monkeypatch.delenv("GIT_DIR")
    want = git_kept(workdir, home, init=False)
    assert got == want == {".gitignore", "forced.log", "train.py", "sub/.gitignore", "sub/other.log",
                           "build/tracked.txt", "self/y.c"}
    # ignore files git ignores still count: what a job makes there on a node is kept
    assert {"- /cache/*", "- /self/*.o"} <= set(rules.rules)
    # The next hop (the head's copy to the workers) has only the rules: the same files arrive.
    again = copied(payload.workdir_rsync_args(rules), tmp_path / "dst", tmp_path / "dst2")
    assert again == want
    # The rules alone, straight from the workdir, agree with git but for what git tracks inside an
    # ignored directory: rsync then enters the directory (the controller's hop has git's own list).
    alone = copied(payload.workdir_rsync_args(rules), workdir, tmp_path / "dst3")
    assert alone == want | {"build/junk"}


def test_a_copy_again_deletes_what_is_gone_and_keeps_what_the_node_made_in_ignored_places(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write(src, {".gitignore": "outputs/\n*.ckpt\n!final.ckpt\n", "train.py": "", "old.py": "", "final.ckpt": "",
                 "data/.keep": ""})
    args = payload.workdir_rsync_args(gitignore.workdir_filter(src, gitignore.nested_destinations(
        ["~/gpuctl_workdir/data", "/root/gpuctl_workdir/models/", "~/gpuctl_workdir/conf.yaml",
         "~/gpuctl_workdir/cfg/deep/a.txt"])))
    copied(args, src, dst)
    (src / "old.py").unlink()
    (src / "final.ckpt").unlink()
    _write(dst, {"outputs/run1/log": "", "step1.ckpt": "", "data/from-mount": "", "models/m.bin": "",
                 "conf.yaml": "", "stray.txt": "", "cfg/deep/a.txt": ""})
    proc = subprocess.run(["rsync", "--archive", *args, f"{src}/", f"{dst}/"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    got = {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()}
    assert got == {".gitignore", "train.py", "outputs/run1/log", "step1.ckpt", "data/from-mount",
                   "models/m.bin", "conf.yaml", "cfg/deep/a.txt"}
    assert not (dst / "data/.keep").exists()  # a mount's destination is the mount's: nothing written there


@pytest.mark.parametrize(("dests", "want"), [
    (["~/gpuctl_workdir/data"], ["data"]),
    (["~/gpuctl_workdir/data/", "~/gpuctl_workdir//a/./b/../c"], ["data", "a/c"]),
    (["/root/gpuctl_workdir/x", "/home/u/gpuctl_workdir/y/z.txt"], ["x", "y/z.txt"]),
    (["~/gpuctl_workdir", "~/gpuctl_workdir/", "/data", "~/other/gpuctl_workdir", "~/gpuctl_workdir/../x"], []),
    (["~/gpuctl_workdir/we*ird [1]"], ["we*ird [1]"]),
    (["~root/gpuctl_workdir/q", "~/x/gpuctl_workdir/y"], ["q"]),
])
def test_nested_destinations(dests: list[str], want: list[str]) -> None:
    assert gitignore.nested_destinations(dests) == want


def test_rules_escape_names_that_look_like_patterns(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write(src, {"we*ird [1]/a": "", "weXird 1/a": "", "plain": ""})
    args = payload.workdir_rsync_args(gitignore.workdir_filter(src, ["we*ird [1]"]))
    assert copied(args, src, tmp_path / "dst") == {"weXird 1/a", "plain"}


def test_workdir_filter_without_git_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "src", {".gitignore": "*.key\n", "a.key": "", "b": ""})
    (tmp_path / "src/.git/info").mkdir(parents=True)
    (tmp_path / "src/.git/info/exclude").write_text("*.x\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gitignore.workdir_filter(tmp_path / "src") == WorkdirFilter(
        rules=("- /*.key", "- /**/*.key", "- /*.x", "- /**/*.x"))


def test_exec_leaves_alone_what_an_earlier_apply_mounted_inside_the_workdir(tmp_path: Path) -> None:
    """`exec` has no file_mounts of its own: the workdir copy still leaves out the destinations
    inside the workdir that an earlier job of the cluster placed there (file_mounts and buckets)."""
    from gpuctl.common.console import Reporter
    from gpuctl.provision.inventory import Inventory, Node
    from gpuctl.spec.buckets import BucketMount
    from gpuctl.jobplane.runner import JobRunner, JobSpec
    from gpuctl.state.registry import Registry

    def runner() -> JobRunner:
        node = Node(name="head", rank=0, node_id="n0", address="10.0.0.2", ssh_host="10.0.0.2")
        made = JobRunner(Inventory(cluster="c", cloud="local", nodes=(node,)), reporter=Reporter(plain=True),
                         registry=Registry())
        made.cdir.mkdir(parents=True, exist_ok=True)
        return made

    workdir = tmp_path / "wd"
    workdir.mkdir()
    apply = JobSpec(name=None, run="true", workdir=workdir,
                    file_mounts={"~/gpuctl_workdir/data": workdir, "/etc/x": workdir, "~/.gpuctl/calls/a": workdir},
                    bucket_mounts=(BucketMount(dest="/root/gpuctl_workdir/ckpt", bucket="b", mode="COPY"),))
    first = runner()
    first.record_placed([*apply.file_mounts, *(b.dest for b in apply.bucket_mounts)])
    assert first.placed() == ["~/gpuctl_workdir/data", "/root/gpuctl_workdir/ckpt"]  # only what the copy meets
    exec_spec = JobSpec(name=None, run="true", workdir=workdir)
    rules = runner().workdir_rules(exec_spec)  # a later command: what the earlier one recorded
    assert rules.rules[:2] == ("- /data", "- /ckpt")
    assert runner().workdir_rules(JobSpec(name=None, run="true")) == WorkdirFilter()  # no workdir: no copy
