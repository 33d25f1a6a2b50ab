"""Shared drafter building blocks: decoder-layer pieces, attention with custom masks, KV caches.

Norms, MLPs and rotary embeddings come from transformers' Llama implementation; attention is written
here because drafters need custom masks (EAGLE-3's training-time-test diagonal, DFlash's block-sparse
mask) and keys/values from outside the layer's own input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from ..errors import SpeculatorsError
from ..target.architecture import LogitsRule, apply_logits_rule
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

RMSNorm = LlamaRMSNorm
MLP = LlamaMLP


class FrozenTarget:
    """The frozen pieces of the target a drafter may use, kept OUTSIDE its module tree (never trained, never
    saved, never in ``state_dict``): the output head (teacher distributions in training; drafting through the
    target's head for EAGLE-1 / MTP), the final RMSNorm (MTP) and the token embedding (DFlash / DSpark).
    Each is moved to the caller's device and dtype once, not per call. Empty (every use raises) until a
    drafter's ``attach_target(target)``. Two views of the head: :meth:`teacher_logits` follows the target's
    architecture rule (:func:`speculators.target.architecture.logits_rule`: Gemma's soft-capping, Granite's /
    Cohere's scaling), so teacher distributions are the target's own; :meth:`lm_head` (a drafter drafting
    through the target's head: EAGLE-1, MTP, full-vocabulary DFlash / DSpark) does not, as vLLM's drafters
    compute their logits with their own logits processor. The embedding is the raw table (no architecture
    multiplier), as vLLM's drafters share the target's ``embed_tokens`` (docs/FORMATS.md, "Targets").

    Args:
        target: a :class:`speculators.target.Target`, or None (not attached yet).
    """

    def __init__(self, target=None):
        self.head_weight: torch.Tensor | None = None if target is None else target.lm_head_weight.detach()
        self._norm = None if target is None else target.final_norm
        self._embed: torch.Tensor | None = None if target is None else target.embed_tokens.weight.detach()
        self.rule: LogitsRule = LogitsRule() if target is None else target.logits_rule
        self._on_device: dict[str, torch.Tensor] = {}

    def _placed(self, name: str, w: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
        if w is None:
            raise RuntimeError(f"attach_target(target) first: the target's {what} is missing")
        key = f"{name}:{like.device}:{like.dtype}"  # one copy per device and dtype (a float32 teacher beside
        cur = self._on_device.get(key)  # bf16 drafting never re-copies the head)
        if cur is None:
            cur = self._on_device[key] = w.to(device=like.device, dtype=like.dtype)
        return cur

    def lm_head(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Frozen target output head, as a drafter drafts through it (no architecture rule, as vLLM):
        ``[..., H]`` post-norm hidden -> ``[..., V]`` logits in ``h``'s dtype, or ``[..., N]`` over the target
        ids ``rows [N]`` (a draft vocabulary) only.

        Raises:
            RuntimeError: not attached.
        """
        w = self._placed("head", self.head_weight, h, "output head")
        w = w if rows is None else w[rows.to(w.device)]
        flat = h.reshape(-1, h.shape[-1]).contiguous()  # a 2-D product (see Target.lm_head)
        return F.linear(flat, w).view(*h.shape[:-1], w.shape[0])

    def teacher_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's own logits on post-norm hidden states (:meth:`lm_head` after the target's logits
        rule: Gemma's soft-capping, Granite's / Cohere's scaling), the teacher of every distillation loss:
        ``[..., V]``, or ``[..., N]`` over ``rows [N]`` (softmax over them = the target's distribution
        renormalised on the draft vocabulary), in ``h``'s dtype.

        Raises:
            RuntimeError: not attached.
        """
        return apply_logits_rule(self.lm_head(h, rows), self.rule)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen final RMSNorm: ``[..., H]`` -> ``[..., H]``.

        Raises:
            RuntimeError: not attached.
        """
        if self._norm is None:
            raise RuntimeError("attach_target(target) first: the target's final norm is missing")
        return self._norm(h)

    def embed(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The target's frozen token embedding: ``ids [...]`` int64 -> ``[..., H]`` on ``like``'s device and
        in its dtype (e.g. a drafter weight).

        Raises:
            RuntimeError: not attached.
        """
        emb = self._placed("embed", self._embed, like, "token embedding")
        return F.embedding(ids.to(like.device), emb)


class DraftVocabBuffers:
    """Mixin of the families that draft over a draft vocabulary kept as vLLM's ``d2t`` / ``t2d`` buffers
    (EAGLE-3, P-EAGLE, Medusa, DFlash / DSpark with a reduced vocabulary; ALGORITHMS.md, "Draft vocabulary"):
    ``d2t [N]`` int64 offsets (``target_id = i + d2t[i]``) and ``t2d [V]`` bool."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def register_draft_vocab(self, draft_vocab_size: int, vocab_size: int) -> None:
        """Register the ``d2t [N]`` / ``t2d [V]`` buffers (identity placeholders, filled by
        :meth:`init_draft_vocab` or a checkpoint)."""
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool))

    @property
    def draft_ids(self) -> torch.Tensor:
        """``[N]`` int64 sorted target ids of the draft vocabulary (``i + d2t[i]``)."""
        from ..losses import draft_to_target

        return draft_to_target(torch.arange(self.d2t.numel(), device=self.d2t.device), self.d2t)

    def init_draft_vocab(self, target, vocab, heads: list[nn.Linear]) -> None:
        """Fill ``d2t`` / ``t2d`` from ``vocab`` (a :class:`speculators.data.vocab.DraftVocab`) and start every
        head of ``heads`` (``Linear(H -> N)``) as the target's own output head over that vocabulary
        (:meth:`DraftVocab.head_rows` of ``target.lm_head_weight``)."""
        with torch.no_grad():
            rows = vocab.head_rows(target.lm_head_weight)
            for head in heads:
                head.weight.copy_(rows)
            self.d2t.copy_(vocab.d2t)
            self.t2d.copy_(vocab.t2d)


# RoPE types transformers' Llama (and vLLM's Llama draft layer) implement; anything else (Qwen2-VL's mrope, ...)
# is trained and exported as plain RoPE with the target's theta.
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_CONFIG_ALIASES = {"hidden_size": ("n_embd", "d_model"), "num_attention_heads": ("n_head", "num_heads"),
                   "intermediate_size": ("n_inner", "ffn_dim", "d_ff"),
                   "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length")}
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def _rope(t: dict) -> dict:
    """The target's RoPE as Llama ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling fields
    of that type), without a partial rotary factor.

    Read from transformers 5's ``rope_parameters`` (per layer type for mixed models: the
    ``full_attention`` entry, since the draft layer attends over its whole context), else the older
    ``rope_scaling`` + ``rope_theta``, else other architectures' theta names (GPT-NeoX ``rotary_emb_base``,
    ChatGLM ``rope_ratio`` = theta / 10000). A type Llama does not implement becomes ``default``."""
    rp = t.get("rope_parameters")
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type
        rp = rp.get("full_attention") or next(iter(rp.values()))
    rp = dict(rp or t.get("rope_scaling") or {})
    theta = rp.get("rope_theta", t.get("rope_theta"))
    if theta is None and t.get("rotary_emb_base") is not None:
        theta = float(t["rotary_emb_base"])
    elif theta is None and t.get("rope_ratio") is not None:
        theta = 10000.0 * float(t["rope_ratio"])
    kind = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    rp.pop("partial_rotary_factor", None)
    if kind not in LLAMA_ROPE_TYPES:
        kind, rp = "default", {}
    out = {"rope_type": kind, "rope_theta": float(theta if theta is not None else 10000.0)}
    if kind != "default":
        out.update(rp)
    return out


def layer_config(target_config: dict, num_hidden_layers: int = 1, **overrides) -> LlamaConfig:
    """A Llama decoder config for a drafter, BUILT from the target's config by an allow-list (never copied
    wholesale: a target's per-layer ``layer_types``, MLA head sizes, MoE fields or multipliers would
    otherwise leak into a 1- or 2-layer Llama draft layer).

    Taken from the target (its text config for a multimodal one): ``vocab_size``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (default: the heads), ``head_dim`` (default hidden /
    heads; for an MLA target such as DeepSeek-V3, whose ``head_dim`` is its rotary part, hidden / heads with
    one kv head per head), ``intermediate_size`` (3 x hidden when the target has none, e.g. MoE-only),
    the norm eps (``rms_norm_eps`` or the LayerNorm eps names), ``max_position_embeddings`` and the RoPE
    (:func:`_rope`: theta and the scaling types Llama implements; a RoPE mismatch between training and
    serving silently destroys acceptance, FORMATS.md). Fixed, as vllm-project/speculators builds its draft
    layer: ``hidden_act: silu``, no attention or MLP bias, untied embeddings; the draft layer rotates the
    WHOLE head dim (a target's partial rotary factor is not copied), so the exported
    ``transformer_layer_config`` describes exactly the trained layer. ``overrides`` are applied last.

    Returns:
        a ``LlamaConfig`` with ``num_hidden_layers`` layers.

    Raises:
        SpeculatorsError: the target config lacks ``hidden_size`` / ``num_attention_heads`` /
            ``vocab_size``, or an override asks for a partial rotary factor other than 1 (the draft layer
            does not implement it).
    """
    t = dict(target_config)
    if isinstance(t.get("text_config"), dict):
        t = {**t, **t["text_config"]}
    for name, aliases in _CONFIG_ALIASES.items():  # GPT-2 / GPT-J / T5-style names of the same fields
        if t.get(name) is None:
            t[name] = next((t[a] for a in aliases if t.get(a) is not None), None)
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if t.get(k) is None]
    if missing:
        raise SpeculatorsError(f"drafter layer config: the target config has no {missing}")
    H, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    mla = t.get("kv_lora_rank") is not None
    hd = None if mla else t.get("head_dim")
    if hd is None and H % heads:
        raise SpeculatorsError(f"drafter layer config: hidden_size {H} is not a multiple of num_attention_heads "
                               f"{heads} and the target config gives no head_dim")
    eps = next((float(t[k]) for k in _EPS_FIELDS if t.get(k) is not None), 1e-6)
    d = dict(vocab_size=int(t["vocab_size"]), hidden_size=H, num_attention_heads=heads,
             num_key_value_heads=heads if mla else int(t.get("num_key_value_heads") or heads),
             head_dim=int(hd or H // heads), intermediate_size=int(t.get("intermediate_size") or 3 * H),
             rms_norm_eps=eps, max_position_embeddings=int(t.get("max_position_embeddings") or 2048),
             rope_parameters=_rope(t), hidden_act="silu", attention_bias=False, mlp_bias=False,
             tie_word_embeddings=False, num_hidden_layers=num_hidden_layers)
    if float(overrides.pop("partial_rotary_factor", None) or 1.0) != 1.0:
        raise SpeculatorsError("partial_rotary_factor: the draft layer rotates the whole head dim; only 1.0 is allowed")
    d.update(overrides)
    return LlamaConfig(**d)


def effective_rms_scale(norm: nn.Module, hidden_size: int) -> torch.Tensor | None:
    """The per-channel scale an RMS norm of the target applies, as a float32 ``[H]`` tensor a Llama RMSNorm's
    ``weight`` can start from: the norm's output on a vector of ones (RMS 1), so Gemma's ``1 + w`` norm gives
    ``1 + w`` and Llama's gives ``w``. None for a norm that is not an RMS norm (a LayerNorm subtracts the
    mean: its output on ones is its bias) or of another width.
    """
    if "rmsnorm" not in type(norm).__name__.lower():
        return None
    w = getattr(norm, "weight", None)
    like = w if isinstance(w, torch.Tensor) else torch.empty(0)
    with torch.no_grad():
        out = norm(torch.ones(1, hidden_size, dtype=like.dtype, device=like.device))
    return out[0].float().cpu() if out.shape[-1] == hidden_size else None


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """Shift along the sequence dim: ``out[:, t] = x[:, t + s]``, zero past the end (same shape as ``x``).

    The label/input shift of every family (``x`` is ``[B, T, ...]``; ``s >= 0``; ``s >= T`` gives zeros).
    """
    if s == 0:
        return x
    pad = torch.zeros((x.shape[0], min(s, x.shape[1])) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x[:, s:], pad], dim=1)


def head_dim(cfg: LlamaConfig) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


class Rotary(nn.Module):
    """RoPE cos/sin for given position ids (transformers' LlamaRotaryEmbedding, so scaling types match)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B, T]`` -> cos, sin ``[B, T, head_dim]`` in ``x``'s dtype."""
        return self.rope(x, position_ids)


@dataclass
class KVCache:
    """Per-layer key/value cache of a drafter at inference: ``k[l], v[l]`` are ``[1, n_kv, S, head_dim]``."""

    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.k or self.k[0] is None else self.k[0].shape[2]

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions of every layer."""
        self.k = [None if t is None else t[:, :, :n] for t in self.k]
        self.v = [None if t is None else t[:, :, :n] for t in self.v]


@dataclass
class RaggedKV:
    """Per-request drafter KV caches batched for ONE forward over several requests (ragged lengths).

    Layout of every layer's ``k[l]`` / ``v[l]`` (``[R, n_kv, base + extra, head_dim]``): row ``r`` holds
    request r's own cached keys in slots ``0..lengths[r]-1`` (zero padding up to ``base = max(lengths)``)
    and the entries appended by this batched run in slots ``base..base+extra-1`` (slot ``base + j`` is the
    j-th appended position of every row). Keys are already rotated at their own position ids, so the
    slot order does not matter to attention: :meth:`key_mask` exposes exactly each row's valid keys.
    The per-request :class:`KVCache` stays the source of truth: :meth:`gather` copies them in,
    :meth:`write_back` copies appended entries out (a run that must leave the caches untouched, e.g. a
    speculative draft chain, simply drops the batch).

    Attributes:
        k, v: per layer ``[R, n_kv, base + extra, head_dim]``.
        lengths: ``[R]`` int64 (on the cache device): cached positions of each row.
        base: ``max(lengths)`` (0 when R == 0): first slot of the appended region.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor
    base: int

    @classmethod
    def gather(cls, caches: list[KVCache], lengths: list[int], extra: int, *, num_layers: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> "RaggedKV":
        """Copy the first ``lengths[r]`` positions of ``caches[r]`` (every layer) into a padded batch with
        room for ``extra`` appended positions.

        Raises:
            SpeculatorsError: ``lengths`` / ``caches`` differ in length, or a cache holds fewer than
                ``lengths[r]`` positions.
        """
        if len(caches) != len(lengths):
            raise SpeculatorsError(f"RaggedKV.gather: {len(caches)} caches but {len(lengths)} lengths")
        for r, (c, n) in enumerate(zip(caches, lengths)):
            if n < 0 or c.length < n or (n > 0 and len(c.k) < num_layers):
                raise SpeculatorsError(f"RaggedKV.gather: cache {r} holds {c.length} positions in {len(c.k)} "
                                       f"layers; {n} positions in {num_layers} layers were asked for")
        base = max(lengths, default=0)
        R = len(caches)
        ks, vs = [], []
        for layer in range(num_layers):
            kb = torch.zeros(R, num_kv_heads, base + extra, head_dim, dtype=dtype, device=device)
            vb = torch.zeros_like(kb)
            for r, (c, n) in enumerate(zip(caches, lengths)):
                if n:
                    kb[r, :, :n] = c.k[layer][0, :, :n]
                    vb[r, :, :n] = c.v[layer][0, :, :n]
            ks.append(kb)
            vs.append(vb)
        return cls(ks, vs, torch.tensor(lengths, dtype=torch.int64, device=device), base)

    def key_mask(self, rows: int, start: int, m: int) -> torch.Tensor:
        """Boolean ``[rows, 1, m, base + start + m]`` mask (True = attend) for ``m`` new queries of the
        first ``rows`` rows written at appended slots ``start..start+m-1``: query t of row r sees row r's
        own cached keys (``s < lengths[r]``) and the appended keys up to itself
        (``base <= s <= base + start + t``)."""
        dev = self.lengths.device
        s = torch.arange(self.base + start + m, device=dev)
        own = s[None, :] < self.lengths[:rows, None]  # [rows, S]
        q = torch.arange(m, device=dev)[:, None] + self.base + start  # [m, 1] slot of each query
        appended = (s[None, :] >= self.base) & (s[None, :] <= q)  # [m, S]
        return (own[:, None, None, :] | appended[None, None]).contiguous()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor) -> torch.Tensor:
        """Write ``k, v`` (``[rows, n_kv, m, hd]``, rows = the first ``rows`` batch rows) into appended slots
        ``start..start+m-1`` of layer ``layer_idx`` and attend.

        Args:
            q: ``[rows, nh, m, hd]`` rotated queries.
            mask: ``[rows, 1, m, base + start + m]`` from :meth:`key_mask`.
        Returns:
            ``[rows, nh, m, hd]``.
        """
        rows, _, m, _ = k.shape
        end = self.base + start + m
        self.k[layer_idx][:rows, :, self.base + start:end] = k
        self.v[layer_idx][:rows, :, self.base + start:end] = v
        kk = self.k[layer_idx][:rows, :, :end]
        vv = self.v[layer_idx][:rows, :, :end]
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=kk.shape[1] != q.shape[1])

    def write_back(self, caches: list[KVCache], counts: list[int]) -> None:
        """Make ``caches[r]`` = its first ``lengths[r]`` positions + the first ``counts[r]`` appended ones
        (fresh contiguous ``[1, n_kv, lengths[r] + counts[r], hd]`` tensors per layer: no cache keeps the
        batch buffer alive)."""
        lens = self.lengths.tolist()
        for r, (c, m) in enumerate(zip(caches, counts)):
            n = lens[r]
            c.k = [torch.cat([kb[r:r + 1, :, :n], kb[r:r + 1, :, self.base:self.base + m]], dim=2) for kb in self.k]
            c.v = [torch.cat([vb[r:r + 1, :, :n], vb[r:r + 1, :, self.base:self.base + m]], dim=2) for vb in self.v]


class Attention(nn.Module):
    """Llama-style GQA attention whose q/k/v projections take ``in_dim`` inputs (2H for EAGLE-3).

    Weight names follow HF/vLLM: ``q_proj, k_proj, v_proj, o_proj``.
    """

    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project and rotate: ``x [B, T, in]`` -> q ``[B, nh, T, hd]``, k, v ``[B, n_kv, T, hd]``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """``o [B, nh, T, hd]`` -> ``[B, T, H]``."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def cached_attend(cache: KVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Append ``k, v`` (``[1, n_kv, m, hd]``) to layer ``layer_idx`` of ``cache`` and attend.

    Args:
        q: ``[1, nh, m, hd]`` rotated queries of the m new positions.
        mask: boolean ``[1, 1, m, S]`` (True = attend), S = cached + m.
    Returns:
        ``[1, nh, m, hd]``.
    """
    while len(cache.k) <= layer_idx:
        cache.k.append(None)
        cache.v.append(None)
    if cache.k[layer_idx] is not None:
        k = torch.cat([cache.k[layer_idx], k], dim=2)
        v = torch.cat([cache.v[layer_idx], v], dim=2)
    cache.k[layer_idx], cache.v[layer_idx] = k, v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class DecoderLayer(nn.Module):
    """Llama decoder-layer parameters with HF/vLLM names (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``); families write their own forward around them.

    Args:
        cfg: the drafter's Llama config.
        attn_in_dim: input width of q/k/v (2H for EAGLE-3's first layer); default H.
        input_norm: False for layers that take an already-normalised or fused input (EAGLE-1 layer 0).
    """

    def __init__(self, cfg: LlamaConfig, attn_in_dim: int | None = None, input_norm: bool = True):
        super().__init__()
        H = cfg.hidden_size
        if input_norm:
            self.input_layernorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_dim=attn_in_dim)
        self.post_attention_layernorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class FusedInputLayer(DecoderLayer):
    """The first decoder layer of EAGLE-3-style drafters (EAGLE-3, P-EAGLE): its attention reads
    ``concat(input_layernorm(embed), hidden_norm(hidden))`` (2H wide q/k/v projections); the residual
    is the hidden half. Weight names as vLLM's ``Eagle3LlamaForCausalLM`` loads them
    (``input_layernorm``, ``hidden_norm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, attn_in_dim=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``emb, hidden [B, T, H]`` -> ``[B, T, 2H]`` attention input."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)


def causal_mask_with_cache(t_new: int, s_cached: int, device=None) -> torch.Tensor:
    """Boolean ``[1, 1, t_new, s_cached + t_new]``: every new query sees the whole cache and the new
    keys up to itself."""
    q = torch.arange(t_new, device=device).unsqueeze(1) + s_cached
    k = torch.arange(s_cached + t_new, device=device).unsqueeze(0)
    return (k <= q)[None, None]


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                  key_valid: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 training-time-test attention without materialising the ``[T, (j+1)T]`` mask.

    At TTT step j the query at position t attends to step-0 keys at positions ``<= t`` (causal over
    the real sequence) and, for each step ``1 <= i <= j``, only to step i's key at the same
    position t (the diagonal). Scores of the diagonal keys are per-position dot products, so the
    cost is one causal ``T x T`` attention plus ``O(j T)``.

    Args:
        q: ``[B, nh, T, hd]`` queries of step j (rotated).
        ks, vs: ``j + 1`` tensors ``[B, n_kv, T, hd]``: keys/values of steps ``0..j`` (rotated).
        key_valid: ``[B, T]`` bool, False on padding.
    Returns:
        ``[B, nh, T, hd]`` attention output.
    """
    B, nh, T, hd = q.shape
    rep = nh // ks[0].shape[1]

    def expand(t):
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t

    scale = 1.0 / math.sqrt(hd)
    k0, v0 = expand(ks[0]), expand(vs[0])
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & key_valid[:, None, None, :]
    s0 = s0.masked_fill(~allowed, torch.finfo(s0.dtype).min)
    diag = [(q * expand(k)).sum(-1, keepdim=True) * scale for k in ks[1:]]  # each [B, nh, T, 1]
    scores = torch.cat([s0] + diag, dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T], v0)
    for i, v in enumerate(vs[1:]):
        out = out + probs[..., T + i:T + i + 1] * expand(v)
    return out
