"""Retrieval as an admissibility test for KV selection (second paper, section 5.1): a passkey
hidden at several depths of filler text, and a multi-key variant (four archives with their
codes, one asked for). A KV policy is admissible where it answers what dense decoding answers.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEW_TOKENS = 10
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
ARCHIVES = ("Amber", "Birch", "Cedar", "Delta")
TASKS = ("passkey", "multikey")


@dataclass
class Trial:
    task: str
    context: int  # prompt tokens
    depth: float
    answer: str
    ids: torch.Tensor


def _haystack(loaded, tokens: int, needles: list[tuple[float, str]], head: str, tail: str):
    """``head`` + filler of about ``tokens`` tokens with each needle at its depth + ``tail``."""
    unit = len(loaded.encode(FILLER)[0]) - (1 if loaded.bos else 0)
    fixed = len(loaded.encode(head + tail + " ".join(n for _, n in needles))[0])
    if tokens < fixed + unit:
        raise ValueError(f"a context of {tokens} tokens is shorter than the trial's text and one "
                         f"line of filler ({fixed + unit} tokens)")
    units = (tokens - fixed) // unit
    slots = {}
    for depth, needle in needles:
        slots.setdefault(round(depth * units), []).append(needle)
    parts = [head]
    for i in range(units + 1):
        parts += [n + " " for n in slots.get(i, [])]
        if i < units:
            parts.append(FILLER)
    parts.append(tail)
    return loaded.encode("".join(parts))


def passkey(loaded, tokens: int, depth: float, seed: int = 0) -> Trial:
    code = str(random.Random(seed).randint(100000, 999999))
    head = ("There is important information hidden inside a lot of irrelevant text. Find it "
            "and memorize it. I will quiz you about it.\n")
    needle = f"The pass key is {code}. Remember it. {code} is the pass key."
    tail = "\nWhat is the pass key? The pass key is"
    return Trial("passkey", tokens, depth, code, _haystack(loaded, tokens, [(depth, needle)],
                                                           head, tail))


def multikey(loaded, tokens: int, depth: float, seed: int = 0) -> Trial:
    rng = random.Random(seed)
    codes = {name: str(rng.randint(100000, 999999)) for name in ARCHIVES}
    asked = ARCHIVES[seed % len(ARCHIVES)]
    others = [d for d in DEPTHS if d != depth]
    rng.shuffle(others)
    needles = [(depth, f"The code for archive {asked} is {codes[asked]}.")]
    needles += [(others[i], f"The code for archive {name} is {codes[name]}.")
                for i, name in enumerate(n for n in ARCHIVES if n != asked)]
    head = ("Several archives and their codes are mentioned in the text below. Remember "
            "them.\n")
    tail = f"\nWhat is the code for archive {asked}? The code for archive {asked} is"
    return Trial("multikey", tokens, depth, codes[asked],
                 _haystack(loaded, tokens, needles, head, tail))


def answer_of(loaded, new_tokens: torch.Tensor) -> str:
    """The first run of digits in the generated text ('' if none)."""
    text = loaded.tokenizer.decode(new_tokens[0], skip_special_tokens=True)
    match = re.search(r"\d+", text)
    return match.group(0) if match else ""


def run(loaded, contexts: list[int], keep: float,
        policies=("dense", "scored", "shared", "window"),
        tasks=TASKS, depths=DEPTHS, decode=None, progress: bool = False) -> list[dict]:
    """One row per (task, context, depth, policy): the answer and whether it is right. The
    policies of a trial share one prefill; each selects from its own copy of the cache."""
    from tqdm import tqdm

    from . import kv

    rows = []
    trials = [(task, n, d) for task in tasks for n in contexts for d in depths]
    for task, n, depth in tqdm(trials, desc="retrieval", disable=not progress, leave=False):
        trial = (passkey if task == "passkey" else multikey)(loaded, n, depth,
                                                            seed=int(depth * 100) + n)
        decoded = kv.generate_policies(loaded.model, trial.ids, NEW_TOKENS, policies, keep,
                                       decode)
        for policy, (new, sel) in decoded.items():
            got = answer_of(loaded, new)
            rows.append({"task": task, "context": n, "prompt_tokens": trial.ids.shape[1],
                         "depth": depth,
                         "policy": policy, "kept_tokens": sel.kept_tokens, "answer": got,
                         "expected": trial.answer, "correct": got == trial.answer})
    return rows


def summary(rows: list[dict]) -> str:
    """Per task, context and policy: right answers, and answers equal to dense decoding's."""
    dense = {(r["task"], r["context"], r["depth"]): r["answer"] for r in rows
             if r["policy"] == "dense"}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["context"], r["policy"]), []).append(r)
    lines = [f"{'task':<9} {'context':>7} {'policy':<7} {'kept':>6} {'right':>6} {'as dense':>8}"]
    for (task, n, policy), rs in groups.items():
        right = sum(r["correct"] for r in rs)
        same = sum(r["answer"] == dense.get((task, n, r["depth"])) for r in rs)
        lines.append(f"{task:<9} {n:>7} {policy:<7} {rs[0]['kept_tokens']:>6} "
                     f"{right:>3}/{len(rs):<2} {same:>5}/{len(rs):<2}")
    return "\n".join(lines)
