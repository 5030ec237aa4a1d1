# Every validation and precondition, tripped at plan time before anything is created. Rules of
# different variables may share a run (each listed one must fail); preconditions run alone.
# (tests/integration/test_terraform_aws_module.py checks the wording of the cross-input errors.)

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "val"
  instance_type     = "p5.48xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "valid_baseline" {
  command = plan
}

# Independent rules share a run: each listed variable must fail its own validation.
run "malformed_names" {
  command = plan

  variables {
    name           = "Bad_Name"
    instance_type  = "p5"
    ssh_user       = "ubuntu user"
    ssh_public_key = null
    key_name       = " "
  }

  expect_failures = [var.name, var.instance_type, var.ssh_user, var.key_name]
}

run "malformed_ids" {
  command = plan

  variables {
    subnet_id                = "my-subnet"
    ami_id                   = "ubuntu-22.04"
    capacity_reservation_id  = "cb-123"
    extra_security_group_ids = ["default"]
    iam_instance_profile     = "arn:aws:iam::111122223333:instance-profile/reader"
    shutdown_behavior        = "hibernate"
    instance_state           = "hibernated"
  }

  expect_failures = [var.subnet_id, var.ami_id, var.capacity_reservation_id, var.extra_security_group_ids, var.iam_instance_profile, var.shutdown_behavior, var.instance_state]
}

run "malformed_network" {
  command = plan

  variables {
    availability_zone = "us-east-1"
    vpc_cidr          = "10.0.0.0/8"
    ssh_ingress_cidrs = ["203.0.113.7/24"]
  }

  expect_failures = [var.availability_zone, var.vpc_cidr, var.ssh_ingress_cidrs]
}

run "unknown_choices_and_sizes" {
  command = plan

  variables {
    market            = "reserved"
    placement_group   = { mode = "spread" }
    ami_ssm_parameter = "aws/service/deeplearning/ami-id"
    root_volume_size  = 4
  }

  expect_failures = [var.market, var.placement_group, var.ami_ssm_parameter, var.root_volume_size]
}

run "zero_nodes" {
  command = plan

  variables {
    node_count = 0
  }

  expect_failures = [var.node_count]
}

run "fractional_nodes" {
  command = plan

  variables {
    node_count = 1.5
  }

  expect_failures = [var.node_count]
}

run "ssh_cidr_ipv6" {
  command = plan

  variables {
    ssh_ingress_cidrs = ["2001:db8::/32"]
  }

  expect_failures = [var.ssh_ingress_cidrs]
}

run "ssh_cidr_bare_address" {
  command = plan

  variables {
    ssh_ingress_cidrs = ["203.0.113.7"]
  }

  expect_failures = [var.ssh_ingress_cidrs]
}

run "ssh_public_key_ecdsa" {
  command = plan

  variables {
    ssh_public_key = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY= me"
  }

  expect_failures = [var.ssh_public_key]
}

run "ssh_public_key_private_key" {
  command = plan

  variables {
    ssh_public_key = "-----BEGIN OPENSSH PRIVATE KEY-----"
  }

  expect_failures = [var.ssh_public_key]
}

run "placement_name_with_spaces" {
  command = plan

  variables {
    placement_group = { mode = "existing", name = "my group" }
  }

  expect_failures = [var.placement_group]
}

run "bastion_instance_type" {
  command = plan

  variables {
    bastion = { enabled = true, instance_type = "micro" }
  }

  expect_failures = [var.bastion]
}

run "bastion_ami_id" {
  command = plan

  variables {
    bastion = { enabled = true, ami_id = "ami-xyz" }
  }

  expect_failures = [var.bastion]
}

run "bastion_root_volume" {
  command = plan

  variables {
    bastion = { enabled = true, root_volume_size = 2 }
  }

  expect_failures = [var.bastion]
}

run "efa_required_on_type_without_efa" {
  command = plan

  variables {
    instance_type = "g4dn.xlarge"
    efa           = true
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

  expect_failures = [data.aws_ec2_instance_type.node]
}

run "both_key_inputs" {
  command = plan

  variables {
    key_name = "team-key"
  }

  expect_failures = [aws_launch_template.node]
}

run "no_key_input" {
  command = plan

  variables {
    ssh_public_key = null
  }

  expect_failures = [aws_launch_template.node]
}

run "capacity_block_without_reservation" {
  command = plan

  variables {
    market = "capacity-block"
  }

  expect_failures = [aws_launch_template.node]
}

run "spot_into_a_reservation" {
  command = plan

  variables {
    market                  = "spot"
    capacity_reservation_id = "cr-0123456789abcdef0"
  }

  expect_failures = [aws_launch_template.node]
}

run "spot_nodes_stopped" {
  command = plan

  variables {
    market         = "spot"
    instance_state = "stopped"
  }

  expect_failures = [aws_launch_template.node]
}

run "existing_placement_group_without_name" {
  command = plan

  variables {
    placement_group = { mode = "existing" }
  }

  expect_failures = [aws_launch_template.node]
}

run "public_ip_with_many_interfaces" {
  command = plan

  variables {
    associate_public_ip = true
  }

  expect_failures = [aws_launch_template.node]
}

run "public_ip_and_elastic_ip" {
  command = plan

  variables {
    instance_type       = "g4dn.xlarge"
    associate_public_ip = true
    elastic_ip          = true
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

  expect_failures = [aws_launch_template.node]
}

run "nat_gateway_with_subnet_id" {
  command = plan

  variables {
    subnet_id         = "subnet-0fedcba9876543210"
    availability_zone = null
    nat_gateway       = true
  }

  expect_failures = [aws_launch_template.node]
}

run "nat_gateway_with_elastic_ip" {
  command = plan

  variables {
    nat_gateway = true
    elastic_ip  = true
  }

  expect_failures = [aws_launch_template.node]
}

run "vpc_too_small_for_nat_gateway" {
  command = plan

  variables {
    vpc_cidr = "10.0.0.0/28"
  }

  expect_failures = [aws_vpc.this]
}

run "zone_differs_from_subnet" {
  command = plan

  variables {
    subnet_id         = "subnet-0fedcba9876543210"
    availability_zone = "us-east-1a"
  }

  expect_failures = [aws_launch_template.node]
}

run "no_zone_offers_the_type" {
  command = plan

  variables {
    availability_zone = null
  }

  override_data {
    target = data.aws_ec2_instance_type_offerings.node
    values = {
      instance_types = []
      locations      = []
      location_types = []
    }
  }

  expect_failures = [aws_subnet.this]
}

run "bastion_without_ssh_cidrs" {
  command = plan

  variables {
    bastion = { enabled = true, ami_id = "ami-0fedcba9876543210" }
  }

  expect_failures = [aws_instance.bastion]
}
