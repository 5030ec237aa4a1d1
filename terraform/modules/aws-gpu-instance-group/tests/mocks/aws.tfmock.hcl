# Plan-time values for ids the plan tests compare against. Used by the plan-only test files:
# override_during = plan breaks apply runs (other computed values are redrawn at apply).

mock_resource "aws_security_group" {
  override_during = plan
  defaults = {
    id = "sg-0a1b2c3d4e5f60718"
  }
}

mock_resource "aws_subnet" {
  override_during = plan
  defaults = {
    id = "subnet-0a1b2c3d4e5f60718"
  }
}

mock_resource "aws_vpc" {
  override_during = plan
  defaults = {
    id = "vpc-0a1b2c3d4e5f60718"
  }
}

mock_resource "aws_placement_group" {
  override_during = plan
  defaults = {
    id = "pg-0a1b2c3d4e5f60718"
  }
}

mock_data "aws_ami" {
  defaults = {
    id               = "ami-0123456789abcdef0"
    root_device_name = "/dev/sda1"
  }
}

mock_data "aws_ssm_parameter" {
  defaults = {
    value          = "ami-0123456789abcdef0"
    insecure_value = "ami-0123456789abcdef0"
    type           = "String"
  }
}

mock_data "aws_subnet" {
  defaults = {
    id                = "subnet-0fedcba9876543210"
    vpc_id            = "vpc-0fedcba9876543210"
    availability_zone = "us-east-1b"
  }
}

mock_data "aws_ec2_instance_type_offerings" {
  defaults = {
    instance_types = ["p5.48xlarge", "p5.48xlarge"]
    locations      = ["us-east-1c", "us-east-1a"]
    location_types = ["availability-zone", "availability-zone"]
  }
}

# p5.48xlarge as describe-instance-types reports it; tests of other types override it.
mock_data "aws_ec2_instance_type" {
  defaults = {
    efa_supported              = true
    efa_maximum_interfaces     = 32
    maximum_network_cards      = 32
    maximum_network_interfaces = 64
    network_cards              = [for i in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31] : { index = i, maximum_interfaces = 2, baseline_bandwidth = 100, peak_bandwidth = 100, performance = "100 Gigabit" }]
  }
}

mock_resource "aws_launch_template" {
  override_during = plan
  defaults = {
    id = "lt-0a1b2c3d4e5f60718"
  }
}
