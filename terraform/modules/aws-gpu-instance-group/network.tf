locals {
  create_network = var.subnet_id == null

  offered_zones = sort(try(data.aws_ec2_instance_type_offerings.node[0].locations, []))

  availability_zone = (local.create_network
    ? (var.availability_zone != null ? var.availability_zone : try(local.offered_zones[0], null))
    : data.aws_subnet.existing[0].availability_zone
  )

  vpc_id    = local.create_network ? aws_vpc.this[0].id : data.aws_subnet.existing[0].vpc_id
  subnet_id = local.create_network ? aws_subnet.this[0].id : var.subnet_id

  # Private nodes in the module's VPC reach the internet through a NAT gateway in a public subnet.
  nat_gateway = local.create_network && coalesce(var.nat_gateway, !local.nodes_public && !var.elastic_ip)

  # The module's VPC gets a route to the internet only when something in it uses one.
  create_internet_gateway = local.create_network && (local.nodes_public || var.elastic_ip || var.bastion.enabled || local.nat_gateway)

  # With a NAT gateway: nodes in the first half of the VPC, the public subnet a /24 (at most
  # /28, the smallest subnet) at its end. Without: one subnet spans the VPC.
  vpc_prefix         = try(tonumber(split("/", var.vpc_cidr)[1]), 16)
  public_subnet_bits = max(min(8, 28 - local.vpc_prefix), 1)
  node_subnet_cidr   = local.nat_gateway ? cidrsubnet(var.vpc_cidr, 1, 0) : var.vpc_cidr
  public_subnet_cidr = local.nat_gateway ? cidrsubnet(var.vpc_cidr, local.public_subnet_bits, pow(2, local.public_subnet_bits) - 1) : null

  # Where the bastion goes, and which subnet the internet route table serves.
  public_subnet_id = local.nat_gateway ? aws_subnet.public[0].id : local.subnet_id
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

  lifecycle {
    precondition {
      condition     = !local.nat_gateway || local.vpc_prefix <= 27
      error_message = "vpc_cidr ${var.vpc_cidr} is too small for a private and a public subnet (the NAT gateway layout); use /27 or larger, e.g. \"10.0.0.0/16\", or set nat_gateway = false."
    }
  }
}

# The nodes' subnet (private when there is a NAT gateway).
resource "aws_subnet" "this" {
  count = local.create_network ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = local.node_subnet_cidr
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = local.nat_gateway ? "${var.name}-private" : var.name })

  lifecycle {
    precondition {
      condition     = local.availability_zone != null
      error_message = "No Availability Zone in this region offers ${var.instance_type}; set availability_zone, pass subnet_id, or choose another region or instance type."
    }
  }
}

# Bastion and NAT gateway, in the nodes' zone.
resource "aws_subnet" "public" {
  count = local.nat_gateway ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = local.public_subnet_cidr
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = "${var.name}-public" })
}

resource "aws_internet_gateway" "this" {
  count = local.create_internet_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = var.name })
}

# Route table of the public subnet (or of the one subnet).
resource "aws_route_table" "this" {
  count = local.create_internet_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = local.nat_gateway ? "${var.name}-public" : var.name })
}

resource "aws_route" "internet" {
  count = local.create_internet_gateway ? 1 : 0

  route_table_id         = aws_route_table.this[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this[0].id
}

resource "aws_route_table_association" "this" {
  count = local.create_internet_gateway ? 1 : 0

  subnet_id      = local.public_subnet_id
  route_table_id = aws_route_table.this[0].id
}

resource "aws_eip" "nat" {
  count = local.nat_gateway ? 1 : 0

  domain = "vpc"
  tags   = merge(local.tags, { Name = "${var.name}-nat" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_nat_gateway" "this" {
  count = local.nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = var.name })

  depends_on = [aws_route.internet]
}

resource "aws_route_table" "private" {
  count = local.nat_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "${var.name}-private" })
}

resource "aws_route" "nat" {
  count = local.nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.private[0].id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

resource "aws_route_table_association" "private" {
  count = local.nat_gateway ? 1 : 0

  subnet_id      = aws_subnet.this[0].id
  route_table_id = aws_route_table.private[0].id
}
