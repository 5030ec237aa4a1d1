"""The places on a node that no file_mount, bucket or copy may take: the one list both ends use.

The controller checks every spelling of a destination against these lists
(nodepaths.py); the node agent checks the real paths, symlinks resolved, with
the same objects (node/destinations.py): the agent is built from its
modules with this one inside it (configplane/bundle.py), so the lists exist
once. Standard library only and Python >= 3.6 syntax, like the rest of the agent.
"""

WORKDIR = "~/gpuctl_workdir"  # payload.WORKDIR_DEST (a test keeps the two equal)
SSH_DIR_ON_NODE = "~/.ssh"  # agent/install.py writes there (its SSH_DIR)
# Never a destination, nor anything in them.
RESERVED_TREES = (
    "~/.gpuctl",
    # In ~/.ssh (itself in RESERVED_DIRS: a deploy key such as ~/.ssh/id_rsa may go in, nothing may replace it
    # whole): what sshd and ssh read on every login (a copy there locks gpuctl out of its nodes or runs on each
    # of its commands) and what gpuctl writes there (agent/install.py: the internal key, the known hosts of the
    # cluster view, its Host entries in config, its public key in authorized_keys).
    "~/.ssh/authorized_keys", "~/.ssh/authorized_keys2", "~/.ssh/config", "~/.ssh/known_hosts",
    "~/.ssh/known_hosts2", "~/.ssh/rc", "~/.ssh/environment",
    # the login shell's startup files: sshd runs every command of gpuctl's through them, and one that
    # prints or exits breaks rsync and the agent for every later job (as a bad authorized_keys would)
    "~/.bashrc", "~/.bash_profile", "~/.bash_login", "~/.bash_logout", "~/.profile", "~/.zshenv", "~/.zprofile",
    "~/.zshrc", "~/.cshrc", "~/.tcshrc",
    "/etc/ssh", "/etc/sudoers", "/etc/sudoers.d", "/etc/pam.d", "/etc/passwd", "/etc/shadow", "/etc/group",
    "/etc/gshadow", "/etc/fuse.conf", "/etc/security", "/etc/profile", "/etc/profile.d", "/etc/bash.bashrc",
    "/etc/environment", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/nsswitch.conf",
    "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.cache",
    # the programs and libraries gpuctl runs (python3, rsync, ssh, bash): never replaced by a copy
    "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32",
    "/usr/lib64", "/usr/libx32", "/usr/libexec",
    "/proc", "/sys", "/dev", "/run", "/var/run", "/boot",
)
# Names in ~/.ssh that start with this are gpuctl's (gpuctl_cluster, gpuctl_known_hosts, and the copies
# written before each is renamed into place): reserved, whatever follows.
RESERVED_SSH_PREFIX = SSH_DIR_ON_NODE + "/gpuctl"
# Never a destination themselves; a new directory below them is fine.
RESERVED_DIRS = (
    "/", "~", SSH_DIR_ON_NODE, "/etc", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp", "/usr", "/var",
    "/usr/local", "/usr/local/bin", "/usr/share", "/var/lib", "/var/log", "/var/tmp",
)
