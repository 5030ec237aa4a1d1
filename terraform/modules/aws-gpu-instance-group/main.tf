locals {
  tags = merge(var.tags, { "gpuctl-cluster" = var.name })

  ami_id = var.ami_id != null ? var.ami_id : data.aws_ssm_parameter.node_ami[0].insecure_value

  key_name = var.ssh_public_key != null ? aws_key_pair.this[0].key_name : var.key_name
}

################################################################################
# EFA interface layout, computed from what EC2 reports for the instance type
################################################################################

data "aws_ec2_instance_type" "node" {
  count = var.efa == false ? 0 : 1

  instance_type = var.instance_type

  lifecycle {
    postcondition {
      condition     = var.efa != true || (self.efa_supported && self.efa_maximum_interfaces > 0)
      error_message = "instance type ${var.instance_type} does not support EFA; use network_tier standard or an EFA type such as p5.48xlarge (module input: efa = false or null)."
    }
  }
}

locals {
  node_type = try(data.aws_ec2_instance_type.node[0], null)

  # Card indices in numeric order; sort() would put "10" before "2".
  reported_cards = [for card in try(local.node_type.network_cards, []) : card.index]
  ordered_cards  = [for i in range(try(max(local.reported_cards...) + 1, 0)) : i if contains(local.reported_cards, i)]
  card_indices   = length(local.ordered_cards) > 0 ? local.ordered_cards : range(max(try(local.node_type.maximum_network_cards, 0), 1))

  # efa_maximum_interfaces, not maximum_network_cards: they differ on p6-b300. One EFA per card.
  efa_count = var.efa == false || !try(local.node_type.efa_supported, false) ? 0 : min(try(local.node_type.efa_maximum_interfaces, 0), length(local.card_indices))

  # Fewer EFAs than cards means card 0 is ENA only (p6-b300: 17 cards, 16 EFA on cards 1-16).
  primary_is_efa = local.efa_count > 0 && local.efa_count >= length(local.card_indices)
  efa_only_cards = (local.primary_is_efa
    ? slice(local.card_indices, 1, local.efa_count)
    : slice([for c in local.card_indices : c if c != 0], 0, local.efa_count)
  )

  # Card 0 / device 0 carries the node's one IP; every other EFA is efa-only (no IP) at
  # device 1 of its own card, the layout AWS documents for P5 ("use case 1").
  network_interfaces = local.efa_count == 0 ? [] : concat(
    [{ network_card_index = 0, device_index = 0, interface_type = local.primary_is_efa ? "efa" : "interface" }],
    [for card in local.efa_only_cards : { network_card_index = card, device_index = 1, interface_type = "efa-only" }],
  )
  interfaces_per_node = max(length(local.network_interfaces), 1)

  nodes_public = coalesce(var.associate_public_ip, local.interfaces_per_node == 1 && !var.elastic_ip && !var.bastion.enabled && var.nat_gateway != true)
}

################################################################################
# Key pair and placement group
################################################################################

resource "aws_key_pair" "this" {
  count = var.ssh_public_key != null ? 1 : 0

  key_name_prefix = "${var.name}-"
  public_key      = trimspace(var.ssh_public_key)
  tags            = local.tags
}

locals {
  placement_mode = coalesce(var.placement_group.mode, var.market == "capacity-block" ? "none" : "create")

  placement_group_name = {
    create   = one(aws_placement_group.this[*].name)
    existing = var.placement_group.name
    none     = null
  }[local.placement_mode]
}

resource "aws_placement_group" "this" {
  count = local.placement_mode == "create" ? 1 : 0

  name     = coalesce(var.placement_group.name, var.name)
  strategy = "cluster"
  tags     = local.tags
}
