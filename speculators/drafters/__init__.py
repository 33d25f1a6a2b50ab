"""Drafter families. Importing this package registers every family (one file each)."""

from .base import DraftVocab, Drafter, DrafterConfig, Proposal, registry  # noqa: F401
from . import eagle3  # noqa: F401  (registers "eagle3")
