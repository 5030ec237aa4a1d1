################################################################################
# Cluster
################################################################################

variable "name" {
  description = "Cluster name. Prefixes resource names, is the `gpuctl-cluster` tag, and names nodes `<name>-<rank>`."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$", var.name))
    error_message = "name must be 1-32 lowercase letters, digits or hyphens, start with a letter and not end with a hyphen, e.g. \"llm-train\"."
  }
}

variable "instance_type" {
  description = "EC2 instance type of every node (one type per cluster, as EFA clusters require), e.g. `p5.48xlarge`."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9-]+$", var.instance_type))
    error_message = "instance_type must be an EC2 instance type such as \"p5.48xlarge\" or \"g5.48xlarge\"."
  }
}

variable "node_count" {
  description = "Number of nodes. Node `i` is rank `i` (rank 0 is the head)."
  type        = number
  nullable    = false

  validation {
    condition     = var.node_count >= 1 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number of at least 1."
  }
}

variable "tags" {
  description = "Tags for every resource. The module adds `gpuctl-cluster` (and `Name`, `gpuctl-rank` on nodes), which win over keys of the same name here."
  type        = map(string)
  default     = {}
  nullable    = false
}

################################################################################
# Network
################################################################################

variable "subnet_id" {
  description = "Existing subnet for all nodes (EFA does not cross Availability Zones, so there is one). null: the module creates a VPC with one subnet in `availability_zone`."
  type        = string
  default     = null

  validation {
    condition     = var.subnet_id == null || can(regex("^subnet-[0-9a-f]+$", var.subnet_id))
    error_message = "subnet_id must be a subnet id such as \"subnet-0123456789abcdef0\", or null to let the module create a VPC and subnet."
  }
}

variable "availability_zone" {
  description = "Availability Zone for the subnet the module creates. null: the first zone (by name) that offers `instance_type`. With `subnet_id`, leave null or give the subnet's zone."
  type        = string
  default     = null

  validation {
    condition     = var.availability_zone == null || can(regex("^[a-z]{2}(-[a-z0-9]+)+[a-z]$", var.availability_zone))
    error_message = "availability_zone must be a zone name such as \"us-east-1a\" (for a Capacity Block: the block's zone), or null."
  }
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of the VPC the module creates when `subnet_id` is null. One subnet spans it, or with a NAT gateway the nodes' private subnet takes the first half and the public subnet a /24 (smaller in small VPCs) at the end; that layout needs /27 or larger."
  type        = string
  default     = "10.0.0.0/16"
  nullable    = false

  validation {
    condition     = can(cidrnetmask(var.vpc_cidr)) && try(tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 28, false)
    error_message = "vpc_cidr must be an IPv4 CIDR block between /16 and /28 (the VPC limits), e.g. \"10.0.0.0/16\"."
  }
}

variable "associate_public_ip" {
  description = "Give each node an auto-assigned public IPv4. null: yes when a node has a single network interface, no bastion is enabled and `nat_gateway` is not true. EC2 refuses it with several interfaces (EFA types such as p5); use `bastion` or `elastic_ip` there."
  type        = bool
  default     = null
}

variable "nat_gateway" {
  description = <<-EOT
    Internet egress for nodes without a public address in the module's VPC. null (default): when the
    module creates the VPC and nodes get no public IP (and `elastic_ip` is off), it adds a small public
    subnet in the same zone, holding the bastion and a NAT gateway, and the nodes' subnet becomes
    private with its default route through the NAT gateway. true: that layout even for nodes that
    would get public IPs (they become private). false: never; private nodes then have no internet
    egress. Not with `subnet_id`, whose routing the caller owns.
  EOT
  type        = bool
  default     = null
}

variable "elastic_ip" {
  description = "Attach an Elastic IP to each node's primary interface: public reachability (and internet egress in the module's VPC) for nodes with several EFA interfaces."
  type        = bool
  default     = false
  nullable    = false
}

variable "ssh_ingress_cidrs" {
  description = "IPv4 CIDRs allowed to SSH (tcp/22) to the nodes and the bastion. Empty (default): no SSH from anywhere outside the cluster."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for c in var.ssh_ingress_cidrs : can(cidrnetmask(c)) && try(cidrsubnet(c, 0, 0) == c, false)])
    error_message = "Each ssh_ingress_cidrs entry must be an IPv4 CIDR block with no host bits set, e.g. \"203.0.113.7/32\" for one address or \"10.0.0.0/16\"."
  }
}

variable "extra_security_group_ids" {
  description = "Further security groups for every node interface (e.g. one that lets your VPC's controller in)."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for id in var.extra_security_group_ids : can(regex("^sg-[0-9a-f]+$", id))])
    error_message = "extra_security_group_ids must hold security group ids such as \"sg-0123456789abcdef0\"."
  }
}

################################################################################
# Nodes
################################################################################

variable "ami_id" {
  description = "AMI for the nodes. null: the AMI id stored in the SSM parameter `ami_ssm_parameter` (the Deep Learning AMI, which ships the EFA installer, libfabric and aws-ofi-nccl)."
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must be an AMI id such as \"ami-0123456789abcdef0\", or null to look it up from ami_ssm_parameter."
  }
}

variable "ami_ssm_parameter" {
  description = "SSM parameter holding the node AMI id when `ami_id` is null (needs `ssm:GetParameter`)."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
  nullable    = false

  validation {
    condition     = startswith(var.ami_ssm_parameter, "/")
    error_message = "ami_ssm_parameter must be a full SSM parameter name starting with \"/\", e.g. \"/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id\"."
  }
}

variable "ssh_user" {
  description = "Login user of the node AMI (`ubuntu` for the Ubuntu Deep Learning AMI, `ec2-user` for Amazon Linux)."
  type        = string
  default     = "ubuntu"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]*$", var.ssh_user))
    error_message = "ssh_user must be a Linux user name such as \"ubuntu\" or \"ec2-user\"."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key (ed25519 or RSA) imported as the nodes' key pair. Set this or `key_name`."
  type        = string
  default     = null

  validation {
    condition     = var.ssh_public_key == null || can(regex("^(ssh-ed25519|ssh-rsa) [A-Za-z0-9+/]+=*( .*)?$", trimspace(coalesce(var.ssh_public_key, "-"))))
    error_message = "ssh_public_key must be one OpenSSH public key line starting with \"ssh-ed25519 \" or \"ssh-rsa \" (EC2 imports no other kinds), e.g. the contents of id_ed25519.pub."
  }
}

variable "key_name" {
  description = "Name of an existing EC2 key pair for the nodes. Set this or `ssh_public_key`."
  type        = string
  default     = null

  validation {
    condition     = var.key_name == null || try(length(trimspace(var.key_name)) > 0, false)
    error_message = "key_name must name an existing EC2 key pair, or be null when ssh_public_key is given."
  }
}

variable "root_volume_size" {
  description = "Root volume size in GiB. The volume is always gp3 and encrypted."
  type        = number
  default     = 200
  nullable    = false

  validation {
    condition     = var.root_volume_size >= 8 && var.root_volume_size <= 16384 && floor(var.root_volume_size) == var.root_volume_size
    error_message = "root_volume_size must be a whole number of GiB from 8 to 16384 (and at least the AMI's snapshot size; the Deep Learning AMI wants 100 or more)."
  }
}

variable "root_volume_kms_key_id" {
  description = "KMS key (ARN) for root volume encryption. null: the account's default EBS key."
  type        = string
  default     = null
}

variable "iam_instance_profile" {
  description = "Name of an IAM instance profile for the nodes: their identity for AWS APIs (e.g. S3 buckets the jobs read and write, through the instance metadata service). Changing it associates the new profile with the running nodes in place. null: none."
  type        = string
  default     = null

  validation {
    condition     = var.iam_instance_profile == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", coalesce(var.iam_instance_profile, "-")))
    error_message = "iam_instance_profile must be the name of an instance profile (1-128 letters, digits and +=,.@_-), such as \"training-data-reader\", not its ARN; or null for none."
  }
}

variable "user_data" {
  description = "cloud-init user data for the nodes, as plain text (the module base64-encodes it)."
  type        = string
  default     = null
}

################################################################################
# EFA, placement, capacity
################################################################################

variable "efa" {
  description = "Elastic Fabric Adapter. null (default): every EFA interface the type offers when it supports EFA, plain ENA otherwise. true: the same, but planning fails on a type without EFA. false: ENA only."
  type        = bool
  default     = null
}

variable "placement_group" {
  description = <<-EOT
    Cluster placement group. `mode`: "create" (a `cluster` group named `name`, default the cluster name),
    "existing" (join the group called `name`), "none". null mode: "create", or "none" for Capacity Blocks,
    which come co-located.
  EOT
  type = object({
    mode = optional(string)
    name = optional(string)
  })
  default  = {}
  nullable = false

  validation {
    condition     = var.placement_group.mode == null || contains(["create", "existing", "none"], coalesce(var.placement_group.mode, "none"))
    error_message = "placement_group.mode must be \"create\", \"existing\" or \"none\" (or null for the default)."
  }

  validation {
    condition     = var.placement_group.name == null || can(regex("^[A-Za-z0-9._-]{1,255}$", coalesce(var.placement_group.name, "-")))
    error_message = "placement_group.name must be 1-255 letters, digits, dots, underscores or hyphens."
  }
}

variable "market" {
  description = "Purchase option: \"on-demand\" (optionally into a capacity reservation), \"spot\" (one-time, terminated on interruption), or \"capacity-block\" (needs `capacity_reservation_id`)."
  type        = string
  default     = "on-demand"
  nullable    = false

  validation {
    condition     = contains(["on-demand", "spot", "capacity-block"], var.market)
    error_message = "market must be \"on-demand\", \"spot\" or \"capacity-block\"."
  }
}

variable "shutdown_behavior" {
  description = "What a shutdown from inside a node does: \"stop\" (EBS keeps billing) or \"terminate\" (the node and, with delete_on_termination, its volumes and interfaces go). gpuctl sets \"terminate\" for clusters that autodown, whose head shuts every node down once idle. Spot nodes (one-time requests) always terminate."
  type        = string
  default     = "stop"
  nullable    = false

  validation {
    condition     = contains(["stop", "terminate"], var.shutdown_behavior)
    error_message = "shutdown_behavior must be \"stop\" or \"terminate\"."
  }
}

variable "instance_state" {
  description = "The state every node is kept in: \"running\", or \"stopped\" (`gpuctl stop`): the instances stop and keep their EBS volumes, which still bill; their private addresses stay, a public IP that is not an Elastic IP is released and the next start brings a new one. Spot nodes (one-time requests) cannot be stopped. The bastion keeps running either way, so its address and pinned host key stay."
  type        = string
  default     = "running"
  nullable    = false

  validation {
    condition     = contains(["running", "stopped"], var.instance_state)
    error_message = "instance_state must be \"running\" or \"stopped\"."
  }
}

variable "capacity_reservation_id" {
  description = "Capacity reservation (cr-...) to launch into: an On-Demand Capacity Reservation or a Capacity Block. Its Availability Zone must be the subnet's."
  type        = string
  default     = null

  validation {
    condition     = var.capacity_reservation_id == null || can(regex("^cr-[0-9a-f]{8,17}$", var.capacity_reservation_id))
    error_message = "capacity_reservation_id must be a reservation id such as \"cr-0123456789abcdef0\", or null."
  }
}

################################################################################
# Bastion
################################################################################

variable "bastion" {
  description = <<-EOT
    Optional small SSH jump host with a public IP, reachable only from `ssh_ingress_cidrs`; nodes
    accept SSH from it. It sits in the public subnet when there is a NAT gateway (`nat_gateway`),
    else in the nodes' subnet. Use it for nodes without public IPs (EFA types with several
    interfaces). `ami_id` null: the AMI id in `ami_ssm_parameter` (Ubuntu 22.04).
  EOT
  type = object({
    enabled           = optional(bool, false)
    instance_type     = optional(string, "t3.micro")
    ami_id            = optional(string)
    ami_ssm_parameter = optional(string, "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id")
    ssh_user          = optional(string, "ubuntu")
    root_volume_size  = optional(number, 8)
  })
  default  = {}
  nullable = false

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9-]+$", var.bastion.instance_type))
    error_message = "bastion.instance_type must be an EC2 instance type such as \"t3.micro\"."
  }

  validation {
    condition     = var.bastion.ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", coalesce(var.bastion.ami_id, "-")))
    error_message = "bastion.ami_id must be an AMI id such as \"ami-0123456789abcdef0\", or null to look it up from bastion.ami_ssm_parameter."
  }

  validation {
    condition     = var.bastion.root_volume_size >= 8 && floor(var.bastion.root_volume_size) == var.bastion.root_volume_size
    error_message = "bastion.root_volume_size must be a whole number of GiB, at least 8."
  }
}

variable "ssh_private_key_file" {
  description = "Path of the private key matching the nodes' key pair, written into the `ansible_inventory` output as `ansible_ssh_private_key_file`; null leaves it to your SSH/Ansible config."
  type        = string
  default     = null
}

variable "gpus_per_node" {
  description = "GPUs per node written into the `ansible_inventory` output (`gpuctl_gpus`, a hostfile's slots); null: what EC2 reports for the instance type."
  type        = number
  default     = null

  validation {
    condition     = var.gpus_per_node == null || try(var.gpus_per_node >= 0 && floor(var.gpus_per_node) == var.gpus_per_node, false)
    error_message = "gpus_per_node must be a whole number of at least 0, or null."
  }
}
