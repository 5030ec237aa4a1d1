"""The head installs its workers (`gpuctl-node install-peers`, agent/peerinstall.py), with the
built agent in temporary homes and an `ssh` on PATH that runs the remote command in the target's
home: the bundle reaches each worker with the head's own private key, results come back one line
per worker, an unreachable worker is told apart from a failed install, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuctl.configplane import bundle as node_bundle
from gpuctl.configplane import prepare

PUBLIC = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG9wZW5zc2gta2V5LWZvci10ZXN0cy1vbmx5LXh4eHg= gpuctl-internal-t"
PRIVATE = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n"

# ssh OPTIONS... -- HOST COMMAND: HOST "down" is not reached (255); any other runs COMMAND in its home.
FAKE_SSH = """#!/bin/sh
if [ "$1" = -Q ]; then printf 'curve25519-sha256\\nsntrup761x25519-sha512@openssh.com\\n'; exit 0; fi  # OpenSSH 9.2
echo "$@" >> "$FAKE_HOMES/ssh-options.log"
while [ "$1" != "--" ]; do shift; done
host=$2; command=$3
echo "$@" >> "$FAKE_HOMES/ssh.log"
if [ "$host" = down ]; then echo "ssh: connect to host down port 22: Connection refused" >&2; exit 255; fi
mkdir -p "$FAKE_HOMES/$host"
HOME="$FAKE_HOMES/$host" exec sh -c "$command"
"""


def view(workers: list[str]) -> dict:
    hosts = [{"names": [f"w{i}"], "address": w, "port": 22, "user": "root", "alias": f"gpuctl-{w}"}
             for i, w in enumerate(workers)]
    return {"hosts": hosts, "known_hosts": "".join(f"gpuctl-{w} ssh-ed25519 AAAAkey{w}\n" for w in workers)}


def bundle(workers: list[str], fingerprint: str = "fp1") -> dict:
    return prepare.install_bundle(fingerprint_value=fingerprint, internal_public_key=PUBLIC, view=view(workers),
                                  fabric_env={}, fabric_head="127.0.0.1")


def setup(tmp_path: Path, workers: list[str]) -> tuple[Path, dict]:
    """A prepared head in tmp_path/homes/head and the fake ssh first on PATH."""
    homes = tmp_path / "homes"
    head = homes / "head"
    head.mkdir(parents=True)
    data = bundle(workers)
    data["ssh"] = dict(data["ssh"], key=PRIVATE)
    done = subprocess.run([sys.executable, "-c", prepare.install_bootstrap()], input=json.dumps(data),
                          capture_output=True, text=True, env={**os.environ, "HOME": str(head)}, timeout=60)
    assert done.returncode == 0, done.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    env = {**os.environ, "HOME": str(head), "FAKE_HOMES": str(homes), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return homes, env


def install_peers(env: dict, workers: list[str], request_bundle: dict, parallel: int = 2
                  ) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    request = {"bundle": request_bundle, "bootstrap": prepare.install_bootstrap(), "python": sys.executable,
               "view": view([w for w in workers if w != "down"]), "parallel": parallel,
               "targets": [{"name": f"node-{w}", "host": w, "ssh": ["-p", "22", "-o", "BatchMode=yes"]}
                           for w in workers]}
    agent = Path(env["HOME"]) / ".gpuctl" / "bin" / "gpuctl-node"
    proc = subprocess.run([str(agent), "install-peers"], input=json.dumps(request), capture_output=True, text=True,
                          env=env, timeout=120)
    results = {}
    for line in proc.stdout.splitlines():
        data = json.loads(line)
        results[data["node"]] = data
    return proc, results


def test_the_head_installs_each_worker_with_its_own_key(tmp_path: Path):
    workers = ["10.0.0.3", "10.0.0.4", "10.0.0.5"]
    homes, env = setup(tmp_path, workers)
    proc, results = install_peers(env, workers, bundle(workers))
    assert proc.returncode == 0, proc.stderr
    assert sorted(results) == [f"node-{w}" for w in workers]
    for w in workers:
        assert results[f"node-{w}"]["ok"] is True and "kind" in results[f"node-{w}"]["result"]
        home = homes / w
        assert (home / ".gpuctl" / "prepared").read_text() == "fp1\n"
        assert (home / ".gpuctl" / "lib" / "gpuctl_node.py").read_text() == node_bundle.agent_text()
        # the head's own private key (the controller never sent it), and the worker's view
        assert (home / ".ssh" / "gpuctl_cluster").read_text() == PRIVATE
        assert oct((home / ".ssh" / "gpuctl_cluster").stat().st_mode & 0o777) == "0o600"
        assert PUBLIC in (home / ".ssh" / "authorized_keys").read_text()
        assert "w2" in (home / ".ssh" / "config").read_text()
    # nothing of the bundle (it held the key) is left on the head
    assert [p.name for p in (homes / "head" / ".gpuctl").iterdir() if p.name.startswith("install-peers")] == []
    # the key went on stdin, never in an argument
    assert "PRIVATE KEY" not in (homes / "ssh.log").read_text()
    # inside the cluster, the cheap key exchange first (this ssh would start with sntrup761)
    calls = (homes / "ssh-options.log").read_text()
    assert calls.count("-o KexAlgorithms=^curve25519-sha256 -p 22 -o BatchMode=yes -- ") == len(workers), calls


def test_an_unreachable_worker_is_told_apart_from_a_failed_install(tmp_path: Path):
    workers = ["10.0.0.3", "down", "10.0.0.6"]
    homes, env = setup(tmp_path, workers)
    (homes / "10.0.0.6").mkdir(parents=True)
    (homes / "10.0.0.6" / ".gpuctl").write_text("in the way\n")  # the install step cannot write there
    proc, results = install_peers(env, workers, bundle(workers), parallel=8)
    assert proc.returncode == 1
    assert results["node-10.0.0.3"]["ok"] is True
    assert results["node-down"] == {"node": "node-down", "ok": False, "unreachable": True,
                                    "error": "ssh: connect to host down port 22: Connection refused"}
    failed = results["node-10.0.0.6"]
    assert failed["ok"] is False and failed["unreachable"] is False
    assert failed["error"].startswith("gpuctl-node install: cannot write"), failed
    assert (homes / "10.0.0.3" / ".gpuctl" / "prepared").is_file()


def test_a_head_without_its_key_tries_no_worker(tmp_path: Path):
    workers = ["10.0.0.3"]
    homes, env = setup(tmp_path, workers)
    (homes / "head" / ".ssh" / "gpuctl_cluster").unlink()
    proc, results = install_peers(env, workers, bundle(workers))
    assert proc.returncode == 1
    assert results["node-10.0.0.3"]["unreachable"] is True and "on the head" in results["node-10.0.0.3"]["error"]
    assert not (homes / "ssh.log").exists()  # no worker was contacted


# -- the controller's end (jobplane/headinstall.py) and what decides who goes through the head ------

HEAD_SSH = """#!/bin/sh
cat > "$FAKE_HOMES/request.json"
echo "a login banner"
echo '{"node": "worker1", "ok": true, "result": {"kind": "none", "hostname": "n1", "changed": true}}'
echo '{"node": "worker2", "ok": false, "unreachable": false, "error": "gpuctl-node install: tools: no rsync"}'
echo "Connection to head closed by remote host." >&2
exit 255
"""


def test_the_controller_sends_one_request_and_owes_unreported_workers_to_the_prepare_play(tmp_path: Path,
                                                                                         monkeypatch):
    from gpuctl.jobplane import headinstall
    from gpuctl.provision.inventory import Node

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(HEAD_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_HOMES", str(tmp_path))
    head, *workers = [Node(name="head" if r == 0 else f"worker{r}", rank=r, node_id=f"i-{r}",
                           address=f"10.0.0.{r + 2}", ssh_host=f"10.0.0.{r + 2}") for r in range(4)]
    seen = []
    out = headinstall.install_through_head(head, workers, bundle=bundle(["10.0.0.3"]), bootstrap="BOOT",
                                           python="/usr/bin/python3", view=view(["10.0.0.3"]),
                                           control_dir=tmp_path / "cm", on_result=lambda n, r: seen.append(n.name))
    assert seen == ["worker1", "worker2"]  # as each result came, the banner skipped
    assert out["worker1"].ok and out["worker1"].result["hostname"] == "n1"
    assert not out["worker2"].ok and not out["worker2"].unreachable and "no rsync" in out["worker2"].error
    assert out["worker3"].unreachable  # never reported: the prepare play gets it, with the head's reason
    assert out["worker3"].error == "the head (head) did not install it: Connection to head closed by remote host."
    request = json.loads((tmp_path / "request.json").read_text())
    assert [t["name"] for t in request["targets"]] == ["worker1", "worker2", "worker3"]
    assert request["targets"][0]["host"] == "10.0.0.3" and "-i" in request["targets"][0]["ssh"]
    assert "key" not in request["bundle"]["ssh"]  # the private key stays on the controller and the head


def test_known_host_keys_are_pinned_before_first_contact(tmp_path: Path):
    from gpuctl.provision import ssh

    known = tmp_path / "known_hosts"
    known.write_text("gpuctl-i-1 ssh-ed25519 AAAAold\ngpuctl-bastion-x ssh-ed25519 AAAAb\n")
    keys = {"gpuctl-i-1": "ssh-ed25519 AAAAnew1 gpuctl-local-node-1", "gpuctl-i-2": "ssh-ed25519 AAAAnew2",
            "gpuctl-i-3": "garbage"}
    assert ssh.pin_host_keys(known, keys) == 2
    assert known.read_text() == ("gpuctl-bastion-x ssh-ed25519 AAAAb\ngpuctl-i-1 ssh-ed25519 AAAAnew1\n"
                                 "gpuctl-i-2 ssh-ed25519 AAAAnew2\n")
    assert oct(known.stat().st_mode & 0o777) == "0o600"
    mtime = known.stat().st_mtime_ns
    assert ssh.pin_host_keys(known, keys) == 0 and known.stat().st_mtime_ns == mtime  # unchanged: not rewritten
    assert ssh.known_aliases(known) == {"gpuctl-i-1", "gpuctl-i-2", "gpuctl-bastion-x"}
    assert ssh.known_aliases(tmp_path / "none") == set()


def test_local_nodes_host_keys_are_read_where_node_sh_made_them(tmp_path: Path):
    from gpuctl.providers import get_provider

    cdir = tmp_path / "c"
    for rank, line in ((0, "ssh-ed25519 AAAAzero gpuctl-local-node-0"), (2, "ssh-ed25519 AAAAtwo")):
        sshd = cdir / "nodes" / f"node{rank}" / "sshd"
        sshd.mkdir(parents=True)
        (sshd / "ssh_host_ed25519_key.pub").write_text(line + "\n")
    provider = get_provider("local")
    assert provider.authorizes_internal_key_at_boot
    assert provider.boot_host_keys(cdir, 3) == {0: "ssh-ed25519 AAAAzero gpuctl-local-node-0",
                                                2: "ssh-ed25519 AAAAtwo"}  # node1 not made yet: learned later
    assert get_provider("aws").boot_host_keys(cdir, 3) == {}
    assert not get_provider("aws").authorizes_internal_key_at_boot


def test_only_the_install_step_goes_through_the_head():
    assert prepare.only_install_step(manages_sshd=False, features=(), python=None)
    assert not prepare.only_install_step(manages_sshd=True, features=(), python=None)  # sshd limits: Ansible
    assert not prepare.only_install_step(manages_sshd=False, features=("rclone",), python=None)
    assert not prepare.only_install_step(manages_sshd=False, features=(), python={"version": "3.11"})


def test_peers_are_reached_with_a_cheap_key_exchange_only_where_the_default_is_sntrup761():
    """OpenSSH 9.0-9.8 start with sntrup761x25519 (65 ms of client CPU a connection here); a node's
    ssh puts mlkem768x25519 or curve25519 first for hops inside the cluster, and changes nothing
    where its defaults are already fast or `^` may be unknown."""
    from gpuctl.node import peerssh

    def kex(*names: str):
        return lambda: "\n".join(names) + "\n"

    assert peerssh.fast_kex_option(kex("mlkem768x25519-sha256", "sntrup761x25519-sha512@openssh.com",
                                       "curve25519-sha256")) == ["-o", "KexAlgorithms=^mlkem768x25519-sha256"]
    assert peerssh.fast_kex_option(kex("sntrup761x25519-sha512@openssh.com", "curve25519-sha256")) == \
        ["-o", "KexAlgorithms=^curve25519-sha256"]
    assert peerssh.fast_kex_option(kex("curve25519-sha256", "diffie-hellman-group14-sha256")) == []  # OpenSSH 7.4
    assert peerssh.fast_kex_option(kex("sntrup761x25519-sha512@openssh.com")) == []  # curve25519 not built in

    def broken():
        raise OSError("no ssh")

    assert peerssh.fast_kex_option(broken) == []


def _imports_from_cache(home: Path) -> bool:
    """Whether the node's agent loads from its pyc (Python says 'code object from' the cache)."""
    lib = home / ".gpuctl" / "lib"
    proc = subprocess.run([sys.executable, "-v", "-c", f"import sys; sys.path.insert(0, {str(lib)!r}); "
                           "import gpuctl_node"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return f"code object from '{lib}/__pycache__/gpuctl_node." in proc.stderr


def test_workers_get_the_agent_compiled_once_by_the_head(tmp_path: Path):
    """The head compiles the agent once; each worker runs that code and keeps it as a pyc checked
    against the source's hash, so neither its install nor its first job compiles 3,500 lines."""
    workers = ["10.0.0.3"]
    homes, env = setup(tmp_path, workers)
    assert _imports_from_cache(homes / "head")  # the play's bootstrap kept its compile too
    proc, results = install_peers(env, workers, bundle(workers))
    assert proc.returncode == 0 and results["node-10.0.0.3"]["ok"], proc.stderr
    pyc = next((homes / "10.0.0.3" / ".gpuctl" / "lib" / "__pycache__").glob("gpuctl_node.*.pyc"))
    assert pyc.read_bytes()[4:8] == b"\x03\x00\x00\x00"  # PEP 552: hash-based, checked
    assert _imports_from_cache(homes / "10.0.0.3")
    # a later agent never runs from that cache: the hash no longer matches, Python compiles the new text
    agent = homes / "10.0.0.3" / ".gpuctl" / "lib" / "gpuctl_node.py"
    agent.write_text(agent.read_text() + "\nLATER = True\n")
    lib = agent.parent
    later = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(lib)!r}); "
                            "import gpuctl_node; print(gpuctl_node.LATER)"], capture_output=True, text=True, timeout=60)
    assert later.stdout.strip() == "True", later.stderr


def test_bytecode_of_another_python_is_not_run(tmp_path: Path):
    """A worker whose Python differs from the head's (another magic number) compiles the text."""
    home = tmp_path / "node"
    home.mkdir()
    data = bundle(["10.0.0.3"])
    data["ssh"] = dict(data["ssh"], key=PRIVATE)
    data["agent_code"] = {"magic": "AAAAAA==", "zdata": "bm90IGJ5dGVjb2Rl"}  # neither this Python's nor marshal
    done = subprocess.run([sys.executable, "-c", prepare.install_bootstrap()], input=json.dumps(data),
                          capture_output=True, text=True, env={**os.environ, "HOME": str(home)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _imports_from_cache(home)
