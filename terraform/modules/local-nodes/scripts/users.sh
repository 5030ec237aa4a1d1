# shellcheck shell=bash
# The login user of netns-mode nodes that the module makes (create_user), sourced by node.sh and
# bridge.sh. The user is marked by its comment (USER_MARK); each node using it keeps a file in
# USERS_DIR/<user>/ while it lives (node.sh), and the last cluster's bridge to go (bridge.sh down,
# the last step of every teardown, autodown included) removes a user no node uses any more, with
# its sudo rule. One lock for making, marking and removing: clusters come and go at once.
USER_MARK="gpuctl local nodes"
USERS_DIR=${LN_USERS_DIR:-/run/gpuctl-local-users} # LN_USERS_DIR: tests use their own
USER_LOCK=/run/gpuctl-local-user.lock

# ensure_user: LN_USER, made when missing: a normal user with passwordless sudo, as cloud images have
# one (SkyPilot's examples run `sudo apt-get ...`, mpirun refuses root); USER_ENTRY its passwd line.
# A user not made here is left as it is: no sudo rule, no removal.
ensure_user() {
  local rule="/etc/sudoers.d/gpuctl-local-$LN_USER" gecos
  exec 9>"$USER_LOCK"
  flock 9
  USER_ENTRY=$(getent passwd "$LN_USER") || USER_ENTRY=""
  if [[ -z $USER_ENTRY ]]; then
    command -v useradd >/dev/null || die "cannot create user '$LN_USER': useradd not found (package passwd)"
    # password '*': none to log in with, but not a locked account, which sshd (UsePAM no) refuses
    useradd --create-home --shell /bin/bash --user-group --comment "$USER_MARK" --password '*' "$LN_USER" ||
      die "cannot create user '$LN_USER'"
    USER_ENTRY=$(getent passwd "$LN_USER") || die "user '$LN_USER' was made but cannot be read back"
  fi
  IFS=: read -r _ _ _ _ gecos _ <<<"$USER_ENTRY"
  if [[ $gecos == "$USER_MARK" ]]; then
    if [[ ! -e $rule ]]; then
      [[ -d /etc/sudoers.d ]] || mkdir -p -m 750 /etc/sudoers.d
      printf '# %s: their login user, as on a cloud image\n%s ALL=(ALL:ALL) NOPASSWD: ALL\n' "$USER_MARK" "$LN_USER" \
        >"$rule.tmp.$$"
      chmod 440 "$rule.tmp.$$" && mv -f "$rule.tmp.$$" "$rule"
    fi
    mkdir -p -m 700 "$USERS_DIR/$LN_USER" && : >"$USERS_DIR/$LN_USER/$LN_TAG"
  fi
  exec 9>&-
}

# release_user: this node no longer uses LN_USER (its directory stays for tidy_users).
release_user() {
  if [[ -n ${LN_USER:-} && -n ${LN_TAG:-} ]]; then rm -f -- "$USERS_DIR/$LN_USER/$LN_TAG"; fi
}

# admitted_by_a_node USER: does a live local node's sshd admit USER (one made before nodes kept files)?
admitted_by_a_node() {
  local f pid cfg
  while IFS= read -r f; do
    pid=${f#/proc/} pid=${pid%/cmdline}
    cfg=$(grep -azxm1 -- '/run/gpuctl/[^/]*/sshd_config' "$f" 2>/dev/null | tr -d '\0') || continue
    if grep -qxF -- "AllowUsers $1" "/proc/$pid/root$cfg" 2>/dev/null; then return 0; fi
  done < <(grep -lazx -- '/run/gpuctl/[^/]*/sshd_config' /proc/[0-9]*/cmdline 2>/dev/null)
  return 1
}

# This process and its ancestors (a head removing its cluster runs the scripts as its user, through
# sudo): never counted as the user's own processes.
lineage() {
  local pid=$BASHPID stat
  while [[ -n $pid && $pid != 0 ]]; do
    echo "$pid"
    { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || break
    stat=${stat##*) }
    read -r -a stat <<<"$stat"
    pid=${stat[1]}
  done
}

# tidy_users: remove each user made here that no node uses any more, with its sudo rule and home
# (the nodes had homes of their own). A user whose processes still run, or whom a node made before
# nodes kept files admits, is left (and its directory, so that a later teardown tries again).
tidy_users() {
  local dir user gecos uid others
  [[ -d $USERS_DIR ]] || return 0
  exec 9>"$USER_LOCK"
  flock 9
  for dir in "$USERS_DIR"/*/; do
    [[ -d $dir ]] || continue
    user=${dir%/} user=${user##*/}
    if [[ -n $(find "$dir" -mindepth 1 -maxdepth 1 -print -quit 2>/dev/null) ]]; then continue; fi # nodes use it
    IFS=: read -r _ _ uid _ gecos _ <<<"$(getent passwd "$user")"
    [[ -n $uid && $gecos == "$USER_MARK" ]] || { rmdir -- "$dir"; continue; }
    if admitted_by_a_node "$user"; then continue; fi
    others=$({ grep -l "^Uid:[[:space:]]*$uid[[:space:]]" /proc/[0-9]*/status 2>/dev/null || true; } | cut -d/ -f3 |
      { grep -vxF -f <(lineage) || true; } | tr '\n' ' ')
    if [[ -n ${others// /} ]]; then
      echo "local-nodes: left user $user, whose processes still run (${others% }); userdel -r $user removes it" >&2
      continue
    fi
    rm -f -- "/etc/sudoers.d/gpuctl-local-$user"
    if userdel -r -f -- "$user" >/dev/null 2>&1; then rmdir -- "$dir"; else
      echo "local-nodes: could not remove user $user (userdel -r $user)" >&2
    fi
  done
  exec 9>&-
}
