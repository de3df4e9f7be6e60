"""Sparse ops of dejavu-compile: ``torch.ops.dejavu.*`` with their references and kernels."""

from . import ops, reference

__all__ = ["ops", "reference"]
