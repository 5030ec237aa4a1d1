# Security groups, SSH exposure, public addresses and the bastion.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "sec"
  instance_type     = "p4d.24xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

# p4d.24xlarge: 4 network cards, 4 EFA, so nodes have several interfaces.
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

run "defaults_open_nothing" {
  command = plan

  assert {
    condition     = aws_vpc_security_group_ingress_rule.nodes_self.ip_protocol == "-1" && aws_vpc_security_group_ingress_rule.nodes_self.referenced_security_group_id == "sg-0a1b2c3d4e5f60718" && aws_vpc_security_group_ingress_rule.nodes_self.security_group_id == "sg-0a1b2c3d4e5f60718"
    error_message = "the node group must allow all traffic from itself"
  }

  assert {
    condition     = aws_vpc_security_group_egress_rule.nodes_self.ip_protocol == "-1" && aws_vpc_security_group_egress_rule.nodes_self.referenced_security_group_id == "sg-0a1b2c3d4e5f60718" && aws_vpc_security_group_egress_rule.nodes_self.security_group_id == "sg-0a1b2c3d4e5f60718"
    error_message = "the node group must allow all traffic to itself (EFA needs the egress self rule too)"
  }

  assert {
    condition     = aws_vpc_security_group_egress_rule.nodes_internet.ip_protocol == "-1" && aws_vpc_security_group_egress_rule.nodes_internet.cidr_ipv4 == "0.0.0.0/0"
    error_message = "nodes need egress to the internet"
  }

  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.nodes_ssh) == 0 && length(aws_vpc_security_group_ingress_rule.nodes_ssh_from_bastion) == 0
    error_message = "with no ssh_ingress_cidrs there must be no SSH rule at all"
  }

  assert {
    condition     = length(aws_security_group.bastion) == 0 && length(aws_instance.bastion) == 0 && output.bastion == null
    error_message = "no bastion unless asked for"
  }

  assert {
    condition     = length(aws_eip.node) == 0 && alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "nothing public: no Elastic IPs, no auto-assigned addresses"
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 1 && length(aws_route.nat) == 1
    error_message = "private nodes reach the internet only outbound, through the NAT gateway"
  }

  assert {
    condition     = aws_subnet.this[0].map_public_ip_on_launch == false
    error_message = "the module's subnet must not hand out public IPs on its own"
  }
}

run "ssh_only_from_named_cidrs" {
  command = plan

  variables {
    ssh_ingress_cidrs = ["203.0.113.7/32", "198.51.100.0/24"]
  }

  assert {
    condition     = keys(aws_vpc_security_group_ingress_rule.nodes_ssh) == ["198.51.100.0/24", "203.0.113.7/32"]
    error_message = "one SSH rule per named CIDR, got ${jsonencode(keys(aws_vpc_security_group_ingress_rule.nodes_ssh))}"
  }

  assert {
    condition     = alltrue([for cidr, r in aws_vpc_security_group_ingress_rule.nodes_ssh : r.cidr_ipv4 == cidr && r.ip_protocol == "tcp" && r.from_port == 22 && r.to_port == 22 && r.security_group_id == "sg-0a1b2c3d4e5f60718"])
    error_message = "SSH rules must be tcp/22 from exactly the named CIDR"
  }

  assert {
    condition     = !anytrue([for r in aws_vpc_security_group_ingress_rule.nodes_ssh : r.cidr_ipv4 == "0.0.0.0/0"])
    error_message = "SSH must not be open to the world"
  }
}

run "bastion_is_the_only_way_in" {
  command = plan

  variables {
    ssh_ingress_cidrs = ["203.0.113.7/32"]
    bastion           = { enabled = true, ami_id = "ami-0fedcba9876543210" }
  }

  override_resource {
    target          = aws_security_group.bastion
    override_during = plan
    values = {
      id = "sg-0bbbbbbbbbbbbbbbb"
    }
  }

  assert {
    condition     = keys(aws_vpc_security_group_ingress_rule.bastion_ssh) == ["203.0.113.7/32"] && alltrue([for r in aws_vpc_security_group_ingress_rule.bastion_ssh : r.security_group_id == "sg-0bbbbbbbbbbbbbbbb" && r.ip_protocol == "tcp" && r.from_port == 22 && r.to_port == 22])
    error_message = "the bastion must accept SSH from the named CIDRs only"
  }

  assert {
    condition     = aws_vpc_security_group_ingress_rule.nodes_ssh_from_bastion[0].referenced_security_group_id == "sg-0bbbbbbbbbbbbbbbb" && aws_vpc_security_group_ingress_rule.nodes_ssh_from_bastion[0].from_port == 22 && aws_vpc_security_group_ingress_rule.nodes_ssh_from_bastion[0].ip_protocol == "tcp"
    error_message = "nodes must accept SSH from the bastion's group"
  }

  assert {
    condition     = aws_instance.bastion[0].associate_public_ip_address == true && aws_instance.bastion[0].subnet_id == "subnet-0a1b2c3d4e5f60718" && aws_instance.bastion[0].vpc_security_group_ids == toset(["sg-0bbbbbbbbbbbbbbbb"]) && aws_instance.bastion[0].instance_type == "t3.micro"
    error_message = "the bastion is a small instance with a public IP, in its own group"
  }

  assert {
    condition     = aws_instance.bastion[0].metadata_options[0].http_tokens == "required" && aws_instance.bastion[0].root_block_device[0].encrypted == true
    error_message = "the bastion needs IMDSv2 and an encrypted root volume"
  }

  assert {
    condition     = length(aws_internet_gateway.this) == 1 && aws_route.internet[0].destination_cidr_block == "0.0.0.0/0"
    error_message = "a bastion in the module's VPC needs a route to the internet"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "nodes behind a bastion get no public IP"
  }
}

run "single_interface_nodes_are_public_by_default" {
  command = plan

  variables {
    instance_type     = "g4dn.xlarge"
    ssh_ingress_cidrs = ["203.0.113.7/32"]
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
    condition     = alltrue([for n in aws_instance.node : n.associate_public_ip_address == true])
    error_message = "single-interface nodes get a public IP unless told otherwise"
  }

  assert {
    condition     = length(aws_internet_gateway.this) == 1 && length(aws_route_table_association.this) == 1
    error_message = "public nodes in the module's VPC need an internet route"
  }
}

run "private_single_interface_nodes" {
  command = plan

  variables {
    instance_type       = "g4dn.xlarge"
    associate_public_ip = false
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
    condition     = alltrue([for n in aws_instance.node : n.associate_public_ip_address == false]) && length(aws_nat_gateway.this) == 1
    error_message = "associate_public_ip = false keeps nodes private, with egress through the NAT gateway"
  }
}

run "elastic_ips_for_multi_interface_nodes" {
  command = plan

  variables {
    elastic_ip = true
  }

  assert {
    condition     = length(aws_eip.node) == 2 && alltrue([for e in aws_eip.node : e.domain == "vpc"])
    error_message = "one Elastic IP per node"
  }

  assert {
    condition     = length(aws_internet_gateway.this) == 1 && alltrue([for ni in aws_launch_template.node.network_interfaces : ni.associate_public_ip_address == null])
    error_message = "Elastic IPs need the internet gateway and no auto-assigned address"
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 0 && length(aws_subnet.public) == 0
    error_message = "nodes with Elastic IPs need no NAT gateway"
  }
}

run "hardened_launch_template" {
  command = plan

  assert {
    condition     = aws_launch_template.node.metadata_options[0].http_tokens == "required" && aws_launch_template.node.metadata_options[0].http_endpoint == "enabled"
    error_message = "nodes must require IMDSv2"
  }

  assert {
    condition     = aws_launch_template.node.block_device_mappings[0].ebs[0].encrypted == "true" && aws_launch_template.node.block_device_mappings[0].ebs[0].volume_type == "gp3" && aws_launch_template.node.block_device_mappings[0].ebs[0].volume_size == 200 && aws_launch_template.node.block_device_mappings[0].device_name == "/dev/sda1"
    error_message = "the root volume must be encrypted gp3 on the AMI's root device"
  }
}
