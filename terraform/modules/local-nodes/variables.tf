variable "name" {
  description = "Cluster name; with state_dir it derives the bridge, namespace and veth names."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$", var.name))
    error_message = "name must be 1-40 lowercase letters, digits and '-', starting with a letter and not ending with '-'."
  }
}

variable "node_count" {
  description = "Number of nodes; node 0 is the head."
  type        = number
  nullable    = false

  validation {
    condition     = var.node_count >= 1 && var.node_count <= 509 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number from 1 to 509 (a /23 holds the bridge and 509 nodes; a /24, 253)."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key (one line) allowed to log in to every node as ssh_user."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\\.com|sk-ecdsa-sha2-nistp256@openssh\\.com) [A-Za-z0-9+/=]+( [^\\n]*)?\\n?$", var.ssh_public_key))
    error_message = "ssh_public_key must be one OpenSSH public key line such as 'ssh-ed25519 AAAA... comment' (the contents of a .pub file)."
  }
}

variable "internal_public_key" {
  description = "The cluster's node-to-node public key (one OpenSSH line), also authorized on every node at boot, so the head can install its workers itself. Changing it replaces no node. Empty: none."
  type        = string
  default     = ""
  nullable    = false

  validation {
    condition     = var.internal_public_key == "" || can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/=]+( [^\\n]*)?\\n?$", var.internal_public_key))
    error_message = "internal_public_key must be empty or one OpenSSH public key line such as 'ssh-ed25519 AAAA... comment'."
  }
}

variable "mode" {
  description = "netns: one network and mount namespace per node on a private bridge (needs root and iproute2). loopback: sshd processes on 127.0.0.1, one port each."
  type        = string
  default     = "netns"
  nullable    = false

  validation {
    condition     = contains(["netns", "loopback"], var.mode)
    error_message = "mode must be \"netns\" (root with iproute2) or \"loopback\" (anyone)."
  }
}

variable "subnet_cidr" {
  description = "netns mode: the cluster's private /23 or /24; the bridge takes its first address, node i the (i+2)th. Pick one no interface on this machine uses."
  type        = string
  default     = "10.213.0.0/24"
  nullable    = false

  validation {
    condition = (
      can(regex("^(10\\.[0-9]{1,3}|172\\.(1[6-9]|2[0-9]|3[01])|192\\.168)\\.[0-9]{1,3}\\.0/2[34]$", var.subnet_cidr))
      && can(cidrhost(var.subnet_cidr, 1))
      && try(cidrhost(var.subnet_cidr, 0) == split("/", var.subnet_cidr)[0], false)
    )
    error_message = "subnet_cidr must be a private /23 or /24 network address (10.x.y.0, 172.16-31.y.0 or 192.168.y.0; y even for a /23), e.g. 10.213.6.0/23."
  }
}

variable "base_port" {
  description = "loopback mode: node i's sshd listens on 127.0.0.1:(base_port + i). netns mode uses port 22 in each namespace."
  type        = number
  default     = 22200
  nullable    = false

  validation {
    condition     = var.base_port >= 1024 && var.base_port <= 65280 && floor(var.base_port) == var.base_port
    error_message = "base_port must be a whole number from 1024 to 65280 so that base_port + 255 is still a port."
  }
}

variable "state_dir" {
  description = "Absolute directory for node homes, host keys, sshd configs, logs and pids (one subdirectory per node). Removed node by node on destroy."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^(/[A-Za-z0-9._+@-]+){2,}$", var.state_dir))
    error_message = "state_dir must be an absolute path at least two levels deep, without a trailing '/' and made of letters, digits and ._+@- (no spaces), e.g. /home/me/.gpuctl/clusters/demo/nodes."
  }
}

variable "keep_visible_paths" {
  description = "netns mode: host paths nodes must still see (e.g. the Python installation under ~/.pyenv, a venv in a clone): under ssh_user's home, which the node's own home covers, they are bound into it; under a directory ssh_user cannot pass (root's 0700 home, a private home), the node covers the outermost such directory with one holding just these paths. Other paths are seen as they are."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for p in var.keep_visible_paths : can(regex("^(/[A-Za-z0-9._+@-]+)+$", p))])
    error_message = "keep_visible_paths entries must be absolute paths without a trailing '/' made of letters, digits and ._+@- (no spaces or ':')."
  }
}

variable "node_path" {
  description = "PATH of sessions on the nodes (sshd SetEnv and ~/.profile). Local nodes share this machine's software, so put the directories the jobs need here."
  type        = string
  default     = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  nullable    = false

  validation {
    condition     = alltrue([for p in split(":", var.node_path) : can(regex("^(/[A-Za-z0-9._+@-]*)+$", p))])
    error_message = "node_path must be ':'-separated absolute directories without spaces or quotes, e.g. /opt/venv/bin:/usr/bin:/bin."
  }
}

variable "ssh_user" {
  description = "User the nodes accept logins for (netns mode: any user, sshd runs as root; made when missing with create_user). loopback mode without root: must be the user running Terraform."
  type        = string
  default     = "root"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.ssh_user))
    error_message = "ssh_user must be a POSIX user name such as root or ubuntu."
  }
}

variable "create_user" {
  description = "netns mode: create ssh_user when this machine has no such user, with passwordless sudo (as a cloud image's login user). An existing user is left as it is."
  type        = bool
  default     = false
  nullable    = false
}

variable "wait_timeout_seconds" {
  description = "How long bring-up waits for each node's sshd to accept connections before failing."
  type        = number
  default     = 30
  nullable    = false

  validation {
    condition     = var.wait_timeout_seconds >= 1 && var.wait_timeout_seconds <= 600
    error_message = "wait_timeout_seconds must be between 1 and 600."
  }
}
