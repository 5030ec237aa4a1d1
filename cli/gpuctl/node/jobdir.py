"""A job's directory on this node and a stage's files in it; the node's prepared state.

~/.gpuctl holds what the prepare play installed (the fingerprint in `prepared`,
fabric.env) and the jobs (jobs/<job>, see the package's docstring for the
files). Every other module reads and writes a job's files through these
helpers: atomic replacement (an exit code, a pid) and private files (secrets,
scripts), and `Stage`, the paths of one stage's files.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess

from gpuctl.node.procs import pid_alive
from gpuctl.node.protocol import JOB_ID_PATTERN, NODE_JOBS_DIR, SUDO_MKDIR


GPUCTL_DIR = os.path.expanduser("~/.gpuctl")
PREPARED_FILE = os.path.join(GPUCTL_DIR, "prepared")  # the prepare play's fingerprint
INSTALLED_FILE = os.path.join(GPUCTL_DIR, "installed.json")  # {path under ~/.gpuctl: sha256} of the bundle
FABRIC_ENV = os.path.join(GPUCTL_DIR, "fabric.env")  # the prepare play's NCCL/fabric defaults
JOBS_DIR = os.path.expanduser(NODE_JOBS_DIR)  # ~/.gpuctl/jobs
JOB_ID_RE = re.compile(JOB_ID_PATTERN)

# Sources fabric.env, the stage's env file, then secrets.sh with every
# assignment exported, then replaces itself with `bash STAGE.sh`. The paths
# travel as $1..$4, never in the shell text.
WRAPPER = (
    'set -a; for f in "$1" "$2" "$3"; do if [ -f "$f" ]; then . "$f"; fi; done; set +a; '
    'script="$4"; shift 4; exec bash "$script" "$@"'
)


# Set by the launcher, ~/.gpuctl/bin/gpuctl-node, which imports this file from ~/.gpuctl/lib (so its
# bytecode is cached there): the command this agent is run again by. None: this file is the command.
LAUNCHER = None


def agent_file():
    """The agent's command, run again for a detached part of a job (the coordinator, a stage in a
    container, a mount's watcher) and named in its supervisors' command lines."""
    return os.path.abspath(LAUNCHER or __file__)


class Stage(object):
    """The paths of one stage's files in a job directory (STAGE.sh, .log, .pid, .exit...)."""

    def __init__(self, jobdir, stage):
        if not stage or "/" in stage or stage.startswith("."):
            raise SystemExit("gpuctl-node: invalid stage name %r" % stage)
        self.jobdir = os.path.abspath(os.path.expanduser(jobdir))
        self.name = stage
        base = os.path.join(self.jobdir, stage)
        self.script = base + ".sh"
        self.log = base + ".log"
        self.pid = base + ".pid"
        self.supervisor = base + ".supervisor"
        self.exit = base + ".exit"
        self.killed = base + ".killed"
        self.cpid = base + ".cpid"  # in a container: the stage's process group there
        self.tag = base + ".tag"  # the value of STAGE_TAG in the environment of the stage's processes
        self.clean = base + ".clean"  # its supervisor left with nothing of the stage below it
        self.env = base + ".env.sh"
        if not os.path.exists(self.env):
            self.env = os.path.join(self.jobdir, "env.sh")  # written by the Ansible env role
        self.secrets = os.path.join(self.jobdir, "secrets.sh")

    def pgid(self):
        return read_int(self.pid)

    def exit_code(self):
        return read_int(self.exit)

    def supervisor_alive(self):
        return pid_alive(read_int(self.supervisor))

    def running(self):
        return self.pgid() is not None and self.exit_code() is None and self.supervisor_alive()


def read_int(path):
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def write_atomic(path, text):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def shell_quote(value):
    """POSIX single quotes (shlex.quote, which Python 3.6's agent may lack as shlex.quote)."""
    value = str(value)
    if value and re.match(r"^[A-Za-z0-9_@%+=:,./-]+$", value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"


def write_private(path, text, mode=0o600):
    """Write a file only its owner can read, replacing it atomically."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_text(path, default=None):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return default


def job_dir(job_id):
    if not JOB_ID_RE.fullmatch(job_id or ""):
        raise SystemExit("gpuctl-node: invalid job id %r" % job_id)
    return os.path.join(JOBS_DIR, job_id)


SUBMISSION_FILE = "submission"  # in JOBDIR: the payload's nonce, i.e. which submission made the directory


def take_job_dir(jobdir, nonce, reset=False):
    """Make the job's directory on this node; None, or why it cannot be this job's.

    A directory that is already there is taken only when this very submission
    made it (an earlier try of it, or a node sharing the filesystem): the job's
    name (`<id>-<token>`) is the controller's own, but nothing here deletes or
    writes into a directory another submission made. `reset`: the head starts
    the job's event stream again (an earlier try's coordinator must be gone).
    """
    os.makedirs(JOBS_DIR, 0o700, exist_ok=True)
    try:
        os.mkdir(jobdir, 0o700)
    except FileExistsError:
        made_by = (read_text(os.path.join(jobdir, SUBMISSION_FILE)) or "").strip()
        if not nonce or made_by != nonce:
            return ("%s exists and another submission made it (job ids of another gpuctl state on the same "
                    "nodes?); it was left as it is" % jobdir)
        if reset:
            if pid_alive(read_int(os.path.join(jobdir, "events.supervisor"))):
                return "%s: this job is already running here" % jobdir
            shutil.rmtree(jobdir)  # an earlier try of this submission: ours
            os.mkdir(jobdir, 0o700)
        else:
            return None
    if nonce:
        write_private(os.path.join(jobdir, SUBMISSION_FILE), nonce)
    return None


def prepared_problem(expected):
    """Why this node is not in the state gpuctl expects, or None when it is: its fingerprint, then
    the files prepare installed, each as it was written (a damaged agent or probe is prepared again)."""
    found = (read_text(PREPARED_FILE) or "").strip()
    if not found:
        return "never prepared"
    if found != expected:
        return "prepared state %s differs from the expected %s" % (found[:12], (expected or "")[:12])
    return install_problem()


def install_problem():
    """Which file of the installed bundle is missing or not what prepare wrote, or None."""
    try:
        with open(INSTALLED_FILE) as fh:
            installed = json.load(fh)
    except (OSError, ValueError):
        return "its install record %s is missing or unreadable" % INSTALLED_FILE
    if not isinstance(installed, dict):
        return "its install record %s is not a table of files" % INSTALLED_FILE
    for rel, digest in sorted(installed.items()):
        try:
            with open(os.path.join(GPUCTL_DIR, rel), "rb") as fh:
                same = hashlib.sha256(fh.read()).hexdigest() == digest
        except OSError:
            same = False
        if not same:
            return "~/.gpuctl/%s is damaged or missing (not what prepare installed)" % rel
    return None


def stage_tag(st):
    """The stage's tag on this node, or None. Random per stage and node, not derived from the job:
    nodes that share one process table (local nodes) or one home path must not see each other's."""
    text = (read_text(st.tag) or "").strip()
    return text if re.match(r"^[0-9a-f]{32}$", text) else None


def stage_supervisor(st):
    """The stage's supervisor while it lives (its command line is this agent's), else None."""
    pid = read_int(st.supervisor)
    if pid is None or not pid_alive(pid):
        return None
    if pid == os.getpid():
        return pid
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            ours = os.path.basename(agent_file()).encode() in fh.read()
    except OSError:
        return None
    return pid if ours else None


def status_of(st):
    return {
        "pid": st.pgid(),
        "running": st.running(),
        "exit": st.exit_code(),
        "killed": os.path.exists(st.killed),
    }


def dest_paths(dest):
    """(local absolute path, path as rsync's remote side takes it: relative to home for ~/...)."""
    path = dest.rstrip("/") or "/"
    if path == "~":
        return os.path.expanduser("~"), "."
    if path.startswith("~/"):
        return os.path.expanduser(path), path[2:]
    return path, path


def ensure_dir(path):
    """mkdir -p; where the parent is not writable (/data for a login user other than root) through
    `sudo -n`, the directory then owned by this user, as SkyPilot makes absolute destinations."""
    try:
        os.makedirs(path, exist_ok=True)
        return
    except PermissionError:
        if os.geteuid() == 0 or not shutil.which("sudo"):
            raise
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # umask 022: the directories made above it (/opt/x of /opt/x/data) are root's, and this user
    # must pass them; sudo would keep this process's private umask
    if subprocess.call(["sudo", "-n", "sh", "-c", SUDO_MKDIR, "gpuctl-mkdir", path,
                        "%d:%d" % (os.getuid(), os.getgid())], **quiet) != 0:
        raise OSError(errno.EACCES, "cannot create %s (not writable, and sudo -n refused)" % path, path)


def cannot_write(exc, path):
    """One line for job files a node could not write: the path and why (No space left on device...)."""
    return "cannot write %s: %s" % (getattr(exc, "filename", None) or path, exc.strerror or exc)
