"""The data layer: sources, chat rendering, regeneration, features, batches and the draft vocabulary.

Nothing here imports ``speculators.drafters`` or the recipe's ``Recipe``: the pipeline's functions take
the recipe's data spec (:class:`speculators.recipe.DataSpec`) and plain values.
"""

from .vocab import DraftVocab

__all__ = ["DraftVocab"]
