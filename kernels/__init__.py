"""Sparse ops of dejavu-compile: ``torch.ops.dejavu.*`` with their references and kernels.

The ops' default implementation is the PyTorch reference; for CUDA tensors the Triton kernels
(where Triton is installed) and the GPU selector are registered instead: the dispatcher lowers
each op by device.
"""

from . import ops, predictor, reference

try:
    import triton  # noqa: F401
except ImportError:  # CPU-only installs run the reference everywhere
    HAVE_TRITON = False
else:
    HAVE_TRITON = True
    from . import heads, sparse_mlp

    ops.sparse_mlp.register_kernel("cuda")(sparse_mlp.sparse_mlp)
    ops.sparse_head_proj.register_kernel("cuda")(heads.sparse_head_proj)
    ops.sparse_head_out.register_kernel("cuda")(heads.sparse_head_out)
ops.select_predictor.register_kernel("cuda")(predictor.select_predictor)

__all__ = ["HAVE_TRITON", "ops", "reference"]
