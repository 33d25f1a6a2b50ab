"""What one eval decodes: its settings (:class:`EvalSettings`) and the key of each decode pass (:class:`PassKey`).

:class:`EvalSettings` gathers what :func:`speculators.evaluation.runner.run_eval` decodes with (the K sweep,
sampling, methods, batch size, gate, trees, ...), checked once when it is built; ``speculators eval`` builds it
from the recipe's eval section (:meth:`EvalSettings.from_spec`). A :class:`PassKey` names one decode pass (a
method at one K and batch size, gated or not, chain or tree): the eval stores every pass's results under it and
labels the greedy check's mismatches with it, so no module rebuilds a string to find a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..decode.gating import ConfidenceGate, check_confidence_threshold
from ..decode.proposal import check_int
from ..errors import SpeculatorsError
from ..verify import SamplingParams

#: the proposers a report can compare (report keys and table labels, in report order)
METHODS = ("drafter", "drafter_argmax", "ngram", "suffix", "hybrid")
#: the default set (``drafter_argmax`` joins ``drafter`` by itself at temperature > 0)
DEFAULT_METHODS = ("drafter", "ngram", "suffix", "hybrid")
#: the rows that need a drafter
DRAFTER_METHODS = ("drafter", "drafter_argmax", "hybrid")


class PassKey(NamedTuple):
    """One decode pass of an eval: ``method`` (one of :data:`METHODS`, or ``"plain"``) at ``k`` drafts per step
    (a tree's depth) and ``batch_size``; ``gated``: under the confidence gate; ``tree``: the tree's label
    (:attr:`speculators.decode.tree_spec.TreeSpec.label`), None for chains."""

    method: str
    k: int
    batch_size: int
    gated: bool = False
    tree: str | None = None

    @property
    def label(self) -> str:
        """How reports name the pass's proposer (the greedy check's ``proposer``): ``drafter``, ``drafter
        (gated)``, ``drafter tree depth=3,topk=2,total_tokens=6``."""
        if self.tree is not None:
            return f"{self.method} tree {self.tree}"
        return f"{self.method} (gated)" if self.gated else self.method


@dataclass
class EvalSettings:
    """The settings of one :func:`speculators.evaluation.runner.run_eval` (checked in ``__post_init__``).

    Attributes:
        k: max drafts per step, an int or a list (the K sweep; each >= 1); :attr:`ks` is the sorted distinct list.
        max_new_tokens: cap on generated tokens per prompt (>= 1).
        sampling: :class:`speculators.verify.SamplingParams` of ONE request (None = greedy); its temperature /
            top-k / top-p apply to every prompt; prompt ``i`` draws from a fresh generator seeded ``seed + i``
            in every pass.
        batch_size: the loaded batch size (>= 1), measured beside batch 1.
        methods: the subset of :data:`METHODS` to run (``drafter_argmax`` joins ``drafter`` at temperature > 0).
        seed: seed of the per-prompt generators and of the bootstrap.
        eos_ids: explicit stop ids (None = the target's).
        ngram_max: the n-gram proposer's longest n-gram. hybrid_min_match / hybrid_drafter_k: the hybrid
            proposer's shortest suffix match and its drafter's K (None = K).
        bootstrap_resamples: resamples of tau's bootstrap CI.
        confidence_threshold / verify_cost: the confidence gate (:class:`speculators.decode.gating.ConfidenceGate`;
            both None = no gated rows).
        trees: :class:`speculators.decode.tree_spec.TreeSpec` s measured beside the chains.
        adjacent_costs: measure the target forwards right before every pass (the rows' ``pass_costs``).
    Raises:
        SpeculatorsError: a bad ``k``, ``max_new_tokens``, ``batch_size``, ``methods``, ``sampling`` or threshold,
            naming it.
    """

    k: int | list[int]
    max_new_tokens: int
    sampling: SamplingParams | None = None
    batch_size: int = 1
    methods: tuple[str, ...] = DEFAULT_METHODS
    seed: int = 0
    eos_ids: set[int] | None = None
    ngram_max: int = 3
    hybrid_min_match: int = 3
    hybrid_drafter_k: int | None = None
    bootstrap_resamples: int = 1000
    confidence_threshold: float | None = None
    verify_cost: list[float] | None = None
    trees: list = field(default_factory=list)
    adjacent_costs: bool = True
    #: derived in ``__post_init__``: the sorted distinct K values and the sampling values of ``sampling``
    ks: list[int] = field(init=False)
    temperature: float = field(init=False)
    top_k: int = field(init=False)
    top_p: float = field(init=False)

    def __post_init__(self):
        from ..losses import sampling_values

        ks = [self.k] if isinstance(self.k, int) and not isinstance(self.k, bool) else list(self.k)
        if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
            raise SpeculatorsError(f"k: expected an integer >= 1 or a non-empty list of them, got {self.k!r}")
        self.ks = sorted(dict.fromkeys(ks))
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("batch_size", self.batch_size, 1)
        self.temperature, self.top_k, self.top_p = sampling_values(self.sampling)
        methods = tuple(self.methods)
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise SpeculatorsError(f"methods: {bad or 'none given'}; allowed: {list(METHODS)}")
        if self.temperature > 0.0 and "drafter" in methods:  # both vLLM draft_sample_method conventions
            methods = (*methods, "drafter_argmax")
        self.methods = tuple(m for m in METHODS if m in methods)
        if self.confidence_threshold is not None:
            check_confidence_threshold(self.confidence_threshold)
        self.trees = list(dict.fromkeys(self.trees))  # two spellings of one spec are one tree

    @property
    def batch_sizes(self) -> list[int]:
        """Batch 1 and the loaded batch size, ascending."""
        return sorted({1, self.batch_size})

    def gate(self) -> ConfidenceGate | None:
        """The confidence gate of the drafter's gated rows, or None (no threshold nor cost, or no drafter row)."""
        if (self.confidence_threshold is not None or self.verify_cost is not None) and "drafter" in self.methods:
            return ConfidenceGate(self.confidence_threshold, self.verify_cost)
        return None

    @classmethod
    def from_spec(cls, spec, batch_size: int, *, methods: tuple[str, ...] | None = None, gated: bool = True,
                  verify_cost: list[float] | None = None) -> "EvalSettings":
        """The settings of a recipe's eval section (:class:`speculators.recipe.EvalSpec`) at ``batch_size``.

        ``methods``: a subset to run instead of the spec's; ``gated=False`` leaves the gate and the trees out
        (a compared checkpoint is measured on its chains, ungated); ``verify_cost``: the cost-aware gate's
        measured forward costs (:func:`speculators.evaluation.costs.gate_cost`).
        """
        from ..decode.tree_spec import TreeSpec

        return cls(spec.ks, spec.max_new_tokens, SamplingParams.uniform(1, spec.temperature, spec.top_k, spec.top_p),
                   batch_size=batch_size, methods=tuple(m for m in METHODS if m in (methods or spec.methods)),
                   seed=spec.seed, ngram_max=spec.ngram_max, hybrid_min_match=spec.hybrid_min_match,
                   hybrid_drafter_k=spec.hybrid_drafter_k,
                   confidence_threshold=spec.confidence_threshold if gated else None,
                   verify_cost=verify_cost if gated else None,
                   trees=[TreeSpec.parse(t, "eval.trees") for t in spec.trees or []] if gated else [])
