output "nodes" {
  description = "Nodes in rank order, each with a public IP."
  value       = module.cluster.nodes
}

output "ssh_user" {
  description = "Login user."
  value       = module.cluster.ssh_user
}
