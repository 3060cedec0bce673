"""Drawing random attention problems, and making their inputs.

A problem is a small record (:class:`Problem`) drawn from ``(seed, index)`` alone, so one line
names it and ``python -m flashattn.fuzz --seed S --problem I`` rebuilds it exactly. Sizes lean on
the edges where kernels break: lengths of 1, odd lengths, multiples of 64 and 128 and one either
side of them; head dims from 8 to 256; GQA ratios; every dtype the family takes.

Inputs never sit alone in memory: each tensor is a view into a larger buffer whose other
elements are NaN (a gap between rows, heads or head-dim elements, and a margin before and after
the whole tensor), so a kernel that reads one element too far, or with another tensor's stride,
reads a NaN and fails loudly.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional

import torch

#: every kernel family the battery draws for (``families.py`` runs each)
FAMILIES = ("lesson", "fast", "fp32", "window", "dropout", "varlen", "lazy", "sdpa", "cuda")
#: how an input tensor lies in memory (all views of [B, H, S, D])
LAYOUTS = ("contiguous", "bshd", "sbhd", "every_other_d", "head_slice", "row_gap")
#: dO may also be a stride-0 expansion (the gradient of out.sum(), of out.mean())
DO_LAYOUTS = LAYOUTS + ("stride0",)
#: margin of NaN before and after every input, in elements (keeps 16-byte alignment for any dtype)
MARGIN = 64


@dataclasses.dataclass(frozen=True)
class Problem:
    """One randomized attention problem. ``index`` and ``seed`` rebuild it (and its tensors)."""

    seed: int
    index: int
    family: str
    dtype: str                       # "float16", "bfloat16", "float32", "float64"
    B: int
    H: int
    H_kv: int
    S_q: int
    S_k: int
    D: int
    causal: bool = False
    window: Optional[tuple] = None   # (left, right), -1 = no limit on that side
    dropout_p: float = 0.0
    seqlens: Optional[tuple] = None  # varlen: ((q lengths), (k lengths))
    W: int = 0                       # lazy: the bias window
    layouts: tuple = ("contiguous",) * 4  # q, k, v, dO
    logit_scale: float = 1.0         # q is multiplied by this: large logits
    scale: Optional[float] = None    # the softmax scale (None: 1/sqrt(D))
    pool: Optional[tuple] = None     # the families it was drawn among, where not all of them
    variant: str = ""                # which path of the family: "teaching" / "fast" kernels, "deterministic",
                                     # the drop-in's rank ("rank3".."rank5", "+autocast")
    on_gpu: bool = False             # drawn at a GPU's sizes (the CPU interpreter's are smaller)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        """The problem in one line (the reproducer prints it beside the command)."""
        parts = [self.family + (f"[{self.variant}]" if self.variant else ""), self.dtype, f"B{self.B}",
                 f"H{self.H}/{self.H_kv}",
                 f"S_q={self.S_q}", f"S_k={self.S_k}", f"D={self.D}"]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p}")
        if self.seqlens is not None:
            parts.append(f"seqlens_q={list(self.seqlens[0])} seqlens_k={list(self.seqlens[1])}")
        if self.family == "lazy":
            parts.append(f"W={self.W}")
        if self.logit_scale != 1.0:
            parts.append(f"logits x{self.logit_scale:g}")
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        names = ("q", "k", "v", "dO")
        odd = [f"{n}:{lay}" for n, lay in zip(names, self.layouts) if lay != "contiguous"]
        if odd:
            parts.append(" ".join(odd))
        return " ".join(parts)

    def reproducer(self) -> str:
        among = f" --families {','.join(self.pool)}" if self.pool else ""
        sizes = f" --sizes {'gpu' if self.on_gpu else 'cpu'}"
        return f"python -m flashattn.fuzz --seed {self.seed} --problem {self.index}{among}{sizes}   # {self.describe()}"

    def work(self) -> int:
        """Score elements of the problem (B * H * S_q * S_k): what the float64 reference costs."""
        if self.seqlens is not None:
            return self.H * sum(a * b for a, b in zip(*self.seqlens))
        return self.B * self.H * self.S_q * self.S_k


# --------------------------------------------------------------------------------------
# drawing
# --------------------------------------------------------------------------------------
def _length(rng: random.Random, longest: int) -> int:
    """A sequence length in 1..longest, the edges weighted: 1, multiples of 64 and 128 and one
    off either side, odd lengths, and the rest spread evenly on a log scale."""
    pick = rng.random()
    if pick < 0.08:
        return 1
    if pick < 0.40 and longest >= 63:
        unit = rng.choice((64, 128)) if longest >= 129 else 64
        base = unit * rng.randint(1, max(1, longest // unit))
        return max(1, min(longest, base + rng.choice((-1, 0, 0, 1))))
    n = int(round(math.exp(rng.uniform(0.0, math.log(longest)))))
    if pick < 0.70:
        n |= 1                                        # odd
    return max(1, min(longest, n))


def _head_dim(rng: random.Random, largest: int) -> int:
    if rng.random() < 0.5:
        return min(largest, rng.choice((64, 128) if largest >= 128 else (16, 32)))
    return 8 * rng.randint(1, largest // 8)


def _dtype(rng: random.Random, family: str, on_gpu: bool) -> str:
    if family in ("fp32", "cuda"):
        return "float32"
    if not on_gpu:                                    # the interpreter: no bf16 products
        return rng.choice(("float16", "float32", "float32"))
    return rng.choice(("float16", "bfloat16", "bfloat16", "float32") if family != "fast"
                      else ("float16", "bfloat16"))


def _layouts(rng: random.Random) -> tuple:
    if rng.random() < 0.4:
        return ("contiguous",) * 3 + (rng.choice(("contiguous", "stride0")),)
    return tuple(rng.choice(LAYOUTS) for _ in range(3)) + (rng.choice(DO_LAYOUTS),)


def draw(seed: int, index: int, *, on_gpu: bool, families=FAMILIES) -> Problem:
    """Problem ``index`` of the battery seeded ``seed``: the same on every machine of the same
    kind (``on_gpu`` sets the sizes: the CPU interpreter runs programs one after another)."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"families must be among {', '.join(FAMILIES)}, got {', '.join(unknown) or 'none'}")
    families = tuple(f for f in FAMILIES if f in families)      # the order given does not matter
    rng = random.Random(seed * 1_000_003 + index)
    family = rng.choice(families)
    # On a GPU one problem in five may reach ~9,000 keys; the rest stay under 1,024, where most
    # edges live and a problem costs milliseconds, not seconds (the float64 oracle is per head).
    longest = (9000 if rng.random() < 0.2 else 1024) if on_gpu else 80
    largest_d = 256 if on_gpu else 48
    if family == "cuda":
        largest_d = 128
    dtype = _dtype(rng, family, on_gpu)
    H_kv = rng.choice((1, 1, 2, 3))
    group = rng.choice((1, 1, 2, 4)) if family not in ("lazy",) else 1
    H, B = H_kv * group, rng.choice((1, 1, 2, 3))
    S_q, S_k = _length(rng, longest), _length(rng, longest)
    if rng.random() < 0.3:
        S_k = S_q
    D = _head_dim(rng, largest_d)
    pool = None if families == FAMILIES else families
    fields = dict(seed=seed, index=index, pool=pool, on_gpu=on_gpu, family=family, dtype=dtype, B=B, H=H, H_kv=H_kv,
                  S_q=S_q, S_k=S_k, D=D, causal=rng.random() < 0.5, layouts=_layouts(rng),
                  logit_scale=rng.choice((1.0, 1.0, 1.0, 4.0, 12.0)),
                  scale=rng.choice((None, None, None, 0.3, 1.0)))
    if family == "window":
        fields["window"] = (rng.choice((-1, 0, 1, 7, 63, rng.randint(0, S_k))),
                            rng.choice((-1, 0, 0, 5, rng.randint(0, S_k))))
    elif family == "dropout":
        fields["dropout_p"] = rng.choice((0.1, 0.1, 0.3, 0.6))
        if rng.random() < 0.3:
            fields["window"] = (rng.randint(0, S_k), rng.choice((-1, 0, 3)))
    elif family == "varlen":
        n = rng.randint(1, 4)
        fields["B"] = 1
        lens_q = tuple(_length(rng, max(1, longest // n)) for _ in range(n))
        lens_k = lens_q if rng.random() < 0.5 else tuple(_length(rng, max(1, longest // n)) for _ in range(n))
        fields["seqlens"] = (lens_q, lens_k)
        fields["S_q"], fields["S_k"] = max(lens_q), max(lens_k)
        if rng.random() < 0.3:
            fields["window"] = (rng.randint(0, 64), rng.choice((-1, 0)))
        if rng.random() < 0.2:
            fields["dropout_p"] = 0.2
        packed = rng.choice(("bshd", "bshd", "contiguous"))     # [total, H, D], or head-major
        fields["layouts"] = (packed,) * 3 + (rng.choice((packed, "stride0")),)
    elif family == "lazy":
        fields.update(S_k=S_q, causal=True, W=rng.choice((0, 1, 6, 40, 300)), scale=None,
                      logit_scale=rng.choice((1.0, 1.0, 4.0)))
    elif family == "sdpa":      # the drop-in: leading dims and enable_gqa, as a model calls it
        fields["layouts"] = fields["layouts"][:3] + (rng.choice(("contiguous", "stride0", "bshd")),)
    fields["variant"] = _variant(rng, family, fields, on_gpu)
    problem = Problem(**fields)
    return _fit(problem, on_gpu)


def _variant(rng: random.Random, family: str, fields: dict, on_gpu: bool) -> str:
    """Which path of the family the problem takes (part of its description)."""
    if family == "fp32":
        return rng.choice(("default", "deterministic"))
    if family in ("window", "dropout", "varlen"):
        return rng.choice(("teaching", "fast"))
    if family == "sdpa":
        rank = rng.choice((3, 4, 5)) if fields["B"] == 1 else rng.choice((4, 5))
        autocast = on_gpu and fields["dtype"] == "float32" and rng.random() < 0.3
        return f"rank{rank}" + ("+autocast" if autocast else "")
    return ""


def _fit(problem: Problem, on_gpu: bool) -> Problem:
    """Shrink the batch, then the heads, then the longer length (halved, keeping its oddness)
    until the float64 reference is affordable."""
    budget = (3 * 2 ** 27 if on_gpu else 2 ** 14) // (4 if problem.family == "lazy" else 1)
    p = problem
    while p.work() > budget and p.B > 1:
        p = dataclasses.replace(p, B=p.B - 1)
    while p.work() > budget and p.H > p.H_kv:
        p = dataclasses.replace(p, H=p.H - p.H_kv)
    while p.work() > budget and p.seqlens is None and max(p.S_q, p.S_k) > 1:
        def half(n):
            return max(1, (n // 2) | (n & 1))
        if p.family == "lazy":
            p = dataclasses.replace(p, S_q=half(p.S_q), S_k=half(p.S_q))
        elif p.S_q >= p.S_k:
            p = dataclasses.replace(p, S_q=half(p.S_q))
        else:
            p = dataclasses.replace(p, S_k=half(p.S_k))
    return p


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------
def _nan_buffer(numel: int, dtype, device) -> torch.Tensor:
    return torch.full((numel + 2 * MARGIN,), float("nan"), dtype=dtype, device=device)


def place(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` [B, H, S, D] copied into a view laid out as ``layout``, inside NaN."""
    B, H, S, D = values.shape
    dtype, device = values.dtype, values.device
    if layout == "stride0":
        return values.reshape(-1)[:1].reshape(()).expand(B, H, S, D)
    shapes = {                       # the buffer's shape, and how to view it as [B, H, S, D]
        "contiguous": ((B, H, S, D), lambda t: t),
        "bshd": ((B, S, H, D), lambda t: t.transpose(1, 2)),
        "sbhd": ((S, B, H, D), lambda t: t.permute(1, 2, 0, 3)),
        "every_other_d": ((B, H, S, 2 * D), lambda t: t[..., ::2]),
        "head_slice": ((B, H + 2, S, D), lambda t: t[:, 1:H + 1]),
        "row_gap": ((B, H, S + 3, D), lambda t: t[:, :, 1:S + 1]),
    }
    shape, view = shapes[layout]
    buffer = _nan_buffer(math.prod(shape), dtype, device)
    out = view(buffer[MARGIN:MARGIN + math.prod(shape)].view(shape))
    out.copy_(values)
    return out


def make_inputs(p: Problem, device) -> dict:
    """q, k, v, dO (and bias, tau for lazy attention) for problem ``p``, from its own generator."""
    gen = torch.Generator().manual_seed(p.seed * 1_000_003 + p.index)
    dtype = p.torch_dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    if p.seqlens is not None:        # packed: [1, H, total, D] views of [total, H, D] tensors
        total_q, total_k = sum(p.seqlens[0]), sum(p.seqlens[1])
        shapes = ((1, p.H, total_q, p.D), (1, p.H_kv, total_k, p.D), (1, p.H_kv, total_k, p.D),
                  (1, p.H, total_q, p.D))
    else:
        shapes = ((p.B, p.H, p.S_q, p.D), (p.B, p.H_kv, p.S_k, p.D), (p.B, p.H_kv, p.S_k, p.D),
                  (p.B, p.H, p.S_q, p.D))
    values = [randn(*s) for s in shapes]
    values[0] = values[0] * p.logit_scale
    tensors = {name: place(x.to(device=device, dtype=dtype), layout)
               for name, x, layout in zip(("q", "k", "v", "do"), values, p.layouts)}
    if p.family == "lazy":
        tensors["bias"] = (0.5 * randn(p.H, p.W + 1)).to(device)
        tensors["tau"] = (torch.rand(p.H, generator=gen) * 1.6 - 0.8).to(device)
    return tensors
