#!/usr/bin/env bash
# hostns.sh PID START COMMAND...: run COMMAND in this machine's mount and network namespaces, as
# those of PID, the cluster's anchor (bridge.sh starts it), once PID is checked to still be the
# process that started at START. A node's head runs it through sudo to remove the cluster itself
# (autodown): the nodes' namespace files and the bridge exist only in this machine's namespaces.
set -euo pipefail
(($# >= 3)) || { echo "usage: hostns.sh PID START COMMAND..." >&2; exit 2; }
pid=$1 start=$2
shift 2
[[ $pid =~ ^[0-9]+$ ]] || { echo "hostns: bad pid '$pid'" >&2; exit 2; }
stat=""
{ read -r stat <"/proc/$pid/stat"; } 2>/dev/null || true
stat=${stat##*) } # the command name may hold spaces: fields after it
read -r -a fields <<<"$stat"
if [[ ${fields[19]:-} != "$start" ]]; then
  echo "hostns: the cluster's anchor (pid $pid) is gone; remove the cluster from the controller (gpuctl down)" >&2
  exit 3
fi
exec nsenter -t "$pid" -m -n -- "$@"
