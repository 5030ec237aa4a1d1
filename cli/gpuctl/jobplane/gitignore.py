"""Which workdir files the copy leaves out, with git's rules, as rsync filter rules (pure but for git and the walk).

rsync's own `dir-merge .gitignore` is not git's rule set (`**`, trailing
spaces, `\\#`, `!negations` and anchoring all differ), so the controller
decides, and every hop gets the same answer:

- `rules`: each .gitignore line (nested files, and in a git work tree also
  `.git/info/exclude`, core.excludesFile and the .gitignore files above the
  workdir) translated into anchored rsync rules in git's precedence (deeper
  files first, later lines first, `!` as `+`). They go with the payload to
  the head's pushes too, and being patterns they also protect, on every
  receiver, what a job wrote into an ignored place from `--delete`.
- `ignored`: in a git work tree, the paths git itself reports ignored
  (`git ls-files --others --ignored --exclude-standard --directory`), as
  anchored excludes for the controller's own hop: what leaves this machine
  never depends on the translation. Files git tracks although a rule matches
  them are copied (`+` rules), as git would keep them.
- `protect`: file_mount and bucket destinations inside the workdir: the
  workdir copy neither writes nor deletes there (another mount owns it).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

WORKDIR_NAME = "gpuctl_workdir"
# Variables that would point git at another repository or index than the workdir's own.
_GIT_LOCATION_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
                     "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_IMPLICIT_WORK_TREE", "GIT_PREFIX", "GIT_NAMESPACE")
GIT_TIMEOUT_S = 120
_WILDCARDS = "*?["


@dataclass(frozen=True)
class Pattern:
    body: str  # wildmatch syntax, without the `!` and the trailing `/`
    negative: bool
    dir_only: bool
    anchored: bool  # a `/` before the end: matched against the path from the file's directory


@dataclass(frozen=True)
class WorkdirFilter:
    rules: tuple[str, ...] = ()  # rsync filter rules ("- /x", "+ /y") for every hop
    ignored: tuple[str, ...] = ()  # exact anchored excludes from git, for the controller's hop

    def rsync_args(self) -> list[str]:
        return [f"--filter={r}" for r in self.rules]


# -- parsing: git's dir.c (add_patterns_from_buffer, trim_trailing_spaces, parse_path_pattern) ----------------

def _trim_trailing_spaces(line: str) -> str:
    last_space = None
    i = 0
    while i < len(line):
        c = line[i]
        if c == " ":
            if last_space is None:
                last_space = i
        elif c == "\\":
            i += 1
            if i >= len(line):
                return line
            last_space = None
        else:
            last_space = None
        i += 1
    return line if last_space is None else line[:last_space]


def parse(text: str) -> list[Pattern]:
    """The patterns of one ignore file, in file order (comments, blanks and invalid lines left out)."""
    out = []
    if text.startswith("\ufeff"):
        text = text[1:]
    for raw in text.split("\n"):
        if raw.endswith("\r"):
            raw = raw[:-1]
        raw = raw.split("\0", 1)[0]  # git reads each line as a C string
        if not raw or raw.startswith("#"):
            continue
        line = _trim_trailing_spaces(raw)
        negative = line.startswith("!")
        if negative:
            line = line[1:]
        dir_only = line.endswith("/")
        if dir_only:
            line = line[:-1]
        if not line or _ends_in_lone_backslash(line):
            continue  # matches nothing in git
        anchored = "/" in line
        if line.startswith("/"):
            line = line[1:]
        out.append(Pattern(line, negative, dir_only, anchored))
    return out


def _ends_in_lone_backslash(body: str) -> bool:
    i = 0
    while i < len(body):
        if body[i] == "\\":
            if i + 1 >= len(body):
                return True
            i += 1
        i += 1
    return False


# -- translation to rsync -----------------------------------------------------------------------------------

def _tokens(body: str) -> list[str]:
    """Split wildmatch syntax into tokens: '\\x' escapes, '[...]' classes, runs of '*', single characters."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            out.append(body[i:i + 2])
            i += 2
        elif c == "[":
            j = i + 1
            if j < len(body) and body[j] in "!^":
                j += 1
            if j < len(body) and body[j] == "]":
                j += 1
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            out.append(body[i:j + 1])
            i = j + 1
        elif c == "*":
            j = i
            while j < len(body) and body[j] == "*":
                j += 1
            out.append(body[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return out


def _segments(body: str) -> list[list[str]]:
    """Tokens split at unescaped '/', one list per path component."""
    segs: list[list[str]] = [[]]
    for tok in _tokens(body):
        if tok == "/":
            segs.append([])
        else:
            segs[-1].append(tok)
    return segs


def _star(tok: str) -> bool:
    return tok.startswith("*")


def _rsync_component(toks: Sequence[str]) -> str:
    """One component: any run of '*' that is not a whole component is git's '*' (rsync's '**' crosses '/')."""
    return "".join("*" if _star(t) else t for t in toks)


def escape(path: str) -> str:
    """`path` as a literal rsync pattern: wildcards and backslashes escaped where rsync would read them."""
    if not any(c in path for c in _WILDCARDS):
        return path
    return "".join("\\" + c if c in _WILDCARDS + "\\" else c for c in path)


def _wm_escape(name: str) -> str:
    return "".join("\\" + c if c in _WILDCARDS + "\\" else c for c in name)


def _finish(pattern: str) -> str:
    """rsync reads backslashes as escapes only in a pattern with a wildcard: unescape the others."""
    if any(c in pattern for c in _WILDCARDS):
        return pattern
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            i += 1
        out.append(pattern[i])
        i += 1
    return "".join(out)


def _variants(segs: Sequence[Sequence[str]]) -> list[str]:
    """The rsync spellings of a path pattern: a whole-component '**' matches zero or more directories
    in git, one or more in rsync, so each one in the middle or front is also tried as nothing."""
    results = [""]
    last = len(segs) - 1
    for k, seg in enumerate(segs):
        doublestar = len(seg) == 1 and seg[0].startswith("**")
        if doublestar and k < last:
            results = [r + "**/" for r in results] + results
        elif doublestar:
            results = [r + "**" for r in results]
        else:
            results = [r + _rsync_component(seg) + ("/" if k < last else "") for r in results]
    return results


def rsync_rules(pat: Pattern, base: str = "") -> list[str]:
    """The rsync rules (first match wins) for one git pattern read from the ignore file of directory
    `base` (relative to the workdir, "" for the workdir itself)."""
    prefix = "/" + "".join(_wm_escape(part) + "/" for part in base.split("/") if part)
    if pat.anchored:
        bodies = _variants(_segments(pat.body))
    else:
        name = _rsync_component(_tokens(pat.body))
        bodies = [name, "**/" + name]
    sign = "+ " if pat.negative else "- "
    tail = "/" if pat.dir_only else ""
    return [sign + _finish(prefix + b + tail) for b in bodies]


def _relative_to_workdir(pat: Pattern, below: Sequence[str]) -> Pattern | None:
    """A pattern of an ignore file in a directory above the workdir (`below`: the components from that
    directory down to the workdir), as seen from the workdir; None when it cannot match inside it."""
    if not pat.anchored:
        return pat
    segs = _segments(pat.body)
    for i, name in enumerate(below):
        if i >= len(segs):
            return None
        seg = segs[i]
        if len(seg) == 1 and seg[0].startswith("**"):
            # `**` may take any number of the components above: keep it (wider, never narrower)
            return Pattern("/".join("".join(s) for s in segs[i:]), pat.negative, pat.dir_only, True)
        if not fnmatch.fnmatchcase(name, _rsync_component(seg).replace("\\", "")):
            return None
    rest = segs[len(below):]
    if not rest:
        return None  # the pattern names the workdir itself or a directory above it
    return Pattern("/".join("".join(s) for s in rest), pat.negative, pat.dir_only, True)


def rules_for(files: Iterable[tuple[str, str]], outer: Iterable[tuple[Sequence[str], str]] = ()) -> list[str]:
    """All rules in git's precedence. `files`: (directory relative to the workdir, text) of each
    .gitignore inside it; `outer`: (components from its directory down to the workdir, text) of each
    ignore file above it, most specific first (parent .gitignore files, then info/exclude, then
    core.excludesFile)."""
    out: list[str] = []
    for base, text in sorted(files, key=lambda f: -len([p for p in f[0].split("/") if p])):
        for pat in reversed(parse(text)):
            out += rsync_rules(pat, base)
    for below, text in outer:
        for pat in reversed(parse(text)):
            seen = _relative_to_workdir(pat, below)
            if seen is not None:
                out += rsync_rules(seen)
    return out


# -- the workdir ----------------------------------------------------------------------------------------------

def git_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The user's environment without what would point git at another repository, and no prompts."""
    env = dict(os.environ if environ is None else environ)
    for name in _GIT_LOCATION_ENV:
        env.pop(name, None)
    env["GIT_TERMINAL_PROMPT"] = "0"
    return env


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    # core.fsmonitor off: reading the index must not start a program a repository's config names
    try:
        return subprocess.run(["git", "-c", "core.fsmonitor=false", "-C", str(root), *args], env=git_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=GIT_TIMEOUT_S)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None


def _lines0(proc: subprocess.CompletedProcess[bytes]) -> list[str]:
    return [os.fsdecode(p) for p in proc.stdout.split(b"\0") if p]


def _read(path: Path) -> str:
    try:
        if path.is_symlink():  # git (>= 2.32) does not follow a symlinked .gitignore
            return ""
        return path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError:
        return ""


def _walk_gitignores(root: Path) -> list[str]:
    """The .gitignore files under `root` (relative), outside any .git directory."""
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        if ".gitignore" in files:
            found.append(os.path.relpath(os.path.join(top, ".gitignore"), root))
    return found


def _git_tree(root: Path) -> WorkdirFilter | None:
    """The filter from git itself when `root` is in a git work tree; None otherwise (or without git)."""
    probe = _git(root, "rev-parse", "--is-inside-work-tree", "--show-prefix", "--git-path", "info/exclude")
    if probe is None or probe.returncode != 0:
        return None
    out = probe.stdout.decode("utf-8", "surrogateescape").split("\n")
    if len(out) < 3 or out[0].strip() != "true":
        return None
    prefix, info_exclude = out[1], out[2]
    ignored = _git(root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    tracked_ignored = _git(root, "ls-files", "-z", "--cached", "--ignored", "--exclude-standard")
    # Not ignored ones (cheap: git does not enter ignored directories); ignored ones: below
    gitignores = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                      ":(glob)**/.gitignore")
    excludes_file = _git(root, "config", "--path", "core.excludesFile")
    if any(p is None or p.returncode != 0 for p in (ignored, tracked_ignored, gitignores)):
        return None
    assert ignored is not None and tracked_ignored is not None and gitignores is not None
    listed = _lines0(ignored)
    # A .gitignore git ignores still applies: one that ignores itself (`*`), or a directory git lists
    # whole because its own .gitignore ignores all it holds (as `.pytest_cache/`).
    more = [p for p in listed if posixpath.basename(p) == ".gitignore"]
    more += [p + ".gitignore" for p in listed if p.endswith("/") and (root / p / ".gitignore").is_file()]
    files = [(posixpath.dirname(rel), _read(root / rel)) for rel in _lines0(gitignores) + more]
    parts = [p for p in prefix.strip("/").split("/") if p]
    repo = root.joinpath(*[".."] * len(parts)) if parts else root
    outer: list[tuple[Sequence[str], str]] = []
    for depth in range(len(parts) - 1, -1, -1):  # the nearest parent first
        outer.append((parts[depth:], _read(repo.joinpath(*parts[:depth], ".gitignore"))))
    outer.append((parts, _read(root / info_exclude)))
    user_file = (excludes_file.stdout.decode("utf-8", "surrogateescape").strip()
                 if excludes_file is not None and excludes_file.returncode == 0 else "")
    default = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "git" / "ignore"
    outer.append((parts, _read(Path(user_file).expanduser() if user_file else default)))
    keep: list[str] = []
    for path in _lines0(tracked_ignored):  # with its directories: rsync does not enter an excluded one
        parts = path.split("/")
        for rule in ["+ /" + escape("/".join(parts[:i])) + "/" for i in range(1, len(parts))] + ["+ /" + escape(path)]:
            if rule not in keep:
                keep.append(rule)
    return WorkdirFilter(rules=tuple(keep + rules_for(files, outer)),
                         ignored=tuple("/" + escape(p) for p in listed))


def workdir_filter(root: Path, protect: Sequence[str] = ()) -> WorkdirFilter:
    """What the copy of workdir `root` leaves out (see the module's docstring); `protect`: destinations
    inside the workdir, relative to it (nested_destinations)."""
    first = ["- /" + escape(p) for p in protect]
    for path in protect:  # their directories, when not in the workdir, are not deleted around them either
        parts = path.split("/")[:-1]
        first += [r for r in ("P /" + escape("/".join(parts[:i + 1])) + "/" for i in range(len(parts)))
                  if r not in first]
    from_git = _git_tree(root)
    if from_git is not None:
        return WorkdirFilter(rules=tuple(first) + from_git.rules, ignored=from_git.ignored)
    files = [(posixpath.dirname(rel), _read(root / rel)) for rel in _walk_gitignores(root)]
    # a repository's own excludes even where git itself is missing
    outer = [((), _read(root / ".git" / "info" / "exclude"))]
    return WorkdirFilter(rules=tuple(first + rules_for(files, outer)))


def nested_destinations(dests: Iterable[str], workdir: str = "~/" + WORKDIR_NAME) -> list[str]:
    """The destinations (file_mounts, buckets) inside the workdir, relative to it. An absolute (or
    ~user/) destination counts when a `gpuctl_workdir` directory is among its parents (the node's home
    is not known here; protecting a path that is elsewhere costs only that it is not copied)."""
    top = workdir.rstrip("/")
    out: list[str] = []
    for dest in dests:
        path = posixpath.normpath(dest.rstrip("/") or "/")
        rel = None
        if path.startswith(top + "/"):
            rel = path[len(top) + 1:]
        elif not path.startswith("~/"):  # absolute, or ~user/...: somebody's home, perhaps the login's
            parts = path.split("/")
            if WORKDIR_NAME in parts[:-1]:
                rel = "/".join(parts[parts.index(WORKDIR_NAME) + 1:])
        if rel and rel not in out and not rel.startswith(".."):
            out.append(rel)
    return out


def ignored_by_git(root: Path) -> list[str] | None:
    """What git itself reports ignored in `root` (untracked; relative to it, a directory ignored whole as one
    entry ending in '/'), as SkyPilot leaves it out of a bucket upload; None outside a git work tree or
    without git, [] when git ignores `root` whole (SkyPilot then keeps everything)."""
    probe = _git(root, "rev-parse", "--is-inside-work-tree")
    if probe is None or probe.returncode != 0 or probe.stdout.strip() != b"true":
        return None
    listed = _git(root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    if listed is None or listed.returncode != 0:
        return None
    paths = _lines0(listed)
    return [] if "./" in paths else paths
