"""Drafter families. Importing this package registers every family: each module of this package other
than the shared infrastructure below is one family that registers itself (``@register``), so adding a
family is adding its file (plus its recipes); no list to edit."""

import importlib
import pkgutil

from .base import Drafter, DrafterConfig
from .registry import registry
from .serving_format import ServingFormat

__all__ = ["Drafter", "DrafterConfig", "ServingFormat", "registry"]

# shared infrastructure, not families
INFRASTRUCTURE = frozenset({"anchors", "base", "checkpoint", "dflash_format", "dflash_tree", "eagle3_format", "joint",
                            "layers", "parity_inputs", "registry", "serving_format", "training_state",
                            "tree_drafting"})

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in INFRASTRUCTURE and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
