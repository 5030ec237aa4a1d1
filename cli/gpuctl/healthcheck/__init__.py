"""`gpuctl check`: does a cluster deliver its fabric? (issue 12)

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
"""
