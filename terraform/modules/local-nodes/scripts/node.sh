#!/usr/bin/env bash
# One node of the local-nodes module: `node.sh up` starts it, `node.sh down`
# removes every trace of it (safe to run again after a partial failure).
# Terraform runs this from local-exec; the parameters are LN_* environment
# variables (see main.tf).
#
# Everything of the node lives under LN_DIR:
#   home/          the node's home (netns: mounted over the user's home inside
#                  the node; loopback: HOME of its sessions)
#   sshd/          sshd_config, host key, authorized_keys, session wrapper
#   sshd.log       sshd's log (-e)
#   sshd.pid       "PID STARTTIME" of the node's sshd
#   node.env       the LN_* values `down` needs, written first, so a node whose
#                  bring-up was interrupted can still be removed:
#                  (set -a; . DIR/node.env; bash node.sh down)
#
# A node's processes are found three ways, and teardown ends exactly those:
# the recorded sshd (PID and start time, so a reused PID is never hit), every
# process in the node's network namespace (netns mode), and every process whose
# environment carries GPUCTL_NODE_TAG=LN_TAG (sshd sets it in each session and
# children inherit it through setsid/nohup/daemonizing). Never by name.
set -euo pipefail
umask 077
# Started from inside a node? Then our children must not carry its tag.
unset GPUCTL_NODE_TAG

die() { echo "local-nodes: node ${LN_INDEX:-?} (${LN_DIR:-?}): $*" >&2; exit 1; }
# shellcheck source=users.sh
. "$(dirname -- "${BASH_SOURCE[0]}")/users.sh"

LOG="$LN_DIR/sshd.log"
PIDFILE="$LN_DIR/sshd.pid"
RUN_DIR="/run/gpuctl/${LN_NETNS:-}" # netns mode: where the node sees its sshd/ dir
DEV_DIR="$RUN_DIR.dev"                # netns mode: device files of the node's own (fuse)

# Field 22 (start time) and field 3 (state) of /proc/PID/stat; the command
# name may contain spaces, so split after its closing parenthesis.
proc_stat() {
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  # shellcheck disable=SC2086
  set -- $stat
  echo "$1 ${20}"
}

# Is PID running (not a zombie) and, if given, did it start at START?
alive() {
  local st
  st=$(proc_stat "$1") || return 1
  [[ ${st%% *} != Z ]] || return 1
  [[ -z ${2:-} || ${st#* } == "$2" ]]
}

# `ip netns add` names a namespace by a file in /run/netns (what `ip netns list` lists).
ns_exists() { [[ -n ${LN_NETNS:-} && -e /run/netns/$LN_NETNS ]]; }

# This script and its ancestors, which must never be signalled (they could
# carry the tag if Terraform itself was started from inside a node).
self_and_ancestors() {
  local pid=$$ stat
  echo "$BASHPID"
  while [[ -n $pid && $pid != 0 && $pid != 1 ]]; do
    echo "$pid"
    { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || break
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    pid=$2
  done
  return 0
}

node_pids() {
  local pid="" start="" p
  {
    if [[ -r $PIDFILE ]]; then
      read -r pid start <"$PIDFILE" || true
      if [[ -n $pid ]] && alive "$pid" "$start"; then echo "$pid"; fi
    fi
    if [[ ${LN_MODE:-} == netns ]] && ns_exists; then ip netns pids "$LN_NETNS" 2>/dev/null || true; fi
    grep -lzxF "GPUCTL_NODE_TAG=$LN_TAG" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true
  } | sort -un | { grep -vxF -f <(self_and_ancestors) || true; } | while read -r p; do
    if alive "$p"; then echo "$p"; fi
  done
  return 0
}

kill_node_processes() {
  local round pids sig
  for round in $(seq 1 50); do
    pids=$(node_pids | tr '\n' ' ')
    [[ -z ${pids// /} ]] && return 0
    sig=TERM
    ((round > 10)) && sig=KILL
    # shellcheck disable=SC2086
    kill -s "$sig" $pids 2>/dev/null || true
    sleep 0.2
  done
  die "processes $pids survived SIGKILL; end them by hand and run terraform destroy again"
}

# down [keep-state-dir]: the state directory (shared by the cluster's nodes)
# goes with the last node, except when `up` clears its own leftovers: a sibling
# being brought up at the same time may have just made it.
down() {
  [[ $LN_DIR == /*/*/* ]] || die "refusing to work on state directory '$LN_DIR' (too close to /)"
  kill_node_processes
  if [[ $LN_MODE == netns ]]; then
    ip link del dev "$LN_VETH" 2>/dev/null || true
    if ns_exists; then ip netns del "$LN_NETNS"; fi
    ! ns_exists || die "network namespace $LN_NETNS is still present; delete it (ip netns del $LN_NETNS)"
    ! ip link show dev "$LN_VETH" >/dev/null 2>&1 || die "veth $LN_VETH is still present; delete it (ip link del $LN_VETH)"
  fi
  # The node's bind mounts lived in its private mount namespace, which ended
  # with its last process. A mount under LN_DIR visible here would make rm -rf
  # delete through it into the host's files: stop instead.
  local mounted
  mounted=$(awk -v d="$LN_DIR" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | head -n 1)
  [[ -z $mounted ]] || die "$mounted is mounted on this machine; unmount it (umount -R $mounted) and run destroy again"
  rm -rf -- "$LN_DIR"
  if [[ ${1:-} != keep-state-dir ]]; then
    rmdir -- "$(dirname -- "$LN_DIR")" 2>/dev/null || true # fails while other nodes remain
  fi
  if [[ $LN_MODE == netns ]]; then
    # /run/gpuctl itself stays (like /run/sshd): every node of every cluster
    # makes its directory there, and removing it would race their mkdir -p.
    rmdir -- "$RUN_DIR" 2>/dev/null || true
    rm -rf -- "$DEV_DIR"
    if [[ ${1:-} != keep-state-dir ]]; then release_user; fi # the bridge, which goes last, tidies users
  fi
}

find_sshd() {
  local p
  p=$(PATH="$PATH:/usr/sbin:/sbin:/usr/local/sbin" command -v sshd) || die "sshd not found; install openssh-server (apt-get install openssh-server)"
  echo "$p"
}

find_sftp_server() {
  local p
  for p in /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server /usr/libexec/sftp-server /usr/lib/ssh/sftp-server; do
    if [[ -x $p ]]; then echo "$p" && return 0; fi
  done
  echo internal-sftp
}

# fstab_add VAR SOURCE TARGET TYPE OPTIONS: append an fstab line to VAR. libmount reads octal
# escapes in paths, so a space or a backslash survives; no process is started.
fstab_add() {
  local -n fstab=$1
  local field line="" p
  for p in "$2" "$3"; do
    field=${p//\\/\\134}
    field=${field// /\\040}
    field=${field//$'\t'/\\011}
    field=${field//$'\n'/\\012}
    line+="$field "
  done
  fstab+="$line$4 $5 0 0"$'\n'
}

# netns mode: is PID this node's sshd (up's $sshd), in the node's namespace, listening on LN_PORT? Read from
# /proc, with no process and no packet: a connection tried while the node's link is still coming
# up can lose its SYN, and TCP sends the next one a second later.
listening() {
  local _sl address _remote state _rest port
  [[ /proc/$1/exe -ef $sshd && /proc/$1/ns/net -ef /run/netns/$LN_NETNS ]] || return 1
  printf -v port '%04X' "$LN_PORT"
  {
    while read -r _sl address _remote state _rest; do
      [[ $state == 0A && $address == *:"$port" ]] && return 0
    done <"/proc/$1/net/tcp"
  } 2>/dev/null
  return 1
}

# Does something answer with an SSH banner on ADDR:PORT?
banner() {
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" && IFS= read -r -t 2 line <&3 && [[ $line == SSH-* ]]' _ "$1" "$2" 2>/dev/null
}

write_sshd_config() {
  local conf_dir=$1 home=$2 listen extra_keys="" setenv forced=""
  if [[ $LN_MODE == netns ]]; then
    listen=0.0.0.0 # inside the namespace: only lo and eth0
    extra_keys=" .ssh/authorized_keys"
    setenv="PATH=$LN_NODE_PATH GPUCTL_NODE_TAG=$LN_TAG"
  else
    listen=127.0.0.1
    setenv="PATH=$LN_NODE_PATH GPUCTL_NODE_TAG=$LN_TAG HOME=$home"
    forced="ForceCommand /bin/sh $conf_dir/session.sh"
  fi
  local text
  IFS= read -r -d '' text <<CFG || true
# gpuctl local node $LN_INDEX ($LN_MODE mode), written by terraform/modules/local-nodes.
Port $LN_PORT
ListenAddress $listen
AddressFamily inet
HostKey $conf_dir/ssh_host_ed25519_key
PidFile none
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile $conf_dir/authorized_keys$extra_keys
AllowUsers $LN_USER
PermitUserEnvironment no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
AllowTcpForwarding yes
LoginGraceTime 30
ClientAliveInterval 30
ClientAliveCountMax 6
# Ansible's ControlMaster multiplexes many sessions over one connection, and
# jobs open many connections at once.
MaxSessions 256
MaxStartups 256:30:512
MaxAuthTries 20
AcceptEnv LANG LC_*
SetEnv $setenv
Subsystem sftp $SFTP_SERVER
$forced
CFG
  printf '%s' "$text" >"$LN_DIR/sshd/sshd_config"
}

# loopback mode: sessions start in the node's home (sshd itself always starts
# them in the user's real home), and sftp starts there too.
write_session_wrapper() {
  cat >"$LN_DIR/sshd/session.sh" <<'SH'
# ForceCommand of a loopback-mode gpuctl local node: run the client's command
# in the node's own home (HOME is set by sshd's SetEnv).
cd "$HOME" || exit 1
case "${SSH_ORIGINAL_COMMAND:-}" in
  "") exec "${SHELL:-/bin/sh}" -l ;;
  internal-sftp | */sftp-server) exec "$SSH_ORIGINAL_COMMAND" -d "$HOME" ;;
  *) exec "${SHELL:-/bin/sh}" -c "$SSH_ORIGINAL_COMMAND" ;;
esac
SH
}

# The kernel's ARP cache is one table for every network namespace, 1024 entries by default
# (gc_thresh3): a few hundred nodes that each learn their fan-out peers fill it, and then no node
# can reach a new one ("neighbor table overflow"). Raise the limits with the cluster's size, room
# for each node to know 64 others; never lower them.
raise_neighbour_limits() {
  local nodes=0 line want key have
  while IFS= read -r line; do [[ -z $line ]] || nodes=$((nodes + 1)); done <<<"$LN_HOSTS"
  want=$((1024 + 64 * nodes))
  for key in gc_thresh3:$want gc_thresh2:$((want / 2)); do
    { read -r have <"/proc/sys/net/ipv4/neigh/default/${key%%:*}"; } 2>/dev/null || continue
    if ((have < ${key#*:})); then
      echo "${key#*:}" >"/proc/sys/net/ipv4/neigh/default/${key%%:*}" ||
        echo "local-nodes: could not raise net.ipv4.neigh.default.${key%%:*} to ${key#*:}" >&2
    fi
  done
}

netns_up() {
  [[ -e /sys/class/net/$LN_BRIDGE ]] || die "bridge $LN_BRIDGE is missing (terraform_data.bridge makes it); run apply again"
  raise_neighbour_limits
  # The MAC follows the address (02: locally administered, then the IPv4 bytes): a node replaced at
  # the same address keeps it, so the other nodes' neighbour caches stay right.
  local mac
  # shellcheck disable=SC2086
  printf -v mac '02:00:%02x:%02x:%02x:%02x' ${LN_ADDR//./ }
  # One ip process per namespace (a batch stops at its first error): every process costs here.
  printf 'netns add %s\nlink add %s type veth peer name eth0 netns %s\nlink set dev %s master %s up\n' \
    "$LN_NETNS" "$LN_VETH" "$LN_NETNS" "$LN_VETH" "$LN_BRIDGE" | ip -batch -
  printf 'link set dev eth0 address %s\naddr add %s/%s dev eth0\nlink set dev eth0 up\nlink set dev lo up\n' \
    "$mac" "$LN_ADDR" "$LN_PREFIX_LEN" | ip -n "$LN_NETNS" -batch -
}


# A sibling's teardown (Terraform replaces nodes in parallel) removes the
# state directory when it looks empty, which can fall between the two steps of
# mkdir -p; once the node's own directory exists it keeps the parent.
make_node_dir() {
  local _
  for _ in 1 2 3 4; do
    if mkdir -p -m 755 "$LN_DIR/home" "$LN_DIR/sshd" 2>/dev/null; then return 0; fi
  done
  mkdir -p -m 755 "$LN_DIR/home" "$LN_DIR/sshd"
}

# PRIVATE: the directories above the kept paths that the login user cannot pass (search bit of
# its class: owner, group or other; root passes all), each on its own line. One stat for all.
PRIVATE=""
private_dirs() {
  local home=$1 uid gids p a
  shift
  [[ $LN_USER != root ]] || return 0
  local ancestors=()
  for p in "$@"; do
    [[ -n $p && $p != "$home"/* ]] || continue
    a=$p
    while a=${a%/*}; [[ -n $a ]]; do
      [[ " ${ancestors[*]} " == *" $a "* ]] || ancestors+=("$a")
    done
  done
  ((${#ancestors[@]})) || return 0
  IFS=: read -r _ _ uid _ <<<"$USER_ENTRY"
  gids=" $(id -G -- "$LN_USER") "
  local owner group mode name bit
  while read -r owner group mode name; do
    if [[ $owner == "$uid" ]]; then bit=64; elif [[ $gids == *" $group "* ]]; then bit=8; else bit=1; fi
    if (((8#$mode & bit) == 0)); then PRIVATE+="$name"$'\n'; fi
  done < <(stat -L -c '%u %g %a %n' -- "${ancestors[@]}" 2>/dev/null)
}

# cover_of PATH: the outermost directory above PATH that the login user cannot pass (fails if none).
cover_of() {
  local a="" part rest=${1#/}
  while [[ $rest == */* ]]; do
    part=${rest%%/*} rest=${rest#*/} a+="/$part"
    if [[ $'\n'$PRIVATE == *$'\n'"$a"$'\n'* ]]; then echo "$a" && return 0; fi
  done
  return 1
}

# cover_dir DIR: what the node sees at DIR (a private directory it cannot pass), under LN_DIR.
cover_dir() { echo "$LN_DIR/covers${1}"; }

up() {
  local sshd home pid keep=() p rel
  [[ $LN_DIR == /*/*/* ]] || die "refusing to use state directory '$LN_DIR' (too close to /)"
  command -v ssh-keygen >/dev/null || die "ssh-keygen not found; install openssh-client"
  sshd=$(find_sshd)
  SFTP_SERVER=$(find_sftp_server)
  USER_ENTRY=$(getent passwd "$LN_USER") || USER_ENTRY=""
  if [[ ${LN_CREATE_USER:-false} == true && $LN_MODE == netns ]]; then ensure_user; fi
  IFS=: read -r _ _ _ _ _ home _ <<<"$USER_ENTRY"
  [[ -n $home ]] || die "user '$LN_USER' does not exist on this machine; set ssh_user to an existing user"
  # sshd (UsePAM no) refuses a locked account ('!' before its password, as `useradd` leaves one
  # made without a password) even for a key: say so now, not as a node that never lets anyone in.
  local shadow_entry password
  shadow_entry=$(getent shadow "$LN_USER" 2>/dev/null) || shadow_entry=""
  IFS=: read -r _ password _ <<<"$shadow_entry"
  if [[ $password == '!'* ]]; then
    die "user '$LN_USER' is locked (its password starts with '!'), and sshd refuses a locked account even with a key; unlock it for key logins (usermod -p '*' $LN_USER) or choose another user"
  fi
  if [[ $LN_MODE == netns ]]; then
    ((EUID == 0)) || die "netns mode needs root; run as root or use mode = \"loopback\""
    for p in ip unshare setsid; do command -v "$p" >/dev/null || die "netns mode needs '$p' (iproute2, util-linux) or use mode = \"loopback\""; done
  elif ((EUID != 0)) && [[ $LN_USER != "$(id -un)" ]]; then
    die "loopback mode without root can only accept logins for $(id -un); set ssh_user = \"$(id -un)\""
  fi

  # Leftovers of an earlier failed attempt have this node's names (they hash
  # the cluster name and state_dir): remove them first. A node made for the first time has none, and
  # the search for them costs more processes than the bring-up itself.
  if [[ -e $LN_DIR ]] || ns_exists || [[ $LN_MODE == netns && (-e $RUN_DIR || -e $DEV_DIR || -e /sys/class/net/$LN_VETH) ]]; then
    down keep-state-dir
  fi

  trap 'rc=$?; if ((rc != 0)); then echo "local-nodes: node $LN_INDEX: bring-up failed, removing what was made" >&2; (down) >&2 || true; fi' EXIT

  make_node_dir # LN_DIR 0700 (this script's umask), home and sshd 0755
  # sshd reads a user's keys as that user: one other than root may pass the directory (the host
  # key in it stays root's alone) and read the public keys
  if [[ $LN_USER != root ]]; then chmod 711 "$LN_DIR/sshd"; else chmod 700 "$LN_DIR/sshd"; fi
  printf 'LN_MODE=%s\nLN_INDEX=%s\nLN_DIR=%s\nLN_NETNS=%s\nLN_VETH=%s\nLN_TAG=%s\nLN_USER=%s\n' \
    "$LN_MODE" "$LN_INDEX" "$LN_DIR" "$LN_NETNS" "$LN_VETH" "$LN_TAG" "$LN_USER" >"$LN_DIR/node.env"
  ssh-keygen -q -t ed25519 -N '' -C "gpuctl-local-node-$LN_INDEX" -f "$LN_DIR/sshd/ssh_host_ed25519_key"
  (umask 022 && printf '%s\n' "$LN_PUBKEY" >"$LN_DIR/sshd/authorized_keys")
  # The cluster's internal key, authorized at boot so the head may install this node itself. It goes
  # where the install step manages it (the node's ~/.ssh/authorized_keys, by the key's comment), so
  # a rotated key replaces it there; netns mode only (loopback nodes use the access key).
  if [[ -n ${LN_INTERNAL_PUBKEY:-} && $LN_MODE == netns ]]; then
    mkdir -p -m 700 "$LN_DIR/home/.ssh"
    (umask 077 && printf '%s\n' "$LN_INTERNAL_PUBKEY" >"$LN_DIR/home/.ssh/authorized_keys")
  fi
  # /etc/profile resets PATH in login shells; SetEnv covers the other sessions.
  (umask 022 && printf '# gpuctl local node: this machine'"'"'s software, as the cluster'"'"'s PATH says.\nPATH="%s"\nexport PATH\n' \
    "$LN_NODE_PATH" >"$LN_DIR/home/.profile")

  if [[ $LN_MODE == netns ]]; then
    write_sshd_config "$RUN_DIR" "$home"
    # Paths that nodes must still see (the Python installation, the clone gpuctl runs from): under the
    # login user's home they are bound into the node's own home, which covers the real one; under a
    # directory the login user cannot pass (root's 0700 home where pyenv keeps Python, a private home
    # holding the clone) the node covers the outermost such directory with one holding just them
    # (its own mount namespace only: this machine's directory stays as it is).
    IFS=: read -r -a keep <<<"${LN_KEEP:-}"
    local binds=() insides=() covers=() cover inside
    private_dirs "$home" "${keep[@]}"
    local mount_points=() files=()
    for p in "${keep[@]}"; do
      [[ -n $p && -e $p ]] || continue
      if [[ $p == "$home"/* ]]; then
        inside="$LN_DIR/home/${p#"$home"/}"
      elif cover=$(cover_of "$p"); then
        inside="$(cover_dir "$cover")/${p#"$cover"/}"
        [[ " ${covers[*]} " == *" $cover "* ]] || covers+=("$cover")
      else
        continue
      fi
      if [[ -d $p ]]; then mount_points+=("$inside"); else mount_points+=("${inside%/*}") files+=("$inside"); fi
      binds+=("$p") insides+=("$inside")
    done
    # mount points the login user must pass; one mkdir for all of them
    umask 022
    if ((${#mount_points[@]})); then mkdir -p "${mount_points[@]}"; fi
    for p in "${files[@]}"; do : >"$p"; done
    umask 077
    if [[ $LN_USER != root ]]; then chown -R "$LN_USER:" "$LN_DIR/home"; fi
    [[ -d /run/sshd ]] || mkdir -p -m 755 /run/sshd
    mkdir -p "$RUN_DIR"
    # where the node sees its sshd directory: passable by a login user other than root (above)
    if [[ $LN_USER != root ]]; then chmod 711 "${RUN_DIR%/*}"; fi
    netns_up
    # Own hostname (UTS namespace) resolving to the node's address, as on a
    # real machine: gloo and NCCL pick their interface from it.
    local host_name=${LN_HOSTNAME:-$LN_NETNS}
    local hosts=${LN_HOSTS:-$LN_ADDR $host_name}
    # Reverse lookups as a VPC answers them: a dual-stack listener (torch's TCPStore) sees its
    # peers as ::ffff:ADDR, and with no DNS reachable here every lookup not in this file fails
    # with EAI_AGAIN (torch warns "hostname of the client socket cannot be retrieved").
    local mapped="" address names
    while read -r address names; do
      [[ $address =~ ^[0-9.]+$ && -n $names ]] && mapped+="::ffff:$address $names"$'\n'
    done <<<"$hosts"
    # /etc/hosts on the node: everyone reads it
    (umask 022 && printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n%s\n%s' "$hosts" "$mapped" >"$LN_DIR/hosts")
    # FUSE for the login user, as a distribution's udev rule gives it (0666): fusermount opens
    # /dev/fuse with the user's rights, and a container's /dev/fuse is often root's alone. The node
    # sees a device file of its own over it, in a directory only root passes (not the state
    # directory, which users copy); this machine's /dev/fuse stays as it is.
    local fuse="" fuse_mode="" fuse_major="" fuse_minor=""
    if [[ $LN_USER != root && -c /dev/fuse ]]; then read -r fuse_mode fuse_major fuse_minor <<<"$(stat -c '%a %t %T' /dev/fuse)"; fi
    if [[ -n $fuse_mode ]] && (((8#$fuse_mode & 6) != 6)); then
      fuse="$DEV_DIR/fuse"
      mkdir -m 700 -p "$DEV_DIR" &&
      mknod -m 666 "$fuse" c "$((16#$fuse_major))" "$((16#$fuse_minor))" || {
        echo "local-nodes: node $LN_INDEX: cannot make a FUSE device for $LN_USER: bucket mounts need root there" >&2
        fuse=""
      }
    fi
    # The node's mounts, as two fstab files for one `mount -a` each (a mount process per entry cost
    # more than the rest of the node's start-up). Optional: `ip netns exec` mounts a fresh /sys, which
    # hides the cgroup filesystems container runtimes (podman, runc) need, so the node mounts this
    # machine's again; and the FUSE device above. Required: the node's files over this machine's, the
    # kept paths first, as the node home covers the real one.
    local optional="" required="" fstype dir options _rest
    while read -r _ dir fstype options _rest; do
      # already escaped as fstab escapes
      if [[ $dir == /sys/fs/cgroup* ]]; then optional+="$fstype $dir $fstype $options,X-mount.mkdir 0 0"$'\n'; fi
    done </proc/self/mounts
    if [[ -n $fuse ]]; then fstab_add optional "$fuse" /dev/fuse none bind; fi
    fstab_add required "$LN_DIR/hosts" /etc/hosts none bind
    fstab_add required "$LN_DIR/sshd" "$RUN_DIR" none bind
    local i
    for i in "${!binds[@]}"; do fstab_add required "${binds[$i]}" "${insides[$i]}" none rbind; done
    fstab_add required "$LN_DIR/home" "$home" none rbind
    for cover in "${covers[@]}"; do fstab_add required "$(cover_dir "$cover")" "$cover" none rbind; done
    printf '%s' "$optional" >"$LN_DIR/optional.fstab"
    printf '%s' "$required" >"$LN_DIR/node.fstab"
    # shellcheck disable=SC2016
    local inner='set -e
host_name=$1 optional=$2 required=$3 sshd=$4 cfg=$5
echo "$host_name" >/proc/sys/kernel/hostname
if [ -s "$optional" ]; then
  mount -a -T "$optional" || echo "local-nodes: some of this node'"'"'s optional mounts failed (above): without cgroups containers will not run, without /dev/fuse bucket mounts need root" >&2
fi
mount -a -T "$required"
exec "$sshd" -D -e -f "$cfg"'
    setsid env GPUCTL_NODE_TAG="$LN_TAG" ip netns exec "$LN_NETNS" unshare --mount --uts --propagation private \
      sh -c "$inner" gpuctl-node "$host_name" "$LN_DIR/optional.fstab" "$LN_DIR/node.fstab" "$sshd" \
      "$RUN_DIR/sshd_config" </dev/null >>"$LOG" 2>&1 &
    pid=$!
  else
    write_sshd_config "$LN_DIR/sshd" "$LN_DIR/home"
    write_session_wrapper
    if banner "$LN_ADDR" "$LN_PORT"; then die "port $LN_PORT on $LN_ADDR is already in use; choose another base_port"; fi
    setsid env GPUCTL_NODE_TAG="$LN_TAG" "$sshd" -D -e -f "$LN_DIR/sshd/sshd_config" </dev/null >>"$LOG" 2>&1 &
    pid=$!
  fi
  local start
  start=$(proc_stat "$pid") && start=${start#* } || die "sshd (pid $pid) exited at once; its log says: $(tail -n 5 "$LOG" 2>/dev/null)"
  echo "$pid $start" >"$PIDFILE"

  local deadline=$((SECONDS + ${LN_WAIT:-30}))
  ready() {
    if [[ $LN_MODE == netns ]]; then listening "$pid"; else banner "$LN_ADDR" "$LN_PORT"; fi
  }
  until ready && alive "$pid" "$start"; do
    alive "$pid" "$start" || die "sshd exited during start-up; its log says: $(tail -n 5 "$LOG" 2>/dev/null)"
    ((SECONDS < deadline)) || die "sshd (pid $pid) did not accept connections on $LN_ADDR:$LN_PORT within ${LN_WAIT:-30}s; its log says: $(tail -n 5 "$LOG" 2>/dev/null)"
    sleep 0.05
  done
  [[ /proc/$pid/exe -ef $sshd ]] || die "pid $pid is not $sshd after start-up"
  trap - EXIT
  echo "local-nodes: node $LN_INDEX up: ssh -p $LN_PORT $LN_USER@$LN_ADDR (sshd pid $pid)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) die "usage: node.sh up|down" ;;
esac
