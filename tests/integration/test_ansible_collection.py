"""gpuctl's Ansible side as the collection gpuctl.cluster, used with no gpuctl code driving it,
as a platform team's CI would: `ansible-galaxy collection build ansible/`, install it into a
temporary collections path, then `ansible-playbook` of a playbook of one's own that imports
gpuctl.cluster.prepare, setup, env and run, against two real sshd nodes (tests/testhosts.py)
from a hand-written inventory. What the tarball holds: tests/unit/test_collection_build.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import testhosts
import yaml

from gpuctl.configplane import bundle, collection

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# The platform team's own playbook: the README's example, with the test's own key and head.
SITE = """\
- ansible.builtin.import_playbook: gpuctl.cluster.prepare
  vars:
    gpuctl_internal_key: {key}
    gpuctl_fabric_head: {head}
    gpuctl_sshd_limits_manage: false   # the test hosts run their own sshd config
- ansible.builtin.import_playbook: gpuctl.cluster.setup
- ansible.builtin.import_playbook: gpuctl.cluster.env
- ansible.builtin.import_playbook: gpuctl.cluster.run
"""


def ansible(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / args[0]), *args[1:]], check=False, capture_output=True, text=True, cwd=cwd,
                          env=env, stdin=subprocess.DEVNULL, timeout=300)


def test_prepare_setup_run_from_the_installed_collection(tmp_path: Path) -> None:
    why = testhosts.missing_requirements()
    if why:
        pytest.skip(why)
    # Nothing of gpuctl's own Ansible settings: no ANSIBLE_* from the caller, no ansible.cfg in
    # the working directory, so roles can only come from the installed collection.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(tmp_path / "no-such.cfg"), ANSIBLE_COLLECTIONS_PATH=str(tmp_path / "collections"),
               ANSIBLE_HOME=str(tmp_path / "ansible-home"))
    tarball = collection.build(tmp_path / "dist", galaxy=str(BIN / "ansible-galaxy"))  # as `make collection`
    installed = ansible(["ansible-galaxy", "collection", "install", "-p", str(tmp_path / "collections"),
                         str(tarball)], cwd=tmp_path, env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    key = tmp_path / "internal_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuctl-internal-coll", "-f", str(key)],
                   check=True)
    token = "tok-" + secrets.token_hex(12)
    secrets_file = tmp_path / "secrets.sh"
    secrets_file.touch(mode=0o600)
    secrets_file.write_text(f"export API_TOKEN='{token}'\n")

    with testhosts.running_hosts(2, tmp_path / "hosts", cluster="coll") as hosts:
        nodes = hosts.inventory.nodes
        head = nodes[0].address
        inventory = tmp_path / "inventory.yml"
        inventory.write_text(yaml.safe_dump({"all": {"children": {"gpuctl_nodes": {"hosts": {
            f"gpu-{n.rank}": {"ansible_host": n.ssh_host, "ansible_port": n.ssh_port, "ansible_user": n.ssh_user,
                              "ansible_ssh_private_key_file": str(hosts.key), "gpuctl_rank": n.rank,
                              "gpuctl_address": n.address,
                              "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}
            for n in nodes}}}}}))
        job = tmp_path / "job.yml"
        job.write_text(yaml.safe_dump({
            "gpuctl_job_id": "coll-1",
            "gpuctl_setup_script": "echo \"setup $GPUCTL_NODE_RANK of $GPUCTL_NUM_NODES\" > ~/coll-setup.txt\n",
            "gpuctl_setup_env": {"GPUCTL_NUM_NODES": "2"},
            "gpuctl_setup_rank_vars": ["GPUCTL_NODE_RANK"],
            "gpuctl_run_script": "echo \"rank $RANK master $MASTER_ADDR token $API_TOKEN $(cat ~/coll-setup.txt)\" "
                                 "> ~/coll-run.txt\ncat \"$GPUCTL_HOSTFILE\" > ~/coll-hostfile.txt\n",
            "gpuctl_run_env": {"MASTER_ADDR": head, "WORLD_SIZE": "2"},
            "gpuctl_run_rank_vars": ["RANK"],
            "gpuctl_secrets_file": str(secrets_file),
            "gpuctl_hostfile_lines": [f"{n.address} slots=1" for n in nodes],
        }))
        site = tmp_path / "site.yml"
        site.write_text(SITE.format(key=key, head=head))
        play = ansible(["ansible-playbook", "-i", str(inventory), "-e", f"@{job}", str(site)], cwd=tmp_path, env=env)
        assert play.returncode == 0, f"{play.stdout[-4000:]}\n{play.stderr[-2000:]}"
        assert token not in play.stdout + play.stderr  # the secret went by file, copied no_log

        # run returns once every rank started; the agent records each rank's exit when it ends.
        exits = [hosts.home(n.rank) / ".gpuctl" / "jobs" / "coll-1" / "run.exit" for n in nodes]
        deadline = time.monotonic() + 30
        while not all(p.is_file() for p in exits) and time.monotonic() < deadline:
            time.sleep(0.2)
        for n, exit_file in zip(nodes, exits):
            home = hosts.home(n.rank)
            assert exit_file.read_text().strip() == "0"
            assert (home / "coll-setup.txt").read_text() == f"setup {n.rank} of 2\n"
            run_out = (home / "coll-run.txt").read_text()
            assert run_out == f"rank {n.rank} master {head} token {token} setup {n.rank} of 2\n"
            assert (home / "coll-hostfile.txt").read_text() == "".join(f"{m.address} slots=1\n" for m in nodes)
            launcher = home / ".gpuctl" / "bin" / "gpuctl-node"
            assert os.access(launcher, os.X_OK)
            assert launcher.read_bytes() == bundle.files()["bin/gpuctl-node"][0]
            agent = home / ".gpuctl" / "lib" / "gpuctl_node.py"
            assert agent.read_bytes() == bundle.agent_text().encode()
            assert "NCCL_SOCKET_IFNAME=" in (home / ".gpuctl" / "fabric.env").read_text()
            assert (home / ".ssh" / "gpuctl_cluster").read_bytes() == key.read_bytes()  # node-to-node SSH
            assert f"HostName {nodes[1 - n.rank].address}" in (home / ".ssh" / "config").read_text()

        # A collection playbook by its name, with a variable left out: one clear message, no node touched.
        missing = ansible(["ansible-playbook", "-i", str(inventory), "-e", "gpuctl_run_script=true",
                           "gpuctl.cluster.run"], cwd=tmp_path, env=env)
        assert missing.returncode != 0
        assert "gpuctl_job_id is not set" in missing.stdout
