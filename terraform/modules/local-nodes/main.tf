# Local nodes: N real sshd processes on this machine, for tests and demos.
#
# Built-ins only: every node is a terraform_data whose local-exec provisioners
# run scripts/node.sh (up on create, down on destroy); in netns mode the
# cluster's bridge is its own terraform_data that the nodes depend on, so it is
# created before and destroyed after them. Destroy-time provisioners may only
# read `self`, so everything teardown needs lives in triggers_replace (which
# also means any change to a node's inputs rebuilds that node).

locals {
  netns = var.mode == "netns"

  # Interface names are limited to 15 characters. A readable slug of the name
  # plus a hash of (name, state_dir) keeps two clusters -- or two state
  # directories using the same cluster name -- from ever sharing a bridge,
  # namespace or veth: "gb" + 3 + 6 = 11, "gn"/"gv" + 9 + "-" + index <= 15.
  slug = substr(replace(var.name, "-", ""), 0, 3)
  hash = substr(sha1("${var.name}\n${var.state_dir}"), 0, 6)
  key  = "${local.slug}${local.hash}"

  bridge      = "gb${local.key}"
  bridge_addr = cidrhost(var.subnet_cidr, 1)
  prefix_len  = tonumber(split("/", var.subnet_cidr)[1])

  nodes = [for i in range(var.node_count) : {
    index   = i
    dir     = "${var.state_dir}/node${i}"
    netns   = local.netns ? "gn${local.key}-${i}" : ""
    veth    = local.netns ? "gv${local.key}-${i}" : ""
    address = local.netns ? cidrhost(var.subnet_cidr, i + 2) : "127.0.0.1"
    port    = local.netns ? 22 : var.base_port + i
    # Exported to the node's sshd and set in every session (SetEnv): teardown
    # also finds processes by it, e.g. ranks that detached from their session.
    tag = "gpuctl-${local.key}-${i}"
  }]

  # Every node's /etc/hosts names all nodes, so peers resolve both ways.
  hosts = join("\n", [for n in local.nodes : "${n.address} ${var.name}-${n.index}"])
}

resource "terraform_data" "bridge" {
  count = local.netns ? 1 : 0

  triggers_replace = {
    bridge     = local.bridge
    address    = local.bridge_addr
    prefix_len = local.prefix_len
    state_dir  = var.state_dir
  }

  provisioner "local-exec" {
    interpreter = ["bash", "${path.module}/scripts/bridge.sh"]
    command     = "up"
    environment = {
      LN_BRIDGE      = self.triggers_replace.bridge
      LN_BRIDGE_ADDR = "${self.triggers_replace.address}/${self.triggers_replace.prefix_len}"
      LN_STATE_DIR   = self.triggers_replace.state_dir
    }
  }

  provisioner "local-exec" {
    when        = destroy
    interpreter = ["bash", "${path.module}/scripts/bridge.sh"]
    command     = "down"
    environment = {
      LN_BRIDGE    = self.triggers_replace.bridge
      LN_STATE_DIR = self.triggers_replace.state_dir
    }
  }
}

resource "terraform_data" "node" {
  count = var.node_count

  depends_on = [terraform_data.bridge]

  triggers_replace = merge(local.nodes[count.index], {
    mode         = var.mode
    state_dir    = var.state_dir
    bridge       = local.netns ? local.bridge : ""
    prefix_len   = local.prefix_len
    user         = var.ssh_user
    public_key   = trimspace(var.ssh_public_key)
    node_path    = var.node_path
    keep_visible = join(":", var.keep_visible_paths)
  })

  lifecycle {
    precondition {
      condition     = local.netns || var.base_port + var.node_count - 1 <= 65535
      error_message = "loopback mode: base_port + node_count - 1 must be a port (<= 65535); lower base_port."
    }
    precondition {
      condition     = !local.netns || var.node_count <= pow(2, 32 - local.prefix_len) - 3
      error_message = "netns mode: subnet_cidr holds the bridge and 253 nodes (/24) or 509 (/23); give a /23 or fewer nodes."
    }
    precondition {
      condition     = local.netns || var.node_count <= 253
      error_message = "loopback mode: at most 253 nodes (gpuctl gives each loopback cluster a block of 256 ports)."
    }
  }

  provisioner "local-exec" {
    interpreter = ["bash", "${path.module}/scripts/node.sh"]
    command     = "up"
    environment = {
      LN_MODE       = self.triggers_replace.mode
      LN_INDEX      = self.triggers_replace.index
      LN_DIR        = self.triggers_replace.dir
      LN_NETNS      = self.triggers_replace.netns
      LN_VETH       = self.triggers_replace.veth
      LN_BRIDGE     = self.triggers_replace.bridge
      LN_ADDR       = self.triggers_replace.address
      LN_PREFIX_LEN = self.triggers_replace.prefix_len
      LN_PORT       = self.triggers_replace.port
      LN_USER       = self.triggers_replace.user
      LN_PUBKEY     = self.triggers_replace.public_key
      LN_NODE_PATH  = self.triggers_replace.node_path
      LN_KEEP       = self.triggers_replace.keep_visible
      LN_TAG        = self.triggers_replace.tag
      LN_HOSTNAME   = "${var.name}-${count.index}"
      LN_HOSTS      = local.hosts
      LN_WAIT       = var.wait_timeout_seconds
      # Not triggers: a new internal key replaces no node (the install step authorizes it too).
      LN_INTERNAL_PUBKEY = trimspace(var.internal_public_key)
      LN_CREATE_USER     = var.create_user ? "true" : "false"
    }
  }

  provisioner "local-exec" {
    when        = destroy
    interpreter = ["bash", "${path.module}/scripts/node.sh"]
    command     = "down"
    environment = {
      LN_MODE  = self.triggers_replace.mode
      LN_DIR   = self.triggers_replace.dir
      LN_NETNS = self.triggers_replace.netns
      LN_VETH  = self.triggers_replace.veth
      LN_TAG   = self.triggers_replace.tag
      LN_USER  = self.triggers_replace.user
    }
  }
}
