"""Joining a run's process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dbo.fingerprint import CollectiveTracker
from scenarios.harness import RunOptions
from scenarios.ranks.records import RankEnv

__all__ = [
    "HOSTED_ENV",
    "RankSetupError",
    "env_int",
    "first_line",
    "init_rank",
    "launched_by_torchrun",
]

# Set in the children of `run_local_ranks`: the parent hosts the store (as torchrun's agent does).
HOSTED_ENV = "DBO_SIM_STORE_HOSTED"


class RankSetupError(RuntimeError):
    """A rank could not join the group: unreachable store, group never formed, bad env."""


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (or an equivalent launcher) started as one of several."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def env_int(name: str) -> int:
    """The integer environment variable `name`; a missing or non-integer one is a setup error."""
    text = os.environ.get(name)
    if text is None:
        raise RankSetupError(f"environment variable {name} is not set (torchrun sets it)")
    try:
        return int(text)
    except ValueError:
        raise RankSetupError(
            f"environment variable {name} must be an integer, got {text!r}"
        ) from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def init_rank(opts: RunOptions) -> RankEnv:
    """Join the run described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise RankSetupError(
            f"RANK ({rank}) must be in [0, WORLD_SIZE) with WORLD_SIZE ({world}) >= 1"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    store = _open_store(rank, opts)
    every_gpu = _every_rank_has_a_gpu(store, rank, world, local_rank, opts)
    timeout = timedelta(seconds=opts.timeout_s)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        cuda_group = None
        if every_gpu:
            torch.cuda.set_device(local_rank)
            cuda_group = dist.new_group(backend="nccl", timeout=timeout)
    except Exception as error:
        raise RankSetupError(_group_never_formed(rank, world, opts, error)) from error
    # Every collective of the run is fingerprinted across the ranks before it runs: a rank
    # out of step is named (its collective's kind and call site) instead of pairing wrongly.
    CollectiveTracker(rank, None).install()
    group = dist.group.WORLD
    return RankEnv(rank, world, local_rank, store, group, group, cuda_group)


def _open_store(rank: int, opts: RunOptions) -> Any:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = env_int("MASTER_PORT")
    # torchrun's agent (or our parent) already hosts the store; otherwise rank 0 hosts it.
    hosted = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or os.environ.get(HOSTED_ENV) == "1"
    )
    try:
        raw = dist.TCPStore(
            addr,
            port,
            is_master=rank == 0 and not hosted,
            timeout=timedelta(seconds=opts.timeout_s),
            wait_for_workers=False,
        )
    except Exception as error:
        raise RankSetupError(
            f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
            f"{opts.timeout_s:g} s: {first_line(error)}"
        ) from error
    return dist.PrefixStore("dbo-sim", raw)


def _every_rank_has_a_gpu(
    store: Any, rank: int, world: int, local_rank: int, opts: RunOptions
) -> bool:
    """NCCL only when every rank has its own GPU: each rank says, then all decide alike."""
    has_gpu = (
        opts.device == "cuda"
        and torch.cuda.is_available()
        and local_rank < torch.cuda.device_count()
    )
    store.set(f"gpu/{rank}", "1" if has_gpu else "0")
    try:
        store.wait([f"gpu/{r}" for r in range(world)], timedelta(seconds=opts.timeout_s))
    except Exception as error:
        raise RankSetupError(_group_never_formed(rank, world, opts, error)) from error
    every_gpu = all(store.get(f"gpu/{r}") == b"1" for r in range(world))
    if opts.device == "cuda" and not every_gpu:
        lacking = [r for r in range(world) if store.get(f"gpu/{r}") != b"1"]
        raise RankSetupError(
            f"--device cuda needs a GPU per rank; rank(s) {lacking} have none (this machine has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})"
        )
    return every_gpu


def _group_never_formed(rank: int, world: int, opts: RunOptions, error: BaseException) -> str:
    return (
        f"rank {rank}: the process group of WORLD_SIZE={world} ranks did not form within "
        f"{opts.timeout_s:g} s (are all {world} ranks started, with the same MASTER_ADDR/PORT?): "
        f"{first_line(error)}"
    )
