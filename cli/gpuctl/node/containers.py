"""`image_id: docker:IMAGE` (payload["container"]): setup and run in the node's container.

Setup and run go inside one long-lived container per node, as SkyPilot keeps
one per cluster, so what setup installs is there for run and for later jobs.
It is created on first use, reused while it has the image and every mount a
job needs (the same file or directory: device and inode), and re-created when
they change:
  name     gpuctl-<cluster>-<node name> (local nodes share one image store)
  options  --network=host --ipc=host; all GPUs where the node has NVIDIA
           devices (docker --gpus=all, podman --device=nvidia.com/gpu=all);
           the workdir, the file_mounts and bucket destinations and
           ~/.gpuctl/jobs bound at the node's own paths
  inside   HOME is the node user's home, so ~/... means what it means on the
           node; the stage's env, secrets and hostfile are read from the job
           directory there, never passed on a command line
The node's check (H) finds a runtime that answers (docker, then podman, or
GPUCTL_CONTAINER_RUNTIME) and writes JOBDIR/container.json; the stage's
supervisor starts `gpuctl-node container-stage` in place of bash, which
creates or reuses the container and becomes `RUNTIME exec ... bash -c
CONTAINER_WRAPPER`. That wrapper starts the stage in a process group of its
own and writes its id (in the container's PID namespace) to STAGE.cpid:
`kill` signals that group through the runtime, as `docker exec` passes no
signal on. A container is never re-created under another job's running stage:
each stage holds a shared flock on ~/.gpuctl/containers/NAME.use, and a
re-creation that cannot take it exclusively is refused (exit code 125).
"""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys

from gpuctl.node.jobdir import GPUCTL_DIR, JOBS_DIR, Stage, WRAPPER, dest_paths, read_int, shell_quote


RUNTIMES = ("docker", "podman")
RUNTIME_ENV = "GPUCTL_CONTAINER_RUNTIME"
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")
CONTAINERS_DIR = os.path.join(GPUCTL_DIR, "containers")
CONTAINER_LABEL = "gpuctl.spec"
CONTAINER_FILE = "container.json"

# PID 1 of the container: sleeps until stopped, and ends at once when it is.
KEEPALIVE = 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done'

# $1 the STAGE.cpid file, $2 STAGE.killed, then WRAPPER's arguments. `set -m` puts
# the stage in its own process group; a kill that came before the group's id was
# written is seen through the killed file.
CONTAINER_WRAPPER = (
    'cpid="$1" killed="$2"; shift 2; set -m; bash -c %s "$0" "$@" & pid=$!; set +m; '
    'echo "$pid" >"$cpid"; if [ -e "$killed" ]; then kill -TERM -- "-$pid"; fi; wait "$pid"' % shell_quote(WRAPPER))


def sudo_prefix():
    """["/usr/bin/sudo", "-n"] for a login user other than root whose sudo needs no password (local
    nodes, cloud images' users): the containers then live in the machine's own (root) store, where
    `gpuctl down` removes them; [] otherwise."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if not sudo:
        return []
    try:
        ok = subprocess.run([sudo, "-n", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [sudo, "-n"] if ok else []


def runtime_argv(cfg):
    """How the node's container runtime is run: its path, after sudo where that applies."""
    return list(cfg.get("sudo") or []) + [cfg["runtime"]]


def find_runtime(wanted=None, prefix=()):
    """(path of a container runtime that answers, None), or (None, what is wrong and what to install).
    `prefix`: sudo_prefix()."""
    notes = []
    for name in [wanted] if wanted else RUNTIMES:
        if os.path.isabs(name):
            path = name if os.path.isfile(name) and os.access(name, os.X_OK) else None
        else:
            path = shutil.which(name)
        if not path:
            notes.append("%s is not installed%s" % (name, "" if os.path.isabs(name) else " (not on PATH)"))
            continue
        try:
            proc = subprocess.run(list(prefix) + [path, "version"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            notes.append("`%s version` did not answer: %s" % (name, exc))
            continue
        if proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            why = err[-1] if err else "exit code %d" % proc.returncode
            notes.append("`%s version` failed: %s" % (name, why[:200]))
            continue
        return path, None
    if wanted:
        return None, "%s=%s: %s; install it on the node or unset %s" % (RUNTIME_ENV, wanted, "; ".join(notes),
                                                                        RUNTIME_ENV)
    return None, ("no container runtime to run the job's image in: %s; install Docker (and the NVIDIA Container "
                  "Toolkit where the node has GPUs) or Podman on the node" % "; ".join(notes))


def has_nvidia_gpus():
    try:
        return any(re.match(r"nvidia[0-9]+$", name) for name in os.listdir("/dev"))
    except OSError:
        return False


def container_config(box, node_name, workdir):
    """(this node's container for the job, None) or (None, problem): what JOBDIR/container.json holds."""
    image = box.get("image") or ""
    if not IMAGE_RE.fullmatch(image):
        return None, "%r is not a container image name" % image
    paths = []
    for dest in [workdir] + list(box.get("mounts") or []) + [JOBS_DIR]:
        path = os.path.normpath(dest_paths(dest)[0])
        if not os.path.isabs(path) or path == "/" or ":" in path or "," in path:
            return None, ("%s cannot be bound into a container (an absolute path other than /, without ':' or ',')"
                          % dest)
        paths.append(path)
    mounts = []  # one bind per tree: a destination inside another is there already
    for path in sorted(set(paths), key=len):
        if not any(path.startswith(m.rstrip("/") + "/") for m in mounts):
            mounts.append(path)
    sudo = sudo_prefix()
    runtime, problem = find_runtime(box.get("runtime"), sudo)
    if problem:
        return None, problem
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", "%s-%s" % (box.get("name") or "gpuctl", node_name))
    return {"runtime": runtime, "sudo": sudo,
            "flavor": "podman" if "podman" in os.path.basename(runtime) else "docker",
            "name": name if name[:1].isalnum() else "gpuctl-" + name, "image": image, "mounts": sorted(mounts),
            "gpus": has_nvidia_gpus(), "fabric": os.path.isdir("/dev/infiniband"), "home": os.path.expanduser("~"),
            "workdir": os.path.normpath(dest_paths(workdir)[0])}, None


def stage_container(st):
    """The job's container.json on this node, or None when the job runs on the node itself."""
    try:
        with open(os.path.join(st.jobdir, CONTAINER_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def wanted_container(cfg):
    """What the job needs of the container: the image, GPUs, and each existing mount's device:inode."""
    mounts = {}
    for path in cfg["mounts"]:
        if not os.path.exists(path):
            if path != cfg["workdir"] and path != JOBS_DIR:
                continue  # a file_mount not copied here (yet): bound once it is there
            os.makedirs(path, exist_ok=True)
        st = os.stat(path)
        mounts[path] = "%d:%d" % (st.st_dev, st.st_ino)
    return {"image": cfg["image"], "gpus": bool(cfg["gpus"]), "mounts": mounts}


def container_fits(have, want):
    """Whether a container made for `have` serves a job that needs `want` (it may bind more)."""
    bound = have.get("mounts") or {}
    return (have.get("image") == want["image"] and have.get("gpus") == want["gpus"]
            and all(bound.get(path) == ident for path, ident in want["mounts"].items()))


def container_run_argv(cfg, want):
    argv = runtime_argv(cfg) + ["run", "--detach", "--name=" + cfg["name"],
            "--label=%s=%s" % (CONTAINER_LABEL, json.dumps(want, sort_keys=True, separators=(",", ":"))),
            "--network=host", "--ipc=host"]
    if want["gpus"]:
        argv.append("--device=nvidia.com/gpu=all" if cfg["flavor"] == "podman" else "--gpus=all")
    if cfg.get("fabric"):  # EFA / InfiniBand: the verbs devices, and the pinned memory RDMA needs
        argv += ["--device=/dev/infiniband", "--ulimit=memlock=-1:-1"]
    argv += ["--volume=%s:%s" % (path, path) for path in sorted(want["mounts"])]
    # Nothing user-given before `--`: the image cannot be read as an option.
    return argv + ["--entrypoint=bash", "--", cfg["image"], "-c", KEEPALIVE]


def container_exec_argv(cfg, st):
    fabric = os.path.join(st.jobdir, "fabric.env")
    return runtime_argv(cfg) + ["exec", "--env=PYTHONUNBUFFERED=1", "--env=HOME=" + cfg["home"],
            "--workdir=" + cfg["workdir"], cfg["name"], "bash", "-c", CONTAINER_WRAPPER, "gpuctl-" + st.name,
            st.cpid, st.killed, fabric, st.env, st.secrets, st.script]


def container_state(cfg):
    """(running, the spec in its label) of the node's container, or None when there is none."""
    try:
        proc = subprocess.run(runtime_argv(cfg) + ["inspect", "--type", "container", "--format",
                               '{{.State.Running}}|{{index .Config.Labels "%s"}}' % CONTAINER_LABEL, cfg["name"]],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    running, _, label = proc.stdout.decode("utf-8", "replace").strip().partition("|")
    try:
        have = json.loads(label)
    except ValueError:
        have = {}
    return running == "true", have if isinstance(have, dict) else {}


def say(text):
    sys.stdout.write("gpuctl-node: %s\n" % text)
    sys.stdout.flush()


def ensure_container(cfg):
    """Reuse, start or (re-)create the node's container; (0, fd holding it in use) or (exit code, None)."""
    os.makedirs(CONTAINERS_DIR, 0o700, exist_ok=True)
    base = os.path.join(CONTAINERS_DIR, cfg["name"])
    lock = os.open(base + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    use = os.open(base + ".use", os.O_RDWR | os.O_CREAT, 0o600)
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one job at a time decides
        want = wanted_container(cfg)
        state = container_state(cfg)
        if state is not None and container_fits(state[1], want):
            if state[0] or subprocess.call(runtime_argv(cfg) + ["start", cfg["name"]], **quiet) == 0:
                fcntl.flock(use, fcntl.LOCK_SH)
                return 0, use
        if state is not None:
            try:
                fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                say("container %s runs another job's stage with another image or other mounts; it can be "
                    "re-created once that job ends" % cfg["name"])
                os.close(use)
                return 125, None
            subprocess.call(runtime_argv(cfg) + ["rm", "--force", cfg["name"]], **quiet)
        say("starting container %s from %s" % (cfg["name"], cfg["image"]))
        code = subprocess.call(container_run_argv(cfg, want), **quiet)
        if code != 0:
            say("%s could not start container %s (exit code %d)" % (os.path.basename(cfg["runtime"]), cfg["name"],
                                                                  code))
            os.close(use)
            return 125, None
        fcntl.flock(use, fcntl.LOCK_SH)
        return 0, use
    finally:
        os.close(lock)


def cmd_container_stage(args):
    """A stage in the node's container (its supervisor starts this in place of bash)."""
    st = Stage(args.jobdir, args.stage)
    cfg = stage_container(st)
    if cfg is None:
        say("%s has no readable %s" % (st.jobdir, CONTAINER_FILE))
        return 125
    code, use = ensure_container(cfg)
    if code:
        return code
    if os.path.exists(st.killed):
        return 128 + (read_int(st.killed) or 15)
    os.set_inheritable(use, True)  # held (shared) while the stage runs: no re-creation under it
    sys.stderr.flush()
    try:
        argv = container_exec_argv(cfg, st)
        os.execv(argv[0], argv)
    except OSError as exc:
        say("cannot run %s: %s" % (cfg["runtime"], exc))
        return 126


def signal_in_container(cfg, st, sig):
    """Signal the stage's process group inside its container; False when that is not known (yet) or gone."""
    cpid = read_int(st.cpid)
    if not cpid or cpid <= 1:
        return False
    try:
        code = subprocess.call(runtime_argv(cfg) + ["exec", cfg["name"], "bash", "-c", 'kill -"$1" -- "-$2" 2>/dev/null',
                                "gpuctl-kill", str(int(sig)), str(cpid)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return code == 0
