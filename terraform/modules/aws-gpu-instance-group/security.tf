locals {
  node_security_group_ids = concat([aws_security_group.nodes.id], var.extra_security_group_ids)
}

resource "aws_security_group" "nodes" {
  name_prefix = "${var.name}-nodes-"
  description = "gpuctl ${var.name} nodes: all traffic within the group (EFA), SSH from named CIDRs"
  vpc_id      = local.vpc_id

  tags = merge(local.tags, { Name = "${var.name}-nodes" })

  lifecycle {
    create_before_destroy = true
  }
}

# EFA's OS-bypass traffic needs both self rules; the egress one even with egress to 0.0.0.0/0.
#
# Rules that reference a group: when the provider does not know the account id
# (skip_requesting_account_id, as with EC2 emulators) it reads the reference back as
# "account/sg-id", plans an update, and that update fails (hashicorp/terraform-provider-aws#30664).
# So they ignore changes to the reference (a new group replaces them instead) and carry no
# description, which moto drops (another endless diff).
resource "aws_vpc_security_group_ingress_rule" "nodes_self" {
  security_group_id            = aws_security_group.nodes.id
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.nodes.id
  tags                         = local.tags

  lifecycle {
    ignore_changes = [referenced_security_group_id]
  }
}

resource "aws_vpc_security_group_egress_rule" "nodes_self" {
  security_group_id            = aws_security_group.nodes.id
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.nodes.id
  tags                         = local.tags

  lifecycle {
    ignore_changes = [referenced_security_group_id]
  }
}

resource "aws_vpc_security_group_egress_rule" "nodes_internet" {
  security_group_id = aws_security_group.nodes.id
  description       = "All outbound traffic"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
  tags              = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "nodes_ssh" {
  for_each = toset(var.ssh_ingress_cidrs)

  security_group_id = aws_security_group.nodes.id
  description       = "SSH from ${each.value}"
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  cidr_ipv4         = each.value
  tags              = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "nodes_ssh_from_bastion" {
  count = var.bastion.enabled ? 1 : 0

  security_group_id            = aws_security_group.nodes.id
  ip_protocol                  = "tcp"
  from_port                    = 22
  to_port                      = 22
  referenced_security_group_id = aws_security_group.bastion[0].id
  tags                         = local.tags

  lifecycle {
    ignore_changes       = [referenced_security_group_id]
    replace_triggered_by = [aws_security_group.bastion[count.index].id]
  }
}
