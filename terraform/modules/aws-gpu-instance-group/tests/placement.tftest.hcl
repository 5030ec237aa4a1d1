# Cluster placement group: create (default), join an existing one, or none.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "pg"
  instance_type     = "p5.48xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "create_by_default" {
  command = plan

  assert {
    condition     = length(aws_placement_group.this) == 1 && aws_placement_group.this[0].strategy == "cluster" && aws_placement_group.this[0].name == "pg"
    error_message = "by default the module creates a cluster placement group named after the cluster"
  }

  assert {
    condition     = aws_launch_template.node.placement[0].group_name == "pg" && output.placement_group_name == "pg"
    error_message = "nodes must launch into the created group"
  }
}

run "create_with_name" {
  command = plan

  variables {
    placement_group = { mode = "create", name = "pg-us-east-1a" }
  }

  assert {
    condition     = aws_placement_group.this[0].name == "pg-us-east-1a" && aws_placement_group.this[0].strategy == "cluster"
    error_message = "placement_group.name names the created group"
  }

  assert {
    condition     = aws_launch_template.node.placement[0].group_name == "pg-us-east-1a" && output.placement_group_name == "pg-us-east-1a"
    error_message = "nodes must launch into the named group"
  }
}

run "existing" {
  command = plan

  variables {
    placement_group = { mode = "existing", name = "shared-training-pg" }
  }

  assert {
    condition     = length(aws_placement_group.this) == 0
    error_message = "mode existing must not create a group"
  }

  assert {
    condition     = aws_launch_template.node.placement[0].group_name == "shared-training-pg" && output.placement_group_name == "shared-training-pg"
    error_message = "nodes must launch into the existing group"
  }
}

run "none" {
  command = plan

  variables {
    placement_group = { mode = "none" }
  }

  assert {
    condition     = length(aws_placement_group.this) == 0 && length(aws_launch_template.node.placement) == 0 && output.placement_group_name == null
    error_message = "mode none: no group, no placement block, null output"
  }
}

run "none_by_default_for_capacity_blocks" {
  command = plan

  variables {
    market                  = "capacity-block"
    capacity_reservation_id = "cr-0123456789abcdef0"
  }

  assert {
    condition     = length(aws_placement_group.this) == 0 && length(aws_launch_template.node.placement) == 0 && output.placement_group_name == null
    error_message = "Capacity Blocks come co-located: no placement group unless asked for"
  }
}
