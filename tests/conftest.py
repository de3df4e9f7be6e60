"""Tiny random Hugging Face models of each supported family (no downloads)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# Triton kernels run on CPU through the interpreter (read when kernels are decorated, so before
# dejavu_compile is imported). A GPU run sets TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiled on a GPU, each kernel runs one config instead of an autotuning sweep (see
# kernels/triton_common.py): the tests check results, not speed.
os.environ.setdefault("DEJAVU_QUICK_TUNE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402

VOCAB = 96


@contextlib.contextmanager
def deterministic_algorithms():
    """PyTorch's deterministic mode (warnings only: cuBLAS and the like would otherwise refuse
    without their own settings) while the block runs, then as before: the sparse kernels keep
    each program's partial sums apart instead of adding them with atomics in no fixed order,
    so the same call gives the same bits every run."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _build(name: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)
    if name == "opt":
        cfg = tf.OPTConfig(ffn_dim=96, word_embed_proj_dim=64, **common)
        cls = tf.OPTForCausalLM
    elif name == "llama":
        cfg = tf.LlamaConfig(intermediate_size=96, num_key_value_heads=2, **common)
        cls = tf.LlamaForCausalLM
    elif name == "mistral":
        cfg = tf.MistralConfig(intermediate_size=96, num_key_value_heads=2, sliding_window=None,
                               **common)
        cls = tf.MistralForCausalLM
    elif name == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=96, num_key_value_heads=2, **common)
        cls = tf.Qwen2ForCausalLM
    elif name == "gemma3":
        cfg = tf.Gemma3TextConfig(intermediate_size=96, num_key_value_heads=1, head_dim=16,
                                  sliding_window=8, **common)
        cls = tf.Gemma3ForCausalLM
    else:
        raise KeyError(name)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # Random init leaves biases at zero; make them count so a dropped bias shows.
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.05)
    return model


ARCHS = ("opt", "llama", "mistral", "qwen2", "gemma3")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def tiny():
    return _build


def prompt(batch: int = 1, length: int = 7, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


def load_example(path: Path):
    """The example at ``path``, imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_outside_interpreter(code: str, *args: str, cwd: Path, timeout: int = 600,
                                unset: tuple[str, ...] = ()) -> str:
    """The output of the script ``code`` (with ``args``) run in a fresh Python without
    ``TRITON_INTERPRET`` (nor the variables ``unset``), so that it can compile Triton kernels
    for a GPU target (Triton's own ptxas, no GPU needed); a failure is the test's, with the
    script's error."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *unset)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
