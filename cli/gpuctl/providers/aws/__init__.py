"""AWS: GPU instance groups with EFA and placement groups (terraform/modules/aws-gpu-instance-group).
`provider` is the Provider; `preflight` asks EC2 before Terraform runs, `catalog` resolves
accelerators to instance types offline, `hostkeys` checks learned host keys against the console,
`instances` reads the nodes' states (stopped? lost?).
Kept light: the registry imports `provider` only when a cluster is on AWS (boto3 with it)."""
