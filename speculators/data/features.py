"""Target features for training, extracted once and cached on disk as safetensors shards.

Per token we keep: ``input_ids``, ``loss_mask``, the concatenated aux hidden states ``aux [nH]``,
the final post-norm hidden state ``top [H]`` (teacher logits are recomputed from it with the frozen
``lm_head``: 1 KiB per token instead of 96 KiB of logits) and the target's argmax next token
``argmax`` (full-vocab greedy prediction at t, used for metrics and for the draft-vocab loss mask).

One cache directory per (target fingerprint, aux layer ids, storage dtype); inside it every
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

from ..utils import atomic_write_text, cache_root, stable_hash

STORE_DTYPE = torch.float16


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
        aux: ``[N, n_aux * H]`` float16; top: ``[N, H]`` float16.
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
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def feature_cache_dir(target) -> Path:
    """Cache location of this target's features (its fingerprint, aux layer ids, storage dtype)."""
    key = stable_hash({"target": target.fingerprint, "aux": target.aux_layer_ids, "dtype": str(STORE_DTYPE)})
    return cache_root() / "features" / key


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
                     shard_tokens: int = 65536, log=print, progress=None) -> FeatureStore:
    """Run the target over ``examples`` (or read the cache) and return their features.

    Shards are written atomically as they complete and listed in ``index.json``; an interrupted
    extraction resumes from the completed shards.

    Args:
        target: a :class:`speculators.target.Target`.
        examples: tokenised conversations.
        batch_tokens: padded tokens per forward (memory knob).
        progress: optional callable ``(done_tokens, total_tokens)`` for progress display.
    """
    d = feature_cache_dir(target)
    d.mkdir(parents=True, exist_ok=True)
    index_file = d / "index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else {"shards": [], "keys": {}}
    keys = [example_key(e.input_ids) for e in examples]
    todo, seen = [], set(index["keys"])
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
            name = f"shard-{len(index['shards']):05d}.safetensors"
            tensors = _pack([(e, f) for e, f in pending])
            tmp = d / f".{name}.tmp"
            shard_keys = [example_key(e.input_ids) for e, _ in pending]
            save_file(tensors, str(tmp), metadata={"keys": json.dumps(shard_keys)})
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
            feats = target.features(ids, att, with_logits=False)
            argmax = _argmax_chunked(target, feats.top)
            for r, e in enumerate(exs):
                n = len(e.input_ids)
                pending.append((e, {"aux": feats.aux[r, :n].to(STORE_DTYPE).cpu(),
                                    "top": feats.top[r, :n].to(STORE_DTYPE).cpu(),
                                    "argmax": argmax[r, :n].cpu()}))
                n_tok += n
            if sum(len(e.input_ids) for e, _ in pending) >= shard_tokens:
                flush()
            if progress:
                progress(n_tok, sum(len(e.input_ids) for e in todo))
        flush()
        dt = time.time() - t0
        log(f"features: {n_tok} tokens in {dt:.1f}s ({n_tok / max(dt, 1e-9):.0f} target tokens/s)")
    return _load(d, index, examples, keys)


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


def _load(d: Path, index: dict, examples: list[TokenizedExample], keys: list[str]) -> FeatureStore:
    """Assemble the store of ``examples`` from the shards that hold their keys (each read once).

    ``input_ids`` and ``loss_mask`` come from the examples; features from the cache.
    """
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    wanted = set(keys)
    for name in sorted({index["keys"][k] for k in wanted}):
        t = load_file(str(d / name))
        with safe_open(str(d / name), "pt") as f:
            shard_keys = json.loads(f.metadata()["keys"])
        off = t["offsets"]
        for i, k in enumerate(shard_keys):
            if k in wanted:
                a, b = int(off[i]), int(off[i + 1])
                per_key[k] = {n: t[n][a:b].clone() for n in ("argmax", "aux", "top")}
    rows = [per_key[k] for k in keys]
    lens = [len(e.input_ids) for e in examples]
    offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    cat = {n: torch.cat([r[n] for r in rows]) for n in ("argmax", "aux", "top")}
    input_ids = torch.cat([torch.tensor(e.input_ids, dtype=torch.int64) for e in examples])
    loss_mask = torch.cat([torch.tensor(e.loss_mask, dtype=torch.bool) for e in examples])
    return FeatureStore([e.id for e in examples], offsets, input_ids, loss_mask, cat["argmax"],
                        cat["aux"], cat["top"])
