"""Static check: every tensor of an exported checkpoint against what vLLM's weight loader places.

Written from vLLM's source at commit ``00bd1493b3e8`` (the v0.33.0 line; :data:`VLLM_VERSION`):
``model_executor/models/llama_eagle3.py`` (EAGLE-3 and P-EAGLE: names get ``model.`` except ``lm_head``,
``d2t`` becomes ``draft_id_to_target_id``, ``t2d`` is dropped, ``mask_hidden`` is a ``[1, 3H]`` buffer
required with parallel drafting, everything else must reach a parameter through ``AutoWeightsLoader``,
which raises "There is no module or parameter named ..."), ``llama_eagle.py`` (EAGLE-1), ``medusa.py``,
``deepseek_mtp.py`` (the module layout our MTP export follows), ``mlp_speculator.py``, the DFlash / DSpark drafter models,
``registry.py`` (the causal-LM classes a ``draft_model`` checkpoint may name) and
``transformers_utils/configs/speculators/*`` (which config keys they read). vLLM fuses
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` itself: the file keeps
the unfused Hugging Face names.

:func:`check_layout` reads a checkpoint directory and returns a list of problems (empty: vLLM places
every tensor, at the right shape, and finds every tensor it requires). It reads names and shapes only
(safetensors header), so it runs on any checkpoint, ours or trained elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..errors import SpeculatorsError
from . import model_config_fields

#: The vLLM release whose loaders these rules follow.
VLLM_VERSION = "0.33.0"
#: vLLM's EAGLE-3 ``fc`` for a speculators-format config is sized for exactly this many taps.
EAGLE3_TAPS = 3


def _dims(config: dict[str, Any], layer: dict[str, Any]) -> dict[str, int]:
    H = int(layer["hidden_size"])
    nh = int(layer["num_attention_heads"])
    nkv = int(layer.get("num_key_value_heads") or nh)
    hd = int(layer.get("head_dim") or H // nh)
    return {"H": H, "nh": nh, "nkv": nkv, "hd": hd, "I": int(layer.get("intermediate_size") or 4 * H),
            "V": int(layer.get("vocab_size") or config.get("vocab_size") or 0),
            "L": int(layer.get("num_hidden_layers") or 1)}


def _decoder_layer(prefix: str, d: dict[str, int], attn_in: int, qk_norm: bool, input_norm: bool = True
                   ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Names -> shapes of one Llama/Qwen3 decoder layer under ``prefix``; all required."""
    H, I, nh, nkv, hd = d["H"], d["I"], d["nh"], d["nkv"], d["hd"]
    shapes = {f"{prefix}self_attn.q_proj.weight": (nh * hd, attn_in),
              f"{prefix}self_attn.k_proj.weight": (nkv * hd, attn_in),
              f"{prefix}self_attn.v_proj.weight": (nkv * hd, attn_in),
              f"{prefix}self_attn.o_proj.weight": (H, nh * hd),
              f"{prefix}post_attention_layernorm.weight": (H,),
              f"{prefix}mlp.gate_proj.weight": (I, H), f"{prefix}mlp.up_proj.weight": (I, H),
              f"{prefix}mlp.down_proj.weight": (H, I)}
    if input_norm:
        shapes[f"{prefix}input_layernorm.weight"] = (H,)
    if qk_norm:
        shapes[f"{prefix}self_attn.q_norm.weight"] = (hd,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (hd,)
    return shapes, set(shapes)


def _aux_ids(config: dict[str, Any], key: str, problems: list[str], exact: int | None = None) -> list[int]:
    ids = config.get(key)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"config `{key}`: {ids!r} is not a non-empty list of layer ids")
        return []
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        problems.append(f"config `{key}` {ids}: vLLM collects each tapped layer once, in layer order; the ids "
                        "must be distinct and ascending")
    if exact is not None and len(ids) != exact:
        problems.append(f"config `{key}` {ids}: vLLM {VLLM_VERSION} sizes fc for exactly {exact} taps")
    return ids


def expected_layout(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...] | None], set[str], list[str]]:
    """What vLLM's loader for this ``config.json`` places.

    Returns:
        ``(shapes, required, problems)``: ``shapes`` maps every placeable name to its shape (None: any
        shape); ``required`` the names the loader cannot do without; ``problems`` config-level findings
        (aux-id rules).
    Raises:
        SpeculatorsError: a family this check does not know, or a config without the sizes it needs.
    """
    problems: list[str] = []
    family = config.get("speculators_model_type") or config.get("model_type")
    try:
        if family == "medusa" and "speculators_model_type" not in config:
            trunc, V = int(config.get("truncated_vocab_size") or 0), int(config["vocab_size"])
            if 0 < trunc < V and not config.get("original_lm_head"):
                problems.append(f"config `truncated_vocab_size` {trunc} < `vocab_size` {V} with per-head lm_heads "
                                "(`original_lm_head` false): vLLM 0.32's Medusa sizes each head at vocab_size rows "
                                "and cuts a loaded head to the token_map rows, which then fails its shape check "
                                "(seen when the real engine loaded such a file); only the full vocabulary loads")
            return _medusa_vllm(config) + (problems,)
        if family == "mlp_speculator":
            return _mlp_speculator(config) + (problems,)
        if _plain_causal_lm(config):
            return _hf_causal_lm(config) + (problems,)
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpeculatorsError("config.json has no `transformer_layer_config` dict")
        if family not in _LAYOUTS:
            raise SpeculatorsError(f"vLLM layout check: unknown family {family!r} (config "
                                   "`speculators_model_type` / `model_type`)")
        d = _dims(config, layer)
        d["N"] = int(config.get("draft_vocab_size") or d["V"])
        d["qk"] = layer.get("model_type") == "qwen3"
        shapes, required = _LAYOUTS[family](family, config, d, problems)
    except (KeyError, TypeError, ValueError) as e:
        raise SpeculatorsError(f"vLLM layout check: config.json lacks a size it needs ({e})") from None
    return shapes, required, problems


def _layers(d: dict, first_in: int, prefix: str = "layers.", input_norm_after_first: bool = False):
    """Every decoder layer ``{prefix}{i}.`` of the drafter (the first taking ``first_in`` features)."""
    shapes, required = {}, set()
    for i in range(d["L"]):
        kw = {"input_norm": i > 0} if input_norm_after_first else {}
        s, r = _decoder_layer(f"{prefix}{i}.", d, first_in if i == 0 else d["H"], d["qk"], **kw)
        shapes.update(s)
        required |= r
    return shapes, required


def _eagle3_like(family: str, config: dict[str, Any], d: dict, problems: list[str]):
    """``llama_eagle3.py`` (vLLM serves P-EAGLE through it, plus the parallel-drafting ``mask_hidden``)."""
    H, V, N = d["H"], d["V"], d["N"]
    ids = _aux_ids(config, "eagle_aux_hidden_state_layer_ids", problems, exact=EAGLE3_TAPS)
    n = max(len(ids), 1)
    shapes = {"fc.weight": (H, n * H), "norm.weight": (H,), "lm_head.weight": (N, H),
              "embed_tokens.weight": (V, H), "d2t": (N,), "t2d": (V,), "layers.0.hidden_norm.weight": (H,)}
    required = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (n * H,)
        required.add("input_norm.weight")
    if config.get("fc_norm"):
        for i in range(n):
            shapes[f"fc_norm.{i}.weight"] = (H,)
            required.add(f"fc_norm.{i}.weight")
    s, r = _layers(d, 2 * H)
    shapes.update(s)
    required |= r
    if family == "peagle":
        shapes["mask_hidden"] = (1, 1, n * H)
        required.add("mask_hidden")
    return shapes, required


def _block_drafter(family: str, config: dict[str, Any], d: dict, problems: list[str]):
    """``qwen3_dflash.py`` / ``qwen3_dspark.py`` (DSpark adds the Markov and confidence heads; its
    ``mask_embedding`` is dropped; a reduced vocabulary needs its own lm_head and d2t)."""
    H, V, N = d["H"], d["V"], d["N"]
    ids = _aux_ids(config, "aux_hidden_state_layer_ids", problems)
    n = max(len(ids), 1)
    shapes = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (N, H), "embed_tokens.weight": (V, H), "d2t": (N,), "t2d": (V,)}
    required = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    s, r = _layers(d, H)
    shapes.update(s)
    required |= r
    if family != "dspark":
        return shapes, required
    shapes["mask_embedding"] = None
    if N != V:
        required |= {"lm_head.weight", "d2t"}
    r_ = int(config.get("markov_rank") or 0)
    if r_ > 0:
        shapes["markov_head.markov_w1.weight"] = (V, r_)
        shapes["markov_head.markov_w2.weight"] = (N, r_)
        required |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if config.get("enable_confidence_head"):
        width = H + (r_ if config.get("confidence_head_with_markov") else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
        required |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return shapes, required


def _eagle1(family: str, config: dict[str, Any], d: dict, problems: list[str]):
    """EAGLE-1 in our own layout (vLLM's ``method: eagle`` loader takes another one)."""
    H, V = d["H"], d["V"]
    shapes: dict[str, tuple[int, ...] | None] = {"fc.weight": (H, 2 * H), "embed_tokens.weight": (V, H)}
    required = {"fc.weight"}
    if config.get("fusion_bias"):
        shapes["fc.bias"] = (H,)
        required.add("fc.bias")
    s, r = _layers(d, H, input_norm_after_first=True)
    shapes.update(s)
    return shapes, required | r


def _mtp(family: str, config: dict[str, Any], d: dict, problems: list[str]):
    """MTP modules in the DeepSeek layout (``enorm``, ``hnorm``, ``eh_proj``, the block, ``shared_head``);
    ``embed_tokens`` optional (DeepSeek-V3's MTP shares the target's)."""
    H, V = d["H"], d["V"]
    shapes: dict[str, tuple[int, ...] | None] = {"embed_tokens.weight": (V, H)}
    required: set[str] = set()
    for i in range(int(config.get("num_nextn_predict_layers") or 1)):
        p = f"layers.{i}."
        shapes.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                       p + "shared_head.norm.weight": (H,), p + "shared_head.head.weight": (V, H)})
        required |= {p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight"}
        s, r = _decoder_layer(p, d, H, d["qk"])
        shapes.update(s)
        required |= r
    return shapes, required


def _medusa_speculators(family: str, config: dict[str, Any], d: dict, problems: list[str]):
    """Medusa in the speculators layout (our own: vLLM's Medusa loader takes its native layout)."""
    H, V, N = d["H"], d["V"], d["N"]
    K, nl = int(config.get("num_heads") or 0), int(config.get("num_hidden_layers") or 1)
    shapes: dict[str, tuple[int, ...] | None] = {"d2t": (N,), "t2d": (V,), "token_map": (N,)}
    required: set[str] = set()
    for k in range(K):
        for j in range(nl):
            shapes[f"blocks.{k}.layers.{j}.weight"] = (H, H)
            shapes[f"blocks.{k}.layers.{j}.bias"] = (H,)
        shapes[f"lm_heads.{k}.weight"] = (N, H)
        required.add(f"lm_heads.{k}.weight")
    return shapes, required


#: ``speculators_model_type`` -> what vLLM's loader for it places (``(family, config, dims, problems) ->
#: (shapes, required)``)
_LAYOUTS = {"eagle3": _eagle3_like, "peagle": _eagle3_like, "dflash": _block_drafter, "dspark": _block_drafter,
            "eagle": _eagle1, "mtp": _mtp, "medusa": _medusa_speculators}


def _medusa_vllm(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
    """vLLM's native Medusa (``medusa.py``): ``blocks.{k}.layers.{j}`` ResidualBlocks (bias with
    ``medusa_fc_bias``), ``lm_heads.{k}.weight [V, H]``, ``token_map`` with a truncated vocabulary."""
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    K, nl = int(config["num_heads"]), int(config.get("num_hidden_layers") or 1)
    shapes: dict[str, tuple[int, ...] | None] = {}
    required = set()
    for k in range(K):
        for j in range(nl):
            shapes[f"blocks.{k}.layers.{j}.weight"] = (H, H)
            required.add(f"blocks.{k}.layers.{j}.weight")
            if config.get("medusa_fc_bias"):
                shapes[f"blocks.{k}.layers.{j}.bias"] = (H,)
                required.add(f"blocks.{k}.layers.{j}.bias")
        shapes[f"lm_heads.{k}.weight"] = (V, H)
        required.add(f"lm_heads.{k}.weight")
    if config.get("truncated_vocab_size"):
        shapes["token_map"] = (int(config["truncated_vocab_size"]),)
        required.add("token_map")
    return shapes, required


def _mlp_speculator(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
    """vLLM's ``MLPSpeculator`` (``mlp_speculator.py``; ``load_weights`` drops a ``speculator.`` prefix and looks
    each name up in ``named_parameters()``): per stage i < ``n_predict`` ``emb.{i}.weight [V, D]``,
    ``proj.{i}.weight [D, emb_dim if i == 0 else D]``, ``head.{i}.weight [V, D]``, ``ln.{i}.weight|bias [D]``
    (``inner_dim`` 0 -> D = ``emb_dim``). With ``tie_weights`` the stages share one module, so
    ``named_parameters()`` holds only index 0 (``proj`` 0 and 1): the other indices are silently skipped by
    its loader (listed with any shape), and only the shared ones are required."""
    V, E, K = int(config["vocab_size"]), int(config["emb_dim"]), int(config["n_predict"])
    D = int(config.get("inner_dim") or 0) or E
    tied = bool(config.get("tie_weights"))
    shapes: dict[str, tuple[int, ...] | None] = {}
    required = set()
    for i in range(K):
        stage = {f"emb.{i}.weight": (V, D), f"proj.{i}.weight": (D, E if i == 0 else D), f"head.{i}.weight": (V, D),
                 f"ln.{i}.weight": (D,), f"ln.{i}.bias": (D,)}
        for name, shape in stage.items():
            placed = not tied or i == 0 or (name.startswith("proj.") and i == 1)
            shapes[name] = shape if placed else None
            if placed:
                required.add(name)
    return shapes, required


#: Hugging Face causal-LM classes in vLLM's model registry (``model_executor/models/registry.py``,
#: ``_TEXT_GENERATION_MODELS``) among the architectures this project trains for: vLLM loads each from the
#: Hugging Face checkpoint layout (its ``load_weights`` maps transformers' names, fuses q/k/v and gate/up
#: itself, skips ``rotary_emb.inv_freq`` and, with tied embeddings, ``lm_head.weight``). A distilled draft model
#: is exported as such a checkpoint (``method: draft_model`` loads it with the class ``architectures`` names).
VLLM_CAUSAL_LMS = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM",
    "Llama4ForCausalLM", "DeepseekV3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "GPTNeoXForCausalLM",
})


def _plain_causal_lm(config: dict[str, Any]) -> bool:
    """A plain Hugging Face model (no speculators block) of a class vLLM registers (:data:`VLLM_CAUSAL_LMS`)."""
    arch = (config.get("architectures") or [None])[0]
    return "speculators_model_type" not in config and arch in VLLM_CAUSAL_LMS


def _hf_causal_lm(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
    """A plain causal LM: every tensor transformers' ``save_pretrained`` writes for this config (the class
    ``architectures`` names, built on the meta device, its weight conversions reverted: per-expert MoE names),
    all required;
    with ``tie_word_embeddings`` the ``lm_head.weight`` vLLM skips may be present or absent."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    d = model_config_fields(config)
    model_type, arch = d.pop("model_type", None), config["architectures"][0]
    cls = getattr(transformers, arch, None)
    if not isinstance(model_type, str) or cls is None:
        raise SpeculatorsError(f"vLLM layout check: config.json model_type {model_type!r} / architectures "
                               f"{arch!r}: transformers has no such class")
    with torch.device("meta"):  # names and shapes only: no memory, no weights
        lm = cls(transformers.AutoConfig.for_model(model_type, **d))
    own = dict(lm.state_dict())
    if config.get("tie_word_embeddings"):
        own.pop("lm_head.weight", None)
    shapes: dict[str, tuple[int, ...] | None] = {
        k: tuple(v.shape) for k, v in revert_weight_conversion(lm, own).items()}
    required = set(shapes)
    if config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = None
        required.discard("lm_head.weight")
    return shapes, required


def known_layout(config: dict[str, Any]) -> bool:
    """Whether this check knows vLLM's loader for the ``config.json`` (its ``speculators_model_type``, vLLM's
    native Medusa / MLP speculator ``model_type``, or a plain causal LM of a class in :data:`VLLM_CAUSAL_LMS`).
    A family vLLM has no loader for is not checked."""
    family = config.get("speculators_model_type") or config.get("model_type")
    return family in _LAYOUTS or family == "mlp_speculator" or _plain_causal_lm(config)


def check_layout(path: str | Path) -> list[str]:
    """Problems vLLM's loader would have with the checkpoint directory ``path`` (module docstring).

    Each problem names the tensor or config key: a name vLLM places nowhere ("There is no module or
    parameter named ..."), a shape other than the one vLLM allocates, a tensor vLLM requires that the
    file lacks, an aux-id rule broken.

    Raises:
        SpeculatorsError: ``path`` lacks ``config.json`` / ``model.safetensors``, or the family is unknown.
    """
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise SpeculatorsError(f"vLLM layout check: {f} does not exist")
    config = json.loads(cfg_file.read_text())
    shapes, required, problems = expected_layout(config)
    with safe_open(str(weights), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    lenient = config.get("model_type") == "mlp_speculator"  # its load_weights: prefix dropped, unknown names skipped
    if lenient:
        found = {k.removeprefix("speculator."): v for k, v in found.items()}
    for name, shape in sorted(found.items()):
        if name in shapes and shapes[name] is None:  # dropped by the loader whatever its shape
            continue
        if name not in shapes:
            problems.append(f"tensor `{name}`: vLLM {VLLM_VERSION} has no module or parameter for it " + (
                "(its MLPSpeculator loader skips it silently: the tensor would not be loaded)" if lenient else
                "(its loader raises \"There is no module or parameter named ...\")"))
        elif shapes[name] is not None and tuple(shapes[name]) != shape:
            problems.append(f"tensor `{name}`: shape {list(shape)}, vLLM allocates {list(shapes[name])}")
    for name in sorted(required - set(found)):
        problems.append(f"tensor `{name}` is missing: vLLM {VLLM_VERSION} requires it")
    return problems



__all__ = ["EAGLE3_TAPS", "VLLM_CAUSAL_LMS", "VLLM_VERSION", "check_layout", "expected_layout", "known_layout"]
