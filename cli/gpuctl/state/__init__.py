"""What gpuctl remembers: the registry of clusters and jobs (SQLite, `registry`), the lock one
command holds while it changes a cluster (`lock`), and shared state in a bucket (`remotestate/`),
which only the registry syncs with."""
