# Two p5.48xlarge nodes with all 32 EFA interfaces each, in a VPC the module creates, in a
# cluster placement group (or in a Capacity Block), reached through a bastion; the module adds a
# NAT gateway so the private nodes can reach the internet.

terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.74, < 7"
    }
  }
}

provider "aws" {
  region = var.region
}

module "cluster" {
  source = "../.."

  name              = var.name
  instance_type     = "p5.48xlarge"
  node_count        = var.node_count
  availability_zone = var.availability_zone

  ssh_public_key    = var.ssh_public_key
  ssh_ingress_cidrs = var.ssh_ingress_cidrs

  # Fail the plan, rather than silently fall back to TCP, if the type ever lacks EFA.
  efa = true

  # A Capacity Block when one is given (no placement group needed), else on-demand.
  market                  = var.capacity_reservation_id != null ? "capacity-block" : "on-demand"
  capacity_reservation_id = var.capacity_reservation_id

  # 32 interfaces per node rule out auto-assigned public IPs: SSH goes through the bastion.
  bastion = { enabled = true }

  root_volume_size = 500

  tags = {
    project = "llm-pretraining"
  }
}
