"""EAGLE-3 (Li et al., arXiv 2503.01840): multi-layer feature fusion + training-time test (TTT).

Architecture (ALGORITHMS.md, FORMATS.md; weight names as vLLM's ``Eagle3LlamaForCausalLM`` loads):

* ``fc: Linear(n_aux*H -> H, bias=False)`` fuses the aux hidden states into ``g[t]`` (with
  ``norm_before_fc``, after an RMSNorm over the concatenated ``n_aux*H`` vector);
* layer 0 attends over ``concat(input_layernorm(embed(x_{t+1})), hidden_norm(g[t]))`` (2H): its
  q/k/v projections take 2H inputs and its residual is the hidden half; further layers (optional) are
  plain Llama decoder layers;
* final ``norm`` and an own ``lm_head: Linear(H -> N_draft)`` initialised from the target's lm_head
  rows of the draft vocabulary, trained unless ``train_lm_head: false`` (vllm-project/speculators
  freezes it); ``embed_tokens`` is copied from the target and frozen.

Indexing. The drafter input at index t is ``(g[t], x_{t+1})`` at position id ``t + 1``; it predicts
the target's distribution at position ``t + 1`` (over ``x_{t+2}``). TTT step j at index t takes the
token ``x_{t+1+j}`` (teacher forcing; or the step-(j-1) draft with ``ttt_input: draft``), the
output hidden state of step j-1 at the same index (pre-norm ``h``; ``norm(h)`` with ``norm_output``),
position id ``t + 1 + j``, and is trained against the target distribution at ``t + 1 + j``. Attention
at step j: causal over step-0 keys plus, for each earlier step, only the key at the same index (the
diagonal): exactly what the drafter sees at inference, where its KV cache holds real-feature entries
for the context followed by its own chain.

Eagle 3.1 (``norm_before_fc: true, norm_output: true``; vllm-project/speculators' training defaults
since 0.7, vLLM's ``norm_before_fc`` / ``norm_output`` config fields): the fc input is RMS-normalised
(SmolLM2's aux hidden states carry massive activations: position norms up to ~25000 against a median
of ~150-500), and the next draft step takes ``norm(h)``. ``norm_before_residual`` (vLLM's field of that
name, vllm-project/speculators' trainer default) starts layer 0's residual from ``hidden_norm(g)`` instead of
``g``. The defaults stay off so that checkpoints written before these fields load unchanged (50-step
SmolLM2 runs: ``norm_output`` helps, ``norm_before_fc`` and ``norm_before_residual`` slow early learning;
ALGORITHMS.md).

Inference is batched: :meth:`Eagle3Drafter.propose` runs ONE drafter forward per chain step
for all requests still drafting and :meth:`Eagle3Drafter.advance` ONE forward for all requests' verified
positions, over a padded :class:`~.layers.RaggedKV` gathered from the requests' own caches (each
request's :class:`Eagle3State` stays the source of truth, so requests may join and leave between
calls); :meth:`Eagle3Drafter._propose_one` / :meth:`Eagle3Drafter._advance_one` are the per-request
reference they equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..data.vocab import DraftVocab
from ..errors import SpeculatorsError
from ..losses import (
    chained_acceptance,
    combine_terms,
    hard_cross_entropy,
    sample_draft,
    target_to_draft,
)
from ..verify import SamplingParams
from ..decode.proposal import check_batch
from .base import Drafter, DrafterConfig
from ..decode.proposal import Proposal, request_sampling
from .checkpoint import TargetMeta
from .registry import register
from .eagle3_format import Eagle3Format
from .layers import (
    DecoderLayer,
    DraftVocabBuffers,
    FusedInputLayer,
    KVCache,
    RaggedKV,
    RMSNorm,
    Rotary,
    cached_attend,
    causal_mask_with_cache,
    layer_config,
    shift_left,
    ttt_attention,
)


class Eagle3Config(DrafterConfig):
    """``drafter:`` section of an EAGLE-3 recipe."""

    algorithm: Literal["eagle3"] = "eagle3"
    num_layers: int = Field(default=1, ge=1, le=8, description="decoder layers in the drafter")
    ttt_steps: int = Field(default=3, ge=1, le=8, description="training-time-test steps")
    ttt_decay: float = Field(default=0.8, gt=0.0, le=1.0, description="loss weight w^j of TTT step j")
    ttt_input: Literal["ground_truth", "draft"] = Field(
        default="ground_truth", description="token fed at TTT step j>0: teacher-forced or the drafter's argmax")
    loss: Literal["kl", "ce"] = Field(default="kl", description="kl: soft CE to the target distribution; ce: to its argmax")
    norm_before_fc: bool = Field(
        default=False, description="RMSNorm over the concatenated aux hidden states before fc (Eagle 3.1; tames "
                                   "the target's massive activations)")
    norm_output: bool = Field(
        default=False, description="feed the POST-norm output hidden state norm(h) to the next draft step (TTT "
                                   "step and inference chain alike; Eagle 3.1) instead of the pre-norm h")
    norm_before_residual: bool = Field(
        default=False, description="layer 0's residual stream starts from hidden_norm(hidden) instead of the raw "
                                   "fused hidden state (vLLM's and vllm-project/speculators' norm_before_residual; "
                                   "the latter's trainer default): the layer's output no longer drowns in the "
                                   "target's massive activations carried by g, nor in the fed-back h at TTT steps")
    train_lm_head: bool = Field(
        default=True, description="train the drafter's lm_head (initialised from the target's rows of the draft "
                                  "vocabulary); False keeps it frozen, as vllm-project/speculators does (fewer "
                                  "trainable weights, no lm_head weight gradient)")
    intermediate_size: int | None = Field(default=None, gt=0, description="MLP width; default: the target's")
    num_speculative_tokens: int = Field(default=4, ge=1, le=64, description="K written to the vLLM config")


@dataclass
class Eagle3State:
    """Per-request inference state: drafter KV cache, last output hidden state and logits."""

    cache: KVCache
    num_positions: int        # number of real-feature inputs in the cache (position ids 1..n)
    last_hidden: torch.Tensor  # [1, 1, H] output hidden state of the newest real-feature input, as fed to the
    #                            next step (pre-norm; post-norm with ``norm_output``, see Eagle3Drafter._head)
    last_logits: torch.Tensor  # [N_draft] logits predicting the next token


def _scatter_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], B: int, T: int) -> torch.Tensor:
    """``x [1, heads, n, hd]`` of the rows ``(b, t)`` -> ``[B, heads, T, hd]``, zeros on every other row."""
    dense = x.new_zeros(B, T, x.shape[1], x.shape[3]).index_put(rows, x[0].transpose(0, 1))
    return dense.permute(0, 2, 1, 3)


@register
class Eagle3Drafter(DraftVocabBuffers, Drafter):
    """EAGLE-3 drafter (see module docstring). Tensor shapes: ``B`` batch, ``T`` sequence, ``H`` hidden."""

    algorithm = "eagle3"
    config_class = Eagle3Config

    @property
    def distills(self) -> bool:
        """``loss: kl``: each TTT step's loss is a divergence to the target's distribution (``train.loss``)."""
        return self.cfg.loss == "kl"

    serving = Eagle3Format()

    def __init__(self, cfg: Eagle3Config, meta: TargetMeta, draft_vocab_size: int):
        super().__init__(cfg, meta)
        over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        self.layer_cfg = layer_config(self.meta.target_config, num_hidden_layers=cfg.num_layers, **over)
        H, V, n_aux = self.layer_cfg.hidden_size, self.meta.vocab_size, len(self.meta.aux_layer_ids)
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        # norm_before_fc: RMSNorm over the concatenated aux states, exported as ``input_norm.weight`` (vLLM's and
        # vllm-project/speculators' name; vLLM's ``fc_norm`` is another module, one norm per tap)
        self.input_norm = RMSNorm(n_aux * H, eps=self.layer_cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(n_aux * H, H, bias=False)
        self.layers = nn.ModuleList([FusedInputLayer(self.layer_cfg)] +
                                    [DecoderLayer(self.layer_cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, eps=self.layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        self.register_draft_vocab(draft_vocab_size, V)
        self.rotary = Rotary(self.layer_cfg)

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """The draft-vocabulary ``lm_head`` (:meth:`Drafter.output_heads`)."""
        return [self.lm_head]

    @classmethod
    def from_target(cls, cfg: Eagle3Config, target, vocab: DraftVocab) -> "Eagle3Drafter":
        """Fresh drafter: embedding copied (frozen), lm_head from the target's rows of the draft vocab."""
        d = cls(cfg, TargetMeta.from_target(target), vocab.size)
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        d.init_draft_vocab(target, vocab, [d.lm_head])
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: Eagle3Config, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> "Eagle3Drafter":
        """Empty module; the draft vocabulary size is ``lm_head.weight``'s row count.

        Raises:
            SpeculatorsError: the checkpoint has no ``lm_head.weight``.
        """
        return cls(cfg, meta, cls.serving.draft_vocab_size_of(weights))


    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., n_aux*H]`` aux hidden states -> ``[..., H]`` fused features g."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def _head(self, h: torch.Tensor,
              rows: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder-stack output ``h [..., H]`` -> ``(feed [..., H], logits [..., N] float32)``: the logits are
        ``lm_head(norm(h))``; ``feed`` is the hidden state the next draft step takes (TTT step j+1 in
        training, the next chain step at inference): ``h`` itself (pre-norm, EAGLE-3), or ``norm(h)`` with
        ``norm_output`` (Eagle 3.1, vllm-project/speculators' ``norm_output``). ``rows`` (index tensors into
        ``h``'s leading dims): the logits of those rows only, ``[n, N]``; ``feed`` still covers every row."""
        normed = self.norm(h) if rows is None or self.cfg.norm_output else None
        feed = normed if self.cfg.norm_output else h
        logits = self.lm_head(normed if rows is None else normed[rows] if normed is not None else self.norm(h[rows]))
        return feed, logits.float()

    def _run_layers(self, emb, hidden, cos, sin, attend) -> torch.Tensor:
        """Decoder stack; ``attend(layer_idx, attn_module, q, k, v) -> o [B, nh, T, hd]``. Layer 0's residual
        is ``hidden`` itself, or ``hidden_norm(hidden)`` with ``norm_before_residual``."""
        h = hidden
        for i, layer in enumerate(self.layers):
            # layer 0 with norm_before_residual: the residual is hidden_norm(hidden), as in vLLM's Eagle3 layer
            residual = layer.hidden_norm(h) if i == 0 and self.cfg.norm_before_residual else h
            x = layer.attn_input(emb, h) if i == 0 else layer.input_layernorm(h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            h = residual + layer.self_attn.out(attend(i, q, k, v))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    # ------------------------------------------------------------------ training
    counts_use_argmax = True  # a position counts only if the target's argmax is in the draft vocabulary
    #: the training loss computes steps >= 1 and every output head only on the rows a loss term or metric reads
    #: (False: every row everywhere, as ``ttt_input: draft`` must; the same loss and gradients, what the tests
    #: compare the selection with)
    labelled_rows_only = True

    def _label_masks(self, batch) -> list[torch.Tensor]:
        """``[B, T]`` bool per TTT step j: token ``t + 2 + j`` (the one step j drafts) is a real assistant
        token: the ``labelled`` masks of :func:`speculators.losses.chained_acceptance`."""
        lm = batch.loss_mask & batch.attention_mask
        return [shift_left(lm, 2 + j) for j in range(self.cfg.ttt_steps)]

    def _valid_masks(self, batch) -> list[torch.Tensor]:
        """``[B, T]`` bool per TTT step j: the step's label mask (:meth:`_label_masks`) and the target's
        argmax at ``t + 1 + j`` lies in the draft vocabulary (the LOSS's positions, used by :meth:`loss`
        and :meth:`loss_counts`; the metrics count out-of-vocabulary tokens as misses instead)."""
        in_vocab = self.t2d[batch.argmax.to(self.t2d.device)].to(batch.argmax.device)  # [B, T]
        return [lab & shift_left(in_vocab, 1 + j) for j, lab in enumerate(self._label_masks(batch))]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[ttt_steps]`` int64: valid positions of each TTT step's term (see :meth:`Drafter.loss_counts`)."""
        return torch.stack([v.sum() for v in self._valid_masks(batch)])

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """TTT loss: ``sum_j w^j * Loss_j``, Loss_j = soft CE (or CE) of step-j logits at t vs the
        target distribution at ``t + 1 + j`` restricted to the draft vocab, summed over valid positions
        and divided by ``norm[j]`` (default: their count, i.e. the mean; see :meth:`Drafter.loss`).

        Valid (t, j) for the loss: token ``t + 2 + j`` is a real assistant token and the target's argmax
        at ``t + 1 + j`` lies in the draft vocabulary (a label outside it cannot be learned).

        Returns:
            loss (scalar) and metrics ``loss_j`` (this batch's mean), ``full_acc_j, cond_acc_j, sim_tau``
            from :func:`speculators.losses.chained_acceptance`: step j's draft at t is correct when it
            equals the target's greedy token at ``t + 1 + j`` (target-id space, so a token outside the
            draft vocabulary is a miss), labelled when token ``t + 2 + j`` is a real assistant token.
        """
        cfg: Eagle3Config = self.cfg
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        draft_ids = self.draft_ids
        if self.frozen_target.head_weight is None:
            raise RuntimeError("attach_target(target) before training: the teacher head is missing")
        # Row selection (unless the next step's input tokens are this step's drafts, ttt_input: draft, which
        # need every row): the output head (norm, lm_head, softmax, loss) of step j runs only on the rows a loss
        # term or a metric reads, its labelled positions; steps j >= 1 run the decoder only on the rows a later
        # head reads (their query at t sees the step-0 keys <= t and the chain's own keys at t, nothing else of
        # steps >= 1). Step 0 runs on every row: its keys are every later query's context. The same loss and
        # gradients as every row everywhere; less work where prompts are long.
        select = cfg.ttt_input != "draft" and self.labelled_rows_only
        labs = self._label_masks(batch)
        valids = self._valid_masks(batch)
        counts = torch.stack([v.sum() for v in valids])
        teacher_p = self._teacher_probs(batch, select) if cfg.loss == "kl" else None  # [B, T, N] float32
        needed = [None] + [torch.stack(labs[j:]).any(0).nonzero(as_tuple=True) if select else None
                           for j in range(1, cfg.ttt_steps)]
        sums: list[torch.Tensor] = []

        g = self.fuse(batch.aux)
        key_valid = shift_left(batch.attention_mask, 1)
        hidden = g
        ks: list[list[torch.Tensor]] = [[] for _ in self.layers]
        vs: list[list[torch.Tensor]] = [[] for _ in self.layers]
        metrics: dict[str, float] = {}
        corrects: list[torch.Tensor] = []
        tokens = shift_left(batch.input_ids, 1)
        for j in range(cfg.ttt_steps):
            r = needed[j]  # (b, t) of the rows this step computes; None: all, [B, T]
            pos = (torch.arange(T, device=dev) + 1 + j).unsqueeze(0).expand(B, T)
            cos, sin = self.rotary(hidden, pos)  # of the dense positions (a scaled RoPE reads their maximum)
            if r is None:
                emb, hid = self.embed_tokens(tokens), hidden
            else:  # the rows as one sequence [1, n]: per-row layers, attention through the dense layout
                emb, hid, cos, sin = self.embed_tokens(tokens[r])[None], hidden[r][None], cos[r][None], sin[r][None]

            def attend(i, q, k, v):
                if r is not None:
                    q, k, v = (_scatter_rows(x, r, B, T) for x in (q, k, v))
                ks[i].append(k)
                vs[i].append(v)
                o = ttt_attention(q, ks[i], vs[i], key_valid)
                return o if r is None else o.permute(0, 2, 1, 3)[r].transpose(0, 1)[None]

            h = self._run_layers(emb, hid, cos, sin, attend)
            if r is not None:  # back to [B, T, H], zeros on the rows no later step reads
                h = h.new_zeros(B, T, h.shape[-1]).index_put(r, h[0])
            goal = shift_left(batch.argmax, 1 + j)  # the target's greedy token at t + 1 + j
            if select:  # rows (b, t) of the labelled positions: logits [n, N], teacher at (b, t + 1 + j)
                rows = labs[j].nonzero(as_tuple=True)
                hidden, logits = self._head(h, rows)  # fed to step j + 1 on every row; [n, N]
                teacher = None if teacher_p is None else teacher_p[rows[0], rows[1] + 1 + j]
                valid, goal_rows = valids[j][rows], goal[rows]
            else:
                hidden, logits = self._head(h)  # fed to j+1; [B, T, N]
                teacher = None if teacher_p is None else shift_left(teacher_p, 1 + j)
                valid, goal_rows = valids[j], goal
            if cfg.loss == "kl":
                sums.append(self.distill_loss.sum(logits, teacher, valid))
            else:
                sums.append(hard_cross_entropy(logits, target_to_draft(goal_rows, self.t2d)[0], valid))
            with torch.no_grad():
                pred = draft_ids[logits.argmax(-1)]
                if select:  # target-id space: an out-of-vocabulary goal is a miss; unlabelled rows are never read
                    correct = torch.zeros(B, T, dtype=torch.bool, device=dev)
                    correct[rows] = pred == goal_rows
                else:
                    correct = pred == goal
                corrects.append(correct)
                metrics[f"loss_{j}"] = float(sums[-1].detach() / counts[j].clamp(min=1))
            if cfg.ttt_input == "draft":
                tokens = pred.detach()
            else:
                tokens = shift_left(batch.input_ids, 2 + j)
        metrics.update(chained_acceptance(corrects, labs))
        total, self.last_own_loss = combine_terms(sums, [cfg.ttt_decay ** j for j in range(cfg.ttt_steps)],
                                                  counts, norm, where=self.algorithm)
        return total, metrics

    @torch.no_grad()
    def _teacher_probs(self, batch, select: bool) -> torch.Tensor:
        """The target's distribution over the draft vocabulary, ``[B, T, N]`` float32: at every position, or
        (``select``) only at the positions a TTT step reads it, those whose next token is an assistant token
        (step j reads position ``t + 1 + j`` where token ``t + 2 + j`` is one); zeros elsewhere."""
        if not select:
            return torch.softmax(self.frozen_target.teacher_logits(batch.top, self.draft_ids).float(), dim=-1)
        need = shift_left(batch.loss_mask & batch.attention_mask, 1).nonzero(as_tuple=True)
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T, self.draft_ids.numel(), dtype=torch.float32, device=batch.top.device)
        out[need] = torch.softmax(self.frozen_target.teacher_logits(batch.top[need], self.draft_ids).float(), dim=-1)
        return out

    # ------------------------------------------------------------------ inference
    def _forward_cached(self, state_cache: KVCache, emb, hidden, start_pos: int):
        B, m, _ = emb.shape
        pos = torch.arange(start_pos, start_pos + m, device=emb.device).unsqueeze(0)
        cos, sin = self.rotary(hidden, pos)
        mask = causal_mask_with_cache(m, state_cache.length, device=emb.device)

        def attend(i, q, k, v):
            return cached_attend(state_cache, i, q, k, v, mask)

        feed, logits = self._head(self._run_layers(emb, hidden, cos, sin, attend)[:, -1:])
        return feed, logits[0, 0]

    def _gather(self, states: list[Eagle3State], extra: int) -> RaggedKV:
        """The requests' own caches (their ``num_positions`` real-feature entries) as one padded batch
        with room for ``extra`` appended positions per row."""
        attn = self.layers[0].self_attn
        return RaggedKV.gather([s.cache for s in states], [s.num_positions for s in states], extra,
                               num_layers=len(self.layers), num_kv_heads=attn.num_kv, head_dim=attn.head_dim,
                               dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    def _forward_ragged(self, kv: RaggedKV, rows: int, emb: torch.Tensor, hidden: torch.Tensor,
                        pos: torch.Tensor, start: int) -> torch.Tensor:
        """ONE decoder-stack forward of the first ``rows`` rows of ``kv``: ``emb, hidden [rows, m, H]`` at
        position ids ``pos [rows, m]``, keys/values written at appended slots ``start..start+m-1``.
        Returns the pre-norm output hidden states ``[rows, m, H]``."""
        cos, sin = self.rotary(hidden, pos)
        mask = kv.key_mask(rows, start, emb.shape[1])

        def attend(i, q, k, v):
            return kv.attend(i, q, k, v, start, mask)

        return self._run_layers(emb, hidden, cos, sin, attend)

    @staticmethod
    def _check_advance_inputs(new_ids: torch.Tensor, features, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [m], aux [m, n_aux*H])`` of one request.

        Raises:
            SpeculatorsError: ``new_ids`` empty or not 1-D (after squeezing a batch of one), or the
                features' ``aux`` rows differ from ``m``.
        """
        ids = new_ids.reshape(-1) if new_ids.dim() == 2 and new_ids.shape[0] == 1 else new_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise SpeculatorsError(f"{where}new_ids: expected a non-empty 1-D tensor [m] of verified token ids, "
                                   f"got shape {tuple(new_ids.shape)}")
        aux = features.aux
        aux = aux.reshape(-1, aux.shape[-1])
        if aux.shape[0] != ids.shape[0]:
            raise SpeculatorsError(f"{where}features.aux: expected the target features of the {ids.shape[0]} "
                                   f"positions the new tokens follow, got {aux.shape[0]} rows")
        return ids, aux

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> Eagle3State:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1``."""
        state = Eagle3State(KVCache(), 0, None, None)
        self._advance_one(state, input_ids.reshape(-1)[1:], features)
        return state

    @torch.no_grad()
    def _advance_one(self, state: Eagle3State, new_ids: torch.Tensor, features) -> None:
        """Append inputs ``(g[t], x_{t+1})`` for the ``m`` newly verified positions of one request:
        ``new_ids [m]`` int64, ``features`` the request's :class:`speculators.target.TargetFeatures` of the
        ``m`` positions they follow (``aux [1, m, n_aux*H]``).

        Raises:
            SpeculatorsError: ``new_ids`` empty / not 1-D, or ``features.aux`` without ``m`` rows.
        """
        ids, aux = self._check_advance_inputs(new_ids, features, "advance: ")
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        aux = aux.to(device=dev, dtype=dt).unsqueeze(0)
        ids = ids.to(dev).unsqueeze(0)
        state.cache.crop(state.num_positions)  # drop chain entries of the last proposal
        h, logits = self._forward_cached(state.cache, self.embed_tokens(ids), self.fuse(aux),
                                         start_pos=state.num_positions + 1)
        state.num_positions += ids.shape[1]
        state.last_hidden, state.last_logits = h[:, -1:], logits

    @torch.no_grad()
    def advance(self, states: list[Eagle3State], new_ids: list[torch.Tensor], features: list) -> None:
        """Batched :meth:`_advance_one`: ONE drafter forward appends request i's ``m_i`` verified
        positions for every request (``new_ids[i] [m_i]`` int64, ``features[i]`` its
        :class:`speculators.target.TargetFeatures` with ``aux [1, m_i, n_aux*H]``).

        The requests' caches are gathered into a padded :class:`~.layers.RaggedKV` (own entries, then the
        new ones in a common appended region, masked per row), the new inputs are right-padded to
        ``max m_i``, and each request's cache / ``num_positions`` / ``last_hidden`` / ``last_logits`` are
        written back: the same state ``_advance_one`` gives per request (up to float rounding of the
        batched matmuls).

        Raises:
            SpeculatorsError: the three lists differ in length, or a request's ``new_ids`` / ``features``
                are invalid (see :meth:`_advance_one`), naming the request index.
        """
        if not isinstance(states, (list, tuple)):
            raise SpeculatorsError(f"advance: states must be a list of per-request states (batched protocol), "
                                   f"got {type(states).__name__}; for one request call advance([state], [ids], "
                                   f"[features])")
        B = len(states)
        if len(new_ids) != B or len(features) != B:
            raise SpeculatorsError(f"advance: states, new_ids and features must have one entry per request; "
                                   f"got {B}, {len(new_ids)}, {len(features)}")
        if B == 0:
            return
        checked = [self._check_advance_inputs(new_ids[i], features[i], f"advance: request {i}: ")
                   for i in range(B)]
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        ms = [int(ids.shape[0]) for ids, _ in checked]
        M = max(ms)
        D = checked[0][1].shape[-1]
        ids = torch.zeros(B, M, dtype=torch.int64, device=dev)
        aux = torch.zeros(B, M, D, dtype=dt, device=dev)
        for i, (ids_i, aux_i) in enumerate(checked):
            ids[i, :ms[i]] = ids_i.to(dev)
            aux[i, :ms[i]] = aux_i.to(device=dev, dtype=dt)
        kv = self._gather(states, M)
        pos = kv.lengths[:, None] + 1 + torch.arange(M, device=dev)[None]  # [B, M]
        h = self._forward_ragged(kv, B, self.embed_tokens(ids), self.fuse(aux), pos, start=0)
        last = h[torch.arange(B, device=dev), torch.tensor(ms, device=dev) - 1]  # [B, H] each row's newest input
        last, logits = self._head(last)  # fed to the next step [B, H]; [B, N]
        kv.write_back([s.cache for s in states], ms)
        for i, s in enumerate(states):
            s.num_positions += ms[i]
            s.last_hidden = last[i].reshape(1, 1, -1).clone()
            s.last_logits = logits[i].clone()

    @torch.no_grad()
    def _propose_one(self, state: Eagle3State, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Autoregressive chain of ``k`` drafts for ONE request with its own KV cache (rolled back on return).

        Each draft comes from :func:`speculators.losses.sample_draft` on the step's draft-vocabulary
        logits under ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of
        one; ``None`` = greedy): greedy gives the argmax and ``probs=None`` (point-mass drafts);
        otherwise the draft is drawn from the same temperature/top-k/top-p transform the verifier
        applies to the target, with ``generator`` (default: the request's own), and the ``[k, V]``
        float32 full-vocabulary distributions (zero outside the draft vocabulary) are returned.

        Raises:
            SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
        """
        V = self.t2d.numel()
        hidden, logits = state.last_hidden, state.last_logits
        toks, probs = [], []
        for i in range(k):
            ids, q = sample_draft(logits, sampling, generator, d2t=self.d2t, vocab_size=V)
            toks.append(int(ids[0]))
            if q is not None:
                probs.append(q[0])
            if i + 1 < k:
                emb = self.embed_tokens(ids.reshape(1, 1).to(self.embed_tokens.weight.device))
                hidden, logits = self._forward_cached(state.cache, emb, hidden,
                                                      start_pos=state.num_positions + 1 + i)
        state.cache.crop(state.num_positions)
        return Proposal(torch.tensor(toks, dtype=torch.int64), torch.stack(probs) if probs else None)

    @torch.no_grad()
    def propose(self, states: list[Eagle3State], ks: list[int], sampling: SamplingParams | None = None,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Batched draft chains: request i gets ``ks[i]`` drafts (0 allowed: an empty Proposal), the same
        tokens and probabilities :meth:`_propose_one` gives for it alone.

        ONE drafter forward per chain step covers every request still drafting: the requests' caches are
        gathered once into a padded :class:`~.layers.RaggedKV` (the chain's entries go to a common
        appended region, masked per row), rows are ordered by ``ks`` (longest first) so the requests still
        drafting at step j are a prefix of the batch, and each row runs at its own position ids. Drafts
        come from :func:`speculators.losses.sample_draft` per request: greedy rows (temperature 0, or
        ``sampling`` None) in one argmax call; a sampled request draws from ITS generator only
        (``generators[i]`` when given, else ``sampling.generators[i]``, else torch's global RNG) and
        returns ``[ks[i], V]`` float32 full-vocabulary q rows. The requests' states are not modified (the
        speculative entries live only in the discarded batch).

        Args:
            states: B per-request states from :meth:`start` / :meth:`advance`.
            ks: B ints >= 0 (the number of drafts of each request).
            sampling: :class:`speculators.verify.SamplingParams` of the B requests (``None`` = greedy).
            generators: B ``torch.Generator`` or None, or None.
        Returns:
            B :class:`~.base.Proposal` in request order: ``token_ids [ks[i]]`` int64 target ids (CPU),
            ``probs [ks[i], V]`` float32 (CPU) or None for greedy requests.
        Raises:
            SpeculatorsError: ``ks`` / ``generators`` not one entry per state, a negative or non-integer
                ``ks[i]``, or ``sampling`` not valid ``SamplingParams`` for B requests (naming the field).
        """
        B = len(check_batch(states, ks, sampling, generators))
        ks = [int(k) for k in ks]
        V = self.t2d.numel()
        toks: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        live = sorted((i for i in range(B) if ks[i] > 0), key=lambda i: -ks[i])  # stable
        if live:
            temps = [0.0] * B if sampling is None else sampling.temperature.tolist()
            # request i's own generator: generators[i] when given, else sampling.generators[i]
            one = {i: request_sampling(sampling, i, None if generators is None else generators[i])
                   for i in live if temps[i] != 0.0}
            kk = [ks[i] for i in live]
            dev = self.fc.weight.device
            hidden = torch.cat([states[i].last_hidden.to(dev) for i in live])  # [R, 1, H]
            logits = torch.stack([states[i].last_logits.to(dev) for i in live])  # [R, N]
            n_fwd = sum(k > 1 for k in kk)
            if n_fwd:
                kv = self._gather([states[i] for i in live[:n_fwd]], kk[0] - 1)
            greedy_rows = [r for r, i in enumerate(live) if i not in one]
            all_greedy = len(greedy_rows) == len(live)
            for j in range(kk[0]):
                a = sum(k > j for k in kk)  # rows drafting token j: a prefix
                if all_greedy:  # one argmax call for the whole step
                    step, _ = sample_draft(logits[:a], None, d2t=self.d2t, vocab_size=V)
                else:
                    step = torch.empty(a, dtype=torch.int64)
                    rows = [r for r in greedy_rows if r < a]
                    if rows:
                        step[rows], _ = sample_draft(logits[torch.tensor(rows, device=logits.device)], None,
                                                     d2t=self.d2t, vocab_size=V)
                    for r in range(a):
                        if live[r] in one:  # this request's own generator, one draw per draft
                            ids, q = sample_draft(logits[r], one[live[r]], d2t=self.d2t, vocab_size=V)
                            step[r] = ids[0]
                            probs[live[r]].append(q[0])
                for r, t in enumerate(step.tolist()):
                    toks[live[r]].append(t)
                f = sum(k > j + 1 for k in kk)  # rows that need the next step's logits
                if f == 0:
                    break
                emb = self.embed_tokens(step[:f].to(dev).reshape(f, 1))
                pos = (kv.lengths[:f] + 1 + j).reshape(f, 1)
                hidden, logits = self._head(self._forward_ragged(kv, f, emb, hidden[:f], pos, start=j))
                logits = logits[:, 0]  # [f, N]
        return [Proposal(torch.tensor(toks[i], dtype=torch.int64), torch.stack(probs[i]) if probs[i] else None)
                for i in range(B)]

    drafts_trees = True  # declared capability: propose_tree (EAGLE-2 dynamic trees, vLLM static trees)

    @torch.no_grad()
    def propose_tree(self, states: list[Eagle3State], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests (:func:`speculators.drafters.tree_drafting.expand_tree`: EAGLE-2's
        dynamic expansion or a static ``speculative_token_tree``), the requests' states left unchanged.

        Each level is ONE drafter forward over every request's frontier nodes: a node's input is the
        embedding of its token and its parent's output hidden state (the root's: ``last_hidden``) at
        position id ``num_positions + depth``, as the chain's step at that depth; its keys go to the
        appended region of a padded :class:`~.layers.RaggedKV` and its queries see the request's cached
        keys and its ancestors' appended keys only (the tree mask). Children are top-k tokens (point
        masses for the verifier), so ``sampling`` / ``generators`` are not drawn from.

        Args:
            states: B states from :meth:`start` / :meth:`advance`.
            spec: a :class:`speculators.decode.tree_spec.TreeSpec`.
            depth_caps: per request the deepest level kept (>= 0; 0 = an empty tree).
            sampling, generators: checked for B requests, otherwise unused (top-k children).
        Returns:
            B :class:`speculators.verify.tree.DraftTree` (int64 target ids and parents, CPU, ``probs`` None).
        Raises:
            SpeculatorsError: ``depth_caps`` / ``generators`` not one entry per state, a negative cap, or
                ``sampling`` not valid for B requests.
        """
        from .tree_drafting import expand_tree, level_inputs, level_mask, tree_extra_slots

        check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")
        if not states:
            return []
        dev = self.fc.weight.device
        root_logits = torch.stack([s.last_logits.to(dev) for s in states])
        root_feed = torch.cat([s.last_hidden.to(dev) for s in states])  # [R, 1, H]
        extra = tree_extra_slots(spec, depth_caps)
        kv = self._gather(states, extra) if extra else None
        feeds: list[torch.Tensor] = []  # per run node, [R, H] its output feed

        def forward(tokens, parents, visible, depth):
            R, F = tokens.shape
            n_run = visible.shape[2] - F
            hidden = level_inputs(root_feed, feeds, parents)
            cos, sin = self.rotary(hidden, (kv.lengths[:, None] + depth).expand(R, F))
            mask = level_mask(kv, visible)

            def attend(i, q, k, v):
                return kv.attend(i, q, k, v, n_run, mask)

            feed, logits = self._head(self._run_layers(self.embed_tokens(tokens.to(dev)), hidden, cos, sin, attend))
            feeds.extend(feed.unbind(1))
            return logits

        return expand_tree(root_logits, forward, spec, self.d2t, [int(c) for c in depth_caps])
