"""The process table of this node: whether a process or group lives, a stage's processes, signals.

Reads /proc (Linux); where it is missing, signal 0 answers instead. A stage
is found three ways (stop_group in stages.py uses all of them): its process
group, the tree below its supervisor (a subreaper, where what left the group
in a session of its own was re-parented), and STAGE_TAG in the environment of
every process it started (what escaped both).
"""

import os


def stat_fields(pid, proc_root="/proc"):
    """The fields of PROC/PID/stat after the command name (which may hold spaces): state, ppid,
    pgrp, session, tty_nr, ...; None when the process is gone."""
    try:
        with open("%s/%s/stat" % (proc_root, pid)) as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()


def _proc_state(pid):
    """(state letter, pgrp) from /proc, or None when the process is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[2]))


def pid_alive(pid):
    if not pid or pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        st = _proc_state(pid)
        return st is not None and st[0] != "Z"  # a zombie has ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid):
    """Whether any live (non-zombie) process is in process group `pgid`."""
    if not pgid or pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)  # no such group: nothing to look for (every job's end asks, on every node)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_state(int(entry))
            if st is not None and st[1] == pgid and st[0] != "Z":
                return True
    return False


def killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Make this process the one a descendant is re-parented to when its parent dies (Linux), so
    what a stage starts in a session of its own (torchrun's workers) stays findable under it."""
    try:
        import ctypes  # only here: a node without it still runs stages, as before

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def process_table():
    """{pid: (state letter, parent pid, process group)} of every process, from /proc."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as fh:
                data = fh.read()
        except OSError:
            continue
        fields = data[data.rfind(")") + 2:].split()
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def stage_processes(pgid, root=None):
    """The live processes of a stage: its process group, everything below a member of it (a
    session of its own does not leave the tree), and everything below `root` (its supervisor,
    a subreaper: where what lost its parent went)."""
    table = process_table()
    children = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = set(pid for pid, (_, _, group) in table.items() if pgid and group == pgid)
    todo = list(found) + ([root] if root else [])
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(pid for pid in found if table[pid][0] != "Z")


STAGE_TAG = "GPUCTL_NODE_STAGE"  # in the environment of every process of a stage: a random value (STAGE.tag)


def tagged_processes(tag):
    """This user's live processes whose environment carries STAGE_TAG=`tag`: a stage's processes
    that left its group and its supervisor's tree both (a daemon that double-forked to init, or
    a session leader whose supervisor died), found wherever they went."""
    if not tag:
        return []
    want = ("\0%s=%s\0" % (STAGE_TAG, tag)).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as fh:
                environ = fh.read()
        except OSError:  # gone, or another user's
            continue
        if want in b"\0" + environ + b"\0":
            found.append(int(name))
    return found


def descendants(pid):
    """The live (non-zombie) processes below `pid` in the process tree."""
    return stage_processes(None, pid)


def kill_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
