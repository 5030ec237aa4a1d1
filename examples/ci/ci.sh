#!/usr/bin/env bash
# The commands a CI job runs to train on a gpuctl cluster: bring it up, run the job, tear it down.
# Each step may run on a different runner: the cluster lives in the shared state bucket
# (GPUCTL_STATE_BUCKET), not on the runner. Every step writes gpuctl's JSON document to
# $GPUCTL_CI_OUT/<step>.json for later steps and artifacts.
#
#   examples/ci/ci.sh up      validate, then provision (or reuse) the cluster and prepare it
#   examples/ci/ci.sh run     setup + run on every node; exit code 1 if a rank failed
#   examples/ci/ci.sh down    terraform destroy and forget the cluster (safe to repeat)
#
# Environment: GPUCTL_STATE_BUCKET (required), CLUSTER (default ci-$GITHUB_RUN_ID-$GITHUB_RUN_ATTEMPT),
# TASK (default cluster.yaml next to this script), GPUCTL_INFRA (optional --infra override),
# GPUCTL (the gpuctl command, default gpuctl), GPUCTL_CI_OUT (default ./gpuctl-ci),
# GPUCTL_CI_IDLE_MINUTES (default 30): the cluster removes itself after that many idle minutes (no
# job, no ssh session), decided on the cluster: a runner killed at any step cannot leak it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
: "${GPUCTL_STATE_BUCKET:?set GPUCTL_STATE_BUCKET: the cluster must outlive this runner}"
step=${1:?usage: ci.sh up|run|down}
cluster=${CLUSTER:-ci-${GITHUB_RUN_ID:-manual}-${GITHUB_RUN_ATTEMPT:-1}}
task=${TASK:-$here/cluster.yaml}
case $task in -*) task=./$task ;; esac  # a path, never an option
out=${GPUCTL_CI_OUT:-gpuctl-ci}
read -r -a gpuctl <<< "${GPUCTL:-gpuctl}"
infra=()
if [[ -n ${GPUCTL_INFRA:-} ]]; then infra=(--infra "$GPUCTL_INFRA"); fi
autodown=(--down -i "${GPUCTL_CI_IDLE_MINUTES:-30}")
mkdir -p "$out"

case $step in
  up)
    "${gpuctl[@]}" validate "${infra[@]}" --output json "$task" > "$out/validate.json"
    "${gpuctl[@]}" apply "${infra[@]}" --cluster "$cluster" --provision-only "${autodown[@]}" --output json \
      "$task" > "$out/up.json"
    ;;
  run)
    # the task's setup and run on the cluster `up` made (Terraform changes nothing: it is reused)
    "${gpuctl[@]}" apply "${infra[@]}" --cluster "$cluster" "${autodown[@]}" --output json "$task" > "$out/run.json"
    ;;
  down)
    "${gpuctl[@]}" down --output json "$cluster" > "$out/down.json"
    ;;
  *)
    echo "ci.sh: unknown step '$step'; use up, run or down" >&2
    exit 2
    ;;
esac
