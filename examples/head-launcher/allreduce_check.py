"""One process of a gloo all_reduce; started by launch.sh on every node over SSH.

Reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (what torchrun would
set), sums rank+1 over all processes and checks the result.
"""

import datetime
import os
import socket
import sys

# Before torch loads: no warning per connection that the peer's address has no DNS name.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    ok = value.item() == expected
    print(f"rank {rank}/{world} on {socket.gethostname()}: all_reduce sum {value.item():g} "
          f"(expected {expected:g}) {'ok' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
