# gpuctl's inventory reads nodes, ssh_user and bastion (docs/architecture.md); their names and
# shapes are pinned by tests/output_shapes.tftest.hcl.

output "nodes" {
  description = "Nodes in rank order (index 0 is the head): `{id, private_ip, public_ip, availability_zone}`; public_ip is null when a node has none."
  value = [
    for i, node in aws_instance.node : {
      id                = node.id
      private_ip        = node.private_ip
      public_ip         = var.elastic_ip ? aws_eip.node[i].public_ip : (try(length(node.public_ip) > 0, false) ? node.public_ip : null)
      availability_zone = node.availability_zone
    }
  ]
}

output "bastion" {
  description = "The bastion as `{id, public_ip, private_ip, ssh_user}` (use it as ProxyJump), or null when disabled."
  value = var.bastion.enabled ? {
    id         = aws_instance.bastion[0].id
    public_ip  = aws_instance.bastion[0].public_ip
    private_ip = aws_instance.bastion[0].private_ip
    ssh_user   = var.bastion.ssh_user
  } : null
}

output "ssh_user" {
  description = "Login user on the nodes."
  value       = var.ssh_user
}

output "launch_template_id" {
  description = "ID of the nodes' launch template."
  value       = aws_launch_template.node.id
}

output "security_group_id" {
  description = "ID of the nodes' security group (all traffic within itself, for EFA)."
  value       = aws_security_group.nodes.id
}

output "placement_group_name" {
  description = "Name of the cluster placement group the nodes are in, or null."
  value       = local.placement_group_name
}

output "efa_interfaces_per_node" {
  description = "EFA devices per node (0 without EFA)."
  value       = local.efa_count
}

output "subnet_id" {
  description = "ID of the subnet holding every node."
  value       = local.subnet_id
}

output "vpc_id" {
  description = "ID of the nodes' VPC."
  value       = local.vpc_id
}

output "availability_zone" {
  description = "Availability Zone of every node."
  value       = local.availability_zone
}

output "nat_gateway_id" {
  description = "ID of the NAT gateway that gives private nodes internet egress, or null when there is none."
  value       = one(aws_nat_gateway.this[*].id)
}

output "public_subnet_id" {
  description = "ID of the public subnet holding the bastion and the NAT gateway, or null when the nodes' subnet is the only one."
  value       = one(aws_subnet.public[*].id)
}
