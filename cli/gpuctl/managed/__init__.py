"""Managed jobs: a job that owns its cluster and survives node loss (`gpuctl jobs ...`).

store: the jobs, their attempts and recoveries (SQLite beside the registry). policy: what an
attempt's end means (recover, restart, finish). supervisor: the detached process that brings the
cluster up, runs attempt after attempt, replaces only the lost nodes, and takes the cluster down
however the job ends. launch: start, find and revive supervisors; cancel.
"""
