# Runs share state. After a mocked apply, a tag change or a new instance profile must leave the
# nodes in place (a node planned for replacement would have an unknown id): neither is part of
# node_shape, which replaces nodes when it changes. The mock never bumps launch-template versions, so the
# nodes' ignore_changes on the version is not exercised here (it was checked against moto).

mock_provider "aws" {
  source = "./tests/mocks"

  mock_resource "aws_security_group" {
    defaults = {
      id = "sg-0a1b2c3d4e5f60718"
    }
  }

  mock_resource "aws_subnet" {
    defaults = {
      id = "subnet-0a1b2c3d4e5f60718"
    }
  }

  mock_resource "aws_vpc" {
    defaults = {
      id = "vpc-0a1b2c3d4e5f60718"
    }
  }

  mock_resource "aws_placement_group" {
    defaults = {
      id = "pg-0a1b2c3d4e5f60718"
    }
  }

  mock_resource "aws_launch_template" {
    defaults = {
      id             = "lt-0a1b2c3d4e5f60718"
      latest_version = 1
    }
  }

  mock_resource "aws_instance" {
    defaults = {
      id         = "i-0a1b2c3d4e5f60718"
      private_ip = "10.0.0.10"
      public_ip  = ""
    }
  }
}

variables {
  name              = "life"
  instance_type     = "p5.48xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ami_id            = "ami-0123456789abcdef0"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
  tags              = { team = "ml" }
}

run "create" {
}

run "retag_keeps_nodes" {
  command = plan

  variables {
    tags = { team = "research", cost-center = "42" }
  }

  assert {
    condition     = [for n in aws_instance.node : n.id] == ["i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"]
    error_message = "a tag change must not replace nodes"
  }

  assert {
    condition     = aws_instance.node[0].tags["team"] == "research"
    error_message = "tags are updated in place"
  }
}

run "new_instance_profile_keeps_nodes" {
  command = plan

  variables {
    iam_instance_profile = "training-data-reader"
  }

  assert {
    condition     = [for n in aws_instance.node : n.id] == ["i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"]
    error_message = "giving the nodes an instance profile must not replace them"
  }

  assert {
    condition     = aws_instance.node[0].iam_instance_profile == "training-data-reader"
    error_message = "the profile is associated with the running nodes in place"
  }
}

run "new_ami_replaces_nodes" {
  command = plan

  variables {
    ami_id = "ami-0fedcba9876543210"
  }

  assert {
    condition     = terraform_data.node_shape.input.ami_id == "ami-0fedcba9876543210"
    error_message = "the node shape follows the AMI, which replaces the nodes through replace_triggered_by"
  }
}

run "autodown_terminates_in_place" {
  command = plan

  variables {
    shutdown_behavior = "terminate"
  }

  assert {
    condition     = [for n in aws_instance.node : n.id] == ["i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"]
    error_message = "turning autodown on must not replace the nodes"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.instance_initiated_shutdown_behavior == "terminate"])
    error_message = "an autodown cluster's nodes terminate when its head shuts them down"
  }
}

run "every_node_is_kept_running" {
  command = plan

  assert {
    condition     = length(aws_ec2_instance_state.node) == 2 && alltrue([for s in aws_ec2_instance_state.node : s.state == "running"])
    error_message = "each node is kept running: an apply starts a node that stopped itself (autostop)"
  }
}

run "stop_keeps_nodes_and_disks" {
  variables {
    instance_state = "stopped"
  }

  assert {
    condition     = [for n in aws_instance.node : n.id] == ["i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"]
    error_message = "stopping the cluster (gpuctl stop) must keep the same instances, and so their volumes"
  }

  assert {
    condition     = alltrue([for s in aws_ec2_instance_state.node : s.state == "stopped"])
    error_message = "every node is stopped"
  }
}

run "start_brings_the_same_nodes_back" {
  command = plan

  assert {
    condition     = [for n in aws_instance.node : n.id] == ["i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"]
    error_message = "starting a stopped cluster (gpuctl start, apply) must not replace its nodes"
  }

  assert {
    condition     = alltrue([for s in aws_ec2_instance_state.node : s.state == "running"])
    error_message = "each node is running again"
  }
}

