#!/usr/bin/env bash
# The cluster's bridge for netns-mode local nodes. `bridge.sh up` creates it
# with the cluster's first address (.1/24), `bridge.sh down` deletes it.
# Terraform runs this from local-exec with LN_BRIDGE, LN_BRIDGE_ADDR and
# LN_STATE_DIR set; LN_STATE_DIR/bridge.env records the name so that a bridge
# whose creation was interrupted can still be found and removed.
set -euo pipefail
umask 077

die() { echo "local-nodes: bridge ${LN_BRIDGE:-?}: $*" >&2; exit 1; }
# shellcheck source=users.sh
. "$(dirname -- "${BASH_SOURCE[0]}")/users.sh"

exists() { ip link show dev "$LN_BRIDGE" >/dev/null 2>&1; }

up() {
  [[ $(id -u) == 0 ]] || die "netns mode needs root; run as root or use mode = \"loopback\""
  command -v ip >/dev/null || die "netns mode needs iproute2 (apt-get install iproute2) or use mode = \"loopback\""
  # A bridge of this name is a leftover of an earlier failed run of this same
  # cluster (the name hashes the cluster name and state_dir): start clean.
  if exists; then ip link del dev "$LN_BRIDGE"; fi
  local net="${LN_BRIDGE_ADDR%.*/*}.0/${LN_BRIDGE_ADDR#*/}" used
  used=$(ip -o -4 addr show to "$net" 2>/dev/null | awk '{print $2 " " $4}' | head -n 3 | tr '\n' ' ')
  [[ -z $used ]] || die "subnet $net is already used on this machine ($used); choose another subnet_cidr"
  mkdir -p "$LN_STATE_DIR"
  printf 'LN_BRIDGE=%s\nLN_STATE_DIR=%s\n' "$LN_BRIDGE" "$LN_STATE_DIR" >"$LN_STATE_DIR/bridge.env"
  ip link add name "$LN_BRIDGE" type bridge
  if ! { ip addr add "$LN_BRIDGE_ADDR" dev "$LN_BRIDGE" && ip link set dev "$LN_BRIDGE" up; }; then
    ip link del dev "$LN_BRIDGE" 2>/dev/null || true
    die "could not configure $LN_BRIDGE_ADDR on the bridge"
  fi
  start_anchor
}

# The cluster's anchor: a process that only sleeps, in this machine's mount and network namespaces,
# so that a node (whose own namespaces hide them) can enter those to remove the cluster itself
# (scripts/hostns.sh, autodown). PID 1 would do where it may be entered; in containers and
# sandboxes it often may not. Recorded with its start time; `down` ends it.
start_anchor() {
  local pid start
  setsid sleep infinity </dev/null >/dev/null 2>&1 &
  pid=$!
  start=$(start_time "$pid") || die "the cluster's anchor process (sleep) did not start"
  printf 'LN_ANCHOR=%s\nLN_ANCHOR_START=%s\n' "$pid" "$start" >>"$LN_STATE_DIR/bridge.env"
}

# Field 22 of /proc/PID/stat (start time); the command name may hold spaces, so split after it.
start_time() {
  local stat fields
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  read -r -a fields <<<"$stat"
  echo "${fields[19]}"
}

stop_anchor() {
  local pid="" start=""
  [[ -r $LN_STATE_DIR/bridge.env ]] || return 0
  pid=$(sed -n 's/^LN_ANCHOR=//p' "$LN_STATE_DIR/bridge.env")
  start=$(sed -n 's/^LN_ANCHOR_START=//p' "$LN_STATE_DIR/bridge.env")
  [[ -n $pid && -n $start ]] || return 0
  if [[ $(start_time "$pid") == "$start" ]]; then kill "$pid" 2>/dev/null || true; fi
}

down() {
  if [[ -n ${LN_STATE_DIR:-} ]]; then stop_anchor; fi
  if exists; then ip link del dev "$LN_BRIDGE"; fi
  if exists; then die "still present after 'ip link del'; delete it by hand (ip link del $LN_BRIDGE)"; fi
  if [[ -n ${LN_STATE_DIR:-} ]]; then
    rm -f -- "$LN_STATE_DIR/bridge.env"
    rmdir -- "$LN_STATE_DIR" 2>/dev/null || true # once the nodes are gone too
  fi
  tidy_users # the cluster's last step: a login user made for local nodes goes with the last of them
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) die "usage: bridge.sh up|down" ;;
esac
