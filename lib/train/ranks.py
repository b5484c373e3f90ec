"""The trainer across the devices of its job: one process per device under torchrun, rank 0 the only one that talks to
the proxy and the bucket (train.py), the others following its orders through the process group.

    python train.py --nproc-per-node 2 --max-steps 40   # two ranks: train.py starts itself under torchrun (launch)
    torchrun --standalone --nproc-per-node 2 train.py --max-steps 40                  # the same, by hand
    python train.py --max-steps 40                      # rank 0 alone: no process group

One rank per GPU (NCCL) on a machine with GPUs, else CPU ranks (gloo). A job on Hugging Face Jobs runs
`uv run train.py ... --nproc-per-node N` (hf jobs uv run runs a script, whose PEP 723 header uv reads): train.py then
starts torchrun itself, through torch.distributed.run, the code behind the torchrun command.

Layout: the base model is replicated, one full copy per rank (frozen), or with --shard base (a base a replica of which
does not fit one GPU: memory.shard_base) its decoder layers are sharded over the ranks by FSDP2 (Ranks.shard_base);
the LoRA weights are whole on every rank either way. A step's groups are split across the ranks (a group's
completions stay together); each rank forms its share of the one-process loss (the token mean's normaliser is the
count over the whole batch, which every rank is handed), the LoRA gradients are summed across ranks with one
all-reduce, and the step's diagnostics are merged from every rank's tallies. Rank 0 alone
steps AdamW (so the optimizer state, the checkpoint and the published adapter are exactly one process's) and
broadcasts the updated LoRA weights, so the replicas cannot drift apart.

Why replicate where it fits: a replica runs only its own share's forwards and meets the other ranks once a step. A
sharded base all-gathers each layer in every forward and backward, so every rank must run every forward in lockstep:
train.train_step pads the shorter shares with zero-weight micro-batches, and the audit's recomputes (lib/train/audit.py,
rank 0's) are run by every rank (docs/DESIGN.md#the-trainers-ranks).
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class RanksLost(BaseException):
    """A collective of the process group failed: another rank died or cannot be reached. No group of a batch is to blame,
    so it derives from BaseException, as SystemExit does: the handlers that judge a batch's groups by what their
    training raised (train.forward_backward, the audit's culprits) do not catch it, and the rank stops (train.main)."""


class LockstepLost(RanksLost):
    """A forward or backward of a sharded model (--shard base) raised on this rank: the other ranks wait in that pass's
    collectives, which this rank can no longer match, so the job ends (torchrun stops every rank) and its relaunch
    resumes from the last checkpoint. The groups that reach the step are screened first (audit.group_problem)."""


@contextmanager
def collective(rank: int, world: int, what: str) -> Iterator[None]:
    """Run one collective: a RuntimeError there (how gloo and NCCL report a peer that is gone; DistBackendError is one)
    becomes RanksLost, naming this rank and the call."""
    try:
        yield
    except RuntimeError as e:
        raise RanksLost(f"trainer rank {rank} of {world}: {what} across the ranks failed, another rank is gone "
                        f"({str(e).splitlines()[0][:300]})") from None


@dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer's job: rank `rank` of `world`. world 1 is the plain `python train.py`
    trainer: no process group, and every method below is then the identity (or does nothing)."""
    rank: int = 0
    world: int = 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that leases, publishes, checkpoints, audits and reports."""
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's share of `items` (round-robin, so every rank's share differs from another's by one at most)."""
        return items[self.rank::self.world]

    def rounds(self, n: int, per: int) -> int:
        """Micro-batches of `per` items the rank with the largest share of `n` items runs (rank 0's: share)."""
        largest = -(-n // self.world)  # ceil: rank 0's share, the largest
        return -(-largest // per)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (a pickled object: an order, a batch of groups)."""
        if self.world == 1:
            return obj
        box = [obj]
        with collective(self.rank, self.world, "a broadcast"):
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        with collective(self.rank, self.world, "a gather"):
            torch.distributed.all_gather_object(out, obj)
        return out

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """The gradients of `params` summed over the ranks, in place, with one all-reduce of one flat buffer. A rank that
        trained nothing contributes zeros; where no rank did, the gradients stay None (as in one process)."""
        if self.world == 1:
            return
        trained = torch.tensor([float(any(p.grad is not None for p in params))], device=params[0].device)
        with collective(self.rank, self.world, "the gradients' all-reduce"):
            torch.distributed.all_reduce(trained)
            if trained.item() == 0:
                return
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            torch.distributed.all_reduce(flat)
        for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.grad = g.view_as(p).clone()

    def same_weights(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values of `params` on every rank (after rank 0's update or checkpoint restore)."""
        if self.world == 1:
            return
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            with collective(self.rank, self.world, "the weights' broadcast"):
                torch.distributed.broadcast(flat, src=0)
            for p, v in zip(params, torch.split(flat, [p.numel() for p in params])):
                p.copy_(v.view_as(p))

    def shard_base(self, model) -> None:
        """FSDP2 over the frozen base: each decoder layer of the peft `model` one fully_shard unit and the decoder (the
        module the trainer calls: models.completion_logprobs) the root, their weights split over the ranks. The LoRA
        weights, the embeddings, the final norm and the head stay whole on every rank (ignored_params): LoRA's are
        what rank 0's AdamW steps, saves and publishes and the audit swaps, as with a replicated base; the head is
        called outside the decoder, and is tied to the embeddings in small models. Every unit then holds one dtype
        (the base's), and each rank must run the same forwards (models.LOCKSTEP_ATTR; train.train_step).
        `model` comes in host memory (models.load_base on_cpu): fully_shard moves each layer's shard to this rank's
        device as it splits it, and the whole weights and the buffers are moved after."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from models import LOCKSTEP_ATTR
        lm = model.get_base_model()
        decoder = lm.get_decoder()
        in_layers = {id(p) for layer in decoder.layers for p in layer.parameters()}
        whole = {p for p in model.parameters() if p.requires_grad or id(p) not in in_layers}
        cuda = torch.cuda.is_available()
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        for layer in decoder.layers:
            fully_shard(layer, mesh=mesh, ignored_params=whole)
        fully_shard(decoder, mesh=mesh, ignored_params=whole)
        on_device(model, whole, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        setattr(lm, LOCKSTEP_ATTR, True)

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def on_device(model, params: set, device: torch.device) -> None:
    """`params` (the weights FSDP2 leaves whole) and every buffer of `model` (rotary tables, ...) moved to `device`,
    each parameter keeping its identity (the optimizer and models.lora_views hold them)."""
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(device)
    for name, buf in list(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf.to(device))


def join(timeout_h: float = 24.0) -> Ranks:
    """This process's Ranks: under torchrun (WORLD_SIZE > 1) the process group joined, NCCL with one GPU per rank
    (LOCAL_RANK's) or gloo on CPU; else rank 0 alone. The group's timeout is long: a follower waits in a broadcast
    for as long as rank 0 waits for a batch (rollouts, an outage of the proxy); a rank that dies is caught by
    torchrun, which ends the others."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=timeout_h))
    return Ranks(torch.distributed.get_rank(), torch.distributed.get_world_size())


def launch(nproc: int, argv: list[str]) -> None:
    """Run `argv` (this script and its arguments) as `nproc` ranks on this machine under torchrun (torch.distributed.run,
    one node, a free rendezvous port); returns when every rank exited 0. A rank that fails ends the others (torchrun
    stops them) and this process, saying which rank and how: the job ends, and its relaunch resumes from the last
    checkpoint."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise SystemExit(f"--nproc-per-node {nproc}: this machine has {gpus} GPU(s); one rank per GPU")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    # on SIGTERM torchrun passes it on to every rank, then kills them after this many seconds (30 by default): rank 0
    # needs the time to finish its step and write its checkpoint, as the one-process trainer has it
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    try:
        torchrun(["--standalone", "--nproc-per-node", str(nproc), *argv])
    except SignalException as e:
        raise SystemExit(f"trainer stopped by {e.sigval.name}: torchrun passed it on to every rank (rank 0 writes its "
                         "checkpoint first: its lines are above)") from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        raise SystemExit(f"trainer rank {rank} of {nproc} ended with {how}: torchrun stopped every rank (its own lines "
                         "are above); a relaunch resumes from the last checkpoint") from None
