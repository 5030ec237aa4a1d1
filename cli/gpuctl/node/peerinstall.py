"""Prepare through the cluster (`gpuctl-node install-peers`): the head installs its workers.

The controller prepares the head alone (one module run), then hands it one request on stdin: the
install bundle without the private key (the head adds its own copy), the bootstrap the Ansible
module runs, and the workers to install. The head runs that bootstrap on each worker over ssh with
the cluster's internal key, up to `parallel` at a time, and prints one JSON line per worker as it
ends, so the controller's work no longer grows with the cluster.

First contact is authenticated both ways before anything is sent: each worker authorized the
internal public key at boot (the provider's module placed it), and the head checks its host key
strictly against the cluster view (written here first), which holds the key the controller read
where the node was made, not one learned at first contact. A worker the head cannot reach is
reported `unreachable`; the controller then prepares it directly (and waits for it if it boots).
"""

import json
import os
import subprocess
import sys
import threading
import zlib

from gpuctl.node.install import KEY_NAME, SSH_DIR, InstallError, agent_code, write_view
from gpuctl.node.jobdir import GPUCTL_DIR, shell_quote
from gpuctl.node.peerssh import peer_ssh_argv, run_peer_ssh
from gpuctl.node.protocol import PEER_INSTALL_TIMEOUT

_SSH_FAILED = 255  # ssh's own exit code: the worker was not reached (or refused us)


def _tail(data, lines=3):
    text = data.decode("utf-8", "replace").strip().splitlines()
    return " | ".join(ln.strip() for ln in text[-lines:] if ln.strip())


def _bundle_fd(bundle):
    """An unlinked private file holding the bundle (it carries the private key): each worker's
    ssh reads its own descriptor of it (/proc/self/fd), and nothing is left when this ends."""
    path = os.path.join(os.path.expanduser(GPUCTL_DIR), "install-peers.%d" % os.getpid())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.write(fd, json.dumps(bundle, separators=(",", ":")).encode("utf-8"))
    return fd


def install_one(target, remote, bundle_fd, timeout=PEER_INSTALL_TIMEOUT):
    """One worker's install step over ssh: its result line as a dict. Output goes to files, not
    pipes: the ControlMaster ssh leaves behind for the job must not hold the result back."""
    argv = peer_ssh_argv(target["ssh"]) + ["--", target["host"], remote]
    with open("/proc/self/fd/%d" % bundle_fd, "rb") as stdin:
        try:
            code, out, err = run_peer_ssh(argv, timeout, stdin=stdin)
        except OSError as exc:
            return {"node": target["name"], "ok": False, "unreachable": True, "error": "cannot start ssh: %s" % exc}
        except subprocess.TimeoutExpired:
            return {"node": target["name"], "ok": False, "unreachable": False,
                    "error": "the install step took over %d s" % timeout}
    if code == 0:
        try:
            result = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"node": target["name"], "ok": False, "unreachable": False,
                    "error": "gpuctl-node install printed no result"}
        return {"node": target["name"], "ok": True, "result": result}
    return {"node": target["name"], "ok": False, "unreachable": code == _SSH_FAILED,
            "error": _tail(err) or _tail(out) or "exit code %d" % code}


def install_peers(request, emit):
    """Install every target of `request`, `parallel` at a time; emit(result) as each ends.
    Returns 0 when every worker was installed, 1 otherwise."""
    targets = list(request.get("targets") or [])
    try:
        write_view(request.get("view"))
        with open(os.path.join(os.path.expanduser(SSH_DIR), KEY_NAME)) as fh:
            key = fh.read()
    except (InstallError, OSError) as exc:  # the head itself is not as prepared: nothing is tried
        for t in targets:
            emit({"node": t["name"], "ok": False, "unreachable": True, "error": "on the head: %s" % exc})
        return 1
    bundle = dict(request["bundle"])
    bundle["ssh"] = dict(bundle["ssh"], key=key)
    try:  # compiled once here rather than on every worker (they run the head's image)
        bundle["agent_code"] = agent_code(bundle)
    except (KeyError, SyntaxError, ValueError, zlib.error):
        pass  # each worker compiles the text itself
    remote = "%s -c %s" % (shell_quote(request.get("python") or "python3"), shell_quote(request["bootstrap"]))
    fd = _bundle_fd(bundle)
    lock = threading.Lock()
    pending = list(reversed(targets))
    failed = []

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                target = pending.pop()
            try:
                result = install_one(target, remote, fd)
            except Exception as exc:  # noqa: BLE001 - reported for this worker; the others go on
                result = {"node": target["name"], "ok": False, "unreachable": True,
                          "error": "the head could not run ssh to it: %s" % exc}
            with lock:
                if not result["ok"]:
                    failed.append(target["name"])
                emit(result)

    try:
        threads = [threading.Thread(target=worker) for _ in range(max(1, min(int(request.get("parallel") or 32),
                                                                                len(targets))))]
        for t in threads:
            t.daemon = True
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return 1 if failed else 0


def cmd_install_peers(args):
    """`gpuctl-node install-peers`: the request on stdin (one JSON document), results on stdout."""
    request = json.loads(sys.stdin.read())

    def emit(result):
        try:
            sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, OSError):  # the controller went away: the installs still end cleanly
            pass

    return install_peers(request, emit)
