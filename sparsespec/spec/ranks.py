"""Data-parallel drafter training over several processes, one GPU each: this process's share of the work, and the
collectives that keep every process's drafter the same.

    ranks = Ranks.current()        # rank 0 of 1 unless a process group is initialised
    ranks.share(prompts)           # this process's items: every size-th one from its rank
    ranks.average_grads(params)    # gradients averaged over the processes (after backward, before clipping)
    ranks.max(x) / ranks.sum(t)    # one value for every process (the training clock, held-out sums)
    spawn(fn, n, device, *args)    # fn(*args) in n processes with a process group (NCCL on CUDA, gloo on CPU)

With one process every call is the identity, and nothing of torch.distributed is touched.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import SparseSpecError


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> "Ranks":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        """The process that logs and writes the shared files."""
        return self.rank == 0

    def share(self, items: list) -> list:
        return items[self.rank::self.size]

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Every parameter's gradient replaced by its mean over the processes (one flat all-reduce)."""
        if self.size == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= self.size
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def max(self, value: float, device: torch.device) -> float:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def broadcast_(self, params: Iterable[torch.Tensor]) -> None:
        """Rank 0's values in every process (the same start, whatever each process's random state)."""
        if self.size > 1:
            for p in params:
                dist.broadcast(p.data, 0)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def spawn(fn: Callable, n: int, device: str, *args) -> None:
    """Run fn(*args) in n processes (rank r on GPU r on CUDA), a process group around it. fn must be importable (a
    module-level function). An error in any process ends all of them and is raised here as one SparseSpecError
    line: the first SparseSpecError's message, else the first error raised (a process's failure makes the others
    fail too, on their next collective: the first one is the cause)."""
    if n < 1:
        raise SparseSpecError(f"need >= 1 process, got {n}")
    if device == "cuda" and n > torch.cuda.device_count():
        raise SparseSpecError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = torch.multiprocessing.get_context("spawn").SimpleQueue()  # (is it ours, message) in raising order
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # (its note on ending the others)
    try:
        torch.multiprocessing.spawn(_process, args=(n, port, device, fn, args, errors), nprocs=n, join=True)
    except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as e:
        raised = []
        while not errors.empty():
            raised.append(errors.get())
        ours = [message for is_ours, message in raised if is_ours]
        if ours:
            raise SparseSpecError(ours[0]) from None
        first = raised[0][1] if raised else str(e).strip().splitlines()[-1]
        raise SparseSpecError(f"a training process failed: {first}") from None


def _process(rank: int, n: int, port: int, device: str, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # "cuda" in this process is its own GPU
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // n))  # the cores shared, not oversubscribed
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank) if cuda else None)
    try:
        fn(*args)
    except BaseException as e:
        errors.put((isinstance(e, SparseSpecError), str(e) or type(e).__name__))
        raise
    finally:
        dist.destroy_process_group()
