"""Drafter families. Importing this package registers every family: each module of this package other
than the shared infrastructure below is one family that registers itself (``@register``), so adding a
family is adding its file (plus its recipes); no list to edit."""

import importlib
import pkgutil

from ..data.vocab import DraftVocab  # noqa: F401  (lives in the data layer; re-exported for users)
from .base import Drafter, DrafterConfig, Proposal  # noqa: F401
from .registry import registry  # noqa: F401
from .serving_format import ServingFormat  # noqa: F401

# shared infrastructure, not families
INFRASTRUCTURE = frozenset({"anchors", "base", "checkpoint", "dflash_tree", "joint", "layers",
                            "parity_inputs", "registry", "serving_format", "training_state", "tree_drafting"})

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in INFRASTRUCTURE and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
