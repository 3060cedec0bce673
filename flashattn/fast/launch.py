"""Launching a compiled kernel again without redoing Triton's per-call bookkeeping.

Every ``kernel[grid](*args, **kwargs)`` call of a Triton JIT function binds each argument and
specialises it (a tensor by dtype and 16-byte alignment; an int by whether it is 1, divisible
by 16, or wider than 32 bits), turns that into a cache key, looks the compiled kernel up, checks
the globals it read, and only then calls the kernel's launcher. For the forward's 35 arguments
that bookkeeping is about two thirds of the 35 us a launch costs on an H100's host (triton 3.6),
and a forward + backward launches four kernels: at S = 1k the host took longer to launch the
forward than the GPU took to run it (notebook 06, section 4).

A training loop calls the same kernel with arguments of the same kinds over and over.
:class:`DirectLaunch` does Triton's work the first time it meets a kind of arguments, keeps the
compiled kernel, and from then on calls its launcher itself, as PyTorch's inductor does for the
kernels it generates. The kind (:meth:`DirectLaunch.kind`) holds everything Triton specialises
on: every specialised int's value, the 32/64-bit class of the ``do_not_specialize`` ones, the
floats' type (Triton passes any float as fp32), each tensor's dtype and alignment, and the
current device. Two calls of one kind compile to the
same kernel, so the direct call runs exactly what ``kernel[grid]`` would have. (Settings Triton
reads when it compiles, such as ``TRITON_DEBUG``, are those of a kind's first launch.)

The plain launch is kept where the direct one does not apply: Triton's interpreter, a launch hook
(a profiler such as proton reads the launch's metadata), a pre-run hook, ``FLASHATTN_DIRECT_LAUNCH=0``
(read at import; :func:`set_direct` at run time), or a Triton whose compiled kernels do not look as
this module expects (then it turns itself off, once, and says so in a warning).
"""
from __future__ import annotations

import operator
import warnings

import torch
from triton import knobs
from triton.runtime import driver

from .. import runtime, settings

#: Environment variable: ``FLASHATTN_DIRECT_LAUNCH=0`` launches every kernel through ``kernel[grid]``
#: (``settings.direct_launch``).
DIRECT_ENV = "FLASHATTN_DIRECT_LAUNCH"
_proven = False     # a direct launch has succeeded: this Triton's launchers take what we pass
#: Functions called as ``observe(launch, grid, args)`` at every ``DirectLaunch`` call, before it
#: launches (the exercise checkers count a backward's kernel launches with one).
OBSERVERS: list = []
#: Kinds of arguments remembered per kernel variant before the memory is cleared (a model fed
#: ever new shapes must not grow it without bound; a new kind only costs one plain launch).
MAX_KINDS = 256


def set_direct(enabled: bool) -> None:
    """Launch through the kept compiled kernels (True) or always through ``kernel[grid]`` (False)."""
    settings.set_values(direct_launch=bool(enabled))


def runtime_names(kernel) -> tuple[str, ...]:
    """A jitted kernel's parameters that are passed at launch (not ``tl.constexpr``), in order."""
    names = getattr(kernel, "_flashattn_runtime_names", None)
    if names is None:
        import inspect

        fn = getattr(kernel, "fn", kernel)
        names = tuple(p.name for p in inspect.signature(fn).parameters.values()
                      if "constexpr" not in str(p.annotation))
        kernel._flashattn_runtime_names = names
    return names


def arguments(kernel, **values) -> tuple:
    """The positional arguments of a launch of ``kernel``, given by name: a launcher names what
    it passes (``Q=q, S_k=S_k, ...``) and a missing or unknown name is an error here, not a
    silently shifted argument. (A plan, ``plans.py``, replays the tuple without this cost.)"""
    names = runtime_names(kernel)
    if len(values) != len(names) or values.keys() != set(names):
        missing = [n for n in names if n not in values]
        unknown = [n for n in values if n not in names]
        raise TypeError(f"{getattr(kernel, '__name__', kernel)}: missing {missing}, unknown {unknown}")
    return tuple(map(values.__getitem__, names))


def strides(name: str, values) -> dict:
    """``strides("q", (sb, sh, ss, sd))`` -> ``{"stride_q_b": sb, "stride_q_h": sh, ...}``: the
    kernels name a tensor's strides by its batch, head, sequence and head-dim axes, in that order."""
    return {f"stride_{name}_{axis}": value for axis, value in zip("bhsd", values)}


def _picker(positions):
    """``args -> tuple(args[i] for i in positions)``, done in C by ``operator.itemgetter``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def int_class(x: int) -> int:
    """Triton's type for an integer it does not specialise: 0 i32, 1 i64, 2 u64."""
    return 0 if -0x80000000 <= x <= 0x7FFFFFFF else 1 if x < 2 ** 63 else 2


def _hooks_idle() -> bool:
    """No launch hook set: triton 3.6 keeps ``None``, newer ones an empty ``HookChain``."""
    hooks = knobs.runtime
    for hook in (hooks.launch_enter_hook, hooks.launch_exit_hook,
                 getattr(hooks, "add_stages_inspection_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class DirectLaunch:
    """One variant of a jitted kernel -- its constexprs and launch options (``kwargs``) fixed --
    launched on positional ``args`` whose types per position do not change from call to call
    (tensors stay tensors, ints stay ints)."""

    def __init__(self, raw, kwargs: dict):
        self.raw, self.kwargs = raw, dict(kwargs)
        self.compiled: dict = {}      # kind -> (launcher, function, packed metadata, constexpr values)
        self.kernels: dict = {}       # kind -> Triton's compiled kernel (its signature: ``native.py`` reads it)
        self._pick = None             # (tensors, specialised ints, unspecialised ints, floats) pickers: first call

    def _positions(self, args) -> None:
        params = self.raw.params
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        floats = [i for i, a in enumerate(args) if isinstance(a, float)]    # never specialised: their type only
        ints = [i for i in range(len(args)) if i not in tensors and i not in floats]
        loose = [i for i in ints if params[i].do_not_specialize]
        exact = [i for i in ints if not params[i].do_not_specialize]
        self._pick = (_picker(tensors), _picker(exact), _picker(loose), _picker(floats))

    def kind(self, args, device: int) -> tuple:
        """What Triton specialises these arguments on, as a dict key."""
        if self._pick is None:
            self._positions(args)
        tensors, exact, loose, floats = self._pick
        return (device, exact(args), tuple(map(int_class, loose(args))), tuple(map(type, floats(args))),
                tuple([(t.dtype, not t.data_ptr() & 15) for t in tensors(args)]))

    def __call__(self, grid: tuple, args: tuple) -> None:
        if OBSERVERS:
            for observe in OBSERVERS:
                observe(self, grid, args)
        if not (settings.current.direct_launch and _hooks_idle()) or runtime.INTERPRET or getattr(self.raw, "pre_run_hooks", None):
            self.raw[grid](*args, **self.kwargs)
            return
        device = driver.active.get_current_device()
        kind = self.kind(args, device)
        entry = self.compiled.get(kind)
        if entry is None:                       # Triton binds, specialises and compiles (or finds) it
            compiled = self.raw[grid](*args, **self.kwargs)
            self._keep(kind, compiled, args)
            return
        launcher, function, metadata, constexprs = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        call = (grid[0], g1, g2, driver.active.get_current_stream(device), function, metadata, None,
                knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args, *constexprs)
        if _proven:
            launcher(*call)   # what JITFunction.run passes, less the launch metadata (no hook reads it)
        else:
            self._first(launcher, call, grid, args)

    def _first(self, launcher, call, grid, args) -> None:
        """The first direct launch in this process: a launcher that refuses the arguments (a Triton
        that passes them otherwise) refuses before launching anything, so the plain launch can
        take over."""
        global _proven
        try:
            launcher(*call)
        except TypeError as err:
            _off(err)
            self.raw[grid](*args, **self.kwargs)
            return
        _proven = True

    def _keep(self, kind, compiled, args) -> None:
        if hasattr(compiled, "result"):         # a future (AsyncCompileMode): keep nothing
            return
        try:
            launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
            names = self.raw.arg_names
            bound = self.raw.signature.bind(*args, **{k: v for k, v in self.kwargs.items() if k in names})
            bound.apply_defaults()
            constexprs = tuple(bound.arguments.values())[len(args):]
        except (AttributeError, TypeError) as err:
            _off(err)
            return
        if len(self.compiled) >= MAX_KINDS:
            self.compiled.clear()
            self.kernels.clear()
        self.compiled[kind] = (launcher, function, metadata, constexprs)
        self.kernels[kind] = compiled


def _off(err: Exception) -> None:
    settings.set_values(direct_launch=False)
    warnings.warn(f"flashattn: this Triton's compiled kernels do not take a direct launch as expected ({err}); "
                  f"every kernel is launched through kernel[grid] from now on", RuntimeWarning, stacklevel=3)
