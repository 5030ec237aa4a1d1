"""Everything gpuctl runs on a node: the agent (gpuctl-node) and the node's own probes.

Standard library only, Python >= 3.6: nodes have nothing but their system python3 (the
all-reduce probe alone needs torch, the node's, and is run as a file). This package is the lowest
layer: it imports nothing of gpuctl outside itself, and the controller imports from it what both
ends share (protocol.py, reserved.py, the probes' marks). It reaches a node one way: the bundle
(configplane/bundle.py) that prepare installs under ~/.gpuctl, in which the agent's modules are
ONE file, lib/gpuctl_node.py, imported by bin/gpuctl-node (launcher.py). The agent's modules, in
the order the bundle joins them (each uses only the ones before it):
  reserved.py        the places no copy or mount may take (shared with spec/nodepaths.py)
  protocol.py        the wire words: sub-commands, relay commands, events (shared with the controller)
  procs.py           the process table: liveness, a stage's processes, signals
  peerssh.py         ssh from this node to another node of the cluster
  jobdir.py          a job's directory and a stage's files on this node; prepared state
  install.py         prepare's step on this node (install); peerinstall.py: the head installs its workers
  autostop.py        the idle watcher and its hook
  containers.py      image_id docker:IMAGE: the node's long-lived container
  stages.py          a stage's supervisor: start, wait, stop (launch, kill, status)
  spotnotice.py      AWS spot interruption notices: the run stage's IMDS watcher, ~/.gpuctl/doomed
  epochs.py          a managed job's attempts: epoch admission before a stage starts (fence)
  gpuqueue.py        the head's job queue: a job waits for its GPUs, then sees only its own
  follow.py          a stage's log as a byte stream (follow, attach) or as O/o events
  destinations.py    claims of shared destinations; where no copy or mount may land (check-dest)
  buckets.py         cloud-bucket file_mounts with rclone: check, copy, mount, unmount
  relay.py           one node's part of a job and the ssh tree below it (relay)
  coordinator.py     the head's side of a job: phases, fail-fast, the outcome (submit, attach, events, cancel)
  main.py            the command line
The node's programs, installed as files beside the agent:
  launcher.py        bin/gpuctl-node: imports the agent (its bytecode cached), or exits 127
  fabricprobe.py     lib/gpuctl-fabric-probe: the node's fabric and its NCCL env (install runs it)
  nodehealth.py      lib/nodehealth.py: `gpuctl check --health`'s probe (GPUs, Xid, RDMA, ...)
  allreduceprobe.py  lib/allreduceprobe.py: `gpuctl check`'s all-reduce (torch), with ncclperf.py


A job reaches a cluster as ONE ssh call from the controller to the head:
`gpuctl-node submit` reads the job (JSON) and its secrets from stdin, starts a
detached coordinator, and streams the job's events back. The coordinator
fans the job out to the workers over the cluster's internal key as a tree of
`gpuctl-node relay` processes (at most `branching` children per node), so the
controller's cost does not grow with the number of nodes. Every rank's output
lines and exit code flow up the tree into JOBDIR/events.log on the head, which
`submit` (and later `attach`) streams to the controller. Fail-fast is decided
by the coordinator, which sees every exit first: it keeps working when the
controller detaches or goes away. Nothing of a job outlives the process that
answers for it on a node (the coordinator, or a worker's relay): each stage's
supervisor stops the stage's process group and removes the secrets when that
owner dies (see stages._supervise), and the owner stops a stage whose supervisor died.

Per stage STAGE (setup, run), files in JOBDIR (~/.gpuctl/jobs/<job>, <job> being
the controller's `<id>-<token>`; JOBDIR/submission names the submission that made it):
  STAGE.sh         the user's script (run under bash, in the workdir)
  STAGE.env.sh     exported variables of the stage (env.sh: older layout)
  secrets.sh       exported secrets (0600), there only while a stage of the job runs
  STAGE.log        the script's stdout and stderr, appended as written
  STAGE.pid        process-group id of the stage (bash is the group leader)
  STAGE.supervisor pid of the supervisor that waits for the stage
  STAGE.exit       exit code, written atomically when the stage ended
                   (128+N when a signal N ended it, or when `kill` stopped it)
  STAGE.killed     the last signal `kill` sent, if it was used
  STAGE.cpid       in a container: the stage's process group there
  container.json   image_id docker:IMAGE: the node's container (see containers.py)
  epoch.json       a managed job's epoch {"task", "value"}, once a stage of it was admitted
The node's own: ~/.gpuctl/epochs/<task> (the newest epoch of each task seen here,
under ~/.gpuctl/epochs.lock), ~/.gpuctl/doomed (a spot notice came: the node goes) and, on
the head, ~/.gpuctl/queue/ (the GPU queue's state.json and lock, a waiting job's JOB.wake FIFO).
The coordinator's own files on the head: payload.json (the job, no secrets),
events.log / events.supervisor / events.exit (followed like a stage),
job.json (the outcome), coordinator.log (its own errors).

The events up the tree and the commands down it: protocol.py.

Other commands: launch/follow/kill/status of one stage on this node (used by
`gpuctl logs` and as a fallback), claim (shared-filesystem detection), cancel,
attach, events and job-status of a coordinated job, container-stage (a stage in the
node's container, started by the stage's supervisor), fence (a managed job's
newer attempt stops the older ones' ranks here).
"""
