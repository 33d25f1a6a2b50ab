"""The target (verifier) model package; see :mod:`speculators.target.model`."""

from .model import *  # noqa: F401,F403
from .model import (_check_placement, _placement_device, distinct_layer_ids, gguf_cache_dir,  # noqa: F401
                    SMOLLM2_GGUF, SMOLLM2_HUB_ID)
