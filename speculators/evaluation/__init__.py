"""Measuring drafters by real speculative generation.

``runner`` (:func:`speculators.evaluation.runner.run_eval`: every pass, its rows and the report), ``settings`` (what
an eval decodes with, and the key of each pass), ``loading`` (the checkpoint, its target and the prompts),
``acceptance`` (tau and the acceptance counts), ``greedy_check`` (greedy losslessness and near-tie classification),
``trees`` and ``static_tree`` (draft-tree rows, acceptance per depth and rank, the best static tree),
``forward_cost`` / ``costs`` / ``cost_model`` (the target's measured forward costs and the predicted tokens/s), and
``report`` / ``report_types`` / ``plots`` (the typed report and its renderings).
"""
