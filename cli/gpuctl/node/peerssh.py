"""How this node starts ssh to a peer of its cluster: OpenSSH with a key exchange that is cheap.

OpenSSH 9.0 to 9.8 open every connection with sntrup761x25519, whose key generation costs the
client about 65 ms of CPU here (OpenSSH 9.2): 2 s for a head installing 31 workers, on the node
that also runs rank 0. For hops inside the cluster the client puts a faster exchange first:
mlkem768x25519 (post-quantum too) where it has it, else curve25519, the default before 9.0. The
controller's own connections keep OpenSSH's defaults. `^` (prepend to the default list) exists
wherever sntrup761x25519-sha512@openssh.com does (8.5 on); older clients get no option at all.
"""

import subprocess
import tempfile

_FAST_KEX = []  # [the option] or [], once this process asked its ssh (`ssh -Q kex`)


def fast_kex_option(query=None):
    """["-o", "KexAlgorithms=^..."] when this node's ssh would otherwise start with sntrup761; []."""
    if query is None and _FAST_KEX:
        return _FAST_KEX[0]
    try:
        names = (query() if query else subprocess.run(
            ["ssh", "-Q", "kex"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            timeout=10).stdout.decode("ascii", "replace")).split()
    except (OSError, subprocess.SubprocessError):
        names = []
    if "mlkem768x25519-sha256" in names:
        option = ["-o", "KexAlgorithms=^mlkem768x25519-sha256"]
    elif "sntrup761x25519-sha512@openssh.com" in names and "curve25519-sha256" in names:
        option = ["-o", "KexAlgorithms=^curve25519-sha256"]
    else:
        option = []
    if query is None:
        _FAST_KEX.append(option)
    return option


def peer_ssh_argv(options):
    """ssh, the fast exchange, then the peer's own options (the payload's: key, known hosts, ...)."""
    return ["ssh"] + fast_kex_option() + list(options)


def run_peer_ssh(argv, timeout, stdin=subprocess.DEVNULL):
    """(exit code, stdout, stderr) of an ssh to a peer, its output in files, not pipes: a
    ControlMaster ssh goes on in the background and would hold a pipe, and so the answer, until its
    ControlPersist time. Past `timeout` it is killed and subprocess.TimeoutExpired raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=out, stderr=err, close_fds=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()
