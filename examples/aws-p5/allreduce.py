"""NCCL all_reduce bus bandwidth across all ranks (the nccl-tests formula)."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    world = dist.get_world_size()
    n = args.size_mb * 1024 * 1024 // 4
    buf = torch.ones(n, dtype=torch.float32, device="cuda")

    for _ in range(args.warmup):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.iters

    size = n * 4
    algbw = size / elapsed / 1e9
    busbw = algbw * 2 * (world - 1) / world
    if dist.get_rank() == 0:
        print(f"all_reduce {args.size_mb} MiB x {world} ranks: {elapsed * 1e3:.2f} ms, "
              f"algbw {algbw:.1f} GB/s, busbw {busbw:.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
