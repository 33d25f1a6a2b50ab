"""Target features for training: extracted once and cached on disk as safetensors shards (``data.features:
offline``), or computed by the frozen target inside every training step (``online``, see
:class:`speculators.train.unit.TrainingUnit`); both go through :func:`batch_features`, so the two
modes train on the same numbers.

Per token we keep: ``input_ids``, ``loss_mask``, the concatenated aux hidden states ``aux [nH]``,
the final post-norm hidden state ``top [H]`` (teacher logits are recomputed from it with the frozen
``lm_head``: 1 KiB per token instead of 96 KiB of logits) and the target's argmax next token
``argmax`` (full-vocab greedy prediction at t, used for metrics and for the draft-vocab loss mask).

Storage dtype (``data.feature_dtype``, :data:`FEATURE_DTYPES`):

* ``bfloat16`` (default): 2 bytes per value, float32's range (max ~3.4e38), 8 significant bits
  (a stored value is within 2**-9 = 0.2% of the target's); what a bf16 target produces anyway.
* ``float32``: 4 bytes per value, exact for a float32 target (twice the disk and RAM).
* ``float16``: 2 bytes, 11 significant bits, but overflows above 65504 (large-norm residual
  streams of big targets exceed it); extraction raises naming the layer and the value instead of
  storing ``inf``.

Cache format :data:`FEATURE_FORMAT_VERSION` (3). Format 2 (before ``data.feature_dtype``) always stored
float16, which silently turned activations above 65504 into ``inf``. A format-2 cache is never read:
its directory key differs (the format and dtype are part of the key), so its features are extracted
again under the new key and the old directory is reported (:func:`legacy_cache_dirs`) so that it can
be deleted; every shard also records its format and dtype, and a shard whose record differs from the
directory's is treated as damaged (extracted again).

One cache directory per (format, target fingerprint, aux layer ids, storage dtype); inside it every
example is keyed by the hash of its token ids, so a second epoch, a second run, or another recipe
(another drafter family) over overlapping data reads the features back instead of recomputing them,
and only new examples are extracted. Concurrent writers to one cache directory are not supported.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import SpeculatorsError
from ..utils import atomic_write_text, cache_root, restore_plain_modes, stable_hash

#: ``data.feature_dtype`` name -> storage dtype of the cached ``aux`` / ``top`` features.
FEATURE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                                          "float16": torch.float16}
DEFAULT_FEATURE_DTYPE = "bfloat16"
STORE_DTYPE = FEATURE_DTYPES[DEFAULT_FEATURE_DTYPE]  # the default storage dtype
FEATURE_FORMAT_VERSION = 3  # 2: float16 only (overflowed above 65504); 3: data.feature_dtype, recorded per shard
FLOAT16_MAX = 65504.0


def feature_dtype(name: str | torch.dtype) -> torch.dtype:
    """The storage dtype named by ``data.feature_dtype`` (a name of :data:`FEATURE_DTYPES` or one of its dtypes).

    Raises:
        SpeculatorsError: any other name, naming ``data.feature_dtype`` and the allowed values.
    """
    if isinstance(name, torch.dtype) and name in FEATURE_DTYPES.values():
        return name
    if name not in FEATURE_DTYPES:
        raise SpeculatorsError(f"data.feature_dtype: {name!r} is not a feature storage dtype; "
                               f"allowed: {sorted(FEATURE_DTYPES)}")
    return FEATURE_DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in FEATURE_DTYPES.items() if v == dtype)


def to_feature_dtype(x: torch.Tensor, dtype: str | torch.dtype, what: str, layer_ids=None) -> torch.Tensor:
    """``x`` cast to the storage dtype ``dtype``; for float16, refuse values it cannot hold.

    Args:
        x: ``[..., n * H]`` features (any float dtype): ``aux`` (n = ``len(layer_ids)`` taps, concatenated
            in that order) or ``top`` (n = 1).
        dtype: ``data.feature_dtype`` (:func:`feature_dtype`).
        what: ``"aux"`` or ``"top"``, named in the error.
        layer_ids: for ``aux``: the 0-based tapped decoder layers, to name the layer that overflows.
    Returns:
        ``x`` in ``dtype`` (same device and shape).
    Raises:
        SpeculatorsError: ``dtype`` is float16 and a value of ``x`` is beyond +-65504 (it would be stored
            as inf), naming the tap (aux layer id, or the final hidden state) and the largest magnitude.
    """
    dt = feature_dtype(dtype)
    if dt == torch.float16 and x.numel():
        n = len(layer_ids) if layer_ids else 1
        peaks = x.detach().float().abs().reshape(-1, n, x.shape[-1] // n).amax(dim=(0, 2))  # [n]
        bad = int(torch.argmax(peaks))
        if not bool(torch.isfinite(peaks[bad])) or float(peaks[bad]) > FLOAT16_MAX:
            where = f"aux layer {layer_ids[bad]}" if layer_ids else "the final hidden state (top)"
            raise SpeculatorsError(f"data.feature_dtype: float16 cannot store the target's {what} features: "
                                   f"{where} holds a value of magnitude {float(peaks[bad]):.6g} > {FLOAT16_MAX:g} "
                                   f"(it would be stored as inf); use data.feature_dtype: bfloat16 or float32")
    return x.to(dt)


@torch.no_grad()
def batch_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   dtype: str | torch.dtype = DEFAULT_FEATURE_DTYPE) -> dict[str, torch.Tensor]:
    """The training features of one right-padded batch, as both feature modes produce them.

    One frozen-target forward (:meth:`speculators.target.Target.features`, the target's own dtype, no
    autocast, no gradients); ``argmax`` is read from the unrounded final hidden state; ``aux`` and ``top``
    are then rounded to the storage dtype (:func:`to_feature_dtype`). The offline cache stores these
    values; online training (:class:`speculators.train.unit.TrainingUnit`) feeds them to the drafter
    directly, so both modes see the same numbers.

    Args:
        target: the frozen :class:`speculators.target.Target` (not LoRA-adapted).
        input_ids: ``[B, T]`` int64, right-padded. attention_mask: ``[B, T]`` 1/True on real tokens.
        dtype: ``data.feature_dtype``.
    Returns:
        ``{"aux" [B, T, n_aux * H], "top" [B, T, H]}`` in ``dtype`` and ``"argmax" [B, T]`` int64, on the
        target's device; every padding position is 0 (as :func:`speculators.data.dataset.collate` pads).
    Raises:
        SpeculatorsError: float16 storage of a value beyond 65504 (:func:`to_feature_dtype`).
    """
    dev_type = target.device.type
    with torch.autocast(device_type=dev_type, enabled=False):  # the target's dtype, as offline extraction
        feats = target.features(input_ids, attention_mask, with_logits=False)
        argmax = _argmax_chunked(target, feats.top)
    aux = to_feature_dtype(feats.aux, dtype, "aux", list(target.aux_layer_ids))
    top = to_feature_dtype(feats.top, dtype, "top")
    pad = ~attention_mask.to(aux.device).bool()
    return {"aux": aux.masked_fill(pad[..., None], 0), "top": top.masked_fill(pad[..., None], 0),
            "argmax": argmax.masked_fill(pad, 0)}


@dataclass
class TokenizedExample:
    """One rendered conversation: ``input_ids [T]`` int64, ``loss_mask [T]`` bool (assistant tokens)."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class FeatureStore:
    """All cached features of a dataset, concatenated along tokens, with per-example offsets.

    Attributes:
        ids: example ids, in store order.
        offsets: ``[E + 1]`` int64 token offsets.
        input_ids, loss_mask, argmax: ``[N]`` per-token tensors (int64, bool, int64).
        aux: ``[N, n_aux * H]``; top: ``[N, H]``; in the storage dtype (``data.feature_dtype``). A
            tokens-only store (:meth:`tokens_only`, ``data.features: online``) has ``aux [N, 0]``,
            ``top [N, 0]`` and an all-zero ``argmax``: the features are computed in the training step.
    """

    def __init__(self, ids, offsets, input_ids, loss_mask, argmax, aux, top):
        self.ids, self.offsets = ids, offsets
        self.input_ids, self.loss_mask, self.argmax, self.aux, self.top = input_ids, loss_mask, argmax, aux, top

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def example(self, i: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": self.input_ids[a:b], "loss_mask": self.loss_mask[a:b],
                "argmax": self.argmax[a:b], "aux": self.aux[a:b], "top": self.top[a:b]}

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def has_features(self) -> bool:
        """False for a tokens-only store (online features): ``aux``/``top`` have no columns."""
        return self.top.shape[-1] > 0

    @classmethod
    def tokens_only(cls, examples: list["TokenizedExample"],
                    dtype: str | torch.dtype = DEFAULT_FEATURE_DTYPE) -> "FeatureStore":
        """The store of ``examples`` without target features (``data.features: online``): token ids and
        loss masks only, ``aux [N, 0]`` / ``top [N, 0]`` in ``dtype`` and ``argmax [N]`` zeros. Nothing
        is written to disk and the target is not run."""
        lens = [len(e.input_ids) for e in examples]
        n = sum(lens)
        dt = feature_dtype(dtype)
        offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
        ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int64)
        mask = torch.tensor([bool(m) for e in examples for m in e.loss_mask], dtype=torch.bool)
        return cls([e.id for e in examples], offsets, ids, mask, torch.zeros(n, dtype=torch.int64),
                   torch.zeros(n, 0, dtype=dt), torch.zeros(n, 0, dtype=dt))

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def feature_cache_dir(target, dtype: str | torch.dtype = DEFAULT_FEATURE_DTYPE) -> Path:
    """Cache location of this target's features: a key of the cache format
    (:data:`FEATURE_FORMAT_VERSION`), the target's fingerprint and compute dtype
    (:attr:`speculators.target.Target.cache_identity`: the logit labels depend on it), its aux layer ids and the storage
    dtype (``data.feature_dtype``).

    Raises:
        SpeculatorsError: an unknown ``dtype`` (:func:`feature_dtype`).
    """
    name = _dtype_name(feature_dtype(dtype))
    key = stable_hash({"target": target.cache_identity, "aux": target.aux_layer_ids, "dtype": name,
                       "v": FEATURE_FORMAT_VERSION})
    return cache_root() / "features" / key


def legacy_cache_dirs(target) -> list[Path]:
    """Existing cache directories of ``target`` written by an older feature format (format 2: float16
    features, keyed by ``str(torch.float16)``). They are never read (their values may hold ``inf`` where
    an activation exceeded 65504); :func:`extract_features` reports them so they can be deleted."""
    key = stable_hash({"target": target.fingerprint, "aux": target.aux_layer_ids, "dtype": str(torch.float16),
                       "v": 2})
    d = cache_root() / "features" / key
    return [d] if (d / "index.json").is_file() else []


def example_key(input_ids: list[int]) -> str:
    """Content key of an example's features: the hash of its token ids."""
    return stable_hash(input_ids, n=24)


def _batches_by_length(examples: list[TokenizedExample], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    batches, cur = [], []
    for i in order:
        n = len(examples[i].input_ids)
        if cur and (len(cur) + 1) * max(n, len(examples[cur[-1]].input_ids)) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def extract_features(target, examples: list[TokenizedExample], batch_tokens: int = 4096,
                     shard_tokens: int = 65536, log=print, progress=None,
                     dtype: str | torch.dtype = DEFAULT_FEATURE_DTYPE) -> FeatureStore:
    """Run the target over ``examples`` (or read the cache) and return their features.

    Shards are written atomically as they complete and listed in ``index.json``; an interrupted
    extraction resumes from the completed shards. A damaged cache is repaired rather than fatal: a
    shard that is listed but missing, truncated, not safetensors, or inconsistent with its keys is
    reported through ``log`` (naming the file), deleted and its examples extracted again; an
    unreadable ``index.json`` is reported and the cache rebuilt.

    Args:
        target: a :class:`speculators.target.Target`.
        examples: tokenised conversations.
        batch_tokens: padded tokens per forward (memory knob).
        progress: optional callable ``(done_tokens, total_tokens)`` for progress display.
        dtype: storage dtype of ``aux``/``top`` (``data.feature_dtype``: bfloat16 | float32 | float16).
    Returns:
        the :class:`FeatureStore` of ``examples``, in their order (``aux``/``top`` in ``dtype``).
    Raises:
        SpeculatorsError: a shard written by this call cannot be read back (naming the file); an unknown
            ``dtype``; float16 storage of an activation beyond 65504 (naming the layer and the value).
    """
    store_dt = feature_dtype(dtype)
    d = feature_cache_dir(target, store_dt)
    for old in legacy_cache_dirs(target):
        log(f"features: {old} holds this target's features in the old float16 cache format (format 2, which "
            f"overflows above 65504); it is not read: features are cached under {d} (format "
            f"{FEATURE_FORMAT_VERSION}, {_dtype_name(store_dt)}). Delete {old} to free its disk space")
    d.mkdir(parents=True, exist_ok=True)
    index_file = d / "index.json"
    index = _read_index(index_file, log)
    keys = [example_key(e.input_ids) for e in examples]
    cached, broken = _read_shards(d, index, examples, keys, store_dt)
    if broken:  # a damaged cache is repaired, not fatal: forget the shard, extract its examples again
        for name, why in broken.items():
            log(f"features: warning: {d / name}: {why}; its examples are extracted again")
            _forget_shard(d, index, name)
        atomic_write_text(index_file, json.dumps(index))
    todo, seen = [], set(cached)
    for e, k in zip(examples, keys):
        if k not in seen:
            seen.add(k)
            todo.append(e)
    total = sum(len(e.input_ids) for e in examples)
    if not todo:
        log(f"features: cache hit {d} ({len(examples)} examples, {total} tokens)")
    else:
        log(f"features: extracting {len(todo)} of {len(examples)} examples "
            f"({sum(len(e.input_ids) for e in todo)} tokens) -> {d}")
        t0, n_tok = time.time(), 0
        pending: list[tuple[TokenizedExample, dict]] = []

        def flush():
            if not pending:
                return
            name = _next_shard_name(index)
            tensors = _pack([(e, f) for e, f in pending])
            tmp = d / f".{name}.tmp"
            shard_keys = [example_key(e.input_ids) for e, _ in pending]
            save_file(tensors, str(tmp), metadata={"keys": json.dumps(shard_keys),
                                                   "format": str(FEATURE_FORMAT_VERSION),
                                                   "dtype": _dtype_name(store_dt)})
            restore_plain_modes(tmp)  # safetensors >= 0.8 writes 0o600 files: make it readable per umask
            tmp.replace(d / name)
            index["shards"].append(name)
            index["keys"].update({k: name for k in shard_keys})
            atomic_write_text(index_file, json.dumps(index))
            pending.clear()

        for batch in _batches_by_length(todo, batch_tokens):
            exs = [todo[i] for i in batch]
            T = max(len(e.input_ids) for e in exs)
            ids = torch.zeros(len(exs), T, dtype=torch.long)
            att = torch.zeros(len(exs), T, dtype=torch.long)
            for r, e in enumerate(exs):
                ids[r, :len(e.input_ids)] = torch.tensor(e.input_ids)
                att[r, :len(e.input_ids)] = 1
            feats = batch_features(target, ids, att, store_dt)
            for r, e in enumerate(exs):
                n = len(e.input_ids)
                pending.append((e, {k: feats[k][r, :n].cpu() for k in ("aux", "top", "argmax")}))
                n_tok += n
            if sum(len(e.input_ids) for e, _ in pending) >= shard_tokens:
                flush()
            if progress:
                progress(n_tok, sum(len(e.input_ids) for e in todo))
        flush()
        secs = time.time() - t0
        log(f"features: {n_tok} tokens in {secs:.1f}s ({n_tok / max(secs, 1e-9):.0f} target tokens/s)")
    if todo:
        new_keys = [example_key(e.input_ids) for e in todo]
        new, broken = _read_shards(d, index, todo, new_keys, store_dt)
        if broken:
            name, why = next(iter(broken.items()))
            raise SpeculatorsError(f"features: {d / name}: unreadable right after it was written ({why}); "
                                   f"check the disk and delete {d} to start the cache afresh")
        cached.update(new)
    return _assemble(examples, cached)


def _read_index(index_file: Path, log=print) -> dict:
    """``index.json`` of a cache directory: ``{"shards": [names], "keys": {example key: shard name}}``.

    A missing file is an empty cache; an unreadable or malformed one is reported through ``log`` and
    treated as empty (its shards are then orphans, overwritten or ignored; nothing is read from them).
    """
    empty = {"shards": [], "keys": {}}
    if not index_file.exists():
        return empty
    try:
        index = json.loads(index_file.read_text())
        ok = (isinstance(index, dict) and isinstance(index.get("shards"), list)
              and isinstance(index.get("keys"), dict)
              and all(isinstance(n, str) for n in index["shards"])
              and set(index["keys"].values()) <= set(index["shards"]))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "not a {shards: [...], keys: {...}} index"
    if not ok:
        log(f"features: warning: {index_file}: unreadable ({why}); the cached features are extracted again")
        return empty
    return index


def _next_shard_name(index: dict) -> str:
    """A shard name after every listed one (never the name of a shard the index still refers to)."""
    nums = [int(n[len("shard-"):-len(".safetensors")]) for n in index["shards"]
            if n.startswith("shard-") and n.endswith(".safetensors") and n[len("shard-"):-len(".safetensors")].isdigit()]
    return f"shard-{max(nums, default=-1) + 1:05d}.safetensors"


def _forget_shard(d: Path, index: dict, name: str) -> None:
    """Drop shard ``name`` from ``index`` (in memory) and delete its file if present."""
    index["shards"] = [n for n in index["shards"] if n != name]
    index["keys"] = {k: n for k, n in index["keys"].items() if n != name}
    (d / name).unlink(missing_ok=True)


def _read_shards(d: Path, index: dict, examples: list[TokenizedExample], keys: list[str],
                 dtype: torch.dtype = STORE_DTYPE) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Read the cached features of ``examples`` (content keys ``keys``) from the shards that hold them,
    each shard read once.

    A shard is broken when its file is missing, is not a readable safetensors file (truncated,
    garbage), lacks a tensor or its ``keys`` metadata, has inconsistent offsets/lengths, or stores other
    token ids than the example listed under that key, or was written by another cache format or in
    another dtype than ``dtype`` (its ``format`` / ``dtype`` metadata, or its tensors' dtype).

    Returns:
        ``(features, broken)``: ``features[key]`` = ``{"argmax" [T] int64, "aux" [T, nH] dtype,
        "top" [T, H] dtype}`` for every key read; ``broken[shard name]`` = the reason, for shards that
        could not be used (none of their keys is in ``features``).
    """
    wanted: dict[str, TokenizedExample] = dict(zip(keys, examples))
    names = sorted({index["keys"][k] for k in wanted if k in index["keys"]})
    out: dict[str, dict[str, torch.Tensor]] = {}
    broken: dict[str, str] = {}
    for name in names:
        path = d / name
        if not path.is_file():
            broken[name] = "listed in index.json but missing"
            continue
        try:
            t = load_file(str(path))
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            shard_keys = json.loads(meta["keys"])
            fmt, stored = meta.get("format"), meta.get("dtype")
            if fmt != str(FEATURE_FORMAT_VERSION) or stored != _dtype_name(dtype):
                raise ValueError(f"written by feature format {fmt or 2} in {stored or 'float16'}, expected format "
                                 f"{FEATURE_FORMAT_VERSION} in {_dtype_name(dtype)}")
            if t["aux"].dtype != dtype or t["top"].dtype != dtype:
                raise ValueError(f"features stored as {t['aux'].dtype}/{t['top'].dtype}, expected {dtype}")
            off = t["offsets"]
            n_tok = int(off[-1])
            if (off.numel() != len(shard_keys) + 1 or int(off[0]) != 0 or bool((off[1:] < off[:-1]).any())
                    or any(t[n].shape[0] != n_tok for n in ("input_ids", "argmax", "aux", "top"))):
                raise ValueError("offsets and tensor lengths disagree")
            got = {}
            for i, k in enumerate(shard_keys):
                if k in wanted:
                    a, b = int(off[i]), int(off[i + 1])
                    if t["input_ids"][a:b].tolist() != list(wanted[k].input_ids):
                        raise ValueError(f"example {k} holds other token ids than its key's")
                    got[k] = {n: t[n][a:b].clone() for n in ("argmax", "aux", "top")}
        except Exception as e:  # noqa: BLE001 - any unreadable shard is a cache miss, reported by the caller
            broken[name] = f"unreadable shard ({type(e).__name__}: {e})"
            continue
        out.update(got)
    return out, broken


@torch.no_grad()
def _argmax_chunked(target, top: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    flat = top.reshape(-1, top.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = target.lm_head(flat[i:i + chunk]).argmax(-1)
    return out.view(top.shape[:-1])


def _pack(items) -> dict[str, torch.Tensor]:
    lens = [len(e.input_ids) for e, _ in items]
    offsets = torch.tensor([0] + lens).cumsum(0)
    return {"offsets": offsets,
            "input_ids": torch.cat([torch.tensor(e.input_ids, dtype=torch.int64) for e, _ in items]),
            "loss_mask": torch.cat([torch.tensor(e.loss_mask, dtype=torch.bool) for e, _ in items]),
            "argmax": torch.cat([f["argmax"] for _, f in items]),
            "aux": torch.cat([f["aux"] for _, f in items]),
            "top": torch.cat([f["top"] for _, f in items])}


def _assemble(examples: list[TokenizedExample], features: dict[str, dict[str, torch.Tensor]]) -> FeatureStore:
    """The :class:`FeatureStore` of ``examples`` in their order: ``input_ids`` and ``loss_mask`` from the
    examples, features from ``features`` (by content key; every example's key must be there)."""
    rows = [features[example_key(e.input_ids)] for e in examples]
    lens = [len(e.input_ids) for e in examples]
    offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    cat = {n: torch.cat([r[n] for r in rows]) for n in ("argmax", "aux", "top")}
    input_ids = torch.cat([torch.tensor(e.input_ids, dtype=torch.int64) for e in examples])
    loss_mask = torch.cat([torch.tensor(e.loss_mask, dtype=torch.bool) for e in examples])
    return FeatureStore([e.id for e in examples], offsets, input_ids, loss_mask, cat["argmax"],
                        cat["aux"], cat["top"])
