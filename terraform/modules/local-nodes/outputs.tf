# The module contract every gpuctl provider module honours (docs/architecture.md):
# the inventory generator reads these three outputs and nothing else.

output "nodes" {
  description = "Nodes in rank order (index 0 = head): id, private_ip (the address other nodes use), public_ip (null), ssh_host/ssh_port (where the controller connects), availability_zone (null)."
  value = [for i, n in terraform_data.node : {
    id                = n.id
    private_ip        = local.nodes[i].address
    public_ip         = null
    ssh_host          = local.nodes[i].address
    ssh_port          = local.nodes[i].port
    availability_zone = null
  }]
}

output "ssh_user" {
  description = "User the controller logs in as."
  value       = var.ssh_user
}

output "bastion" {
  description = "Always null: the controller reaches local nodes directly."
  value       = null
}
