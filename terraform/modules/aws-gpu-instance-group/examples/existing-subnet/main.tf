# g5.48xlarge nodes (one EFA each, so they can keep public IPs) in a subnet you already have,
# joining an existing cluster placement group, on spot capacity, with an existing key pair.

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

  name          = var.name
  instance_type = "g5.48xlarge"
  node_count    = var.node_count

  # The subnet fixes the VPC and the Availability Zone.
  subnet_id                = var.subnet_id
  extra_security_group_ids = var.extra_security_group_ids

  key_name          = var.key_name
  ssh_ingress_cidrs = var.ssh_ingress_cidrs

  placement_group = {
    mode = "existing"
    name = var.placement_group_name
  }

  market = "spot"

  tags = {
    project = "fine-tuning"
  }
}
