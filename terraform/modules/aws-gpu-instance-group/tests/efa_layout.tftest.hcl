# EFA interface layout per instance type, from realistic describe-instance-types data
# (see /work/shared/guide/fabric.md). Card lists are given out of order on purpose: the module
# must order cards numerically and must count from efa_maximum_interfaces, not the card count.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "efa"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "p4d_24xlarge" {
  command = plan

  variables {
    instance_type = "p4d.24xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 4
      maximum_network_cards      = 4
      maximum_network_interfaces = 60
      network_cards              = [for i in [3, 1, 0, 2] : { index = i, maximum_interfaces = 15, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 4 && output.efa_interfaces_per_node == 4
    error_message = "p4d.24xlarge: want 4 interfaces and 4 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 4) : [c, 1, "efa-only"]]))
    error_message = "p4d.24xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "p4d.24xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "p4d.24xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "p5_48xlarge" {
  command = plan

  variables {
    instance_type = "p5.48xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 32
      maximum_network_cards      = 32
      maximum_network_interfaces = 64
      network_cards              = [for i in [4, 15, 29, 5, 23, 10, 14, 25, 12, 27, 21, 9, 0, 22, 8, 28, 7, 20, 19, 13, 30, 24, 6, 16, 1, 18, 11, 31, 17, 26, 2, 3] : { index = i, maximum_interfaces = 2, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 32 && output.efa_interfaces_per_node == 32
    error_message = "p5.48xlarge: want 32 interfaces and 32 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 32) : [c, 1, "efa-only"]]))
    error_message = "p5.48xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "p5.48xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "p5.48xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "p5en_48xlarge" {
  command = plan

  variables {
    instance_type = "p5en.48xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 16
      maximum_network_cards      = 16
      maximum_network_interfaces = 32
      network_cards              = [for i in [10, 7, 6, 5, 11, 0, 12, 3, 13, 2, 14, 15, 9, 1, 8, 4] : { index = i, maximum_interfaces = 2, baseline_bandwidth = 200, peak_bandwidth = 200, performance = "200 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 16 && output.efa_interfaces_per_node == 16
    error_message = "p5en.48xlarge: want 16 interfaces and 16 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 16) : [c, 1, "efa-only"]]))
    error_message = "p5en.48xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "p5en.48xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "p5en.48xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "p6_b200_48xlarge" {
  command = plan

  variables {
    instance_type = "p6-b200.48xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 8
      maximum_network_cards      = 8
      maximum_network_interfaces = 16
      network_cards              = [for i in [0, 2, 1, 6, 4, 5, 7, 3] : { index = i, maximum_interfaces = 2, baseline_bandwidth = 400, peak_bandwidth = 400, performance = "400 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 8 && output.efa_interfaces_per_node == 8
    error_message = "p6-b200.48xlarge: want 8 interfaces and 8 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 8) : [c, 1, "efa-only"]]))
    error_message = "p6-b200.48xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "p6-b200.48xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "p6-b200.48xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "p6_b300_48xlarge" {
  command = plan

  variables {
    instance_type = "p6-b300.48xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 16
      maximum_network_cards      = 17
      maximum_network_interfaces = 34
      network_cards              = [for i in [9, 0, 8, 6, 10, 5, 15, 7, 16, 1, 13, 2, 12, 3, 4, 11, 14] : { index = i, maximum_interfaces = 2, baseline_bandwidth = i == 0 ? 100 : 400, peak_bandwidth = i == 0 ? 100 : 400, performance = i == 0 ? "100 Gigabit" : "400 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 17 && output.efa_interfaces_per_node == 16
    error_message = "p6-b300.48xlarge: want 17 interfaces and 16 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "interface"]], [for c in range(1, 17) : [c, 1, "efa-only"]]))
    error_message = "p6-b300.48xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "p6-b300.48xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "p6-b300.48xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "g5_48xlarge" {
  command = plan

  variables {
    instance_type = "g5.48xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 1
      maximum_network_cards      = 1
      maximum_network_interfaces = 7
      network_cards              = [for i in [0] : { index = i, maximum_interfaces = 7, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 1 && output.efa_interfaces_per_node == 1
    error_message = "g5.48xlarge: want 1 interfaces and 1 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 1) : [c, 1, "efa-only"]]))
    error_message = "g5.48xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "g5.48xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = aws_launch_template.node.network_interfaces[0].associate_public_ip_address == "true"
    error_message = "g5.48xlarge: a single-interface node gets a public IP by default"
  }
}

run "trn1_32xlarge" {
  command = plan

  variables {
    instance_type = "trn1.32xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 8
      maximum_network_cards      = 8
      maximum_network_interfaces = 40
      network_cards              = [for i in [5, 6, 0, 2, 7, 3, 4, 1] : { index = i, maximum_interfaces = 5, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 8 && output.efa_interfaces_per_node == 8
    error_message = "trn1.32xlarge: want 8 interfaces and 8 EFA, got ${length(aws_launch_template.node.network_interfaces)} and ${output.efa_interfaces_per_node}"
  }

  assert {
    condition     = jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]]) == jsonencode(concat([[0, 0, "efa"]], [for c in range(1, 8) : [c, 1, "efa-only"]]))
    error_message = "trn1.32xlarge: [card, device, type] layout is ${jsonencode([for ni in aws_launch_template.node.network_interfaces : [ni.network_card_index, ni.device_index, ni.interface_type]])}"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718"]) && ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.delete_on_termination == "true"])
    error_message = "trn1.32xlarge: every interface needs the node security group, the cluster subnet and delete_on_termination"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "trn1.32xlarge: EC2 refuses associate_public_ip_address with several interfaces; it must be unset on all"
  }
}

run "type_without_efa_gets_ena" {
  command = plan

  variables {
    instance_type = "g4dn.xlarge"
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = false
      efa_maximum_interfaces     = 0
      maximum_network_cards      = 1
      maximum_network_interfaces = 3
      network_cards              = [{ index = 0, maximum_interfaces = 3, baseline_bandwidth = 5, peak_bandwidth = 25, performance = "Up to 25 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 0 && output.efa_interfaces_per_node == 0
    error_message = "a type without EFA must get no launch-template interfaces"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.subnet_id == "subnet-0a1b2c3d4e5f60718" && n.vpc_security_group_ids == toset(["sg-0a1b2c3d4e5f60718"]) && n.associate_public_ip_address == true])
    error_message = "without EFA the instances carry subnet, security group and public IP themselves"
  }
}

run "efa_off_on_p5" {
  command = plan

  variables {
    instance_type            = "p5.48xlarge"
    efa                      = false
    extra_security_group_ids = ["sg-0123456789abcdef0"]
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 0 && output.efa_interfaces_per_node == 0
    error_message = "efa = false must give plain ENA networking"
  }

  assert {
    condition     = length(data.aws_ec2_instance_type.node) == 0
    error_message = "efa = false needs no instance type lookup (EC2 emulators lack the data)"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.subnet_id == "subnet-0a1b2c3d4e5f60718" && n.vpc_security_group_ids == toset(["sg-0a1b2c3d4e5f60718", "sg-0123456789abcdef0"])])
    error_message = "without EFA the instances carry the subnet and every security group"
  }
}

run "extra_security_groups_on_every_interface" {
  command = plan

  variables {
    instance_type            = "p4d.24xlarge"
    extra_security_group_ids = ["sg-0123456789abcdef0"]
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 4
      maximum_network_cards      = 4
      maximum_network_interfaces = 60
      network_cards              = [for i in [0, 1, 2, 3] : { index = i, maximum_interfaces = 15, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.security_groups == toset(["sg-0a1b2c3d4e5f60718", "sg-0123456789abcdef0"])])
    error_message = "extra security groups must be on every interface"
  }
}
