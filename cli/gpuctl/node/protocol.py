"""The job plane's wire words, in one place for both ends: the controller and the node agent.

Every word that crosses ssh between them is named here: the agent's path and
sub-commands (how the controller calls it), the commands a relay takes down the
tree, the event letters that come back up, the coordinator's phases and the
stream's markers. The agent is built with this module inside it
(configplane/bundle.py) and the controller imports it (events.py parses
with it; jobplane/agentcall.py, the controller's one door to the agent, builds
every agent command line from its words), so an event or a command word exists
once. Standard library only, Python >= 3.6 syntax: it runs
on the nodes' system python3 too.

Events (one line each, up the tree and to the controller):
  H RANK ok | H RANK unprepared REASON   the node is ready / needs `prepare`
  H RANK problem TEXT                    nothing can run there (no container runtime)
  C RANK [OWNER,...]                     owners of the sync destinations
  Y RANK CODE MESSAGE                    a sync push to RANK ended
  B RANK CODE MESSAGE                    RANK's cloud buckets are copied/mounted (0) or not
  S RANK STAGE                           the stage started on RANK
  O RANK STAGE BYTES                     the end of an output line (all of it, or its last piece)
  o RANK STAGE BYTES                     a piece of an output line that goes on in the next o/u/O
  u RANK STAGE BYTES                     like o, to show now: the rank left its line unfinished
                                         (a prompt, a progress bar's `\\r` redraws)
  X RANK STAGE CODE|?                    the stage ended on RANK
  L RANK REASON                          RANK was lost (ssh to it ended)
  P PHASE                                the coordinator's phase
  D STATUS JSON                          the job ended (last event)
A rank's output is cut into pieces of at most OUT_PIECE bytes, each sent as it
is read, so no hop holds or cuts a longer event; BYTES are the rank's own bytes
(anything but a newline, which ends the event), never read as an event. A last
line without a newline is an `o` before the stage's X. A line the rank leaves
unfinished for SHOW_AFTER_S goes out as it is (`u`), so a prompt or a progress bar
shows while the rank waits, not when its newline comes. Every other event is one
line of text the agent wrote.

Commands down the tree (one line each, on a relay's stdin):
  claim TOKEN | sync JSON | buckets TOKEN KINDS | release | start STAGE | kill GRACE STAGE... | cleanup | end
"""

PROTOCOL = 1  # the payload's "v": the job format this agent and this controller speak

# -- where the agent is on a node (node-side layout: docs/architecture.md) ---------------------
AGENT = "~/.gpuctl/bin/gpuctl-node"
NODE_JOBS_DIR = "~/.gpuctl/jobs"  # a job's directory there: NODE_JOBS_DIR/<job>
JOB_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # a job's name there (the controller's `<id>-<token>`)
MESSAGE_PREFIX = "gpuctl-node: "  # the agent's own lines on stderr (check-dest's refusal, ...)
CLAIM_PREFIX = ".gpuctl-claim-"  # a claim marker's name in a destination (never copied)

# -- the agent's sub-commands ------------------------------------------------------------------
# One stage on one node (`gpuctl logs`, and a fallback):
CMD_LAUNCH = "launch"
CMD_FOLLOW = "follow"
CMD_KILL = "kill"
CMD_STATUS = "status"
# Destinations on one node:
CMD_CLAIM = "claim"  # shared-filesystem detection
CMD_CHECK_DEST = "check-dest"  # may the controller copy to DEST (upload.py, before rsync)
CMD_UNMOUNT_BUCKET = "unmount-bucket"  # a job's mount watcher
# A coordinated job:
CMD_SUBMIT = "submit"  # the controller's one call per job
CMD_ATTACH = "attach"  # stream a job's events from an offset
CMD_CANCEL = "cancel"
CMD_JOB_STATUS = "job-status"
CMD_EVENTS = "events"  # a job's events.log as it is now, in one read (`gpuctl logs` of a job that ended)
CMD_RELAY = "relay"  # a worker's part of a job, started by its parent node
CMD_CONTAINER_STAGE = "container-stage"  # a stage in the node's container, started by its supervisor
CMD_INSTALL = "install"  # prepare's one step on a node: the bundle on stdin (agent/install.py)
CMD_INSTALL_PEERS = "install-peers"  # the head installs the workers it is given (agent/peerinstall.py)
CMD_AUTOSTOP = "autostop"  # set | cancel | renew | release | show | sessions (agent/autostop.py)
CMD_AUTOSTOP_WATCH = "autostop-watch"  # the head's watcher, started by `autostop set`
# A managed job's newer attempt takes its task's ranks on a node: `fence TASK EPOCH [--grace S]` raises
# the node's epoch of TASK and stops the older attempts' stages there (agent/epochs.py); one JSON line
# {"fenced", "epoch", "stopped", "running", "doomed"}.
CMD_FENCE = "fence"
# Every sub-command above: the controller's door (jobplane/agentcall.py) builds a line only from these.
AGENT_COMMANDS = (CMD_LAUNCH, CMD_FOLLOW, CMD_KILL, CMD_STATUS, CMD_CLAIM, CMD_CHECK_DEST, CMD_UNMOUNT_BUCKET,
                  CMD_SUBMIT, CMD_ATTACH, CMD_CANCEL, CMD_JOB_STATUS, CMD_EVENTS, CMD_RELAY,
                  CMD_CONTAINER_STAGE, CMD_INSTALL, CMD_INSTALL_PEERS, CMD_AUTOSTOP, CMD_AUTOSTOP_WATCH, CMD_FENCE)
AUTOSTOP_ACTIONS = ("set", "cancel", "renew", "release", "show", "sessions")
AUTOSTOP_WAIT_FOR = ("jobs_and_ssh", "jobs", "none")  # SkyPilot's autostop.wait_for
# Seconds for one worker's install step on the head, ssh included; the controller's deadline for the
# whole install-peers call follows from it.
PEER_INSTALL_TIMEOUT = 600

# -- commands down the tree (a relay's stdin) ---------------------------------------------------
RELAY_CLAIM = "claim"
RELAY_SYNC = "sync"
RELAY_BUCKETS = "buckets"
RELAY_RELEASE = "release"
RELAY_START = "start"
RELAY_KILL = "kill"
RELAY_CLEANUP = "cleanup"
RELAY_END = "end"

# -- events up the tree (see above) -------------------------------------------------------------
EV_HELLO = "H"
EV_CLAIMS = "C"
EV_SYNCED = "Y"
EV_BUCKETS = "B"
EV_STARTED = "S"
EV_OUTPUT = "O"
EV_PIECE = "o"
EV_SHOWN = "u"
EV_EXIT = "X"
EV_LOST = "L"
EV_PHASE = "P"
EV_DONE = "D"
EVENT_KINDS = (EV_HELLO, EV_CLAIMS, EV_SYNCED, EV_BUCKETS, EV_STARTED, EV_OUTPUT, EV_PIECE, EV_SHOWN, EV_EXIT,
               EV_LOST, EV_PHASE, EV_DONE)
OUT_PIECE = 65536  # at most this many bytes of a rank's output per O/o/u event
SHOW_AFTER_S = 0.1  # a line held this long without its newline is shown as it is (u)
# What H says of a node:
HELLO_OK = "ok"
HELLO_UNPREPARED = "unprepared"
HELLO_PROBLEM = "problem"
EXIT_UNKNOWN = "?"  # X's code when the stage's supervisor died without recording one

# The stages of a job, and the names an O event may carry besides them:
STAGE_SETUP = "setup"
STAGE_RUN = "run"
STAGES = (STAGE_SETUP, STAGE_RUN)
STAGE_EVENTS = "events"  # the coordinator's event log, followed like a stage (events.log, events.exit)
STAGE_AGENT = "gpuctl"  # an O event of the agent's own (a command that failed on a node)

# The coordinator's phases (P PHASE), in the order they come (pending: again each time what it waits for changes):
PHASE_PENDING = "pending"  # P pending WHY: the job waits for its GPUs in the head's queue (gpuqueue.py)
PHASE_START = "start"
PHASE_BUCKETS = "buckets"  # the head checks the job's buckets
PHASE_SYNC = "sync"  # the copies from the head, then `P plan JSON`
PHASE_PLAN = "plan"  # P plan {"copies": [[DEST, [RANK...]], ...]}
PHASE_MOUNTS = "mounts"  # every node fetches or mounts its buckets
PHASE_SETUP = "setup"
PHASE_RUN = "run"  # the ranks are being started
PHASE_RUNNING = "running"  # every rank started
PHASE_CANCELLING = "cancelling"

# -- the streams `follow`, `submit` and `attach` print ----------------------------------------------
SENTINEL = "__GPUCTL_EXIT__"  # the last line: `__GPUCTL_EXIT__ CODE` (or `unknown`)
OFFSET_HEADER = "__GPUCTL_OFFSET__"  # the first line with --print-offset: `__GPUCTL_OFFSET__ BYTES`


# A file_mount's directory where the login user may not write (/opt/x/data), made through
# `sudo -n sh -c SUDO_MKDIR gpuctl-mkdir DIR UID:GID` by the controller's rsync and by the agent:
# umask 022, since the directories made above it are root's and the user must pass them (sudo
# keeps the caller's umask, 077 in the agent), then the directory given to the user.
SUDO_MKDIR = 'umask 022 && mkdir -p -- "$1" && chown -- "$2" "$1"'
