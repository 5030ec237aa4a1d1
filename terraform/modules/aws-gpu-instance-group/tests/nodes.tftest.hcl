# Node instances: count and rank order, tags, AMI, key pair, launch-template contents.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "nodes"
  instance_type     = "p5.48xlarge"
  node_count        = 3
  availability_zone = "us-east-1a"
  ssh_public_key    = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuY3RsLXRlc3Qta2V5LW5vdC1hLXJlYWwta2V5 gpuctl-test"
}

run "ranked_and_tagged" {
  command = plan

  variables {
    tags = { team = "ml", "gpuctl-cluster" = "spoofed" }
  }

  assert {
    condition     = length(aws_instance.node) == 3
    error_message = "one instance per node"
  }

  assert {
    condition     = [for n in aws_instance.node : n.tags["Name"]] == ["nodes-0", "nodes-1", "nodes-2"] && [for n in aws_instance.node : n.tags["gpuctl-rank"]] == ["0", "1", "2"]
    error_message = "instances are named <name>-<rank> and tagged gpuctl-rank in rank order"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.tags["gpuctl-cluster"] == "nodes" && n.tags["team"] == "ml"])
    error_message = "caller tags pass through; the module's gpuctl-cluster tag wins"
  }

  assert {
    condition     = alltrue([for n in aws_instance.node : n.launch_template[0].id == "lt-0a1b2c3d4e5f60718"])
    error_message = "every node launches from the module's launch template"
  }

  assert {
    condition     = alltrue([for ts in aws_launch_template.node.tag_specifications : ts.tags["gpuctl-cluster"] == "nodes"]) && toset([for ts in aws_launch_template.node.tag_specifications : ts.resource_type]) == toset(["volume", "network-interface"])
    error_message = "volumes and interfaces are tagged with the cluster"
  }

  assert {
    condition     = aws_launch_template.node.instance_type == "p5.48xlarge"
    error_message = "the launch template sets the instance type"
  }
}

run "deep_learning_ami_from_ssm_by_default" {
  command = plan

  assert {
    condition     = data.aws_ssm_parameter.node_ami[0].name == "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    error_message = "the default AMI is the Deep Learning AMI's SSM parameter"
  }

  assert {
    condition     = aws_launch_template.node.image_id == "ami-0123456789abcdef0" && output.ssh_user == "ubuntu"
    error_message = "the launch template uses the parameter's AMI id; its user is ubuntu"
  }
}

run "given_ami_skips_ssm" {
  command = plan

  variables {
    ami_id   = "ami-0fedcba9876543210"
    ssh_user = "ec2-user"
  }

  assert {
    condition     = length(data.aws_ssm_parameter.node_ami) == 0 && aws_launch_template.node.image_id == "ami-0fedcba9876543210"
    error_message = "a given ami_id is used as is, without SSM"
  }

  assert {
    condition     = output.ssh_user == "ec2-user"
    error_message = "ssh_user passes through"
  }
}

run "public_key_is_imported" {
  command = plan

  assert {
    condition     = aws_key_pair.this[0].public_key == var.ssh_public_key && aws_key_pair.this[0].key_name_prefix == "nodes-"
    error_message = "ssh_public_key becomes a key pair named after the cluster"
  }
}

run "existing_key_pair" {
  command = plan

  variables {
    ssh_public_key = null
    key_name       = "team-key"
  }

  assert {
    condition     = length(aws_key_pair.this) == 0 && aws_launch_template.node.key_name == "team-key"
    error_message = "key_name is used as is"
  }
}

run "boot_options" {
  command = plan

  variables {
    user_data              = "#!/bin/bash\necho ready\n"
    iam_instance_profile   = "training-data-reader"
    root_volume_size       = 1024
    root_volume_kms_key_id = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
  }

  assert {
    condition     = aws_launch_template.node.user_data == base64encode("#!/bin/bash\necho ready\n")
    error_message = "user_data is base64-encoded into the launch template"
  }

  assert {
    condition     = aws_instance.node[0].iam_instance_profile == "training-data-reader" && length(aws_launch_template.node.iam_instance_profile) == 0
    error_message = "the instance profile is set by name on the instances (changed in place), not in the launch template"
  }

  assert {
    condition     = aws_launch_template.node.block_device_mappings[0].ebs[0].volume_size == 1024 && aws_launch_template.node.block_device_mappings[0].ebs[0].kms_key_id == "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab" && aws_launch_template.node.block_device_mappings[0].ebs[0].encrypted == "true"
    error_message = "root volume size and KMS key pass through; encryption stays on"
  }
}
