output "nodes" {
  description = "Nodes in rank order, with public IPs."
  value       = module.cluster.nodes
}

output "ssh_user" {
  description = "Login user."
  value       = module.cluster.ssh_user
}
