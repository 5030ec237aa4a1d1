"""gpuctl: multi-node GPU training clusters from one cluster.yaml.

Layers, each its own module, passing plain values:
spec (cluster.yaml) -> cluster (request) -> render/terraform (provision)
-> inventory (from `terraform output -json`) -> jobenv/playbooks (Ansible)
-> stream (live rank output) -> state (registry of clusters and jobs).
"""

__version__ = "0.1.0"
