data "aws_ssm_parameter" "bastion_ami" {
  count = var.bastion.enabled && var.bastion.ami_id == null ? 1 : 0

  name = var.bastion.ami_ssm_parameter
}

resource "aws_security_group" "bastion" {
  count = var.bastion.enabled ? 1 : 0

  name_prefix = "${var.name}-bastion-"
  description = "gpuctl ${var.name} bastion: SSH from named CIDRs only"
  vpc_id      = local.vpc_id

  tags = merge(local.tags, { Name = "${var.name}-bastion" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "bastion_ssh" {
  for_each = var.bastion.enabled ? toset(var.ssh_ingress_cidrs) : toset([])

  security_group_id = aws_security_group.bastion[0].id
  description       = "SSH from ${each.value}"
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  cidr_ipv4         = each.value
  tags              = local.tags
}

resource "aws_vpc_security_group_egress_rule" "bastion_all" {
  count = var.bastion.enabled ? 1 : 0

  security_group_id = aws_security_group.bastion[0].id
  description       = "All outbound traffic (SSH on to the nodes)"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
  tags              = local.tags
}

resource "aws_instance" "bastion" {
  count = var.bastion.enabled ? 1 : 0

  ami                         = var.bastion.ami_id != null ? var.bastion.ami_id : data.aws_ssm_parameter.bastion_ami[0].insecure_value
  instance_type               = var.bastion.instance_type
  key_name                    = local.key_name
  subnet_id                   = local.public_subnet_id
  vpc_security_group_ids      = [aws_security_group.bastion[0].id]
  associate_public_ip_address = true

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = var.bastion.root_volume_size
    encrypted   = true
    kms_key_id  = var.root_volume_kms_key_id
  }

  tags        = merge(local.tags, { Name = "${var.name}-bastion", "gpuctl-role" = "bastion" })
  volume_tags = merge(local.tags, { Name = "${var.name}-bastion" })

  depends_on = [aws_route.internet]

  lifecycle {
    precondition {
      condition     = length(var.ssh_ingress_cidrs) > 0
      error_message = "bastion.enabled is true but ssh_ingress_cidrs is empty, so nobody could reach the bastion: add the address you connect from, e.g. [\"203.0.113.7/32\"]."
    }
  }
}
