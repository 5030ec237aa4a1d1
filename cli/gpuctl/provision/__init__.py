"""From a ClusterRequest to nodes one can reach: the provider's Terraform root applied
(`provisioner`, `terraform`), its outputs read as an Inventory (`inventory`, `ansibleinventory`),
keys, ssh options and ssh config made (`sshkeys`, `ssh`, `sshconfig`), and a cluster's life
(`lifecycle`: bring_up / tear_down under the cluster's lock). Knows no cloud by name: it asks
the provider (gpuctl.providers)."""
