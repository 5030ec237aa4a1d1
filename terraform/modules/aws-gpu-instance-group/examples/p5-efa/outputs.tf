output "nodes" {
  description = "Nodes in rank order."
  value       = module.cluster.nodes
}

output "bastion" {
  description = "The bastion (ProxyJump host)."
  value       = module.cluster.bastion
}

output "efa_interfaces_per_node" {
  description = "EFA devices per node (32 on p5.48xlarge)."
  value       = module.cluster.efa_interfaces_per_node
}

output "ssh_head" {
  description = "Command to reach the head node through the bastion."
  value       = "ssh -J ${module.cluster.bastion.ssh_user}@${module.cluster.bastion.public_ip} ${module.cluster.ssh_user}@${module.cluster.nodes[0].private_ip}"
}
