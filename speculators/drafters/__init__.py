"""Drafter families. Importing this package registers every family (one file each)."""

from .base import DraftVocab, Drafter, DrafterConfig, Proposal, registry  # noqa: F401
from . import eagle, eagle3, medusa, mtp  # noqa: F401  (each registers itself)
