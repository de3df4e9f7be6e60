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

import importlib
import pkgutil
from typing import Any

import triton
from triton.runtime.autotuner import Autotuner


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


def tuned() -> dict[str, list[dict[str, Any]]]:
    """The config each autotuned kernel chose so far, per tuning key (kernels that have not
    tuned are left out: one with a single config, as under the interpreter, never tunes)."""
    return {name: [{"key": [_plain(k) for k in key], "config": config_data(config)}
                   for key, config in tuner.cache.items()]
            for name, tuner in sorted(autotuners().items()) if tuner.cache}


def seed(data: dict[str, list[dict[str, Any]]]) -> int:
    """Put recorded choices (``tuned()``'s form) into the autotuners' caches, so those keys run
    their recorded config without tuning; returns how many keys were seeded. A kernel this
    build does not have, or a config that is not among a kernel's candidates now (its configs
    changed since the record, or quick tuning or the interpreter is on), is an error naming it:
    nothing is seeded then."""
    tuners = autotuners()
    if not isinstance(data, dict):
        raise ValueError(f"tuned configs must be a mapping of kernel to entries, got "
                         f"{type(data).__name__}")
    plan: list[tuple[Autotuner, tuple, triton.Config]] = []
    for name, entries in data.items():
        if name not in tuners:
            raise ValueError(f"tuned configs name kernel {name!r}, which this build does not "
                             f"autotune; known: {sorted(tuners)}")
        tuner = tuners[name]
        for entry in entries:
            try:
                key, want = tuple(entry["key"]), entry["config"]
            except (KeyError, TypeError) as e:
                raise ValueError(f"tuned configs of {name!r}: each entry needs 'key' and "
                                 f"'config', got {entry!r}") from e
            match = [c for c in tuner.configs if config_data(c) == want]
            if not match:
                raise ValueError(f"tuned configs of {name!r}: {want} is not among the "
                                 f"kernel's {len(tuner.configs)} candidate configs (changed "
                                 f"since it was recorded, or quick tuning or the interpreter "
                                 f"is on)")
            plan.append((tuner, key, match[0]))
    for tuner, key, config in plan:
        tuner.cache[key] = config
    return len(plan)
