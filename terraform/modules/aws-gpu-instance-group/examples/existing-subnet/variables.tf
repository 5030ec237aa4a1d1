variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-west-2"
}

variable "name" {
  description = "Cluster name."
  type        = string
  default     = "g5-spot"
}

variable "node_count" {
  description = "Number of g5.48xlarge nodes."
  type        = number
  default     = 4
}

variable "subnet_id" {
  description = "Existing subnet for all nodes; it needs a route to an internet gateway for public IPs to be useful."
  type        = string
}

variable "extra_security_group_ids" {
  description = "Further security groups for the nodes."
  type        = list(string)
  default     = []
}

variable "key_name" {
  description = "Existing EC2 key pair."
  type        = string
}

variable "ssh_ingress_cidrs" {
  description = "Where you SSH from, e.g. [\"203.0.113.7/32\"]."
  type        = list(string)
}

variable "placement_group_name" {
  description = "Existing cluster placement group in the subnet's zone."
  type        = string
}
