# Plan-only checks (no node is started): variable validations reject bad input
# with their messages, and the outputs keep the shape gpuctl's inventory reads.
# Run: terraform init && terraform test   (in terraform/modules/local-nodes)

variables {
  name           = "tftest"
  node_count     = 2
  ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG9wZW5zc2gta2V5LWZvci10ZXN0cy1vbmx5LXh4eHg= tftest"
  subnet_cidr    = "10.213.200.0/24"
  state_dir      = "/tmp/gpuctl-tftest/nodes"
}

run "netns_output_shape" {
  command = plan

  assert {
    condition     = length(output.nodes) == 2
    error_message = "nodes must have one entry per node"
  }
  assert {
    condition     = output.nodes[0].private_ip == "10.213.200.2" && output.nodes[1].private_ip == "10.213.200.3"
    error_message = "node i must take address .(i+2) of subnet_cidr, in rank order"
  }
  assert {
    condition     = output.nodes[1].ssh_host == "10.213.200.3" && output.nodes[1].ssh_port == 22
    error_message = "netns nodes are reached on their own address, port 22"
  }
  assert {
    condition     = output.nodes[0].public_ip == null && output.nodes[0].availability_zone == null
    error_message = "local nodes have no public_ip and no availability_zone"
  }
  assert {
    condition     = output.ssh_user == "root" && output.bastion == null
    error_message = "ssh_user defaults to root; local nodes need no bastion"
  }
  assert {
    condition     = length(terraform_data.bridge) == 1 && length(terraform_data.node) == 2
    error_message = "netns mode makes one bridge and one resource per node"
  }
  assert {
    condition     = alltrue([for n in terraform_data.node : length(n.triggers_replace.netns) <= 15 && length(n.triggers_replace.veth) <= 15])
    error_message = "namespace and veth names must fit Linux's 15-character interface names"
  }
}

run "loopback_output_shape" {
  command = plan

  variables {
    mode       = "loopback"
    base_port  = 24000
    node_count = 3
  }

  assert {
    condition     = [for n in output.nodes : "${n.ssh_host}:${n.ssh_port}"] == ["127.0.0.1:24000", "127.0.0.1:24001", "127.0.0.1:24002"]
    error_message = "loopback node i listens on 127.0.0.1:(base_port + i)"
  }
  assert {
    condition     = length(terraform_data.bridge) == 0
    error_message = "loopback mode makes no bridge"
  }
}

run "rejects_public_subnet" {
  command = plan
  variables { subnet_cidr = "8.8.8.0/24" }
  expect_failures = [var.subnet_cidr]
}

run "rejects_misaligned_subnet" {
  command = plan
  variables { subnet_cidr = "10.213.0.5/24" }
  expect_failures = [var.subnet_cidr]
}

run "rejects_relative_state_dir" {
  command = plan
  variables { state_dir = "nodes" }
  expect_failures = [var.state_dir]
}

run "rejects_too_many_nodes" {
  command = plan
  variables { node_count = 510 }
  expect_failures = [var.node_count]
}

run "rejects_unknown_mode" {
  command = plan
  variables { mode = "docker" }
  expect_failures = [var.mode]
}

run "rejects_bad_public_key" {
  command = plan
  variables { ssh_public_key = "not a key" }
  expect_failures = [var.ssh_public_key]
}

run "rejects_bad_internal_public_key" {
  command = plan
  variables { internal_public_key = "ssh-ed25519 AAAA\nPermitOpen any" }
  expect_failures = [var.internal_public_key]
}

run "a_new_internal_key_replaces_no_node" {
  command = plan
  variables { internal_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG9wZW5zc2gta2V5LWZvci10ZXN0cy1vbmx5LXl5eXk= gpuctl-internal-tftest" }
  assert {
    condition     = alltrue([for n in terraform_data.node : !contains([for v in values(n.triggers_replace) : tostring(v)], var.internal_public_key)])
    error_message = "the internal key is given at boot only: a rotation must not rebuild the nodes"
  }
}

run "rejects_keep_path_with_spaces" {
  command = plan
  variables { keep_visible_paths = ["/root/my python"] }
  expect_failures = [var.keep_visible_paths]
}

run "rejects_relative_node_path_entry" {
  command = plan
  variables { node_path = "bin:/usr/bin" }
  expect_failures = [var.node_path]
}

run "a_23_holds_more_than_253_nodes" {
  command = plan
  variables {
    subnet_cidr = "10.213.202.0/23"
    node_count  = 300
  }
  assert {
    condition     = output.nodes[0].private_ip == "10.213.202.2" && output.nodes[299].private_ip == "10.213.203.45"
    error_message = "a /23 numbers its nodes across both halves"
  }
}

run "a_24_holds_253_nodes" {
  command = plan
  variables { node_count = 254 }
  expect_failures = [terraform_data.node]
}

run "rejects_a_misaligned_23" {
  command = plan
  variables { subnet_cidr = "10.213.201.0/23" }
  expect_failures = [var.subnet_cidr]
}
