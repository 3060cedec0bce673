"""Launch plans: the host's work of one call done once per kind of call, then replayed.

A training loop calls attention with inputs of the same shapes, strides and dtype at every step.
Each call of the plain path still redoes the same host work: the tile lookup, the constexpr dict,
the argument tuples with every stride, the autograd-independent checks, one ``DirectLaunch.kind``
per launch. On an H200 that was ~40 us of Python for the forward and ~160 us for the backward at
B8 H12 S256 (``results/host_profile_h200.md``), where the GPU needs ~47 us for both.

A plan is recorded from one call of the plain path (fp16/bf16; no window, dropout or packed
batches; no tile given): for each kernel it launched, the compiled kernel's launcher, the grid,
and its arguments as a template (which input or which freshly allocated output each tensor
argument is; everything else a constant); the fresh outputs' shapes and dtypes; which of them the
call returns. The next call of the same *signature* (every tensor's shape, strides, dtype and
16-byte alignment, the scalars, the current device and settings) allocates the outputs and calls
the launchers: what ``kernel[grid](...)`` would run, launched as ``DirectLaunch`` launches it.

A plan is only recorded when every launch of the call was a direct launch of a kernel already
compiled for those arguments, and only used while nothing watches launches (a launch hook, the
checkers' ``launch.OBSERVERS``), outputs are not guarded or poisoned (``runtime.guarded_outputs``,
``FLASHATTN_POISON``) and direct launches are on: otherwise the call takes the plain path.
``FLASHATTN_PLANS=0`` (``settings.plans``) turns plans off.
"""
from __future__ import annotations

import threading

import torch
from triton import knobs
from triton.runtime import driver

from .. import runtime, settings
from . import launch

#: the dtypes plans are made for (fp32's products depend on torch's TF32 switch, read per call)
HALF = (torch.float16, torch.bfloat16)
#: plans kept before the memory is cleared (a model fed ever new shapes must not grow it unbounded)
MAX_PLANS = 512
_plans: dict = {}
_launches = threading.local()     # launches started by the plain path, per thread (``count_launch``)


def count_launch() -> None:
    """Called by the plain path at every launch of a fast kernel (``tuning.run``, the delta's):
    a recording compares it with the direct launches it saw, so a launch that went through
    ``kernel[grid]`` (a first compile, the autotuner) leaves no incomplete plan."""
    _launches.n = getattr(_launches, "n", 0) + 1


def covers(q, config, warmup: bool, layout, window_args, dropout_p) -> bool:
    """Is this a call plans are made for: fp16/bf16, the default tile, not a warm-up, and none of
    lesson 09's features (packed batches, a window, dropout)? (The launchers' own arguments.)"""
    return (config is None and not warmup and layout is None and not window_args[0] and not dropout_p
            and q.dtype in HALF)


def enabled() -> bool:
    """May a plan be used (or recorded) now?"""
    return (not runtime.INTERPRET and runtime._guarded is None and not runtime._poison
            and not launch.OBSERVERS and settings.current.plans and settings.current.direct_launch and launch._proven
            and launch._hooks_idle())


def signature(tensors, scalars) -> tuple:
    """What a plan depends on: the current device (Triton launches there), every tensor's shape,
    strides, dtype, device and alignment, the call's scalars, and which inputs are one tensor
    (``f(x, x, x)`` records one slot where ``f(q, k, v)`` needs three)."""
    ids = [id(t) for t in tensors]
    same = tuple(map(ids.index, ids)) if len(set(ids)) < len(ids) else None
    return (driver.active.get_current_device(), scalars, same,
            *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors])


def find(key):
    """The plan recorded for ``key`` under the current settings, or None."""
    plan = _plans.get(key)
    if plan is None or plan.settings is settings.current:
        return plan
    # an ``override`` block entered again makes a new, equal object, and FLASHATTN_NATIVE changes no
    # kernel: such settings still fit, and the plan takes them on so that the next call finds them
    # by identity (comparing field by field costs a few microseconds a call)
    if settings.same_kernels(plan.settings, settings.current):
        plan.settings = settings.current
        return plan
    return None


def replay_or_record(key, inputs, call, allocator=None):
    """The plan kept for ``key`` replayed on ``inputs``; else ``call()`` through the plain path,
    recording one (``record``)."""
    plan = find(key)
    if plan is not None:
        return plan(inputs)
    return record(key, inputs, call, allocator)


class Plan:
    """The recorded launches of one call; ``plan(inputs)`` replays them and returns the outputs."""

    __slots__ = ("settings", "device", "current", "fresh", "launches", "returns", "allocator", "kernels")

    def __init__(self, settings_, device, current, fresh, launches, returns, allocator, kernels=()):
        self.settings, self.device, self.current, self.fresh = settings_, device, current, fresh
        self.launches, self.returns, self.allocator = launches, returns, allocator
        self.kernels = kernels     # Triton's compiled kernel per launch (None if unknown): ``native.py`` reads them

    def __call__(self, inputs) -> tuple:
        slots = list(inputs)
        for shape, dtype in self.fresh:
            slots.append(torch.empty(shape, dtype=dtype, device=self.device))
        if self.allocator is not None:       # tensor descriptors need Triton's scratch allocator
            self.allocator()                 # set in the launching thread (``tuning.ensure_allocator``)
        head = (driver.active.get_current_stream(self.current),)    # the current device's, as a launch uses
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        for launcher, grid, function, metadata, constants, tensor_slots, constexprs in self.launches:
            args = list(constants)
            for position, slot in tensor_slots:
                args[position] = slots[slot]
            launcher(*grid, *head, function, metadata, None, enter, leave, *args, *constexprs)
        return tuple(None if slot is None else slots[slot] for slot in self.returns)


def record(key, inputs, call, allocator=None):
    """``call()`` through the plain path, keeping a plan for ``key`` if every launch it made was a
    direct launch of an already compiled kernel. Returns what ``call`` returned."""
    seen = []
    me = threading.get_ident()

    def observe(direct, grid, args):      # called before the launch: is its kernel already kept?
        if threading.get_ident() == me:
            kind = direct.kind(args, driver.active.get_current_device())
            entry = None if getattr(getattr(direct, "raw", None), "pre_run_hooks", None) else direct.compiled.get(kind)
            kernel = getattr(direct, "kernels", {}).get(kind)
            seen.append((entry, tuple(grid), args, kernel))     # (None: a plain launch, which a replay cannot be)

    before = getattr(_launches, "n", 0)
    launch.OBSERVERS.append(observe)
    try:
        result = call()
    finally:
        launch.OBSERVERS.remove(observe)
    if getattr(_launches, "n", 0) - before != len(seen) or not seen:
        return result
    plan = _plan_of(seen, inputs, result, allocator)
    if plan is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return result


def _plan_of(seen, inputs, result, allocator):
    slot_of = {id(t): i for i, t in enumerate(inputs)}
    fresh, device = [], inputs[0].device
    launches, kernels = [], []
    for entry, grid, args, kernel in seen:
        if entry is None:                       # launched through kernel[grid] (a first compile): nothing to replay
            return None
        launcher, function, metadata, constexprs = entry
        constants, tensor_slots = list(args), []
        for position, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            slot = slot_of.get(id(a))
            # An output this call allocated: allocated again per call, with torch.empty -- so a call
            # whose launches need a zeroed buffer (the fused backward's dQ accumulator) is never
            # planned (fast_attention_backward plans the two kernels only).
            if slot is None:
                if not a.is_contiguous() or a.storage_offset() or a.device != device:
                    return None
                slot = slot_of[id(a)] = len(inputs) + len(fresh)
                fresh.append((tuple(a.shape), a.dtype))
            constants[position] = None
            tensor_slots.append((position, slot))
        g = tuple(grid) + (1,) * (3 - len(grid))
        launches.append((launcher, g, function, metadata, tuple(constants), tuple(tensor_slots), constexprs))
        kernels.append(kernel)
    returns = []
    for t in result:
        if t is None:
            returns.append(None)
        elif id(t) in slot_of and slot_of[id(t)] >= len(inputs):
            returns.append(slot_of[id(t)])
        else:                                   # a result the launches did not write (a cast, a view)
            return None
    return Plan(settings.current, device, driver.active.get_current_device(), tuple(fresh), tuple(launches),
                tuple(returns), allocator, tuple(kernels))
