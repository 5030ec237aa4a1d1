variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Cluster name."
  type        = string
  default     = "standard"
}

variable "instance_type" {
  description = "Any instance type."
  type        = string
  default     = "g6.xlarge"
}

variable "node_count" {
  description = "Number of nodes."
  type        = number
  default     = 2
}

variable "availability_zone" {
  description = "Zone for the module's subnet; null picks the first zone offering the type."
  type        = string
  default     = null
}

variable "ami_id" {
  description = "AMI id; null uses the Deep Learning AMI from SSM."
  type        = string
  default     = null
}

variable "ssh_public_key" {
  description = "OpenSSH public key for the nodes."
  type        = string
}

variable "ssh_ingress_cidrs" {
  description = "Where you SSH from, e.g. [\"203.0.113.7/32\"]."
  type        = list(string)
  default     = []
}
