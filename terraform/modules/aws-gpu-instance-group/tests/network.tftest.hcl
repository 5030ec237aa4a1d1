# The module's own VPC and subnet, or an existing subnet; one Availability Zone either way.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name           = "net"
  instance_type  = "p5.48xlarge"
  node_count     = 2
  ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "creates_vpc_and_one_subnet" {
  command = plan

  variables {
    availability_zone = "us-east-1d"
    vpc_cidr          = "10.42.0.0/16"
  }

  assert {
    condition     = aws_vpc.this[0].cidr_block == "10.42.0.0/16" && aws_vpc.this[0].enable_dns_hostnames == true
    error_message = "the module's VPC uses vpc_cidr, with DNS hostnames"
  }

  assert {
    condition     = length(aws_subnet.this) == 1 && aws_subnet.this[0].availability_zone == "us-east-1d" && aws_subnet.this[0].cidr_block == "10.42.0.0/16"
    error_message = "one subnet, in the chosen zone"
  }

  assert {
    condition     = aws_security_group.nodes.vpc_id == "vpc-0a1b2c3d4e5f60718"
    error_message = "the node group lives in the module's VPC"
  }

  assert {
    condition     = output.subnet_id == "subnet-0a1b2c3d4e5f60718" && output.vpc_id == "vpc-0a1b2c3d4e5f60718" && output.availability_zone == "us-east-1d"
    error_message = "outputs name the module's network"
  }

  assert {
    condition     = length(data.aws_ec2_instance_type_offerings.node) == 0
    error_message = "a given zone needs no offerings lookup"
  }
}

run "zone_picked_from_offerings" {
  command = plan

  assert {
    condition     = aws_subnet.this[0].availability_zone == "us-east-1a" && output.availability_zone == "us-east-1a"
    error_message = "without availability_zone, the first zone by name that offers the type (got ${aws_subnet.this[0].availability_zone})"
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
