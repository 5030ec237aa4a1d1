data "aws_ssm_parameter" "node_ami" {
  count = var.ami_id == null ? 1 : 0

  name = var.ami_ssm_parameter
}

# Only for the root device name, which differs between AMIs (/dev/sda1, /dev/xvda).
data "aws_ami" "node" {
  filter {
    name   = "image-id"
    values = [local.ami_id]
  }
}

resource "aws_launch_template" "node" {
  name_prefix            = "${var.name}-"
  description            = "gpuctl ${var.name}: ${var.instance_type}, ${local.efa_count} EFA interface(s)"
  image_id               = local.ami_id
  instance_type          = var.instance_type
  key_name               = local.key_name
  user_data              = var.user_data != null ? base64encode(var.user_data) : null
  update_default_version = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2 # containers on the node reach IMDS through one more hop
  }

  block_device_mappings {
    device_name = data.aws_ami.node.root_device_name

    ebs {
      volume_size           = var.root_volume_size
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.root_volume_kms_key_id
      delete_on_termination = true
    }
  }

  # Without EFA there are no interface blocks: subnet and security groups go on aws_instance,
  # which also keeps the module usable against EC2 emulators that ignore them here.
  dynamic "network_interfaces" {
    for_each = local.network_interfaces

    content {
      network_card_index    = network_interfaces.value.network_card_index
      device_index          = network_interfaces.value.device_index
      interface_type        = network_interfaces.value.interface_type
      subnet_id             = local.subnet_id
      security_groups       = local.node_security_group_ids
      delete_on_termination = true
      # EC2 rejects this parameter (even false) when an instance has several interfaces.
      associate_public_ip_address = local.interfaces_per_node == 1 ? local.nodes_public : null
    }
  }

  dynamic "placement" {
    for_each = local.placement_group_name != null ? [local.placement_group_name] : []

    content {
      group_name = placement.value
    }
  }

  dynamic "instance_market_options" {
    for_each = var.market != "on-demand" ? [var.market] : []

    content {
      market_type = instance_market_options.value

      dynamic "spot_options" {
        for_each = instance_market_options.value == "spot" ? [1] : []

        content {
          spot_instance_type             = "one-time"
          instance_interruption_behavior = "terminate"
        }
      }
    }
  }

  dynamic "capacity_reservation_specification" {
    for_each = var.capacity_reservation_id != null ? [var.capacity_reservation_id] : []

    content {
      capacity_reservation_target {
        capacity_reservation_id = capacity_reservation_specification.value
      }
    }
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(local.tags, { Name = var.name })
  }

  tag_specifications {
    resource_type = "network-interface"
    tags          = merge(local.tags, { Name = var.name })
  }

  tags = local.tags

  lifecycle {
    precondition {
      condition     = (var.ssh_public_key == null) != (var.key_name == null)
      error_message = "Set exactly one of ssh_public_key (imported as a new key pair) or key_name (an existing EC2 key pair)."
    }

    precondition {
      condition     = var.market != "capacity-block" || var.capacity_reservation_id != null
      error_message = "market = \"capacity-block\" needs capacity_reservation_id: the cr-... id of the purchased Capacity Block (and a subnet in its Availability Zone)."
    }

    precondition {
      condition     = var.instance_state == "running" || var.market != "spot"
      error_message = "Spot nodes cannot be stopped (a one-time spot request ends when its instance stops): keep instance_state = \"running\", or destroy the nodes."
    }

    precondition {
      condition     = var.market != "spot" || var.capacity_reservation_id == null
      error_message = "Spot instances cannot launch into a capacity reservation: drop capacity_reservation_id, or use market = \"on-demand\" or \"capacity-block\"."
    }

    precondition {
      condition     = local.placement_mode != "existing" || var.placement_group.name != null
      error_message = "placement_group.mode = \"existing\" needs placement_group.name: the name of a cluster placement group in the nodes' Availability Zone."
    }

    precondition {
      condition     = !(var.associate_public_ip == true && local.interfaces_per_node > 1)
      error_message = "${var.instance_type} nodes get ${local.interfaces_per_node} network interfaces for EFA, and EC2 refuses an auto-assigned public IP with more than one. Set associate_public_ip = false and reach the nodes through bastion = { enabled = true } (ProxyJump), or set elastic_ip = true."
    }

    precondition {
      condition     = !(var.associate_public_ip == true && var.elastic_ip)
      error_message = "associate_public_ip and elastic_ip both give nodes a public address; set only one (elastic_ip works with any number of interfaces)."
    }

    precondition {
      condition     = !(var.nat_gateway == true && var.subnet_id != null)
      error_message = "nat_gateway = true needs the module's own VPC, but subnet_id is given: the caller owns that subnet's routing. Drop nat_gateway and give the subnet's route table a 0.0.0.0/0 route to your NAT gateway."
    }

    precondition {
      condition     = !(var.nat_gateway == true && (var.associate_public_ip == true || var.elastic_ip))
      error_message = "nat_gateway = true puts the nodes in a private subnet, where a public address (associate_public_ip or elastic_ip) cannot be reached; set only one of them."
    }

    precondition {
      condition     = local.create_network || var.availability_zone == null || var.availability_zone == local.availability_zone
      error_message = "availability_zone (${coalesce(var.availability_zone, "null")}) is not the zone of subnet_id (${coalesce(local.availability_zone, "unknown")}); EFA clusters live in one zone: drop availability_zone or pass a subnet in it."
    }
  }
}

# Everything that shapes a node except tags. The instances ignore launch-template versions and
# are replaced when this changes, so a tag change never recreates a (costly) GPU fleet.
resource "terraform_data" "node_shape" {
  input = {
    ami_id                  = local.ami_id
    instance_type           = var.instance_type
    key_name                = local.key_name
    subnet_id               = local.subnet_id
    network_interfaces      = local.network_interfaces
    security_group_ids      = local.efa_count > 0 ? local.node_security_group_ids : []
    placement_group_name    = local.placement_group_name
    market                  = var.market
    capacity_reservation_id = var.capacity_reservation_id
    root_volume_size        = var.root_volume_size
    root_volume_kms_key_id  = var.root_volume_kms_key_id
    # Always null: the profile is set on the instances, which take a new one in place (EC2
    # AssociateIamInstanceProfile). The key stays so that states written before keep their nodes.
    iam_instance_profile = null
    user_data_sha256     = var.user_data != null ? sha256(var.user_data) : null
  }
}

resource "aws_instance" "node" {
  count = var.node_count

  launch_template {
    id      = aws_launch_template.node.id
    version = aws_launch_template.node.latest_version
  }

  # Set only without launch-template interfaces; EC2 refuses both on one request.
  subnet_id                   = local.efa_count == 0 ? local.subnet_id : null
  vpc_security_group_ids      = local.efa_count == 0 ? local.node_security_group_ids : null
  associate_public_ip_address = local.efa_count == 0 ? local.nodes_public : null

  # On the instance, not in the launch template: a changed profile is associated with the
  # running nodes in place instead of replacing them.
  iam_instance_profile = var.iam_instance_profile

  # On the instance too (EC2 ModifyInstanceAttribute, in place): a cluster that now autodowns
  # terminates when its head shuts the nodes down. A one-time spot instance cannot be stopped.
  instance_initiated_shutdown_behavior = var.market == "spot" ? "terminate" : var.shutdown_behavior

  tags = merge(local.tags, {
    Name          = "${var.name}-${count.index}"
    "gpuctl-rank" = tostring(count.index)
  })

  # Egress ready before cloud-init runs.
  depends_on = [aws_route.internet, aws_route.nat]

  lifecycle {
    ignore_changes       = [launch_template[0].version]
    replace_triggered_by = [terraform_data.node_shape]
  }
}

# As instance_state says, running unless `gpuctl stop` asked otherwise: a node that stopped itself
# (gpuctl's autostop shuts it down) is started again by the next apply, as SkyPilot's `sky start`
# would; a terminated one is made again by aws_instance.
resource "aws_ec2_instance_state" "node" {
  count = var.node_count

  instance_id = aws_instance.node[count.index].id
  state       = var.instance_state
}

resource "aws_eip" "node" {
  count = var.elastic_ip ? var.node_count : 0

  domain            = "vpc"
  network_interface = aws_instance.node[count.index].primary_network_interface_id

  tags = merge(local.tags, { Name = "${var.name}-${count.index}" })

  depends_on = [aws_internet_gateway.this]
}
