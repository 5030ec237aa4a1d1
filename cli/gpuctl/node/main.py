"""The agent's command line: one sub-command per thing a node is asked (names: protocol.py)."""

import argparse
import sys

from gpuctl.node.autostop import cmd_autostop, cmd_autostop_watch
from gpuctl.node.buckets import cmd_unmount_bucket
from gpuctl.node.containers import cmd_container_stage
from gpuctl.node.coordinator import cmd_attach, cmd_cancel, cmd_events, cmd_job_status, cmd_submit
from gpuctl.node.destinations import cmd_check_dest, cmd_claim
from gpuctl.node.epochs import FENCE_GRACE, cmd_fence
from gpuctl.node.follow import cmd_follow
from gpuctl.node.install import cmd_install
from gpuctl.node.peerinstall import cmd_install_peers
from gpuctl.node.relay import cmd_relay
from gpuctl.node.stages import cmd_kill, cmd_launch, cmd_status
from gpuctl.node.protocol import (
    AUTOSTOP_ACTIONS, CMD_ATTACH, CMD_AUTOSTOP, CMD_AUTOSTOP_WATCH, CMD_CANCEL, CMD_CHECK_DEST, CMD_CLAIM,
    CMD_CONTAINER_STAGE, CMD_EVENTS, CMD_FENCE, CMD_FOLLOW, CMD_INSTALL, CMD_INSTALL_PEERS,
    CMD_JOB_STATUS, CMD_KILL, CMD_LAUNCH, CMD_RELAY, CMD_STATUS, CMD_SUBMIT, CMD_UNMOUNT_BUCKET, OFFSET_HEADER,
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpuctl-node", description="gpuctl node agent")
    sub = parser.add_subparsers(dest="cmd")
    sub.required = True

    p = sub.add_parser(CMD_LAUNCH, help="start STAGE.sh detached, in its own session")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.add_argument("--wait", action="store_true", help="wait and exit with the stage's exit code")
    p.add_argument("--workdir", default="~/gpuctl_workdir",
                   help="directory to run in (default ~/gpuctl_workdir; $HOME if missing)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser(CMD_FOLLOW, help="print STAGE.log as it grows, then the exit sentinel")
    p.add_argument("jobdir")
    p.add_argument("stage")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--from-start", action="store_true", help="print the whole log (default)")
    where.add_argument("--tail", type=int, metavar="N", help="start with the last N lines")
    where.add_argument("--offset", type=int, metavar="BYTES", help="start at this byte offset")
    p.add_argument("--print-offset", action="store_true",
                   help="first print '%s <byte offset>' (used to resume)" % OFFSET_HEADER)
    p.set_defaults(func=cmd_follow)

    p = sub.add_parser(CMD_KILL, help="SIGTERM the stage's process group, SIGKILL after --grace")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.add_argument("--grace", type=float, default=10.0)
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser(CMD_STATUS, help="print {pid, running, exit, killed} as JSON")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(CMD_CLAIM, help="create and claim destinations; print each one's owner rank (JSON)")
    p.add_argument("token")
    p.add_argument("rank", type=int)
    p.add_argument("--dir", action="append", default=[], help="a destination directory")
    p.add_argument("--file", action="append", default=[], help="a destination file")
    p.add_argument("--release", action="store_true", help="remove this node's markers again")
    p.set_defaults(func=cmd_claim)

    p = sub.add_parser(CMD_UNMOUNT_BUCKET, help="unmount a job's bucket mount at PATH once unused and uploaded")
    p.add_argument("path")
    p.add_argument("--lifeline-fd", type=int, help="first wait for EOF on this inherited descriptor")
    p.set_defaults(func=cmd_unmount_bucket)
    p = sub.add_parser(CMD_CHECK_DEST, help="exit 2 with one line if nothing may be copied to DEST here")
    p.add_argument("dest")
    p.set_defaults(func=cmd_check_dest)

    p = sub.add_parser(CMD_SUBMIT, help="run a job from stdin on the cluster, streaming its events")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser(CMD_RELAY, help="a worker's part of a job (started by its parent node)")
    p.set_defaults(func=cmd_relay)
    p = sub.add_parser(CMD_CONTAINER_STAGE, help="a stage in the node's container (started by its supervisor)")
    p.add_argument("jobdir")
    p.add_argument("stage")
    p.set_defaults(func=cmd_container_stage)
    p = sub.add_parser(CMD_ATTACH, help="stream a job's events from a byte offset")
    p.add_argument("job")
    p.add_argument("--offset", type=int, default=0)
    p.set_defaults(func=cmd_attach)
    p = sub.add_parser(CMD_EVENTS, help="print a job's events.log as it is now (one read)")
    p.add_argument("job")
    p.set_defaults(func=cmd_events)
    p = sub.add_parser(CMD_CANCEL, help="stop a job on every node and wait for its outcome")
    p.add_argument("job")
    p.add_argument("--wait", type=float, default=30.0)
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser(CMD_JOB_STATUS, help="a job's outcome (job.json), or RUNNING / LOST")
    p.add_argument("job")
    p.set_defaults(func=cmd_job_status)

    p = sub.add_parser(CMD_INSTALL, help="bring this node to the prepared state in the bundle on stdin")
    p.set_defaults(func=cmd_install)
    p = sub.add_parser(CMD_INSTALL_PEERS, help="install the workers in the request on stdin (the head, at prepare)")
    p.set_defaults(func=cmd_install_peers)

    p = sub.add_parser(CMD_AUTOSTOP, help="the head's autostop setting (set reads it from stdin)")
    p.add_argument("action", choices=AUTOSTOP_ACTIONS)
    p.add_argument("--lease", type=float, default=600.0, help="renew: seconds the controller's lease lasts")
    p.set_defaults(func=cmd_autostop)
    p = sub.add_parser(CMD_AUTOSTOP_WATCH, help="wait until the cluster is idle, then stop or remove it")
    p.set_defaults(func=cmd_autostop_watch)

    p = sub.add_parser(CMD_FENCE, help="raise TASK's epoch here to EPOCH and stop its older attempts' stages")
    p.add_argument("task")
    p.add_argument("epoch", type=int)
    p.add_argument("--grace", type=float, default=FENCE_GRACE, help="seconds from TERM to KILL (default 3)")
    p.set_defaults(func=cmd_fence)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
