# The module's own VPC (one public subnet, or a private node subnet behind a NAT gateway with a
# public subnet beside it), or an existing subnet; one Availability Zone either way.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name           = "net"
  instance_type  = "p5.48xlarge"
  node_count     = 2
  ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

# Plan-time ids that tell the public side from the private one (the nodes' subnet keeps the
# shared mock's subnet-0a1b2c3d4e5f60718).
override_resource {
  target          = aws_subnet.public
  override_during = plan
  values = {
    id = "subnet-0bbbbbbbbbbbbbbbb"
  }
}

override_resource {
  target          = aws_eip.nat
  override_during = plan
  values = {
    id = "eipalloc-0ccccccccccccccccc"
  }
}

override_resource {
  target          = aws_nat_gateway.this
  override_during = plan
  values = {
    id = "nat-0dddddddddddddddd"
  }
}

override_resource {
  target          = aws_route_table.this
  override_during = plan
  values = {
    id = "rtb-0eeeeeeeeeeeeeeee"
  }
}

override_resource {
  target          = aws_route_table.private
  override_during = plan
  values = {
    id = "rtb-0ffffffffffffffff"
  }
}

override_resource {
  target          = aws_internet_gateway.this
  override_during = plan
  values = {
    id = "igw-0a1b2c3d4e5f60718"
  }
}

run "private_nodes_behind_a_nat_gateway" {
  command = plan

  variables {
    availability_zone = "us-east-1d"
    vpc_cidr          = "10.42.0.0/16"
    ssh_ingress_cidrs = ["203.0.113.7/32"]
    bastion           = { enabled = true, ami_id = "ami-0fedcba9876543210" }
  }

  assert {
    condition     = aws_vpc.this[0].cidr_block == "10.42.0.0/16" && aws_vpc.this[0].enable_dns_hostnames == true
    error_message = "the module's VPC uses vpc_cidr, with DNS hostnames"
  }

  assert {
    condition     = aws_subnet.this[0].cidr_block == "10.42.0.0/17" && aws_subnet.public[0].cidr_block == "10.42.255.0/24"
    error_message = "nodes get the first half of the VPC, the public subnet a /24 at its end (got ${aws_subnet.this[0].cidr_block} and ${aws_subnet.public[0].cidr_block})"
  }

  assert {
    condition     = aws_subnet.this[0].availability_zone == "us-east-1d" && aws_subnet.public[0].availability_zone == "us-east-1d"
    error_message = "both subnets are in the nodes' zone"
  }

  assert {
    condition     = aws_subnet.this[0].map_public_ip_on_launch == false && aws_subnet.public[0].map_public_ip_on_launch == false
    error_message = "no subnet hands out public IPs on its own"
  }

  assert {
    condition     = aws_route.nat[0].destination_cidr_block == "0.0.0.0/0" && aws_route.nat[0].nat_gateway_id == "nat-0dddddddddddddddd" && aws_route.nat[0].route_table_id == "rtb-0ffffffffffffffff" && aws_route.nat[0].gateway_id == null
    error_message = "the private route table sends 0.0.0.0/0 to the NAT gateway"
  }

  assert {
    condition     = aws_route_table_association.private[0].subnet_id == "subnet-0a1b2c3d4e5f60718" && aws_route_table_association.private[0].route_table_id == "rtb-0ffffffffffffffff"
    error_message = "the nodes' subnet uses the private route table"
  }

  assert {
    condition     = aws_nat_gateway.this[0].subnet_id == "subnet-0bbbbbbbbbbbbbbbb" && aws_nat_gateway.this[0].allocation_id == "eipalloc-0ccccccccccccccccc" && aws_eip.nat[0].domain == "vpc"
    error_message = "the NAT gateway sits in the public subnet with its own Elastic IP"
  }

  assert {
    condition     = aws_route.internet[0].destination_cidr_block == "0.0.0.0/0" && aws_route.internet[0].gateway_id == "igw-0a1b2c3d4e5f60718" && aws_route.internet[0].route_table_id == "rtb-0eeeeeeeeeeeeeeee"
    error_message = "the public route table sends 0.0.0.0/0 to the internet gateway"
  }

  assert {
    condition     = length(aws_route_table_association.this) == 1 && aws_route_table_association.this[0].subnet_id == "subnet-0bbbbbbbbbbbbbbbb" && aws_route_table_association.this[0].route_table_id == "rtb-0eeeeeeeeeeeeeeee"
    error_message = "only the public subnet uses the internet gateway's route table"
  }

  assert {
    condition     = aws_instance.bastion[0].subnet_id == "subnet-0bbbbbbbbbbbbbbbb" && aws_instance.bastion[0].associate_public_ip_address == true
    error_message = "the bastion sits in the public subnet, with a public IP"
  }

  assert {
    condition     = length(aws_launch_template.node.network_interfaces) == 32 && alltrue([for ni in aws_launch_template.node.network_interfaces : ni.subnet_id == "subnet-0a1b2c3d4e5f60718" && ni.associate_public_ip_address == null])
    error_message = "all 32 interfaces of every node are in the private subnet, without a public IP"
  }

  assert {
    condition     = length(aws_eip.node) == 0
    error_message = "no Elastic IPs on the nodes"
  }

  assert {
    condition     = aws_security_group.nodes.vpc_id == "vpc-0a1b2c3d4e5f60718"
    error_message = "the node group lives in the module's VPC"
  }

  assert {
    condition     = output.subnet_id == "subnet-0a1b2c3d4e5f60718" && output.public_subnet_id == "subnet-0bbbbbbbbbbbbbbbb" && output.nat_gateway_id == "nat-0dddddddddddddddd"
    error_message = "outputs name the nodes' (private) subnet, the public subnet and the NAT gateway"
  }

  assert {
    condition     = output.vpc_id == "vpc-0a1b2c3d4e5f60718" && output.availability_zone == "us-east-1d"
    error_message = "outputs name the module's VPC and zone"
  }

  assert {
    condition     = length(data.aws_ec2_instance_type_offerings.node) == 0
    error_message = "a given zone needs no offerings lookup"
  }
}

run "private_nodes_without_bastion_still_get_egress" {
  command = plan

  variables {
    availability_zone = "us-east-1d"
  }

  assert {
    condition     = length(aws_instance.bastion) == 0 && length(aws_nat_gateway.this) == 1 && length(aws_subnet.public) == 1 && length(aws_route.nat) == 1
    error_message = "nodes without a public address get the NAT gateway even without a bastion"
  }
}

run "single_interface_public_nodes_keep_one_public_subnet" {
  command = plan

  variables {
    instance_type     = "g5.48xlarge"
    availability_zone = "us-east-1d"
    vpc_cidr          = "10.42.0.0/16"
    ssh_ingress_cidrs = ["203.0.113.7/32"]
  }

  override_data {
    target = data.aws_ec2_instance_type.node
    values = {
      efa_supported              = true
      efa_maximum_interfaces     = 1
      maximum_network_cards      = 1
      maximum_network_interfaces = 7
      network_cards              = [{ index = 0, maximum_interfaces = 7, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
    }
  }

  assert {
    condition     = length(aws_subnet.this) == 1 && aws_subnet.this[0].availability_zone == "us-east-1d" && aws_subnet.this[0].cidr_block == "10.42.0.0/16"
    error_message = "one subnet spanning the VPC, in the chosen zone"
  }

  assert {
    condition     = length(aws_subnet.public) == 0 && length(aws_nat_gateway.this) == 0 && length(aws_eip.nat) == 0 && length(aws_route_table.private) == 0 && length(aws_route.nat) == 0
    error_message = "public nodes need no NAT gateway"
  }

  assert {
    condition     = length(aws_route.internet) == 1 && aws_route_table_association.this[0].subnet_id == "subnet-0a1b2c3d4e5f60718"
    error_message = "the nodes' subnet routes to the internet gateway"
  }

  assert {
    condition     = aws_launch_template.node.network_interfaces[0].associate_public_ip_address == "true"
    error_message = "the single interface gets a public IP"
  }

  assert {
    condition     = output.subnet_id == "subnet-0a1b2c3d4e5f60718" && output.public_subnet_id == null && output.nat_gateway_id == null
    error_message = "outputs: one subnet, no public subnet, no NAT gateway"
  }
}

run "nat_gateway_false_leaves_private_nodes_without_egress" {
  command = plan

  variables {
    availability_zone = "us-east-1d"
    ssh_ingress_cidrs = ["203.0.113.7/32"]
    bastion           = { enabled = true, ami_id = "ami-0fedcba9876543210" }
    nat_gateway       = false
  }

  assert {
    condition     = length(aws_subnet.this) == 1 && aws_subnet.this[0].cidr_block == "10.0.0.0/16" && length(aws_subnet.public) == 0
    error_message = "one subnet spanning the VPC"
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 0 && length(aws_eip.nat) == 0 && length(aws_route.nat) == 0
    error_message = "nat_gateway = false creates no NAT gateway"
  }

  assert {
    condition     = aws_instance.bastion[0].subnet_id == "subnet-0a1b2c3d4e5f60718" && aws_route_table_association.this[0].subnet_id == "subnet-0a1b2c3d4e5f60718"
    error_message = "the bastion shares the nodes' subnet, which routes to the internet gateway"
  }

  assert {
    condition     = output.public_subnet_id == null && output.nat_gateway_id == null
    error_message = "outputs: no public subnet, no NAT gateway"
  }
}

run "nat_gateway_true_makes_single_interface_nodes_private" {
  command = plan

  variables {
    instance_type     = "g4dn.xlarge"
    availability_zone = "us-east-1d"
    nat_gateway       = true
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
    condition     = alltrue([for n in aws_instance.node : n.associate_public_ip_address == false && n.subnet_id == "subnet-0a1b2c3d4e5f60718"])
    error_message = "nodes are private, in the nodes' subnet"
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 1 && aws_route.nat[0].nat_gateway_id == "nat-0dddddddddddddddd"
    error_message = "nat_gateway = true routes the nodes through a NAT gateway"
  }
}

run "small_vpc_subnets" {
  command = plan

  variables {
    availability_zone = "us-east-1d"
    vpc_cidr          = "10.9.8.0/27"
  }

  assert {
    condition     = aws_subnet.this[0].cidr_block == "10.9.8.0/28" && aws_subnet.public[0].cidr_block == "10.9.8.16/28"
    error_message = "a /27 splits into two /28s (got ${aws_subnet.this[0].cidr_block} and ${aws_subnet.public[0].cidr_block})"
  }
}

run "zone_picked_from_offerings" {
  command = plan

  assert {
    condition     = aws_subnet.this[0].availability_zone == "us-east-1a" && aws_subnet.public[0].availability_zone == "us-east-1a" && output.availability_zone == "us-east-1a"
    error_message = "without availability_zone, the first zone by name that offers the type, for both subnets (got ${aws_subnet.this[0].availability_zone})"
  }

  assert {
    condition     = data.aws_ec2_instance_type_offerings.node[0].location_type == "availability-zone"
    error_message = "offerings are looked up per zone"
  }
}

run "existing_subnet" {
  command = plan

  variables {
    subnet_id = "subnet-0fedcba9876543210"
  }

  assert {
    condition     = length(aws_vpc.this) == 0 && length(aws_subnet.this) == 0 && length(aws_internet_gateway.this) == 0
    error_message = "with subnet_id the module creates no network"
  }

  assert {
    condition     = length(aws_subnet.public) == 0 && length(aws_nat_gateway.this) == 0 && length(aws_eip.nat) == 0 && length(aws_route_table.private) == 0 && output.nat_gateway_id == null && output.public_subnet_id == null
    error_message = "with subnet_id the caller owns routing: no NAT gateway"
  }

  assert {
    condition     = aws_security_group.nodes.vpc_id == "vpc-0fedcba9876543210"
    error_message = "the node group lives in the subnet's VPC"
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.node.network_interfaces : ni.subnet_id == "subnet-0fedcba9876543210"])
    error_message = "every interface is in the given subnet"
  }

  assert {
    condition     = output.subnet_id == "subnet-0fedcba9876543210" && output.vpc_id == "vpc-0fedcba9876543210" && output.availability_zone == "us-east-1b"
    error_message = "outputs name the given subnet, its VPC and zone"
  }
}

run "existing_subnet_with_its_zone" {
  command = plan

  variables {
    subnet_id         = "subnet-0fedcba9876543210"
    availability_zone = "us-east-1b"
  }

  assert {
    condition     = output.availability_zone == "us-east-1b"
    error_message = "naming the subnet's own zone is fine"
  }
}
