# Purchase options: on-demand, on-demand into a reservation, spot, Capacity Block.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "mkt"
  instance_type     = "p5.48xlarge"
  node_count        = 2
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "on_demand" {
  command = plan

  assert {
    condition     = length(aws_launch_template.node.instance_market_options) == 0 && length(aws_launch_template.node.capacity_reservation_specification) == 0
    error_message = "plain on-demand needs neither market options nor a reservation"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.instance_initiated_shutdown_behavior == "stop"])
    error_message = "by default a shutdown from inside a node stops it (autostop), as EC2's default"
  }
}

run "on_demand_into_a_reservation" {
  command = plan

  variables {
    capacity_reservation_id = "cr-0123456789abcdef0"
  }

  assert {
    condition     = length(aws_launch_template.node.instance_market_options) == 0
    error_message = "an On-Demand Capacity Reservation needs no market options"
  }

  assert {
    condition     = aws_launch_template.node.capacity_reservation_specification[0].capacity_reservation_target[0].capacity_reservation_id == "cr-0123456789abcdef0"
    error_message = "nodes must target the reservation"
  }
}

run "spot" {
  command = plan

  variables {
    market = "spot"
  }

  assert {
    condition     = aws_launch_template.node.instance_market_options[0].market_type == "spot"
    error_message = "market spot must set market_type spot"
  }

  assert {
    condition     = aws_launch_template.node.instance_market_options[0].spot_options[0].spot_instance_type == "one-time" && aws_launch_template.node.instance_market_options[0].spot_options[0].instance_interruption_behavior == "terminate"
    error_message = "spot nodes are one-time requests terminated on interruption"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.instance_initiated_shutdown_behavior == "terminate"])
    error_message = "a one-time spot node cannot be stopped: a shutdown from inside terminates it"
  }
}

run "capacity_block" {
  command = plan

  variables {
    market                  = "capacity-block"
    capacity_reservation_id = "cr-0123456789abcdef0"
  }

  assert {
    condition     = aws_launch_template.node.instance_market_options[0].market_type == "capacity-block" && length(aws_launch_template.node.instance_market_options[0].spot_options) == 0
    error_message = "Capacity Blocks need market_type capacity-block"
  }

  assert {
    condition     = aws_launch_template.node.capacity_reservation_specification[0].capacity_reservation_target[0].capacity_reservation_id == "cr-0123456789abcdef0"
    error_message = "Capacity Blocks need the reservation target"
  }
}
