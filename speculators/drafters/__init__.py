"""Drafter families. Importing this package registers every family (one file each)."""

from ..data.vocab import DraftVocab  # noqa: F401  (lives in the data layer; re-exported for users)
from .base import Drafter, DrafterConfig, Proposal, registry  # noqa: F401
from . import dflash, eagle, eagle3, medusa, mtp, peagle  # noqa: F401  (each registers itself)
