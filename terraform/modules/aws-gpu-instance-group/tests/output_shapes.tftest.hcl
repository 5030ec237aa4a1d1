# The output contract gpuctl's inventory reads (docs/architecture.md): names, shapes and
# value types after an apply. A change here is a breaking change for every caller.

mock_provider "aws" {
  source = "./tests/mocks"

  # Apply-time values (the shared plan-time overrides would be redrawn at apply).
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
      id                           = "i-0a1b2c3d4e5f60718"
      private_ip                   = "10.0.0.10"
      public_ip                    = ""
      availability_zone            = "us-east-1a"
      primary_network_interface_id = "eni-0a1b2c3d4e5f60718"
    }
  }

  mock_resource "aws_eip" {
    defaults = {
      id        = "eipalloc-0a1b2c3d4e5f60718"
      public_ip = "198.51.100.20"
    }
  }
}

variables {
  name              = "shape"
  instance_type     = "p5.48xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "efa_nodes_without_public_ips" {
  override_resource {
    target = aws_instance.node[0]
    values = {
      id                = "i-00000000000000000"
      private_ip        = "10.0.0.10"
      public_ip         = ""
      availability_zone = "us-east-1a"
    }
  }

  override_resource {
    target = aws_instance.node[1]
    values = {
      id                = "i-11111111111111111"
      private_ip        = "10.0.0.11"
      public_ip         = ""
      availability_zone = "us-east-1a"
    }
  }

  assert {
    condition     = length(output.nodes) == 2 && alltrue([for n in output.nodes : keys(n) == ["availability_zone", "id", "private_ip", "public_ip"]])
    error_message = "nodes is a list of {id, private_ip, public_ip, availability_zone}, got ${jsonencode(output.nodes)}"
  }

  assert {
    condition     = [for n in output.nodes : n.id] == ["i-00000000000000000", "i-11111111111111111"] && [for n in output.nodes : n.private_ip] == ["10.0.0.10", "10.0.0.11"]
    error_message = "nodes must be in rank order, got ${jsonencode(output.nodes)}"
  }

  assert {
    condition     = alltrue([for n in output.nodes : n.public_ip == null && n.availability_zone == "us-east-1a"])
    error_message = "public_ip is null (not \"\") when a node has none"
  }

  assert {
    condition     = output.bastion == null
    error_message = "bastion is null when disabled"
  }

  assert {
    condition     = output.ssh_user == "ubuntu"
    error_message = "ssh_user is a string"
  }

  assert {
    condition     = output.launch_template_id == "lt-0a1b2c3d4e5f60718" && output.security_group_id == "sg-0a1b2c3d4e5f60718"
    error_message = "launch_template_id and security_group_id are ids"
  }

  assert {
    condition     = output.placement_group_name == "shape"
    error_message = "placement_group_name names the group"
  }

  assert {
    condition     = output.efa_interfaces_per_node == 32
    error_message = "efa_interfaces_per_node is a number (32 on p5.48xlarge)"
  }

  assert {
    condition     = output.subnet_id == "subnet-0a1b2c3d4e5f60718" && output.vpc_id == "vpc-0a1b2c3d4e5f60718" && output.availability_zone == "us-east-1a"
    error_message = "subnet_id, vpc_id and availability_zone are strings"
  }

  assert {
    condition     = can(regex("^subnet-", output.public_subnet_id)) && length(output.nat_gateway_id) > 0
    error_message = "private nodes in the module's VPC: public_subnet_id and nat_gateway_id are strings"
  }
}

run "single_interface_nodes_with_public_ips" {
  variables {
    instance_type   = "g4dn.xlarge"
    placement_group = { mode = "none" }
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

  override_resource {
    target = aws_instance.node
    values = {
      public_ip = "203.0.113.50"
    }
  }

  assert {
    condition     = alltrue([for n in output.nodes : n.public_ip == "203.0.113.50"])
    error_message = "public_ip is the node's public address when it has one"
  }

  assert {
    condition     = output.placement_group_name == null && output.efa_interfaces_per_node == 0
    error_message = "placement_group_name is null without a group; efa_interfaces_per_node is 0 without EFA"
  }

  assert {
    condition     = output.public_subnet_id == null && output.nat_gateway_id == null
    error_message = "public nodes: public_subnet_id and nat_gateway_id are null"
  }
}

run "bastion" {
  variables {
    ssh_ingress_cidrs = ["203.0.113.7/32"]
    bastion           = { enabled = true, ami_id = "ami-0fedcba9876543210" }
  }

  override_resource {
    target = aws_instance.bastion
    values = {
      id         = "i-0b0b0b0b0b0b0b0b0"
      public_ip  = "198.51.100.7"
      private_ip = "10.0.0.5"
    }
  }

  assert {
    condition     = keys(output.bastion) == ["id", "private_ip", "public_ip", "ssh_user"]
    error_message = "bastion is {id, public_ip, private_ip, ssh_user}, got ${jsonencode(output.bastion)}"
  }

  assert {
    condition     = output.bastion.id == "i-0b0b0b0b0b0b0b0b0" && output.bastion.public_ip == "198.51.100.7" && output.bastion.private_ip == "10.0.0.5" && output.bastion.ssh_user == "ubuntu"
    error_message = "bastion values, got ${jsonencode(output.bastion)}"
  }

  assert {
    condition     = alltrue([for n in output.nodes : n.public_ip == null])
    error_message = "nodes behind the bastion have no public IP"
  }
}

run "elastic_ips" {
  variables {
    elastic_ip = true
  }

  assert {
    condition     = alltrue([for n in output.nodes : n.public_ip == "198.51.100.20"])
    error_message = "with elastic_ip, public_ip is the Elastic IP, got ${jsonencode(output.nodes)}"
  }
}

run "ansible_inventory_without_bastion" {
  state_key = "inventory" # fresh nodes: the overrides below apply to new instances only

  variables {
    ssh_private_key_file = "~/.ssh/train"
    gpus_per_node        = 8
  }

  override_resource {
    target = aws_instance.node[0]
    values = {
      id                = "i-00000000000000000"
      private_ip        = "10.0.0.10"
      public_ip         = ""
      availability_zone = "us-east-1a"
    }
  }

  override_resource {
    target = aws_instance.node[1]
    values = {
      id                = "i-11111111111111111"
      private_ip        = "10.0.0.11"
      public_ip         = ""
      availability_zone = "us-east-1a"
    }
  }

  assert {
    condition     = keys(yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts) == ["head", "worker1"]
    error_message = "ansible_inventory lists head, worker1 in group gpuctl_nodes, got ${output.ansible_inventory}"
  }

  assert {
    condition     = [for h in values(yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts) : [h.gpuctl_rank, h.gpuctl_address, h.gpuctl_gpus, h.ansible_ssh_private_key_file]] == [[0, "10.0.0.10", 8, "~/.ssh/train"], [1, "10.0.0.11", 8, "~/.ssh/train"]]
    error_message = "hosts carry rank, private address, gpus and the key path, got ${output.ansible_inventory}"
  }

  assert {
    condition     = yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts.worker1.ansible_host == "10.0.0.11" && !contains(keys(yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts.head), "gpuctl_proxy_jump")
    error_message = "without a public address or bastion, ansible_host is the private address and there is no ProxyJump"
  }

  assert {
    condition     = yamldecode(output.ansible_inventory).all.vars == { gpuctl_cluster = "shape", gpuctl_cloud = "aws", gpuctl_zone = "us-east-1a" }
    error_message = "all.vars name the cluster, cloud and zone, got ${output.ansible_inventory}"
  }
}

run "ansible_inventory_behind_bastion" {
  state_key = "inventory_bastion"

  variables {
    ssh_ingress_cidrs = ["203.0.113.7/32"]
    bastion           = { enabled = true, ami_id = "ami-0fedcba9876543210" }
  }

  override_resource {
    target = aws_instance.bastion
    values = {
      id         = "i-0b0b0b0b0b0b0b0b0"
      public_ip  = "198.51.100.7"
      private_ip = "10.0.0.5"
    }
  }

  assert {
    condition     = alltrue([for h in values(yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts) : h.gpuctl_proxy_jump == "ubuntu@198.51.100.7" && h.ansible_ssh_common_args == "-o ProxyJump=ubuntu@198.51.100.7" && h.ansible_host == h.gpuctl_address])
    error_message = "behind a bastion every host is reached at its private address through ProxyJump, got ${output.ansible_inventory}"
  }

  assert {
    condition     = alltrue([for h in values(yamldecode(output.ansible_inventory).all.children.gpuctl_nodes.hosts) : !contains(keys(h), "ansible_ssh_private_key_file")])
    error_message = "without ssh_private_key_file the key is left to the user's SSH config"
  }
}
