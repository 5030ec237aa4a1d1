"""`gpuctl check`: does a cluster deliver its fabric (issue 12), and is each node fit (issue 26)?

One all-reduce across every node and GPU, run as one gpuctl job, and the
transport NCCL chose. Each module does one job and, except the command,
touches nothing outside its arguments:

- bandwidth.py   `--sizes` parsing, algbw/busbw, the table
- nccllog.py     NCCL_DEBUG=INFO lines -> the network each process used
- ncclperf.py    nccl-tests' all_reduce_perf: the mpirun line, its output
- probe.py       the node side (standard library + torch): torch.distributed
                 all_reduce timing; copied to the nodes as a file, never imported here
- fabriccheck.py the fabric a cluster should use (the provider's expected_fabric), and whether a transport is it
- command.py     the job, the collected lines, the verdict
- pairs.py       `--pairs`: each ring pair's bandwidth, and the node all its slow pairs point at
- nodehealth.py  `--health`, the node side (standard library): GPUs, Xid, NVLink, RDMA devices,
                 memlock, modules, DCGM, disks -> findings with an action; copied to the nodes
- health.py      `--health`, the controller side: the job, each node's verdict, health.json
"""
