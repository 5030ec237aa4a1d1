"""The configuration plane: Ansible playbooks that bring nodes to a known state.

`prepare` runs when a cluster is created and whenever a node's prepared state
differs from what this gpuctl expects (its fingerprint); jobs never start an
ansible-playbook (they go through `gpuctl.jobplane`). `playbooks` runs the
packaged playbooks through ansible-runner.
"""
