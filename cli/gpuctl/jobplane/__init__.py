"""The job plane: how a job reaches every node and comes back.

One SSH call from the controller to the head carries the job (`payload`);
the node agent (the modules in `agent/`, built into the one file
gpuctl_node.py, installed on every node as gpuctl-node) fans it out inside
the cluster and streams every rank's output and exit code back (`events`,
read by `client`; both ends speak `protocol`, and the controller calls the
agent only through `agentcall`). The workdir and file_mounts go to the head once
(`upload`) and from the head's copy to the workers. No Ansible runs here:
the configuration plane (`gpuctl.configplane`) prepares a node once, and the
job plane checks, per job, that the node is still as prepared.
"""
