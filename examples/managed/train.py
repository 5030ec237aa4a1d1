"""A DDP training job that survives node loss as a gpuctl managed job (CPU + gloo, or NCCL on GPUs).

Every attempt of a managed job runs this script again from the start, on the same task id
(GPUCTL_TASK_ID) with the next GPUCTL_ATTEMPT. What makes that a resume, not a restart from
scratch, is the checkpoint, and checkpoints are the script's own:

- rank 0 saves {model, optimizer, step} every --ckpt-every steps into --ckpt-dir, atomically
  (a temporary file, then os.replace), so a node lost mid-write leaves the previous checkpoint;
- on start rank 0 loads the checkpoint if there is one and broadcasts it, so only rank 0 needs
  to see the directory (a bucket mounted on every node, or a path every node shares);
- SIGTERM (a spot interruption notice, or torchrun passing one on) ends the run at the next
  step on every rank, which all agree on through one small all-reduce per step; rank 0 saves
  first, then every rank exits 143 (128 + SIGTERM).

The data of step s is drawn from a generator seeded with (rank, s), so a resumed run sees the
batches an uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

CHECKPOINT = "checkpoint.pt"
EXIT_SIGTERM = 143  # what a shell reports for a process ended by SIGTERM

stop_requested = False


def on_sigterm(signum: int, frame: object) -> None:
    # Only note it: the step in flight finishes, then every rank stops at the same step.
    global stop_requested
    stop_requested = True


def load_checkpoint(ckpt_dir: str, rank: int) -> dict | None:
    """Rank 0 reads the checkpoint (None if there is none) and every rank receives it."""
    state = None
    if rank == 0:
        path = os.path.join(ckpt_dir, CHECKPOINT)
        if os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(ckpt_dir: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write to a temporary file, flush it to disk, then rename it over the checkpoint."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, CHECKPOINT)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def leave(code: int) -> None:
    # As in examples/ddp/train.py: skip interpreter shutdown, where a Gloo thread still
    # releasing the last collective's tensors can abort a run that finished well.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt-dir", default=os.environ.get("CKPT_DIR"),
                        help="where rank 0 keeps the checkpoint (default: $CKPT_DIR)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, to watch a recovery")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    if not args.ckpt_dir:
        parser.error("give --ckpt-dir or set CKPT_DIR")

    signal.signal(signal.SIGTERM, on_sigterm)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    state = load_checkpoint(args.ckpt_dir, rank)
    start = 0
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = DDP(net, device_ids=[local_rank] if backend == "nccl" else None)
    attempt = os.environ.get("GPUCTL_ATTEMPT", "1")
    task_id = os.environ.get("GPUCTL_TASK_ID") or os.environ.get("SKYPILOT_TASK_ID") or "-"
    if rank == 0:
        found = "its checkpoint" if state is not None else "no checkpoint yet"
        print(f"attempt {attempt} resumes at step {start} of {args.steps} ({found} in {args.ckpt_dir}); "
              f"task id {task_id}; {world} ranks, {backend}", flush=True)

    true_w = torch.linspace(-1, 1, 16, device=device)
    stop = torch.zeros(1, device=device)
    step, loss = start, None
    while step < args.steps:
        gen = torch.Generator().manual_seed(1_000_003 * step + rank)
        x = torch.randn(64, 16, generator=gen).to(device)
        y = torch.sin(x @ true_w)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        # Every rank learns whether any rank was asked to stop, so all stop after the same step.
        stop.fill_(1.0 if stop_requested else 0.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0 and (stop.item() or step % args.ckpt_every == 0 or step == args.steps):
            save_checkpoint(args.ckpt_dir, net, optimizer, step)
        if rank == 0 and step % 10 == 0:
            print(f"step {step:4d} loss {loss.item():.5f}", flush=True)
        if stop.item():
            if rank == 0:
                print(f"SIGTERM: checkpoint saved at step {step}; exiting {EXIT_SIGTERM}", flush=True)
            dist.destroy_process_group()
            leave(EXIT_SIGTERM)
        if args.step_seconds:
            time.sleep(args.step_seconds)

    dist.barrier()  # rank 0's last checkpoint is written before anyone reports done
    dist.destroy_process_group()
    if rank == 0:
        last = f"final loss {loss.item():.5f}" if loss is not None else "nothing left to train"
        print(f"done: {args.steps} steps, {last}; task id {task_id}", flush=True)
    leave(0)


if __name__ == "__main__":
    main()
