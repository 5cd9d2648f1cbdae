"""The processes of a tensor-parallel server: rank 0 is the server itself, ranks 1..N-1 its
children, each building the same engine over its share of the heads and following rank 0's
orders (`confkv.engine.tensor_parallel`)."""

from __future__ import annotations

import logging
import socket

import torch
from transformers import AutoConfig

from confkv.engine.tensor_parallel import Followers, follow
from confkv.models.default_model import default_model_path
from confkv.models.parallel import RankGroup, check_tensor_parallel, join
from confkv.server.settings import Settings

log = logging.getLogger(__name__)
ADDRESS = "127.0.0.1"  # the ranks of one server share its machine


def rank_device(settings: Settings, rank: int) -> torch.device:
    """Rank r's device: cuda:r with CUDA (one device per rank), else the CPU."""
    device = settings.resolved_device()
    return torch.device("cuda", rank) if device.type == "cuda" and settings.tensor_parallel_size > 1 else device


def check_ranks(settings: Settings) -> None:
    """Refuse, before anything starts, a tensor_parallel_size the model or the machine cannot take."""
    size = settings.tensor_parallel_size
    check_tensor_parallel(AutoConfig.from_pretrained(settings.model_path or default_model_path()), size)
    if settings.resolved_device().type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} CUDA devices, one per rank, and this machine has "
            f"{torch.cuda.device_count()}"
        )


def start_ranks(settings: Settings) -> tuple[RankGroup, Followers]:
    """Start ranks 1..N-1 and join them as rank 0; returns once every rank has joined."""
    with socket.socket() as probe:  # a free port for the group's rendezvous
        probe.bind((ADDRESS, 0))
        port = probe.getsockname()[1]
    size = settings.tensor_parallel_size
    log.info("starting %d tensor-parallel ranks (gloo or NCCL on %s:%d)", size, ADDRESS, port)
    followers = Followers(run_follower, size, (settings.model_dump_json(), port))
    return join(0, size, ADDRESS, port, rank_device(settings, 0)), followers


def run_follower(rank: int, orders, settings_json: str, port: int) -> None:
    """A follower process: join the group, build the same engine as rank 0 over this rank's share
    of the model, then follow rank 0's orders until told to stop."""
    from confkv.server.api import build_engine  # NOTE: here, in the child: the server imports this module

    settings = Settings.model_validate_json(settings_json)
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    device = rank_device(settings, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ranks = join(rank, settings.tensor_parallel_size, ADDRESS, port, device)
    engine, _ = build_engine(settings, ranks)
    log.info("rank %d ready: following rank 0", rank)
    follow(engine, orders)
