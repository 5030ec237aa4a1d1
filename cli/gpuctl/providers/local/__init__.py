"""Local nodes: sshd processes on this machine, each in its own network namespace (or on
loopback ports), for the demo, tests and trying gpuctl without a cloud (terraform/modules/local-nodes)."""
