"""What the checkers raise inside a case, for the mistakes to read: an output of the wrong type,
shape or dtype, a gradient that came back None, a backward without kernels, tensors kept on ctx,
and the exercise's placeholder still raising."""
from __future__ import annotations


class ShapeError(Exception):
    """An output of the wrong type or shape. ``idea``: what it means, where the place that
    raises already knows (the shape mistake then tells it instead of a generic one)."""

    def __init__(self, message: str = "", idea: str = ""):
        super().__init__(message)
        self.idea = idea


class DtypeError(ShapeError):
    """An output of the wrong dtype."""


class NoGradient(ShapeError):
    """A gradient that came back None for an input that requires grad."""


class NoBackwardKernel(Exception):
    """An autograd.Function whose backward launched no Triton kernel (PyTorch's own autograd on a
    materialised softmax, say): right values, not the lesson's kernels."""


class CtxTensors(Exception):
    """An autograd.Function whose forward kept tensors as ctx attributes (``names``), not with
    ctx.save_for_backward."""

    def __init__(self, names: list):
        super().__init__(f"forward kept {', '.join('ctx.' + n for n in names)} as ctx attributes, "
                         f"not with ctx.save_for_backward")
        self.names = names


class Unwritten(NotImplementedError):
    """The exercise's placeholder still raising: the code is not written yet (unlike a
    NotImplementedError that PyTorch raises for an operation it lacks)."""
