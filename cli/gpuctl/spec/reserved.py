"""The places on a node that no file_mount, bucket or copy may take: the one list both ends use.

The controller checks every spelling of a destination against these lists
(nodepaths.py); the node agent checks the real paths, symlinks resolved, with
the same objects (jobplane/agent/destinations.py): the agent is built from its
modules with this one inside it (jobplane/agent/build.py), so the lists exist
once. Standard library only and Python >= 3.6 syntax, like the rest of the agent.
"""

WORKDIR = "~/gpuctl_workdir"  # payload.WORKDIR_DEST (a test keeps the two equal)
# Never a destination, nor anything in them.
RESERVED_TREES = (
    "~/.ssh", "~/.gpuctl",
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
# Never a destination themselves; a new directory below them is fine.
RESERVED_DIRS = (
    "/", "~", "/etc", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp", "/usr", "/var", "/usr/local",
    "/usr/local/bin", "/usr/share", "/var/lib", "/var/log", "/var/tmp",
)
