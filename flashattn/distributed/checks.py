"""Input checks for ring attention: clear errors instead of a hang or a wrong answer.

Some mistakes are visible on one rank (a tensor on the wrong device, an odd zigzag shard), others
only across ranks (shards of different lengths: each rank would wait for a message of the wrong
size, forever, or read garbage). So the checks run in two rounds: each rank checks what it can
see, then the ranks exchange a few numbers about their shards and their verdict in one small
all-gather, and every rank raises: its own error, or one that names the ranks that refused. No
rank goes on into the ring while another stopped (that would hang).
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from .. import runtime
from .layout import LAYOUTS, check_layout

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: what each rank tells the others, in this order
FIELDS = ("refused", "ranks in the group", "B", "H", "H_kv", "S_local", "D", "dtype", "is_causal", "layout",
          "scale")


def process_group(group) -> dist.ProcessGroup:
    """The group to run on: ``group``, or the default one for None. ValueError / TypeError when
    there is none, it is not a group, or this process is not one of its members."""
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed")
    if not dist.is_initialized():
        raise ValueError("ring attention needs an initialized process group, and this process has none: call "
                         "torch.distributed.init_process_group(backend=...) first ('nccl' for CUDA tensors, "
                         "'gloo' for CPU tensors), in every process of the ring")
    if group is None:
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:    # what dist.new_group returns outside the group
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it passed "
                         "(dist.new_group returned its non-member placeholder here): only the group's members "
                         "may call ring attention with it")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (from dist.new_group) or None for the "
                        f"default group, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it passed "
                         f"(global ranks {dist.get_process_group_ranks(group)}): only the group's members may "
                         "call ring attention with it")
    return group


def backend_carries(backend: str, device_type: str) -> bool:
    """Whether a process group of ``backend`` (as ``dist.get_backend`` names it: "nccl", "gloo",
    "cpu:gloo,cuda:nccl", ...) moves tensors of ``device_type``. Backends it does not know
    (mpi, ucc, custom ones) are given the benefit of the doubt."""
    backend = str(backend).lower()
    if ":" in backend:                         # one backend per device type
        return device_type in {pair.split(":")[0] for pair in backend.split(",")}
    known = {"nccl": "cuda", "gloo": "cpu"}    # (gloo's send and receive take CPU tensors only)
    return known.get(backend, device_type) == device_type


def _describe_device_error(backend: str, device: torch.device) -> str:
    wanted = {"cuda": "backend='nccl'", "cpu": "backend='gloo'"}.get(device.type, f"a backend that moves {device.type} tensors")
    return (f"the group's backend is {backend}, which cannot move tensors on {device}, where the shards are: "
            f"initialize the process group with {wanted}")


def _local_checks(q, k, v, group, is_causal, scale, layout):
    """What one rank can check alone. Returns (causal, scale); raises TypeError / ValueError."""
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(is_causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    check_layout(layout)
    backend = dist.get_backend(group)
    if not backend_carries(backend, q.device.type):
        raise ValueError(_describe_device_error(backend, q.device))
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        raise ValueError(f"the shards are on {q.device} but this process's current GPU is "
                         f"cuda:{torch.cuda.current_device()}: one GPU per rank, made current before the ring "
                         f"(torch.cuda.set_device({q.device.index}), or the shards on cuda:{torch.cuda.current_device()})")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"ring attention is self-attention over one sequence: the K/V shard must be as long as "
                         f"the query shard, got S_local = {q.shape[2]} for q and {k.shape[2]} for k and v")
    if layout == "zigzag" and q.shape[2] % 2:
        W = dist.get_world_size(group)
        raise ValueError(f"layout 'zigzag' cuts the sequence into 2W = {2 * W} chunks and gives each rank two: "
                         f"a shard must have an even length, got S_local = {q.shape[2]} (a sequence of "
                         f"{q.shape[2] * W} tokens, not divisible by {2 * W}); use layout='contiguous' or pad")
    return causal, scale


def _summary(q, k, group, causal, scale, layout, refused: bool) -> list[int]:
    if refused:
        return [1] + [0] * (len(FIELDS) - 1)
    B, H, S, D = q.shape
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    return [0, dist.get_world_size(group), B, H, k.shape[1], S, D, dtype, int(causal), LAYOUTS.index(layout),
            scale_bits]


def _exchange(group, summary: list[int]) -> list[list[int]]:
    """Every rank's summary, by one all-gather on a device the group's backend moves."""
    backend = dist.get_backend(group)
    device = torch.device("cpu") if backend_carries(backend, "cpu") else torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(summary, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [t.tolist() for t in every]


def _show(field: str, value: int):
    if field == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else "another dtype"
    if field == "layout":
        return LAYOUTS[value]
    if field == "is_causal":
        return bool(value)
    if field == "scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


def validate_shards(q, k, v, group, is_causal, scale, layout, also=None) -> tuple:
    """Check the shards on this rank (and ``also()``, the caller's own local checks), then that
    every rank's agree (one all-gather of a few numbers). Returns (causal, scale, what ``also``
    returned); raises the same kind of error on every rank."""
    error = None
    causal = scale_ = extra = None
    try:
        causal, scale_ = _local_checks(q, k, v, group, is_causal, scale, layout)
        extra = also() if also is not None else None
    except (TypeError, ValueError) as err:
        error = err                            # raised after the exchange, so that no other rank waits
    rows = _exchange(group, _summary(q, k, group, causal, scale_, layout, error is not None))
    rank = dist.get_rank(group)
    if error is not None:
        raise error
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:
        raise ValueError(f"rank(s) {refused} of the group refused their inputs (see the error raised there); "
                         f"rank {rank}'s were fine, and no rank can go on without the others")
    for i, field in enumerate(FIELDS[1:], start=1):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_show(field, x)}" for r, x in enumerate(values))
            what = ("every rank's shard must have the same length (cut the sequence with "
                    "flashattn.distributed.shard)" if field == "S_local" else
                    f"every rank must pass the same {field}")
            raise ValueError(f"{what}; got {shown}")
    return causal, scale_, extra
