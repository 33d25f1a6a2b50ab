"""Target side of verification: raw target logits -> what the accept/reject scan and the sampler read.

Shared torch code used in front of every backend (torch and Triton), so both see bit-identical
probabilities and return identical tokens.

* ``probs_at_drafts`` -> ``[T]`` ``p_i(d_i)`` at every draft position the scan will read.
* ``final_tokens`` -> ``[B]`` the recovered or bonus token of each request, sampled by the backend's
  ``sample_rows`` (inverse CDF, one float64 uniform per request; see :mod:`speculators.verify.rejection`)
  from the full target distribution of the one row each request still samples (first rejected
  position, or the bonus position).
* ``target_argmax`` -> ``[T + B]`` argmax rows for all-greedy batches.

Two evaluation orders, chosen per call by ``rejection_sample(..., order=...)`` (:func:`use_lazy`; same
values up to floating-point rounding; within one call every backend sees the same tensors):

* eager (``order="eager"``; ``"auto"`` on CUDA and for small CPU inputs): one :func:`apply_sampling` over
  all ``T + B`` rows (vLLM's order).
* lazy (``order="lazy"``, CPU only; ``"auto"`` for CPU inputs above ``2 * CHUNK_BYTES``): position by
  position, only for requests whose earlier drafts were all accepted (a position after a rejection is
  never read by any scan), in row chunks of about ``CHUNK_BYTES`` so intermediates stay in cache.
  Positions never evaluated hold 0 (``-1`` for argmax) and are not read. Rows without top-k / top-p are
  evaluated as ``e = 2**((x - max) / T * log2(e))`` read in place from the logits, and only
  ``p(d) = e_d / sum(e)`` is formed for an accept test; a row whose draft is rejected is normalised
  into a chunk-sized pending buffer while it is still in cache, and the buffer is sampled whenever it
  fills (``final_tokens`` then only evaluates the bonus rows, and any row the scan's verdict moved
  elsewhere). No ``[T + B, V]`` probability tensor is materialised.

Both orders compute in float32 (the logits reach this module detached, float32 or exactly convertible
to it: see ``rejection._entry_logits``), greedy rows included, so the order does not change a greedy token.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import layout as _layout_mod
from .layout import VerifyInputError, _Layout
from .sampling import SamplingParams, _sampling_probs, effective_temperature, first_argmax

ORDERS = ("auto", "lazy", "eager")


def use_lazy(target_logits: Tensor, order: str = "auto") -> bool:
    """Whether ``rejection_sample(..., order=order)`` evaluates the target side lazily.

    ``"eager"``: never. ``"lazy"``: always (CPU tensors only: the lazy order keeps host-side lists and
    reuses CPU buffers). ``"auto"``: on CPU when the logits exceed ``2 * CHUNK_BYTES`` (small inputs:
    eager has less overhead); eager on other devices.

    Raises:
        VerifyInputError: ``order`` is not one of ``ORDERS``, or ``"lazy"`` with non-CPU logits.
    """
    if order not in ORDERS:
        raise VerifyInputError(f"order: expected 'auto', 'lazy' or 'eager', got {order!r}")
    on_cpu = target_logits.device.type == "cpu"
    if order == "lazy" and not on_cpu:
        raise VerifyInputError(
            f"order: 'lazy' is implemented for CPU tensors only, target_logits are on {target_logits.device} "
            f"(use 'auto' or 'eager')"
        )
    if order == "auto":
        return on_cpu and target_logits.numel() * 4 > 2 * _layout_mod.CHUNK_BYTES
    return order == "lazy"


def _chunk_rows(vocab: int) -> int:
    return max(1, _layout_mod.CHUNK_BYTES // (4 * vocab))


_LOCAL = threading.local()


def cpu_buffer(name: str, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A ``[rows, cols]`` CPU buffer kept between calls (per thread, grow-only).

    Reusing the pages avoids the page faults of fresh multi-MB allocations, which on CPU cost as much
    as the arithmetic. Callers must not hold a buffer across another call with the same ``name``.
    """
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.dtype != dtype or buf.shape[1] != cols or buf.shape[0] < rows:
        old_rows = 0 if buf is None or buf.dtype != dtype or buf.shape[1] != cols else buf.shape[0]
        buf = bufs[name] = torch.empty(max(rows, old_rows), cols, dtype=dtype)
    return buf[:rows]


class _Scratch:
    """Two ``[chunk, V]`` float32 buffers reused by every chunk (and every call, on CPU)."""

    def __init__(self, target_logits: Tensor):
        self.rows = _chunk_rows(target_logits.shape[1])
        vocab = target_logits.shape[1]
        self.direct = target_logits.dtype == torch.float32
        if target_logits.device.type == "cpu":
            self.logits = cpu_buffer("scratch.logits", self.rows, vocab)
            self.probs = cpu_buffer("scratch.probs", self.rows, vocab)
            self.rejected = cpu_buffer("scratch.rejected", self.rows, vocab)
        else:
            self.logits = torch.empty(self.rows, vocab, dtype=torch.float32, device=target_logits.device)
            self.probs = torch.empty(self.rows, vocab, dtype=torch.float32, device=target_logits.device)
            self.rejected = torch.empty(self.rows, vocab, dtype=torch.float32, device=target_logits.device)

    def gather_rows(self, target_logits: Tensor, rows: Tensor) -> Tensor:
        if not self.direct:
            return target_logits.index_select(0, rows).float()
        return torch.index_select(target_logits, 0, rows, out=self.logits[: rows.numel()])


class Sampler:
    """Samples recovered / bonus tokens through ``backend.sample_rows`` (looked up at call time).

    ``backend.sample_rows(p, sel, draft_probs, pos, draft_token_ids, u) -> [S] int64`` samples row
    ``p[sel[i]]`` (``sel=None``: row ``i``) of the ``[R, V]`` target probabilities ``p`` with the float64
    uniform ``u[i]``: ``max(p - draft_probs[pos[i]], 0)`` when ``pos[i] >= 0`` (point-mass q, i.e.
    ``draft_probs is None``: ``p`` without ``draft_token_ids[pos[i]]``), else ``p`` (bonus).
    """

    def __init__(self, backend, draft_token_ids: Tensor, draft_probs: Tensor | None, sample_uniform: Tensor):
        self.backend = backend
        self.draft_token_ids = draft_token_ids
        self.draft_probs = draft_probs
        self.sample_uniform = sample_uniform
        self._u_list: list[float] | None = None

    def __call__(self, p: Tensor, sel: Tensor | None, reqs: Tensor | list[int], pos: Tensor | list[int]) -> Tensor:
        device = p.device
        if isinstance(reqs, list):  # lazy CPU path: small host lists
            if self._u_list is None:
                self._u_list = self.sample_uniform.tolist()
            u = torch.tensor([self._u_list[b] for b in reqs], dtype=torch.float64, device=device)
            pos = torch.tensor(pos, dtype=torch.int64, device=device)
        else:
            u = self.sample_uniform.index_select(0, reqs)
        return self.backend.sample_rows(p, sel, self.draft_probs, pos, self.draft_token_ids, u)


LOG2E = 1.4426950408889634


def row_runs(logits: Tensor, rows: list[int]) -> list[tuple[int, int, Tensor]]:
    """Split ``rows`` of the contiguous ``[N, V]`` ``logits`` into maximal runs at a constant stride.

    Returns ``(start, length, view)`` triples: ``view`` is the ``[length, V]`` strided view of rows
    ``rows[start : start + length]``, read in place (no copy). ``rows``: ascending runs are merged;
    any order is valid (a descending step starts a new run).

    Raises:
        ValueError: ``logits`` is not a contiguous 2-D tensor (its rows would not be where the views point).
    """
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"row_runs: logits must be a contiguous [N, V] tensor, got shape {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")
    v, base = logits.shape[1], logits.storage_offset()
    runs, i, n = [], 0, len(rows)
    while i < n:
        j = i + 1
        if j < n and rows[j] > rows[i]:
            step = rows[j] - rows[i]
            while j + 1 < n and rows[j + 1] - rows[j] == step:
                j += 1
            j += 1
        else:
            step = 1
        runs.append((i, j - i, logits.as_strided((j - i, v), (step * v, 1), base + rows[i] * v)))
        i = j
    return runs


def _balanced_chunks(items: list[int], step: int) -> list[list[int]]:
    """``items`` in the fewest chunks of at most ``step``, of (nearly) equal sizes."""
    if not items:
        return []
    size = -(-len(items) // -(-len(items) // step))
    return [items[i : i + size] for i in range(0, len(items), size)]


def _plain_requests(sampling: SamplingParams, vocab: int) -> Tensor:
    """``[B]`` bool: stochastic without top-k / top-p (these rows take the exp2 fast path)."""
    plain = sampling.temperature > 0
    if sampling.top_k is not None:
        plain &= (sampling.top_k <= 0) | (sampling.top_k >= vocab)
    if sampling.top_p is not None:
        plain &= sampling.top_p >= 1.0
    return plain


class _RowEvaluator:
    """Target distributions of arbitrary rows of ``target_logits``, a cache-sized chunk at a time.

    :meth:`rows` returns ``(e, z)`` with ``e / z[:, None] == apply_sampling(rows)`` up to rounding:

    * plain rows (temperature > 0, no top-k / top-p; the common case) skip softmax's normalisation
      pass and its slower exp: ``e = 2**((x - m) * c)`` with ``m`` the row max and ``c = log2(e) / T``,
      ``z = sum(e)`` (an accept test only needs ``p(d) = e_d / z``);
    * other rows go through :func:`apply_sampling`'s code (``z = 1``).

    Plain rows are read in place (strided views over runs of rows at a constant stride, e.g. position
    ``j`` of consecutive equal-length requests) instead of being gathered into a buffer first.
    """

    def __init__(self, target_logits: Tensor, sampling: SamplingParams):
        self.logits = target_logits
        self.sampling = sampling
        self.scratch = _Scratch(target_logits)
        self.vocab = target_logits.shape[1]
        self.temps = effective_temperature(sampling.temperature, warn=False).tolist()
        self.viewable = target_logits.dtype == torch.float32 and target_logits.is_contiguous()

    def rows(self, rows: list[int], reqs: list[int], plain: bool) -> tuple[Tensor, Tensor | None]:
        """``(e [R, V], z [R] or None for z = 1)`` for ``rows`` (request ``reqs[i]``'s parameters)."""
        n = len(rows)
        scratch = self.scratch
        if plain:
            temps = [self.temps[b] for b in reqs]
            same = all(t == temps[0] for t in temps)
            if not same:
                c_all = torch.tensor(temps, dtype=torch.float32, device=self.logits.device).reciprocal_().mul_(LOG2E)
            if self.viewable:  # read the rows in place, run by run
                e = scratch.probs[:n]
                runs = row_runs(self.logits, rows)
            else:
                idx = torch.tensor(rows, dtype=torch.int64, device=self.logits.device)
                e = scratch.gather_rows(self.logits, idx)
                runs = [(0, n, e)]
            for start, length, x in runs:  # e = x - max(x): exactly 0 at the maximum
                torch.sub(x, x.amax(dim=-1, keepdim=True), out=e[start : start + length])
            e.mul_(LOG2E / temps[0] if same else c_all.unsqueeze(1))  # y = (x - max) * log2(e) / T
            e.exp2_()
            return e, e.sum(dim=-1)
        x = scratch.gather_rows(self.logits, torch.tensor(rows, dtype=torch.int64, device=self.logits.device))
        idx = torch.tensor(reqs, dtype=torch.int64, device=self.logits.device)
        sp = self.sampling
        p = _sampling_probs(
            x,
            sp.temperature.index_select(0, idx),  # clamped + cast by _sampling_probs
            None if sp.top_k is None else sp.top_k.index_select(0, idx),
            None if sp.top_p is None else sp.top_p.index_select(0, idx),
            owned=True,
            out=scratch.probs[:n],
        )
        return p, None


class _PendingRows:
    """Rejected rows' target distributions packed into ``buf`` and sampled a buffer at a time.

    Sampling a few rows per chunk costs a dozen small ops each time; batching them up to the buffer's
    ``[chunk, V]`` rows keeps the rows in cache while amortising those ops.
    """

    def __init__(self, buf: Tensor, sampler: Sampler, sampled_row: list[int], sampled_tok: list[int]):
        self.buf, self.sampler = buf, sampler
        self.sampled_row, self.sampled_tok = sampled_row, sampled_tok
        self.count = 0
        self.reqs: list[int] = []
        self.pos: list[int] = []
        self.rows: list[int] = []

    def add(self, e: Tensor, z: Tensor | None, idx: list[int], reqs: list[int], pos: list[int], rows: list[int]):
        """Append rows ``e[idx] / z[idx]`` (``z=None``: already normalised) for requests ``reqs``."""
        k = len(idx)
        dst = self.buf[self.count : self.count + k]
        if k == e.shape[0]:
            dst.copy_(e)
        else:
            torch.index_select(e, 0, torch.tensor(idx, dtype=torch.int64, device=e.device), out=dst)
        if z is not None:
            zs = z if k == e.shape[0] else z[idx]
            dst.div_(zs.unsqueeze(1))
        self.count += k
        self.reqs += reqs
        self.pos += pos
        self.rows += rows

    def sample(self, p: Tensor, reqs: list[int], pos: list[int], rows: list[int]) -> None:
        """Sample the normalised rows ``p`` ``[len(reqs), V]`` now and record each request's row and token."""
        toks = self.sampler(p, None, reqs, pos).tolist()
        for b, r, t in zip(reqs, rows, toks):
            self.sampled_row[b] = r
            self.sampled_tok[b] = t

    def flush(self) -> None:
        """Sample every pending row (:meth:`sample`); empties the buffer."""
        if not self.count:
            return
        self.sample(self.buf[: self.count], self.reqs, self.pos, self.rows)
        self.count = 0
        self.reqs, self.pos, self.rows = [], [], []


def probs_at_drafts(
    layout: _Layout,
    target_logits: Tensor,
    sampling: SamplingParams,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    uniform: Tensor,
    *,
    lazy: bool,
    cache: dict | None = None,
    sampler: Sampler | None = None,
) -> Tensor:
    """``[T]`` float32 ``p_i(d_i)`` (processed target probability of each draft token).

    With ``lazy=True`` the accept test ``u * q(d) < p(d)`` (the scan's exact rule, in float32) decides
    which requests need their next position; positions after a rejection are left at 0, and (with
    ``sampler`` and ``cache``) each rejected row is normalised while its probabilities are in cache,
    sampled with the other pending rejected rows a buffer at a time (:class:`_PendingRows`), and
    recorded in ``cache`` for :func:`final_tokens`. With ``lazy=False`` all ``T + B`` rows go
    through one :func:`apply_sampling`, kept in ``cache``.
    """
    total, batch = layout.total_drafts, layout.batch
    device = target_logits.device
    if not lazy:
        probs = _all_probs(layout, target_logits, sampling, cache)
        if total == 0:
            return torch.zeros(0, dtype=torch.float32, device=device)
        req_of_pos = torch.repeat_interleave(torch.arange(batch, device=device), layout.n, output_size=total)
        return probs[torch.arange(total, device=device) + req_of_pos, draft_token_ids]
    if total == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    # Host-side bookkeeping (lazy is CPU only): B and T are small, tensor ops on them cost more than lists.
    lhs = uniform if draft_probs is None else uniform * draft_probs[torch.arange(total, device=device), draft_token_ids]
    lhs_l = lhs.tolist()  # float32 values: comparing them as Python floats is the scan's float32 test
    ids_l = draft_token_ids.tolist()
    nums = layout.num_drafts
    starts = [0] * batch
    acc = 0
    for b, n in enumerate(nums):
        starts[b] = acc
        acc += n
    plain_l = _plain_requests(sampling, layout.vocab).tolist()
    ev = _RowEvaluator(target_logits, sampling)
    step = ev.scratch.rows
    presample = sampler is not None and cache is not None
    sampled_row = [-1] * batch
    sampled_tok = [-1] * batch
    p_draft = [0.0] * total
    alive = [b for b in range(batch) if nums[b] > 0]
    pending = _PendingRows(ev.scratch.rejected, sampler, sampled_row, sampled_tok) if presample else None
    for j in range(layout.max_drafts):
        if not alive:
            break
        nxt = []
        for plain in (True, False):
            group = [b for b in alive if plain_l[b] == plain]
            for reqs in _balanced_chunks(group, step):
                pos = [starts[b] + j for b in reqs]
                rows = [p + b for p, b in zip(pos, reqs)]
                e, z = ev.rows(rows, reqs, plain)
                d = torch.tensor([ids_l[p] for p in pos], dtype=torch.int64, device=device)
                p_d = e.gather(1, d.unsqueeze(1)).squeeze(1)
                if z is not None:
                    p_d.div_(z)
                rej = []
                for i, (b, p, v) in enumerate(zip(reqs, pos, p_d.tolist())):
                    p_draft[p] = v
                    if lhs_l[p] < v:  # accept with probability min(1, p(d) / q(d))
                        if j + 1 < nums[b]:
                            nxt.append(b)
                    else:
                        rej.append(i)
                if presample and rej:
                    # normalise only the rejected rows (p = e / z), packed into the pending buffer
                    if pending.count + len(rej) > step:
                        pending.flush()
                    r_args = ([reqs[i] for i in rej], [pos[i] for i in rej], [rows[i] for i in rej])
                    if len(rej) == len(reqs) and not pending.count:  # the whole chunk: sample it in place
                        pending.sample(e if z is None else e.div_(z.unsqueeze(1)), *r_args)
                    else:
                        pending.add(e, z, rej, *r_args)
        alive = sorted(nxt)
    if presample:
        pending.flush()
        cache["sampled_row"] = torch.tensor(sampled_row, dtype=torch.int64, device=device)
        cache["sampled_token"] = torch.tensor(sampled_tok, dtype=torch.int64, device=device)
        cache["evaluator"] = ev
    return torch.tensor(p_draft, dtype=torch.float32, device=device)


def _all_probs(layout: _Layout, target_logits: Tensor, sampling: SamplingParams, cache: dict | None) -> Tensor:
    if cache is not None and "probs" in cache:
        return cache["probs"]
    rows = layout.total_drafts + layout.batch
    req_of_row = torch.repeat_interleave(
        torch.arange(layout.batch, device=target_logits.device), layout.n + 1, output_size=rows
    )
    temp = sampling.temperature.index_select(0, req_of_row)  # _sampling_probs applies effective_temperature
    top_k = None if sampling.top_k is None else sampling.top_k.index_select(0, req_of_row)
    top_p = None if sampling.top_p is None else sampling.top_p.index_select(0, req_of_row)
    probs = _sampling_probs(target_logits.float(), temp, top_k, top_p, owned=False)
    if cache is not None:
        cache["probs"] = probs
    return probs


def final_tokens(
    layout: _Layout,
    target_logits: Tensor,
    sampling: SamplingParams,
    num_accepted: Tensor,
    sampler: Sampler,
    *,
    lazy: bool,
    cache: dict | None = None,
) -> Tensor:
    """``[B]`` int64 recovered (first rejected position) or bonus token of each request.

    Rows already sampled by the lazy :func:`probs_at_drafts` (recorded in ``cache``) are reused when
    they are the row the scan's ``num_accepted`` points at; the others are evaluated here.
    """
    device = target_logits.device
    rows = layout.row_start + num_accepted
    pos = torch.where(num_accepted < layout.n, layout.draft_start + num_accepted, -1)
    if cache is not None and "sampled_row" in cache:
        tokens = cache["sampled_token"]
        todo = (cache["sampled_row"] != rows).nonzero().squeeze(1)
    else:
        tokens = torch.empty(layout.batch, dtype=torch.int64, device=device)
        todo = torch.arange(layout.batch, device=device)
    if todo.numel() == 0:
        return tokens
    t_rows, t_pos = rows.index_select(0, todo), pos.index_select(0, todo)
    if not lazy:
        probs = _all_probs(layout, target_logits, sampling, cache)
        tokens[todo] = sampler(probs, t_rows, todo, t_pos)
        return tokens
    ev = cache.get("evaluator") if cache is not None else None
    ev = ev if ev is not None else _RowEvaluator(target_logits, sampling)
    plain_l = _plain_requests(sampling, layout.vocab).tolist()
    todo_l, rows_l, pos_l = todo.tolist(), t_rows.tolist(), t_pos.tolist()
    step = ev.scratch.rows
    for plain in (True, False):
        idx = [i for i, b in enumerate(todo_l) if plain_l[b] == plain]
        for part in _balanced_chunks(idx, step):
            reqs = [todo_l[i] for i in part]
            e, z = ev.rows([rows_l[i] for i in part], reqs, plain)
            if z is not None:
                e.div_(z.unsqueeze(1))
            toks = sampler(e, None, reqs, [pos_l[i] for i in part])
            tokens[torch.tensor(reqs, dtype=torch.int64, device=device)] = toks
    return tokens


def _argmax_rows(target_logits: Tensor, rows: Tensor, scratch: _Scratch) -> Tensor:
    """``[len(rows)]`` :func:`first_argmax` of the given rows, read in place when possible."""
    out = torch.empty(rows.numel(), dtype=torch.int64, device=target_logits.device)
    if target_logits.dtype == torch.float32 and target_logits.is_contiguous():
        for start, length, x in row_runs(target_logits, rows.tolist()):
            out[start : start + length] = first_argmax(x)
        return out
    step = scratch.rows
    for s in range(0, rows.numel(), step):
        out[s : s + step] = first_argmax(scratch.gather_rows(target_logits, rows[s : s + step]))
    return out


def target_argmax(layout: _Layout, target_logits: Tensor, draft_token_ids: Tensor, *, lazy: bool) -> Tensor:
    """``[T + B]`` int64 argmax of the raw target logits (greedy); lazily only rows the scan reads."""
    if not lazy:
        return first_argmax(target_logits)
    device = target_logits.device
    am = torch.full((target_logits.shape[0],), -1, dtype=torch.int64, device=device)
    scratch = _Scratch(target_logits)
    alive = torch.ones(layout.batch, dtype=torch.bool, device=device)
    for j in range(layout.max_drafts + 1):
        req = alive.nonzero().squeeze(1)
        if req.numel() == 0:
            break
        rows = layout.row_start.index_select(0, req) + j  # draft position j, or the bonus row when j == n
        a = _argmax_rows(target_logits, rows, scratch)
        am[rows] = a
        is_draft = layout.n.index_select(0, req) > j
        if layout.total_drafts:
            pos = (layout.draft_start.index_select(0, req) + j).clamp_max(layout.total_drafts - 1)
            alive[req] = is_draft & (draft_token_ids.index_select(0, pos) == a)
        else:
            alive[req] = False
    return am
