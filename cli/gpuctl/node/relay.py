"""One node's part of a job (`relay`): its own rank, and the ssh tree of relays below it.

The head's coordinator and every worker's `gpuctl-node relay` run a `Relay`:
it checks the node (H), writes the job's files, and does each command that
comes down the tree (protocol.py: claim, sync, buckets, start, kill, ...)
here before or after passing it to its children (`Child`: ssh to a worker
running `relay` for a subtree of ranks). Events from its own stages and from
its children go up as they come; a child whose connection ends owes its ranks
as L events.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

from gpuctl.node.buckets import NodeBuckets, bucket_tools_problem
from gpuctl.node.containers import CONTAINER_FILE, container_config
from gpuctl.node.destinations import claim_destinations, destinations_problem, release_claims
from gpuctl.node.epochs import job_admission
from gpuctl.node.follow import LineReader, LocalStage, OUTPUT_HEADS, Out, ev
from gpuctl.node.install import InstallError, write_view
from gpuctl.node.jobdir import (
    FABRIC_ENV, Stage, cannot_write, dest_paths, job_dir, prepared_problem, remove, shell_quote, take_job_dir,
    write_private,
)
from gpuctl.node.peerssh import peer_ssh_argv
from gpuctl.node.spotnotice import SpotWatch, spot_notice_config
from gpuctl.node.stages import kill_stage, stage_env_text, start_stage_watched
from gpuctl.node.protocol import (
    AGENT, CLAIM_PREFIX, CMD_RELAY, EV_CLAIMS, EV_EXIT, EV_HELLO, EV_LOST, EV_OUTPUT, EV_STARTED, EV_SYNCED,
    HELLO_OK, HELLO_PROBLEM, HELLO_UNPREPARED, PROTOCOL, RELAY_BUCKETS, RELAY_CLAIM, RELAY_CLEANUP, RELAY_END,
    RELAY_KILL, RELAY_RELEASE, RELAY_START, RELAY_SYNC, STAGES, STAGE_AGENT, STAGE_RUN, STAGE_SETUP,
)


# A child's events as bytes (Relay._from_child reads them without decoding).
_EXIT, _LOST, _HELLO = EV_EXIT.encode(), EV_LOST.encode(), EV_HELLO.encode()
_UNPREPARED = (" " + HELLO_UNPREPARED).encode()  # in an H: the rank owes nothing more
_PROBLEM = (" %s " % HELLO_PROBLEM).encode()


def partition(ranks, branching):
    """Split `ranks` into at most `branching` contiguous groups of near-equal size."""
    groups = []
    n = len(ranks)
    k = min(max(branching, 1), n)
    start = 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        groups.append(ranks[start:start + size])
        start += size
    return [g for g in groups if g]


class Child(object):
    """A child relay: `ssh child gpuctl-node relay`, carrying a subtree of ranks."""

    def __init__(self, relay, subtree):
        self.relay = relay
        self.rank = subtree[0]
        self.subtree = subtree
        self.open_ranks = set(subtree)  # ranks whose end this child still owes
        self.hello = False  # the child answered (H)
        self.err = b""
        peer = relay.peers[self.rank]
        argv = peer_ssh_argv(peer["ssh"]) + ["--", peer["host"], "%s %s" % (AGENT, CMD_RELAY)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     close_fds=True)
        self.out = LineReader(self.proc.stdout.fileno())
        self.errs = LineReader(self.proc.stderr.fileno())
        payload = dict(relay.payload, subtree=subtree)
        self.send(json.dumps(payload, separators=(",", ":")).encode() + b"\n"
                  + json.dumps(relay.secrets).encode() + b"\n")

    def send(self, data):
        if self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close_stdin(self):
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.stdin = None

    def reason(self):
        text = self.err.decode("utf-8", "replace").strip().splitlines()
        return (text[-1] if text else "ssh exited with code %s" % self.proc.poll())[:300]


def describe_by_node(peers, messages):
    """One clause per distinct message, naming its nodes: `head, worker1: TEXT`."""
    names = {}
    for r in sorted(messages):
        names.setdefault(messages[r], []).append(peers[r]["name"])
    return "; ".join("%s: %s" % (", ".join(n[:3]) + (" and %d more node(s)" % (len(n) - 3) if len(n) > 3 else ""),
                                 text) for text, n in names.items())


def sync_levels(dests):
    """The destinations in push order: level 0 those inside no other, then each level those inside
    one of the level before (a file_mount in the workdir after the workdir)."""
    remote = [dest_paths(d["path"])[1].rstrip("/") or "/" for d in dests]

    def inside(i, j):
        return i != j and (remote[j] in (".", "/") or remote[i].startswith(remote[j] + "/"))

    depth = [sum(1 for j in range(len(dests)) if inside(i, j)) for i in range(len(dests))]
    return [[dests[i] for i in range(len(dests)) if depth[i] == d] for d in sorted(set(depth))]


class Relay(object):
    """One node's part of a job: its own rank, and the children it fans out to.

    The head's coordinator and every worker's `relay` command run this; a
    command given to a relay is done here and passed on to its children.
    """

    def __init__(self, payload, secrets, rank, emit):
        self.payload = payload
        self.secrets = secrets
        self.rank = rank
        self.emit = emit
        self.job = payload["job"]
        self.jobdir = job_dir(self.job)
        self.peers = dict((p["rank"], p) for p in payload["peers"])
        self.subtree = payload.get("subtree") or [rank]
        self.children = []
        self.stages = {}
        self.claim_owners = []
        self.pushes = []  # running rsync pushes: (proc, to_rank, reader of stderr, its lines)
        self.later_pushes = {}  # to_rank -> the levels of destinations still to push there (sync_levels)
        self.ok = False
        self.closing = False  # `end` was sent: children closing now are not lost
        self.node_buckets = None  # this node's part of the bucket fetch (NodeBuckets)
        self.view_problem = None  # learn_view's outcome: None not yet, "" written
        self.spot = None  # the run stage's spot notice watcher (SpotWatch), if the job asks for one
        # Held open (never written) for as long as this process lives: each stage's supervisor
        # stops its stage when it reads EOF here (see _supervise). Not inherited across exec.
        self.lifeline, self._lifeline_w = os.pipe()

    # -- setup ---------------------------------------------------------------
    def prepare_local(self):
        """Check the node's prepared state and write the job's files; emits H."""
        try:
            return self._prepare_local()
        except OSError as exc:  # a full disk, a read-only home: prepare would not help, the job cannot run
            self.emit(ev(EV_HELLO, self.rank, HELLO_PROBLEM, cannot_write(exc, self.jobdir)))
            return False

    def _prepare_local(self):
        problem = prepared_problem(self.payload.get("fingerprint"))
        if problem:
            self.emit(ev(EV_HELLO, self.rank, HELLO_UNPREPARED, problem))
            return False
        problem = self.learn_view()
        if problem:
            self.emit(ev(EV_HELLO, self.rank, HELLO_PROBLEM, problem))
            return False
        if self.rank != 0:  # the head's submit already made its job directory
            problem = take_job_dir(self.jobdir, self.payload.get("nonce"))
            if problem:
                self.emit(ev(EV_HELLO, self.rank, HELLO_PROBLEM, problem))
                return False
        os.chmod(self.jobdir, 0o700)
        stages = self.payload.get("stages") or {}
        for stage, spec in stages.items():
            if not spec or stage not in STAGES:
                continue
            if stage == STAGE_RUN and self.rank >= self.payload.get("job_ranks", len(self.peers)):
                continue
            write_private(os.path.join(self.jobdir, stage + ".sh"), spec["script"], 0o700)
            write_private(os.path.join(self.jobdir, stage + ".env.sh"),
                          stage_env_text(stage, spec, self.rank, self.jobdir,
                                         (self.payload.get("gpu_devices") or {}).get(str(self.rank))), 0o600)
        first = stages.get(STAGE_SETUP) or stages.get(STAGE_RUN)
        if first and first.get("hostfile") is not None:
            self.write_hostfile(first)
        problem = (self.prepare_container() or bucket_tools_problem(self.payload.get("buckets"))
                   or destinations_problem(self.payload))
        if problem:  # nothing can run here: the job ends before anything runs anywhere
            self.emit(ev(EV_HELLO, self.rank, HELLO_PROBLEM, problem))
            return False
        self.emit(ev(EV_HELLO, self.rank, HELLO_OK))
        self.ok = True
        return True

    def learn_view(self):
        """Write the payload's cluster view (install.py) before this node connects on, once: peers
        added or replaced since it was prepared. The problem, or None."""
        if self.view_problem is None:
            try:
                write_view(self.payload.get("view"))
                self.view_problem = ""
            except (InstallError, OSError) as exc:
                self.view_problem = "cannot write the cluster view: %s" % exc
        return self.view_problem or None

    def prepare_container(self):
        """image_id docker:IMAGE: a container runtime that answers, and JOBDIR/container.json; the problem, or None."""
        box = self.payload.get("container")
        if not box:
            return None
        cfg, problem = container_config(box, self.peers[self.rank]["name"],
                                        self.payload.get("workdir") or "~/gpuctl_workdir")
        if problem:
            return problem
        if os.path.isfile(FABRIC_ENV):  # the container sees the job directory, not ~/.gpuctl
            shutil.copyfile(FABRIC_ENV, os.path.join(self.jobdir, "fabric.env"))
        write_private(os.path.join(self.jobdir, CONTAINER_FILE), json.dumps(cfg))
        return None

    def write_hostfile(self, spec):
        """JOBDIR/hostfile: every cluster node during setup, the job's nodes during run (one path:
        GPUCTL_HOSTFILE is the same in both stages)."""
        write_private(os.path.join(self.jobdir, "hostfile"), "".join(line + "\n" for line in spec["hostfile"]),
                      0o644)

    def spawn_children(self):
        for group in partition(self.subtree[1:], int(self.payload.get("branching") or 32)):
            try:
                self.children.append(Child(self, group))
            except OSError as exc:
                for r in group:
                    self.emit(ev(EV_LOST, r, "cannot start ssh: %s" % exc))

    # -- commands ------------------------------------------------------------
    def command(self, line):
        """Do one command here and pass it to every child.

        A claim is made here before the children hear of it, so a node claims
        ahead of every node below it: the head owns whatever it shares, and
        nothing is copied into the directory the head's copy already is.
        """
        words = line.split(" ", 1)
        claims = words[0] in (RELAY_CLAIM, RELAY_BUCKETS)
        if not claims:
            self.forward(line)
        try:
            self._do(line)
        finally:
            if claims:
                self.forward(line)

    def forward(self, line):
        for child in self.children:
            child.send(line.encode() + b"\n")

    def _do(self, line):
        words = line.split(" ", 1)
        verb, rest = words[0], (words[1] if len(words) > 1 else "")
        if verb == RELAY_END:
            self.closing = True
        if not self.ok and verb not in (RELAY_KILL, RELAY_CLEANUP, RELAY_END):
            return
        try:
            if verb == RELAY_CLAIM:
                self._claim(rest.strip())
            elif verb == RELAY_SYNC:
                self._sync(json.loads(rest))
            elif verb == RELAY_BUCKETS:
                token, _, kinds = rest.strip().partition(" ")
                self.node_buckets = NodeBuckets(self, token, json.loads(kinds or "[]"))
                self.node_buckets.start()
            elif verb == RELAY_START:
                self._start(rest.strip())
            elif verb == RELAY_KILL:
                parts = rest.split()
                self.kill_local(float(parts[0]), parts[1:])
            elif verb == RELAY_RELEASE:
                self.release()
            elif verb == RELAY_CLEANUP:
                self.cleanup()
        except Exception as exc:  # noqa: BLE001 - a failed command is reported, never fatal to the tree
            self.emit(ev(EV_OUTPUT, self.rank, STAGE_AGENT, "gpuctl-node: %s failed: %s" % (verb, exc)))
            if verb == RELAY_START:
                self.emit(ev(EV_EXIT, self.rank, rest.strip(), 127))

    def _claim(self, token):
        dests = self.payload.get("sync") or []
        self.claim_token = token
        self.claim_owners = claim_destinations(token, dests, self.rank)
        self.emit(ev(EV_CLAIMS, self.rank, json.dumps(self.claim_owners, separators=(",", ":"))))

    def _sync(self, wave):
        """Push the destinations named in this wave to the ranks this node feeds. Destinations of one
        rank that lie inside another of them (a file_mount in the workdir) go after it, level by
        level (sync_levels): two rsyncs into the same tree at once race (a directory made or
        replaced under the other: exit 23)."""
        dests = self.payload.get("sync") or []
        for src, dst, indexes in wave:
            if src != self.rank:
                continue
            self.later_pushes[dst] = sync_levels([dests[i] for i in indexes])
            self._push_next_level(dst)

    def _push_next_level(self, to_rank):
        """Once no push to `to_rank` runs: its next level of destinations, if any (and the one after,
        when none of them could start: `_push` then said so at once)."""
        while self.later_pushes.get(to_rank) and not any(p[1] == to_rank for p in self.pushes):
            for dest in self.later_pushes[to_rank].pop(0):
                self._push(dest, to_rank, self.peers[to_rank])

    def _push(self, dest, to_rank, peer):
        local, remote = dest_paths(dest["path"])
        # --modify-window=-1: mtimes to the nanosecond, as upload.py (same-size edits within a second)
        argv = ["rsync", "--archive", "--modify-window=-1", "--exclude=/" + CLAIM_PREFIX + "*"]
        argv += list(dest.get("rsync_args") or [])
        rsh = " ".join(shell_quote(a) for a in peer_ssh_argv(peer["ssh"]))
        host = peer["host"]
        target = "%s:%s" % ("[%s]" % host if ":" in host else host, remote)
        if dest.get("dir"):
            argv += ["-e", rsh, "--", local.rstrip("/") + "/", target.rstrip("/") + "/"]
        else:
            argv += ["-e", rsh, "--", local, target]
        if shutil.which("rsync") is None:
            self.emit(ev(EV_SYNCED, to_rank, 127, "rsync is not installed on %s" % self.peers[self.rank]["name"]))
            return
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                close_fds=True)
        self.pushes.append((proc, to_rank, LineReader(proc.stderr.fileno()), []))

    def _start(self, stage):
        if stage not in STAGES:
            return
        if stage == STAGE_RUN and self.rank >= self.payload.get("job_ranks", len(self.peers)):
            return
        spec = (self.payload.get("stages") or {}).get(stage) or {}
        if spec.get("hostfile") is not None:
            self.write_hostfile(spec)
        st = Stage(self.jobdir, stage)
        # A managed job's attempt starts only while its epoch is admitted here (epochs.py): the lock
        # is held until the stage's process group exists, so a `fence` either finds it or refuses it.
        with job_admission(self.payload, self.jobdir) as refused:
            if refused:
                code, err = 4, refused
            else:
                if self.secrets:  # written for the stage; its supervisor removes it when the stage ends
                    write_private(st.secrets, self.secrets)
                code, err, exit_fd = start_stage_watched(st, self.payload.get("workdir") or "~/gpuctl_workdir",
                                                         lifeline=self.lifeline,
                                                         grace=float(self.payload.get("grace") or 3.0))
        if code != 0:
            self.emit(ev(EV_OUTPUT, self.rank, stage, "gpuctl-node: %s" % err))
            self.emit(ev(EV_EXIT, self.rank, stage, 127))
            return
        self.stages[stage] = LocalStage(st, exit_fd)
        self.emit(ev(EV_STARTED, self.rank, stage))
        if stage == STAGE_RUN:
            self.watch_spot()

    def watch_spot(self):
        """A job with spot_notice: poll for an interruption notice while its run stage runs here
        (spotnotice.py). Started after the stage's fork, so no fork copies the watcher's thread."""
        config, problem = spot_notice_config(self.payload)
        if problem:
            self.emit(ev(EV_OUTPUT, self.rank, STAGE_AGENT, "gpuctl-node: no spot notice watch: %s" % problem))
        elif config is not None and self.spot is None:
            self.spot = SpotWatch(config[0], config[1], lambda: [Stage(self.jobdir, STAGE_RUN)]).start()

    def report_spot(self):
        """The spot notice's one line in the job's events, once the watcher saw one."""
        text = self.spot.take_report() if self.spot is not None else None
        if text:
            self.emit(ev(EV_OUTPUT, self.rank, STAGE_AGENT, "gpuctl-node: %s" % text))

    def kill_local(self, grace, stages):
        for stage in stages:
            if stage in STAGES:
                st = Stage(self.jobdir, stage)
                if st.pgid() is not None:
                    kill_stage(st, grace)

    def release(self):
        """Remove this node's claim markers (the copies are done)."""
        if self.claim_owners:
            release_claims(getattr(self, "claim_token", ""), self.payload.get("sync") or [], self.claim_owners,
                           self.rank)
            self.claim_owners = []
        if self.node_buckets is not None:
            self.node_buckets.release()

    def cleanup(self):
        remove(os.path.join(self.jobdir, "secrets.sh"))
        self.release()
        if self.node_buckets is not None:
            self.node_buckets.end()  # mounts holding the job's credentials go too

    # -- the loop ------------------------------------------------------------
    def fds(self):
        out = []
        for child in self.children:
            if not child.out.eof:
                out.append((child.out.fd, ("out", child)))
            if not child.errs.eof:
                out.append((child.errs.fd, ("err", child)))
        for push in self.pushes:
            if not push[2].eof:
                out.append((push[2].fd, ("push", push)))
        for stage in self.stages.values():  # a local stage's exit wakes the loop at once, not at its next poll
            if not stage.done and stage.exit_notice.fd is not None:
                out.append((stage.exit_notice.fd, ("stage", stage)))
        return out

    def busy(self):
        return (bool(self.pushes) or any(not s.done for s in self.stages.values())
                or (self.node_buckets is not None and self.node_buckets.busy()))

    def step(self, extra=(), timeout=0.5):
        """One round: read children and pushes, poll local stages; returns the ready `extra` fds."""
        watched = dict(self.fds())
        for fd in extra:
            watched[fd] = ("extra", None)
        wait = 0.05 if self.busy() else timeout
        try:
            ready, _, _ = select.select(list(watched), [], [], wait) if watched else ([], [], [])
        except InterruptedError:
            ready = []
        if not watched:
            time.sleep(wait)
        extra_ready = []
        for fd in ready:
            kind, obj = watched[fd]
            if kind == "extra":
                extra_ready.append(fd)
            elif kind == "out":
                for line in obj.out.read_lines():
                    self._from_child(obj, line)
                if obj.out.eof:
                    self._child_ended(obj)
            elif kind == "err":
                for line in obj.errs.read_lines():
                    obj.err = (obj.err + line + b"\n")[-4096:]
            elif kind == "push":
                for line in obj[2].read_lines():
                    obj[3].append(line.decode("utf-8", "replace"))
            elif kind == "stage":
                obj.exit_notice.drain()  # its exit line came (read by the stages' poll below), or EOF
        for push in list(self.pushes):
            proc, to_rank, reader, errs = push
            if reader.eof and proc.poll() is not None:
                self.pushes.remove(push)
                msg = (errs[-1] if errs else "") if proc.returncode else "ok"
                self.emit(ev(EV_SYNCED, to_rank, proc.returncode, msg.strip()[:300] or "rsync exit code %d" % proc.returncode))
                self._push_next_level(to_rank)
        self.report_spot()  # before the exits: the notice comes ahead of the X of a rank it stopped
        for stage in list(self.stages.values()):
            if not stage.done:
                stage.poll(self.emit, self.rank)
        if self.node_buckets is not None:
            self.node_buckets.poll(self.emit)
        return extra_ready

    def _from_child(self, child, line):
        if line[:2] in OUTPUT_HEADS:  # a rank's output: passed on as it is
            self.emit(line + b"\n")
            return
        kind, _, rest = line.partition(b" ")
        if kind in (_EXIT, _LOST, _HELLO):
            rank_text = rest.split(b" ", 1)[0]
            if rank_text.isdigit():
                rank = int(rank_text)
                if kind == _HELLO and rank == child.rank:
                    child.hello = True
                if kind == _LOST or (kind == _HELLO and (_UNPREPARED in rest or _PROBLEM in rest)):
                    child.open_ranks.discard(rank)
        self.emit(line + b"\n")

    def _child_ended(self, child):
        """The child's connection closed: every rank it still owed is lost."""
        child.proc.wait()
        while not child.errs.eof:  # ssh has exited: the rest of its stderr (its reason) is there to read
            os.set_blocking(child.errs.fd, True)
            for line in child.errs.read_lines():
                child.err = (child.err + line + b"\n")[-4096:]
        if self.closing:
            child.open_ranks.clear()
            return
        reason = child.reason()
        if not child.hello and child.proc.returncode in (126, 127):
            # ssh reached the node but there is no agent to run: prepare puts it back.
            self.emit(ev(EV_HELLO, child.rank, HELLO_UNPREPARED, "no gpuctl agent: %s" % reason))
            child.open_ranks.discard(child.rank)
        for rank in sorted(child.open_ranks):
            self.emit(ev(EV_LOST, rank, "connection to %s ended: %s" % (self.peers[child.rank]["name"], reason)))
        child.open_ranks.clear()

    def close(self, grace=3.0):
        """End of the job on this node: stop what still runs, drop secrets, close the children.

        Every stage started here is stopped, also one that was seen to end: what
        its script left running in the background, or what a dead supervisor
        left behind, is still in its process group."""
        if self.spot is not None:
            self.spot.stop()
            self.report_spot()  # a notice seen in the last round still reaches the events
        self.kill_local(grace, list(self.stages))
        remove(os.path.join(self.jobdir, "secrets.sh"))
        for child in self.children:
            child.close_stdin()
        deadline = time.time() + 10
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
        self.later_pushes = {}
        for proc, _, _, _ in self.pushes:
            if proc.poll() is None:
                proc.kill()
        if self.node_buckets is not None:
            self.node_buckets.kill()  # a COPY under way; mounts stay


def read_payload(stream):
    """The job (first line, JSON) and its secrets (second line, a JSON string) from a pipe."""
    payload = json.loads(stream.readline().decode("utf-8"))
    if payload.get("v") != PROTOCOL:
        raise SystemExit("gpuctl-node: job protocol %r, this agent speaks %d" % (payload.get("v"), PROTOCOL))
    secrets_line = stream.readline()
    secrets = json.loads(secrets_line.decode("utf-8")) if secrets_line.strip() else ""
    return payload, secrets


def cmd_relay(args):
    """A worker's part of a job: commands from the parent on stdin, events to stdout."""
    stdin = sys.stdin.buffer
    payload, secrets = read_payload(stdin)
    out = Out()
    out_lost = []

    def emit(data):
        if out_lost:
            return
        try:
            out.write(data)
        except (BrokenPipeError, OSError):
            out_lost.append(True)

    rank = payload["subtree"][0]
    relay = Relay(payload, secrets, rank, emit)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the parent's ssh going away shows as stdin EOF
    if relay.subtree[1:] and not prepared_problem(payload.get("fingerprint")):
        relay.learn_view()  # its children's host keys first; prepare_local reports a failure
    relay.spawn_children()
    try:
        if relay.prepare_local():
            # Who fed this node (the parent's address): the fan-out tree, for people and tests.
            with open(os.path.join(relay.jobdir, "relay.from"), "w") as fh:
                fh.write(os.environ.get("SSH_CONNECTION", "") + "\n")
    except Exception as exc:  # noqa: BLE001
        emit(ev(EV_HELLO, rank, HELLO_UNPREPARED, "cannot write the job: %s" % exc))
    commands = LineReader(stdin.fileno())
    try:
        while not commands.eof and not out_lost:
            for fd in relay.step(extra=[commands.fd]):
                for line in commands.read_lines():
                    text = line.decode("utf-8", "replace").strip()
                    if text == RELAY_END:
                        relay.command(text)  # passed on: the children close too, and are not lost
                        commands.eof = True
                        break
                    if text:
                        relay.command(text)
    finally:
        # Parent gone or job over: nothing of the job may outlive it here.
        relay.close(grace=float(payload.get("grace") or 3.0))
        while relay.children and any(not c.out.eof for c in relay.children):
            relay.step(timeout=0.1)
            if all(c.proc.poll() is not None for c in relay.children):
                for c in relay.children:
                    for line in c.out.read_lines():
                        relay._from_child(c, line)
                break
    return 0
