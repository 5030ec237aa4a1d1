variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Cluster name."
  type        = string
  default     = "p5-efa"
}

variable "node_count" {
  description = "Number of p5.48xlarge nodes."
  type        = number
  default     = 2
}

variable "availability_zone" {
  description = "Zone for the cluster (a Capacity Block's zone when one is used); null picks the first zone offering p5.48xlarge."
  type        = string
  default     = null
}

variable "ssh_public_key" {
  description = "OpenSSH public key for the nodes and the bastion."
  type        = string
}

variable "ssh_ingress_cidrs" {
  description = "Where you SSH from, e.g. [\"203.0.113.7/32\"]."
  type        = list(string)
}

variable "capacity_reservation_id" {
  description = "cr-... id of a purchased Capacity Block, or null for on-demand."
  type        = string
  default     = null
}
