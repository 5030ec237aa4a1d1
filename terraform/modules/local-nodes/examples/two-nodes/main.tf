# Two local nodes, by hand (gpuctl renders the same call for `infra: local`).
#
#   ssh-keygen -t ed25519 -N '' -f ./id_ed25519
#   terraform init && sudo terraform apply        # netns mode needs root
#   ssh -i ./id_ed25519 root@10.213.250.2         # node 0 (the head)
#   sudo terraform destroy                        # removes nodes, namespaces, bridge, dirs

variable "mode" {
  description = "netns (root) or loopback (anyone; then also set ssh_user to your user name)."
  type        = string
  default     = "netns"
}

variable "ssh_user" {
  type    = string
  default = "root"
}

module "nodes" {
  source = "../.."

  name           = "example"
  node_count     = 2
  ssh_public_key = file("${path.root}/id_ed25519.pub")
  mode           = var.mode
  subnet_cidr    = "10.213.250.0/24"
  base_port      = 22200
  state_dir      = "${abspath(path.root)}/state/nodes"
  ssh_user       = var.ssh_user
}

output "nodes" {
  value = module.nodes.nodes
}

output "ssh_user" {
  value = module.nodes.ssh_user
}
