"""The autotuners' choices as plain data, and back.

``tuned()`` gives, for every autotuned kernel of this package, the config it chose for each
tuning key so far in this process; ``seed(data)`` puts such data back into the autotuners'
caches, so a later process runs the same tiles without tuning them again. ``dejavu bench``
writes the first into its JSON (``tuned``) and takes the second from ``--tuned FILE``: two runs
can then be compared on the same tiles, and a run skips the minutes that tuning takes.

Data: ``{kernel: [{"key": [...], "config": {"kwargs": {...}, "num_warps": w, "num_stages": s,
"num_ctas": c, "maxnreg": m}}, ...]}``, kernels named ``module.function`` (for example
``sparse_mlp._up_kernel``), keys as Triton builds them (the tuning arguments' values, then the
tensors' dtypes).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import triton
from triton.runtime.autotuner import Autotuner

from .triton_common import INTERPRET, QUICK_TUNE


def autotuners() -> dict[str, Autotuner]:
    """Every autotuned kernel of this package, by ``module.function``."""
    package = importlib.import_module(__package__)
    out: dict[str, Autotuner] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{__package__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, Autotuner):
                out[f"{info.name}.{name}"] = obj
    return out


def config_data(config: triton.Config) -> dict[str, Any]:
    """A config as plain data: its meta-parameters and launch options."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
            "num_stages": config.num_stages, "num_ctas": config.num_ctas,
            "maxnreg": config.maxnreg}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def plain_key(key: tuple) -> list:
    """A tuning key as plain data (dtypes as their names), as ``tuned()`` and the shipped
    files write it."""
    return [_plain(k) for k in key]


def tuned() -> dict[str, list[dict[str, Any]]]:
    """The config each autotuned kernel chose so far, per tuning key (kernels that have not
    tuned are left out: one with a single config, as under the interpreter, never tunes)."""
    return {name: [{"key": plain_key(key), "config": config_data(config)}
                   for key, config in tuner.cache.items()]
            for name, tuner in sorted(autotuners().items()) if tuner.cache}


def _check_mapping(data: Any) -> None:
    """Refuse data that is not ``tuned()``'s mapping of kernel to entries."""
    if not isinstance(data, dict):
        raise ValueError(f"tuned configs must be a mapping of kernel to entries, got "
                         f"{type(data).__name__}")


def _entry(name: str, entry: Any) -> tuple[Any, Any]:
    """The key and config of one of kernel ``name``'s entries, or an error naming it."""
    try:
        return entry["key"], entry["config"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"tuned configs of {name!r}: each entry needs 'key' and 'config', "
                         f"got {entry!r}") from e


def seed(data: dict[str, list[dict[str, Any]]], keep: bool = False) -> int:
    """Put recorded choices (``tuned()``'s form) into the autotuners' caches, so those keys run
    their recorded config without tuning; with ``keep`` a key already in a cache keeps its
    config. Returns how many keys were seeded. A kernel this
    build does not have, or a config that is not among a kernel's candidates now (its configs
    changed since the record, or quick tuning or the interpreter is on), is an error naming it:
    nothing is seeded then."""
    tuners = autotuners()
    _check_mapping(data)
    plan: list[tuple[Autotuner, tuple, triton.Config]] = []
    for name, entries in data.items():
        if name not in tuners:
            raise ValueError(f"tuned configs name kernel {name!r}, which this build does not "
                             f"autotune; known: {sorted(tuners)}")
        tuner = tuners[name]
        for entry in entries:
            key, want = _entry(name, entry)
            key = tuple(key)
            match = [c for c in tuner.configs if config_data(c) == want]
            if not match:
                raise ValueError(f"tuned configs of {name!r}: {want} is not among the "
                                 f"kernel's {len(tuner.configs)} candidate configs (changed "
                                 f"since it was recorded, or quick tuning or the interpreter "
                                 f"is on)")
            plan.append((tuner, key, match[0]))
    if keep:
        plan = [(tuner, key, config) for tuner, key, config in plan if key not in tuner.cache]
    for tuner, key, config in plan:
        tuner.cache[key] = config
    return len(plan)


@contextlib.contextmanager
def pinned(name: str, config: triton.Config):
    """Kernel ``name`` (``module.function``) runs ``config`` for every key while the block runs:
    its candidates are cut to that one, so it neither tunes nor reads its earlier choices. Its
    candidates and choices are back afterwards (choices made inside are dropped). For timing
    each candidate in the setting that matters, as ``examples/tile_study.py`` does."""
    tuners = autotuners()
    if name not in tuners:
        raise ValueError(f"no autotuned kernel {name!r}; known: {sorted(tuners)}")
    tuner = tuners[name]
    configs, cache = tuner.configs, dict(tuner.cache)
    tuner.configs = [config]
    tuner.cache.clear()
    try:
        yield tuner
    finally:
        tuner.configs = configs
        tuner.cache.clear()
        tuner.cache.update(cache)


# Configs measured on a GPU and shipped with the package, one file per GPU model, in the form
# ``dejavu bench`` writes (``{"about": ..., "tuned": {kernel: [entries]}}``). The autotuner
# times each candidate alone, one call after an L2 flush; inside a decode step, beside the
# side stream's predictors, its choice can be far from the fastest: on an H200 the OPT-13B down
# projection at MLP density 0.1 took 1366 us a step with the tile it chose (16 rows x 128
# columns, no loop) and 564 us with 16 x 512 in loops of 4 (BENCHMARKS.md, nineteenth
# session, two calls). A file holds such in-step choices for the shapes it names; other keys
# still tune.
SHIPPED_DIR = Path(__file__).with_name("tuned")
_SHIPPED: dict[str, int | None] = {}  # GPU name -> keys seeded from its file, None: no file


def shipped_path(gpu: str) -> Path:
    """The file of shipped configs for a GPU named ``gpu`` (``torch.cuda.get_device_name``):
    ``NVIDIA H200`` reads ``kernels/tuned/NVIDIA_H200.json``."""
    return SHIPPED_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_") + ".json")


def load_shipped(gpu: str) -> dict[str, list[dict[str, Any]]]:
    """The shipped configs for ``gpu`` (``tuned()``'s form), empty when none are shipped."""
    path = shipped_path(gpu)
    return _read_shipped(path)["tuned"] if path.is_file() else {}


def _read_shipped(path: Path) -> dict[str, Any]:
    """A shipped file whole (``about`` and ``tuned``), its ``tuned`` checked to be a mapping."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tuned"), dict):
        raise ValueError(f"{path}: shipped kernel configs need a 'tuned' mapping of kernel to "
                         f"entries")
    return data


def ship(gpu: str, data: dict[str, list[dict[str, Any]]], path: Path | None = None) -> list[str]:
    """Write ``data``'s entries (``tuned()``'s form: a study's or a bench run's ``tuned``) into
    the file shipped for ``gpu`` (``path``, by default ``shipped_path(gpu)`` of this package;
    another path must have that file's name, so that one GPU's configs cannot land in another
    GPU's file): an entry whose kernel and key the file has replaces that
    config, any other is added. The file's ``about`` is kept as it is: say there where the new
    entries were measured. Returns a line per entry replaced or added (none for one already
    shipped). The file must exist: a new GPU's file starts with its ``about`` written by hand.
    Whether each config is among its kernel's candidates is checked where it is seeded (and by
    ``tests/test_bench.py``), not here."""
    if path is None:
        path = shipped_path(gpu)
    elif Path(path).name != shipped_path(gpu).name:
        raise ValueError(f"{path} is not the shipped file of {gpu!r}: that file is named "
                         f"{shipped_path(gpu).name}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no shipped configs for {gpu!r} at {path}: write its 'about' first")
    _check_mapping(data)
    whole = _read_shipped(path)
    changes = []
    for name, entries in data.items():
        have = whole["tuned"].setdefault(name, [])
        for entry in entries:
            key, config = _entry(name, entry)
            old = next((e for e in have if e["key"] == key), None)
            if old is None:
                have.append({"key": key, "config": config})
                changes.append(f"{name} {key}: added {config['kwargs']}")
            elif old["config"] != config:
                changes.append(f"{name} {key}: {old['config']['kwargs']} -> {config['kwargs']}")
                old["config"] = config
    path.write_text(json.dumps(whole, indent=1) + "\n")
    return changes


def seed_shipped(gpu: str) -> int:
    """Seed the autotuners with the configs shipped for ``gpu``, once per process and GPU
    model; a key already chosen (tuned, or seeded by ``dejavu bench --tuned``) keeps its
    config. Nothing under the interpreter or quick tuning, whose kernels have one config each.
    Returns the keys seeded by this call."""
    if gpu in _SHIPPED or INTERPRET or QUICK_TUNE:
        return 0
    data = load_shipped(gpu)
    count = seed(data, keep=True) if data else 0
    _SHIPPED[gpu] = count if data else None
    return count


def shipped() -> dict[str, dict[str, Any]]:
    """Per GPU name with a shipped file, the file read in this process and the keys it
    seeded."""
    return {gpu: {"path": str(shipped_path(gpu)), "keys": count}
            for gpu, count in _SHIPPED.items() if count is not None}
