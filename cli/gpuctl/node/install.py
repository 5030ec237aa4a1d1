"""The node end of prepare: one bundle on stdin, one idempotent step (`gpuctl-node install`).

The configuration plane (role gpuctl_node) sends every node the same JSON bundle in one module run:
the agent's files, the cluster's internal key, the cluster view (below), what the fabric probe needs
and the fingerprint of the prepared state. The role's bootstrap (`gpuctl-install`) loads the agent
from the bundle and calls `install`, which writes each file only when its content differs (write,
then rename: a node never runs a half-written agent) and the fingerprint last. A bundle that changed
while a node was being prepared therefore shows up as a fingerprint mismatch on the next job.

The cluster view is what a node needs to know of the others: their host keys and one `Host` entry
each in ~/.ssh/config. It also travels in every job's payload (`write_view`, called by each relay
before it connects on), so growing a cluster or replacing a node prepares only those nodes: the
others learn of them from the next job.

Prints one JSON line: the probe's result, `hostname` and `changed`.
"""

import base64
import hashlib
import importlib.util
import json
import marshal
import os
import re
import shutil
import struct
import subprocess
import sys
import types
import zlib

from gpuctl.node.jobdir import GPUCTL_DIR, INSTALLED_FILE, PREPARED_FILE, read_text

SSH_DIR = "~/.ssh"
KEY_NAME = "gpuctl_cluster"
KNOWN_HOSTS_NAME = "gpuctl_known_hosts"
# The old role's blockinfile markers: a block written by an earlier gpuctl is replaced, not doubled.
CONFIG_MARK = "# %s gpuctl cluster hosts (managed by gpuctl, rewritten on every job)"
AGENT_FILE = "lib/gpuctl_node.py"  # the agent; the bundle's other files: its launcher and the node's probes
_BUNDLE_PATH = re.compile(r"(bin|lib)/[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
NODE_DIRS = ("", "bin", "lib", "jobs", "cm")  # cm: ControlMaster sockets of node-to-node ssh
# What may stand in a Host entry: a value with a space or a newline would add options of its own.
_CONFIG_VALUE = re.compile(r"[A-Za-z0-9_.:@%+-]+\Z")


class InstallError(Exception):
    """One step failed: `step` names it, the message says why."""

    def __init__(self, step, message):
        Exception.__init__(self, "%s: %s" % (step, message))


def write_if_changed(path, data, mode):
    """Write `data` (bytes or text) to `path` atomically when it differs; whether it did.
    An unchanged file keeps its mtime (and nothing else is touched)."""
    if not isinstance(data, bytes):
        data = data.encode("utf-8")
    try:
        with open(path, "rb") as fh:
            same = fh.read() == data
    except OSError:
        same = False
    if same:
        if (os.stat(path).st_mode & 0o7777) != mode:
            os.chmod(path, mode)
            return True
        return False
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def _config_value(value, what):
    value = str(value)
    if not _CONFIG_VALUE.match(value):  # from the start, to the very end (no newline)
        raise InstallError("cluster view", "%s %r cannot stand in an ssh config" % (what, value))
    return value


def render_hosts(view, ssh_dir=SSH_DIR):
    """The cluster's Host entries: one per node, named by every name in its `names`."""
    hosts = view.get("hosts") or []
    pinned = bool(view.get("known_hosts")) and all(h.get("alias") for h in hosts)
    lines = []
    for h in hosts:
        names = [_config_value(n, "a node name") for n in h["names"]]
        lines += ["Host " + " ".join(names),
                  "  HostName " + _config_value(h["address"], "an address"),
                  "  Port %d" % int(h["port"])]
        if h.get("user"):
            lines.append("  User " + _config_value(h["user"], "a user"))
        lines += ["  IdentityFile %s/%s" % (ssh_dir, KEY_NAME), "  IdentitiesOnly yes"]
        if pinned:
            lines += ["  HostKeyAlias " + _config_value(h["alias"], "a host key alias"),
                      "  StrictHostKeyChecking yes",
                      "  UserKnownHostsFile %s/%s" % (ssh_dir, KNOWN_HOSTS_NAME),
                      "  GlobalKnownHostsFile /dev/null"]
        else:
            lines.append("  StrictHostKeyChecking accept-new")
        lines += ["  LogLevel ERROR", "  BatchMode yes", "  ConnectTimeout 10"]
    lines += ["# Ends the last entry: whatever follows the block applies to all hosts again.", "Host *"]
    return "\n".join(lines) + "\n"


def with_block(text, block):
    """`text` (an ssh config) with gpuctl's block replaced, or put first: ssh takes the first value
    it finds for an option."""
    begin, end = CONFIG_MARK % "BEGIN", CONFIG_MARK % "END"
    wrapped = begin + "\n" + block + end + "\n"
    lines = text.splitlines(True)
    try:
        first = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == begin)
        last = next(i for i in range(first, len(lines)) if lines[i].rstrip("\n") == end)
    except StopIteration:
        return wrapped + text
    return "".join(lines[:first]) + wrapped + "".join(lines[last + 1:])


def private_dir(path):
    """`path` as a directory only its owner may use (sshd's StrictModes ignores a group-writable ~/.ssh);
    whether it had to change."""
    if not os.path.isdir(path):
        os.makedirs(path, 0o700)
        return True
    if os.stat(path).st_mode & 0o7777 != 0o700:
        os.chmod(path, 0o700)
        return True
    return False


def _ssh_dir():
    path = os.path.expanduser(SSH_DIR)
    private_dir(path)
    return path


def write_view(view):
    """The cluster's known hosts and Host entries, where they differ; whether anything changed.
    None (loopback local nodes share the controller's home): nothing is written."""
    if not view:
        return False
    ssh_dir = _ssh_dir()
    changed = False
    if view.get("known_hosts"):
        changed |= write_if_changed(os.path.join(ssh_dir, KNOWN_HOSTS_NAME), view["known_hosts"], 0o644)
    config = os.path.join(ssh_dir, "config")
    return write_if_changed(config, with_block(read_text(config, ""), render_hosts(view)), 0o600) or changed


def authorize(public_key, ssh_dir):
    """The cluster's public key in authorized_keys; a line with the same comment (the key's name,
    gpuctl-internal-<cluster>) is replaced, so a new key replaces the old one."""
    parts = public_key.split()
    if len(parts) < 3:
        raise InstallError("node-to-node SSH", "the cluster's public key has no comment to name it by")
    path = os.path.join(ssh_dir, "authorized_keys")
    lines = (read_text(path, "") or "").splitlines()
    kept = [ln for ln in lines if not (len(ln.split()) >= 3 and ln.split()[2:] == parts[2:]
                                       and ln.split()[0].startswith(("ssh-", "ecdsa-", "sk-")))]
    return write_if_changed(path, "".join(ln + "\n" for ln in kept + [" ".join(parts)]), 0o600)


def install_ssh(ssh):
    """Node-to-node SSH: the cluster's internal key pair, its authorization, the cluster view."""
    if not ssh.get("key") or not ssh.get("public_key"):
        raise InstallError("node-to-node SSH", "the bundle has no key pair (gpuctl_internal_key and its .pub)")
    ssh_dir = _ssh_dir()
    changed = write_if_changed(os.path.join(ssh_dir, KEY_NAME), ssh["key"].strip() + "\n", 0o600)
    changed |= authorize(ssh["public_key"].strip(), ssh_dir)
    return write_view(ssh.get("view")) or changed


def install_files(bundle):
    """The bundle's files under ~/.gpuctl (bin/, lib/), then the record of what they are
    (installed.json: each file's sha256, which every job checks); whether any changed."""
    changed = False
    for sub in NODE_DIRS:
        changed |= private_dir(os.path.join(GPUCTL_DIR, sub))
    files = bundle["files"]
    if AGENT_FILE not in files:
        raise InstallError("files", "the bundle has no agent (%s)" % AGENT_FILE)
    installed = {}
    for rel, entry in sorted(files.items()):
        if not _BUNDLE_PATH.match(rel):
            raise InstallError("files", "%r is not a file under ~/.gpuctl/bin or ~/.gpuctl/lib" % rel)
        data = file_text(entry).encode("utf-8")
        changed |= write_if_changed(os.path.join(GPUCTL_DIR, rel), data, int(entry["mode"], 8))
        installed[rel] = hashlib.sha256(data).hexdigest()
    return write_if_changed(INSTALLED_FILE, json.dumps(installed, sort_keys=True) + "\n", 0o600) or changed


def file_text(entry):
    """A bundle file's text: `text` as it is, or `zdata` (zlib, then base64: 40% of the bytes)."""
    if "zdata" in entry:
        return zlib.decompress(base64.b64decode(entry["zdata"])).decode("utf-8")
    return entry["text"]


def check_tools():
    """What the job plane runs on every node besides this python3."""
    if shutil.which("rsync") is None:
        raise InstallError("tools", "rsync is not installed on this node; the node image needs python3 (the gpuctl "
                                    "agent) and rsync (workdir and file_mounts)")


def probe_fabric(fabric):
    """Run the fabric probe, which writes ~/.gpuctl/fabric.env; its JSON result. In this process: a
    second Python and its imports cost each node more than the probe itself (the head installs its
    workers 32 at a time on its own CPUs); as a program where the probe cannot be loaded so."""
    path = os.path.join(GPUCTL_DIR, "lib", "gpuctl-fabric-probe")
    try:
        probe = types.ModuleType("gpuctl_fabric_probe")
        probe.__file__ = path
        with open(path) as fh:
            exec(compile(fh.read(), path, "exec"), probe.__dict__)  # noqa: S102 - the bundle's probe, just written
        run, write = probe.probe, probe.write
    except Exception:  # noqa: BLE001 - an older or broken probe: as a program, which says why
        return probe_fabric_program(fabric)
    try:
        result = run(head=fabric.get("head") or None, instance=fabric.get("instance_type") or None,
                     fallback_env=dict((str(k), str(v)) for k, v in (fabric.get("fallback_env") or {}).items()),
                     sys_root="/sys", dev_root="/dev", proc_root="/proc", root="/")
        result["changed"] = write(result, GPUCTL_DIR)
    except (OSError, IOError) as exc:
        raise InstallError("fabric probe", "writing %s: %s" % (GPUCTL_DIR, exc))
    except Exception as exc:  # noqa: BLE001 - the probe's own failure, in one line as the program's
        raise InstallError("fabric probe", "%s: %s" % (type(exc).__name__, exc))
    return result


def probe_fabric_program(fabric):
    """The fabric probe as its own program (`gpuctl-fabric-probe --write`); its JSON result."""
    argv = [sys.executable, os.path.join(GPUCTL_DIR, "lib", "gpuctl-fabric-probe"), "--write", GPUCTL_DIR,
            "--head", str(fabric.get("head") or ""), "--instance-type", str(fabric.get("instance_type") or ""),
            "--fallback-env", json.dumps(fabric.get("fallback_env") or {})]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    if proc.returncode != 0:
        tail = " | ".join(ln for ln in err.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise InstallError("fabric probe", "exit code %d: %s" % (proc.returncode, tail or "no output"))
    try:
        return json.loads(out.decode("utf-8", "replace"))
    except ValueError:
        raise InstallError("fabric probe", "printed no JSON")


def agent_code(bundle):
    """The bundle's agent compiled, for a node with this Python (the head's workers): {magic, zdata}."""
    code = compile(file_text(bundle["files"][AGENT_FILE]), "gpuctl_node.py", "exec")
    return {"magic": base64.b64encode(importlib.util.MAGIC_NUMBER).decode("ascii"),
            "zdata": base64.b64encode(zlib.compress(marshal.dumps(code), 6)).decode("ascii")}


def write_bytecode(code):
    """The agent's import cache from `code`, which the bootstrap just ran: a pyc checked against the
    source's hash (PEP 552), so the first job imports it without compiling the agent again and a
    later agent is never run from a stale cache. Python < 3.7 compiles on import, as before."""
    source_hash = getattr(importlib.util, "source_hash", None)
    if code is None or source_hash is None:
        return
    path = os.path.join(GPUCTL_DIR, AGENT_FILE)
    with open(path, "rb") as fh:
        source = fh.read()
    data = importlib.util.MAGIC_NUMBER + struct.pack("<I", 0b11) + source_hash(source) + marshal.dumps(code)
    cache = importlib.util.cache_from_source(path)
    os.makedirs(os.path.dirname(cache), 0o700, exist_ok=True)
    write_if_changed(cache, data, 0o600)


def install(bundle, code=None):
    """The whole step; exit code 0 and one JSON line, or 1 and one line naming the step that failed.
    `code`: the agent as the bootstrap compiled or was given it, kept as its import cache."""
    try:
        changed = install_files(bundle)
        write_bytecode(code)
        if bundle.get("ssh"):
            changed |= install_ssh(bundle["ssh"])
        check_tools()
        result = probe_fabric(bundle.get("fabric") or {})
        changed |= bool(result.get("changed"))
        if bundle.get("fingerprint"):  # last; none given (wait.yml, a bare role): the record stays
            changed |= write_if_changed(PREPARED_FILE, str(bundle["fingerprint"]) + "\n", 0o600)
    except InstallError as exc:
        sys.stderr.write("gpuctl-node install: %s\n" % exc)
        return 1
    except OSError as exc:
        sys.stderr.write("gpuctl-node install: cannot write %s: %s\n" % (exc.filename or "", exc.strerror or exc))
        return 1
    result.update(changed=changed, hostname=os.uname()[1])
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


def cmd_install(args):
    """`gpuctl-node install`: the bundle on stdin (the role's bootstrap calls install() directly)."""
    return install(json.load(sys.stdin))
