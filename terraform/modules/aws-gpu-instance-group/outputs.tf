# gpuctl's inventory reads nodes, ssh_user and bastion (docs/architecture.md); their names and
# shapes are pinned by tests/output_shapes.tftest.hcl.

locals {
  node_public_ips = [
    for i, node in aws_instance.node : var.elastic_ip ? aws_eip.node[i].public_ip : (try(length(node.public_ip) > 0, false) ? node.public_ip : null)
  ]

  # The ansible_inventory output: gpuctl's inventory format (inventories/README.md).
  inventory_gpus  = coalesce(var.gpus_per_node, try(sum([for g in local.node_type.gpus : g.count]), 0), 0)
  inventory_proxy = var.bastion.enabled ? "${var.bastion.ssh_user}@${aws_instance.bastion[0].public_ip}" : null
  inventory_hosts = {
    for i, node in aws_instance.node : (i == 0 ? "head" : "worker${i}") => merge(
      {
        # behind a bastion, or without a public address: the private one (from the VPC, or via ProxyJump)
        ansible_host   = local.inventory_proxy == null && local.node_public_ips[i] != null ? local.node_public_ips[i] : node.private_ip
        ansible_port   = 22
        ansible_user   = var.ssh_user
        gpuctl_rank    = i
        gpuctl_address = node.private_ip
        gpuctl_gpus    = local.inventory_gpus
        gpuctl_node_id = node.id
      },
      var.ssh_private_key_file == null ? {} : { ansible_ssh_private_key_file = var.ssh_private_key_file },
      local.inventory_proxy == null ? {} : {
        gpuctl_proxy_jump       = local.inventory_proxy
        ansible_ssh_common_args = "-o ProxyJump=${local.inventory_proxy}"
      },
    )
  }
}

output "nodes" {
  description = "Nodes in rank order (index 0 is the head): `{id, private_ip, public_ip, availability_zone}`; public_ip is null when a node has none."
  value = [
    for i, node in aws_instance.node : {
      id                = node.id
      private_ip        = node.private_ip
      public_ip         = local.node_public_ips[i]
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

output "ansible_inventory" {
  description = "The nodes as an Ansible YAML inventory (group `gpuctl_nodes`, hosts head, worker1, ... in rank order; gpuctl's inventory format, also usable as `infra: ssh/FILE`): `terraform output -raw ansible_inventory > inventory.yml`."
  value = yamlencode({
    all = {
      vars = {
        gpuctl_cluster = var.name
        gpuctl_cloud   = "aws"
        gpuctl_zone    = local.availability_zone
      }
      children = { gpuctl_nodes = { hosts = local.inventory_hosts } }
    }
  })
}
