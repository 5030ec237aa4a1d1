#!/usr/bin/env bash
# A head-only launcher (what pdsh/DeepSpeed and mpirun do): for every
# `IP slots=N` line of $GPUCTL_HOSTFILE, start N processes of SCRIPT on that
# node over SSH, all at once, with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/
# LOCAL_RANK set. Each line of output is prefixed with the node's address.
# Exits non-zero if a node is unreachable or any process fails.
#
#   bash launch.sh SCRIPT [ARGS...]
set -uo pipefail

script=$1
shift
hostfile=${GPUCTL_HOSTFILE:?not set: run this under gpuctl}

hosts=() slots=()
while read -r host rest; do
  [[ -z $host || $host == \#* ]] && continue
  n=${rest#slots=}
  [[ $n =~ ^[0-9]+$ && $n -gt 0 ]] || n=1 # CPU nodes: slots=0, one process each
  hosts+=("$host") slots+=("$n")
done <"$hostfile"

world=0
for n in "${slots[@]}"; do world=$((world + n)); done
echo "launcher: ${#hosts[@]} node(s), $world process(es), master ${MASTER_ADDR}:${MASTER_PORT}"

# Every node must answer before anything starts (ssh exits 255 on connection errors).
failed=0
for host in "${hosts[@]}"; do
  ssh "$host" true </dev/null || { echo "launcher: cannot reach $host over SSH" >&2; failed=1; }
done
((failed == 0)) || exit 1

# The remote command: same workdir, PATH and rendezvous on every node.
quoted_args=$(printf ' %q' "$script" "$@")
pids=() names=()
rank=0
for i in "${!hosts[@]}"; do
  host=${hosts[$i]}
  for ((local_rank = 0; local_rank < ${slots[$i]}; local_rank++)); do
    remote="cd ~/gpuctl_workdir && exec env PATH=$(printf %q "$PATH") MASTER_ADDR=$MASTER_ADDR \
MASTER_PORT=$MASTER_PORT WORLD_SIZE=$world RANK=$rank LOCAL_RANK=$local_rank python3 -u$quoted_args"
    ssh "$host" "$remote" </dev/null > >(sed -u "s/^/[$host rank $rank] /") 2>&1 &
    pids+=($!) names+=("$host rank $rank")
    rank=$((rank + 1))
  done
done

for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  code=$?
  if ((code != 0)); then
    echo "launcher: ${names[$i]} exited with code $code" >&2
    failed=1
  fi
done
wait # the output filters
((failed == 0)) && echo "launcher: all $world process(es) succeeded"
exit "$failed"
