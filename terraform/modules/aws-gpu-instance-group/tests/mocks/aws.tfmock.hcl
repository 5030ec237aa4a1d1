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
