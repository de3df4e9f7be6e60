"""Graph passes of dejavu-compile, run in ``PIPELINE`` order on each Dynamo graph.

Each pass is ``run(gm, ctx) -> gm``: it reads and writes only the graph and the ``PassContext``.
"""

from . import discover, lookahead, lower, sparsify
from .context import PassContext

PIPELINE = (
    ("discover", discover.run),
    ("sparsify", sparsify.run),
    ("lookahead", lookahead.run),
    ("lower", lower.run),
)

__all__ = ["PIPELINE", "PassContext"]
