"""dejavu-compile: a torch.compile backend for contextual sparsity in LLM decoding.

    model = dejavu_compile.compile(model, profile="profiles/smollm2-135m.yaml")
    # or: torch.compile(model, backend="dejavu", options={"selector": "oracle", "mlp_density": 0.5})
    dejavu_compile.report(model)
"""

from dejavu_compile import kernels  # noqa: F401  (registers torch.ops.dejavu.*)

from .backend import compile, dejavu_backend, report, transform
from .capture import CapturedStep
from .config import DejavuOptions
from .inspection import export
from .profile import Profile, ProfileError, load_profile, save_profile

__all__ = [
    "CapturedStep",
    "DejavuOptions",
    "Profile",
    "ProfileError",
    "compile",
    "dejavu_backend",
    "export",
    "load_profile",
    "report",
    "save_profile",
    "transform",
]
