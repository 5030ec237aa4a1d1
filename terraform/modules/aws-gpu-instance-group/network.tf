locals {
  create_network = var.subnet_id == null

  offered_zones = sort(try(data.aws_ec2_instance_type_offerings.node[0].locations, []))

  availability_zone = (local.create_network
    ? (var.availability_zone != null ? var.availability_zone : try(local.offered_zones[0], null))
    : data.aws_subnet.existing[0].availability_zone
  )

  vpc_id    = local.create_network ? aws_vpc.this[0].id : data.aws_subnet.existing[0].vpc_id
  subnet_id = local.create_network ? aws_subnet.this[0].id : var.subnet_id

  # The module's VPC gets a route to the internet only when something in it has a public address.
  create_internet_gateway = local.create_network && (local.nodes_public || var.elastic_ip || var.bastion.enabled)
}

data "aws_subnet" "existing" {
  count = local.create_network ? 0 : 1

  id = var.subnet_id
}

data "aws_ec2_instance_type_offerings" "node" {
  count = local.create_network && var.availability_zone == null ? 1 : 0

  location_type = "availability-zone"

  filter {
    name   = "instance-type"
    values = [var.instance_type]
  }
}

resource "aws_vpc" "this" {
  count = local.create_network ? 1 : 0

  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = merge(local.tags, { Name = var.name })
}

resource "aws_subnet" "this" {
  count = local.create_network ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = var.vpc_cidr
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = var.name })

  lifecycle {
    precondition {
      condition     = local.availability_zone != null
      error_message = "No Availability Zone in this region offers ${var.instance_type}; set availability_zone, pass subnet_id, or choose another region or instance type."
    }
  }
}

resource "aws_internet_gateway" "this" {
  count = local.create_internet_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_route_table" "this" {
  count = local.create_internet_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_route" "internet" {
  count = local.create_internet_gateway ? 1 : 0

  route_table_id         = aws_route_table.this[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this[0].id
}

resource "aws_route_table_association" "this" {
  count = local.create_internet_gateway ? 1 : 0

  subnet_id      = aws_subnet.this[0].id
  route_table_id = aws_route_table.this[0].id
}
