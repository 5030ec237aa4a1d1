#!/usr/bin/python
"""Ansible module: bring a node to gpuctl's prepared state in one step (role gpuctl_node)."""

DOCUMENTATION = r"""
module: gpuctl_node_install
short_description: Bring a node to gpuctl's prepared state in one step
description:
  - Runs the node agent's install step (C(gpuctl-node install), cli/gpuctl/node/install.py)
    with O(bundle) on its stdin, in one module run per node.
  - Each file is written only when its content differs (write, then rename), the fingerprint last.
options:
  bundle:
    description: The agent's files, node-to-node SSH (public key and cluster view), the fabric probe's
      settings and the fingerprint, as the role builds them.
    type: dict
    required: true
  private_key:
    description: The cluster's internal private key (kept out of the results and logs).
    type: str
    default: ""
"""

RETURN = r"""
fabric:
  description: The node's fabric as its probe found it (gpuctl-fabric-probe's JSON).
  type: dict
  returned: success
hostname:
  description: The node's hostname (uname -n).
  type: str
  returned: success
"""

import json
import sys

from ansible.module_utils.basic import AnsibleModule

# Loads the agent from the bundle (nothing is written before everything was read) and runs its install.
# The head sends its workers the agent compiled too (`agent_code`): taken when this Python's bytecode
# is the same (magic number), else the text is compiled here. install() keeps it as the import cache.
BOOTSTRAP = (
    "import base64, json, marshal, sys, types, zlib\n"
    "from importlib.util import MAGIC_NUMBER\n"
    "bundle = json.load(sys.stdin)\n"
    "entry = bundle['files']['lib/gpuctl_node.py']\n"
    "text = zlib.decompress(base64.b64decode(entry['zdata'])) if 'zdata' in entry else entry['text']\n"
    "given = bundle.get('agent_code') or {}\n"
    "code = (marshal.loads(zlib.decompress(base64.b64decode(given['zdata'])))\n"
    "        if base64.b64decode(given.get('magic') or '') == MAGIC_NUMBER else compile(text, 'gpuctl_node.py', 'exec'))\n"
    "agent = types.ModuleType('gpuctl_node')\n"
    "exec(code, agent.__dict__)\n"
    "sys.exit(agent.install(bundle, code))\n"
)


def main():
    # no_log: the bundle (the agent, the cluster view) is not written to the node's syslog either
    module = AnsibleModule(argument_spec={"bundle": {"type": "dict", "required": True},
                                          "private_key": {"type": "str", "default": "", "no_log": True}},
                           no_log=True)
    bundle = dict(module.params["bundle"])
    # Results carry no agent text and no key: what the node was given, in short.
    shown = {"module_args": {"fingerprint": bundle.get("fingerprint"), "files": sorted(bundle.get("files") or {}),
                             "ssh": bool(bundle.get("ssh"))}}
    # Before ansible-core 2.19 a template that gave None gives "": no node-to-node SSH either way.
    bundle["ssh"] = dict(bundle["ssh"], key=module.params["private_key"]) if bundle.get("ssh") else None
    rc, out, err = module.run_command([sys.executable, "-c", BOOTSTRAP], data=json.dumps(bundle),
                                      binary_data=True)
    if rc != 0:
        lines = [ln for ln in (err or out or "").strip().splitlines() if ln.strip()]
        module.fail_json(msg=" | ".join(lines[-3:]) or "gpuctl-node install: exit code %d" % rc, rc=rc,
                         stderr=err, invocation=shown)
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        module.fail_json(msg="gpuctl-node install printed no result", rc=rc, stdout=out, stderr=err,
                         invocation=shown)
    changed = bool(result.pop("changed", False))
    module.exit_json(changed=changed, hostname=result.get("hostname", ""), fabric=result, invocation=shown)


if __name__ == "__main__":
    main()
