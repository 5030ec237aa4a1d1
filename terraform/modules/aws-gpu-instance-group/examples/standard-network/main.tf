# ENA-only nodes without a placement group: gpuctl's network_tier standard. With a given AMI
# this is also the shape that runs against EC2 emulators such as moto, which ignore
# launch-template network interfaces and lack placement groups.

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
  instance_type     = var.instance_type
  node_count        = var.node_count
  availability_zone = var.availability_zone
  ami_id            = var.ami_id

  ssh_public_key    = var.ssh_public_key
  ssh_ingress_cidrs = var.ssh_ingress_cidrs

  efa             = false
  placement_group = { mode = "none" }
}
