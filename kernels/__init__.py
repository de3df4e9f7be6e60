"""Sparse ops of dejavu-compile: ``torch.ops.dejavu.*`` with their references and kernels.

The ops' default implementation is the PyTorch reference; for CUDA tensors the Triton kernels
(where Triton is installed) and the GPU selector are registered instead: the dispatcher lowers
each op by device.
"""

# This folder is the package dejavu_compile.kernels. Imported under its own folder's name
# ("kernels", with the repository's root on sys.path, as under pytest), it would run a second
# copy of every module and register the torch.ops.dejavu ops again from that copy, splitting
# their state (the tuned configs, the graph cuts) between two modules. Transformers imports
# "kernels" when it looks for Hugging Face's package of that name, so under that name this
# stays empty (no version: transformers takes it for absent).
if __name__ != "kernels":
    from . import kv, lookahead, ops, predictor, reference

    try:
        import triton  # noqa: F401
    except ImportError:  # CPU-only installs run the reference everywhere
        HAVE_TRITON = False
        _mlp, _head_proj = reference.sparse_mlp, reference.sparse_head_proj
    else:
        HAVE_TRITON = True
        from . import decode_attention, dense, heads, lazy_kv, sparse_mlp

        _mlp, _head_proj = sparse_mlp.sparse_mlp, heads.sparse_head_proj
        ops.sparse_head_out.register_kernel("cuda")(heads.sparse_head_out)
        ops.sparse_mlp_gated.register_kernel("cuda")(sparse_mlp.sparse_mlp_gated)
        kv.decode_attention.register_kernel("cuda")(decode_attention.decode_attention)
        ops.gemv.register_kernel("cuda")(dense.gemv)
        ops.lazy_kv.register_kernel("cuda")(lookahead.waiting(lazy_kv.lazy_kv, 9))
        ops.lazy_qkv.register_kernel("cuda")(lookahead.waiting(lazy_kv.lazy_qkv, 11))
    # On CUDA the first sparse op of a block joins its lookahead predictor's side stream.
    ops.sparse_mlp.register_kernel("cuda")(lookahead.waiting(_mlp, 9, tells_ahead=HAVE_TRITON))

    @ops.sparse_mlp_norm.register_kernel("cuda")
    def _mlp_norm(x, idx, w1, b1, w_up, w2_t, b2, act, residual, norm_w, norm_b, eps,
                  union=False, keep=None, slot=-1, workspace=None, rms=False):
        lookahead.join(x.device, slot)
        norm = (residual, norm_w, norm_b, eps, rms)
        if not HAVE_TRITON:
            return reference.add_norm(_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union), *norm)
        return _mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union, workspace, ahead=slot >= 0,
                    norm=norm)

    if HAVE_TRITON:
        @ops.sparse_head_out_norm.register_kernel("cuda")
        def _head_out_norm(attn, idx, wo_t, b, head_dim, residual, norm_w, norm_b, eps,
                           union=False, workspace=None, early=False, rms=False):
            return heads.sparse_head_out(attn, idx, wo_t, b, head_dim, union, workspace, early,
                                         norm=(residual, norm_w, norm_b, eps, rms))

    ops.sparse_head_proj.register_kernel("cuda")(lookahead.waiting(_head_proj, 6))
    ops.select_predictor.register_kernel("cuda")(predictor.select_predictor)
    ops.select_hidden.register_kernel("cuda")(predictor.select_hidden)
    ops.predict_ahead.register_kernel("cuda")(lookahead.predict_ahead)

    __all__ = ["HAVE_TRITON", "kv", "ops", "reference"]
