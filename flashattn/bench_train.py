"""``python -m flashattn.bench --train``: whole training steps, not kernels, eager and compiled.

A practitioner's measure is the step of a model: the attention kernels, but also every launch,
allocation and autograd node around them. Two block stacks, each trained for a few steps with
bf16 autocast and fused AdamW, with their attention swapped between providers, in turn in one
process (the same GPU state, the same noise):

    gpt2   GPT-2-small-like: d 768, 12 heads of 64, 6 layers, GELU MLP, LayerNorm, B8 S1024
    llama  Llama-like: d 2048, 16 query heads of 128, 4 K/V heads (GQA), 4 layers, SwiGLU,
           RMSNorm, rotary positions, B2 S4096

    providers  flashattn           flashattn.scaled_dot_product_attention (the drop-in)
               torch-sdpa         torch's SDPA, its default backend choice
               torch-sdpa-cudnn   torch's SDPA, cuDNN forced
               torch-sdpa-flash   torch's SDPA, FlashAttention-2 forced

Each (model, mode) is warmed up (compiles excluded), then every provider runs ``steps`` steps per
round, providers in turn, for ``rounds`` rounds; a row keeps the median step time of the rounds
(each round's beside it). Rows: ``{model, mode, provider, step_ms, tokens_per_s, rounds_ms}``.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    name: str
    d_model: int
    heads: int
    kv_heads: int
    layers: int
    batch: int
    seq: int
    vocab: int
    llama: bool            # SwiGLU + RMSNorm + rotary; else GELU + LayerNorm + learned positions


MODELS = {
    "gpt2": ModelShape("gpt2", 768, 12, 12, 6, 8, 1024, 50304, llama=False),
    "llama": ModelShape("llama", 2048, 16, 4, 4, 2, 4096, 32000, llama=True),
}
#: tiny twins, for a run anywhere (the CPU included): the machinery, not the numbers
QUICK = {name: ModelShape(name, 64, 4, 2 if m.llama else 4, 2, 2, 64, 256, m.llama) for name, m in MODELS.items()}
PROVIDERS = ("flashattn", "torch-sdpa", "torch-sdpa-cudnn", "torch-sdpa-flash")
MODES = ("eager", "compiled")


# --------------------------------------------------------------------------------------
# attention providers: (q, k, v) [B, H, S, D] -> out, causal
# --------------------------------------------------------------------------------------
def attention_provider(name: str) -> Callable:
    from .api import scaled_dot_product_attention

    if name == "flashattn":
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=q.shape[1] != k.shape[1])
    backends = {"torch-sdpa": None, "torch-sdpa-cudnn": "CUDNN_ATTENTION", "torch-sdpa-flash": "FLASH_ATTENTION"}
    if name not in backends:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    if backends[name] is None:
        return sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backends[name])

    def forced(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v)

    return forced


# --------------------------------------------------------------------------------------
# the models
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on [B, H, S, D]: each pair (x1, x2) of the halves turned by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Block(nn.Module):
    def __init__(self, m: ModelShape, attend: Callable):
        super().__init__()
        self.m, self.attend, self.head_dim = m, attend, m.d_model // m.heads
        norm = RMSNorm if m.llama else nn.LayerNorm
        self.norm1, self.norm2 = norm(m.d_model), norm(m.d_model)
        self.qkv = nn.Linear(m.d_model, (m.heads + 2 * m.kv_heads) * self.head_dim, bias=not m.llama)
        self.proj = nn.Linear(m.d_model, m.d_model, bias=not m.llama)
        hidden = 4 * m.d_model if not m.llama else 8 * m.d_model // 3 // 64 * 64
        self.up = nn.Linear(m.d_model, hidden * (2 if m.llama else 1), bias=not m.llama)
        self.down = nn.Linear(hidden, m.d_model, bias=not m.llama)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        m, D = self.m, self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([m.heads * D, m.kv_heads * D, m.kv_heads * D], dim=-1)
        q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))     # [B, H, S, D] views
        if m.llama:
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, S, m.d_model)
        x = x + self.proj(y)
        h = self.up(self.norm2(x))
        if m.llama:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, m: ModelShape, attend: Callable):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(m.vocab, m.d_model)
        self.pos = None if m.llama else nn.Parameter(torch.zeros(m.seq, m.d_model))
        self.blocks = nn.ModuleList(Block(m, attend) for _ in range(m.layers))
        self.norm = RMSNorm(m.d_model) if m.llama else nn.LayerNorm(m.d_model)
        self.head = nn.Linear(m.d_model, m.vocab, bias=False)
        D = m.d_model // m.heads
        angles = torch.arange(m.seq)[:, None] * (10000.0 ** (-torch.arange(0, D, 2) / D))[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


# --------------------------------------------------------------------------------------
# steps and timing
# --------------------------------------------------------------------------------------
def make_step(m: ModelShape, provider: str, mode: str, device) -> Callable[[], None]:
    """A closure running one training step (forward, backward, AdamW) of model ``m`` with
    ``provider``'s attention. Compiled: static shapes (``dynamic=False``: a second model or
    provider must not turn the graphs dynamic), one graph per provider."""
    torch.manual_seed(0)
    model = Stack(m, attention_provider(provider)).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    run = torch.compile(model, dynamic=False) if mode == "compiled" else model
    tokens = torch.randint(0, m.vocab, (m.batch, m.seq), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" \
        else contextlib.nullcontext()

    def step():
        with autocast:
            loss = run(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: words in the name of every attention kernel of the providers: flashattn's (``fast_fwd_kernel``,
#: ``fast_dq_kernel``, ``fast_dkdv_kernel``, ``attn_bwd_delta_kernel``, the Gluon ``hopper_fwd_kernel``),
#: cuDNN's (``..._sdpa_...``) and FlashAttention-2's (``flash_fwd_...``, ``flash_bwd_...``)
ATTENTION_KERNEL_WORDS = ("fast_fwd", "fast_dq", "fast_dkdv", "attn_bwd", "hopper_fwd", "sdpa", "flash_fwd",
                          "flash_bwd", "fmha", "attention")


def gpu_breakdown(step: Callable[[], None], steps: int = 3) -> dict:
    """GPU time per step, from torch's profiler over ``steps`` steps: all kernels and copies
    (``gpu_ms``) and attention's kernels (``attention_gpu_ms``, by ``ATTENTION_KERNEL_WORDS``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = attention = 0.0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        us = event.time_range.elapsed_us()
        total += us
        if any(word in event.name.lower() for word in ATTENTION_KERNEL_WORDS):
            attention += us
    return dict(gpu_ms=round(total / steps / 1e3, 3), attention_gpu_ms=round(attention / steps / 1e3, 3))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(models=("gpt2", "llama"), modes=MODES, providers=PROVIDERS, steps: int = 20, rounds: int = 3,
        warmup: int = 5, quick: bool = False, device=None, progress: bool = True) -> list[dict]:
    """One row per (model, mode, provider); a provider that fails (a backend that refuses the
    shape) gets its error instead of a time."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = QUICK if quick else MODELS
    if device.type == "cuda" and "flashattn" in providers:
        from .fast import native

        native.wait()       # the C++ autograd node built (or loaded) before any step is timed
    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(models) * len(modes) * len(providers) * (rounds + 1), desc="train steps", unit="run")
    for model_name in models:
        m = shapes[model_name]
        for mode in modes:
            if mode == "compiled":                 # each group compiles afresh: nothing cached from
                torch._dynamo.reset()               # the last group, no recompile limit reached
            stepper, errors = {}, {}
            for p in providers:          # build and warm every provider first (compiles excluded)
                try:
                    stepper[p] = make_step(m, p, mode, device)
                    for _ in range(warmup):
                        stepper[p]()
                    _sync(device)
                except Exception as e:  # noqa: BLE001 -- recorded in the row
                    errors[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    stepper.pop(p, None)
                if bar is not None:
                    bar.update(1)
            times = {p: [] for p in stepper}
            for _ in range(rounds):
                for p, step in list(stepper.items()):
                    try:
                        _sync(device)
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            step()
                        _sync(device)
                        times[p].append((time.perf_counter() - t0) / steps * 1e3)
                    except Exception as e:  # noqa: BLE001 -- recorded in the row
                        errors[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        stepper.pop(p)
                    if bar is not None:
                        bar.update(1)
            breakdown = {}
            if device.type == "cuda":      # where each provider's step time goes (untimed steps)
                for p, step in stepper.items():
                    try:
                        breakdown[p] = gpu_breakdown(step)
                    except Exception:   # noqa: BLE001 -- a profiler that cannot run: the times stand alone
                        pass
            tokens = m.batch * m.seq
            for p in providers:
                row = dict(model=model_name, mode=mode, provider=p, shape=asdict(m))
                if p in errors:
                    row.update(step_ms=None, error=errors[p])
                else:
                    ms = statistics.median(times[p])
                    row.update(step_ms=round(ms, 3), tokens_per_s=round(tokens / ms * 1e3),
                               rounds_ms=[round(t, 3) for t in times[p]])
                    if p in breakdown:
                        row.update(breakdown[p], host_gap_ms=round(ms - breakdown[p]["gpu_ms"], 3))
                rows.append(row)
            del stepper
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':<7}{'mode':<10}{'provider':<18}{'step ms':>9}{'flashattn speed':>17}"
             f"{'GPU ms':>9}{'attention':>11}{'GPU idle':>10}"]
    base = {(r["model"], r["mode"]): r["step_ms"] for r in rows if r["provider"] == "torch-sdpa"}
    for r in rows:
        if r["step_ms"] is None:
            lines.append(f"{r['model']:<7}{r['mode']:<10}{r['provider']:<18}{'--':>9}  {r['error']}")
            continue
        ratio = ""
        if r["provider"] == "flashattn" and base.get((r["model"], r["mode"])):
            ratio = f"{base[(r['model'], r['mode'])] / r['step_ms']:.2f}x torch's"
        gpu = (f"{r['gpu_ms']:>9.2f}{r['attention_gpu_ms']:>11.2f}{r['host_gap_ms']:>10.2f}"
               if "gpu_ms" in r else "")
        lines.append(f"{r['model']:<7}{r['mode']:<10}{r['provider']:<18}{r['step_ms']:>9.2f}{ratio:>17}{gpu}")
    return "\n".join(lines)


def speedups(rows: list[dict], against: str = "torch-sdpa") -> dict:
    """{(model, mode): flashattn's speed over ``against`` (> 1: flashattn's step is faster)}."""
    times = {(r["model"], r["mode"], r["provider"]): r["step_ms"] for r in rows}
    out = {}
    for (model, mode, provider), ms in times.items():
        other = times.get((model, mode, against))
        if provider == "flashattn" and ms and other:
            out[(model, mode)] = other / ms
    return out


def plot(rows: list[dict], ax=None, title: Optional[str] = None):
    """Grouped bars: step time per (model, mode), one bar per provider."""
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["mode"]) for r in rows}, key=lambda g: (g[0], MODES.index(g[1])))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    ax = ax or plt.subplots(figsize=(8, 3.8))[1]
    width = 0.8 / max(1, len(provs))
    times = {(r["model"], r["mode"], r["provider"]): r["step_ms"] for r in rows}
    for i, p in enumerate(provs):
        xs = [g + i * width for g in range(len(groups))]
        ys = [times.get((m, mo, p)) or math.nan for m, mo in groups]
        ax.bar(xs, ys, width, label=p)
    ax.set_xticks([g + width * (len(provs) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{mo}" for m, mo in groups])
    ax.set_ylabel("ms per training step (lower is better)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
