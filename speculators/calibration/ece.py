"""Measuring a calibration (step 3 of :mod:`speculators.calibration`): survival pairs, equal-mass
reliability bins and the ECE (Nixon et al. 2019, "Measuring calibration in deep learning"), the ECE's
noise floor (what a perfectly calibrated head would score) and the prompt bootstrap (its sampling
uncertainty over prompts), and the summary (ECE, NLL, Brier, per position) the report shows.
"""

from __future__ import annotations

import torch

from ..errors import SpeculatorsError
from ..decode.gating import survival_probabilities
from .record import ConfidenceRecord

DEFAULT_BINS = 15


def survival_pairs(record: ConfidenceRecord, temperature: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (step, position) pair with position <= the step's drafts: ``(S [M] float64 predicted
    survival, y [M] float64 1 when drafts 1..k were all accepted, k [M] int64 1-based position)``.

    ``temperature``: ``[>= K]`` positive (None = all 1), ``bias``: ``[>= K]`` (None = all 0), see
    :func:`speculators.decode.gating.survival_probabilities`.
    """
    probs, labels, pos = [], [], []
    for z, n, a in zip(record.logits, record.drafted.tolist(), record.accepted.tolist()):
        s = survival_probabilities(z[:n], temperature, bias).double()
        probs.append(s)
        labels.append((torch.arange(1, n + 1) <= a).double())
        pos.append(torch.arange(1, n + 1))
    if not probs:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(probs), torch.cat(labels), torch.cat(pos)


BOOTSTRAP_RESAMPLES = 1000  # prompt resamples of :func:`ece_prompt_bootstrap`


def ece_prompt_bootstrap(record: ConfidenceRecord, calibrations: dict[str, tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]],
                         reference: str, bins: int = DEFAULT_BINS, resamples: int = BOOTSTRAP_RESAMPLES,
                         seed: int = 0) -> dict | None:
    """Sampling uncertainty of the survival ECE over PROMPTS: whole prompts (all their steps) are
    resampled with replacement ``resamples`` times and every calibration's pooled ECE
    (:func:`expected_calibration_error`) and its ratio to ``reference``'s are recomputed on each resample
    (a cluster bootstrap: steps of one prompt are correlated, which :func:`ece_noise_floor`, redrawing
    each pair independently, does not see).

    Args:
        record: steps with prompt indices (``record.prompt``). calibrations: name -> ``(temperature,
            bias)`` as :func:`survival_pairs` takes them (None = 1 / 0). reference: the name every ratio
            divides by (e.g. the raw head). bins: equal-mass bins. resamples: >= 1. seed: the
            resampling generator's seed.
    Returns:
        None without prompt indices or with fewer than 2 prompts; else ``{"prompts", "resamples",
        "reference", "ece": {name: {"point", "lo", "hi"}}, "ratio": {name: {"point", "lo", "hi"}}}``
        with 2.5% / 97.5% percentile bounds (``ratio`` for every name but ``reference``; a resample
        whose reference ECE is 0 is left out of the ratios).
    Raises:
        SpeculatorsError: ``reference`` not among ``calibrations``, ``resamples`` < 1, ``bins`` < 1.
    """
    if reference not in calibrations:
        raise SpeculatorsError(f"ece_prompt_bootstrap: reference {reference!r} is not one of {sorted(calibrations)}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise SpeculatorsError(f"resamples must be an integer >= 1, got {resamples!r}")
    if record.prompt is None:
        return None
    prompts, step_prompt = torch.unique(record.prompt, return_inverse=True)
    n_prompts = prompts.numel()
    if n_prompts < 2:
        return None
    pair_prompt = torch.repeat_interleave(step_prompt, record.drafted)  # the pairs' prompt, pair order as survival_pairs
    members = torch.split(torch.argsort(pair_prompt, stable=True), torch.bincount(pair_prompt, minlength=n_prompts).tolist())
    pairs = {name: survival_pairs(record, t, b)[:2] for name, (t, b) in calibrations.items()}
    gen = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {name: [] for name in calibrations}
    for _ in range(resamples):
        pick = torch.randint(n_prompts, (n_prompts,), generator=gen).tolist()
        idx = torch.cat([members[j] for j in pick])
        for name, (s, y) in pairs.items():
            draws[name].append(expected_calibration_error(s[idx], y[idx], bins))

    def band(values: list[float], point: float) -> dict:
        v = torch.tensor(values, dtype=torch.float64)
        lo, hi = torch.quantile(v, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist() if v.numel() else (point, point)
        return {"point": point, "lo": lo, "hi": hi}

    point = {name: expected_calibration_error(s, y, bins) for name, (s, y) in pairs.items()}
    ref = draws[reference]
    out = {"prompts": int(n_prompts), "resamples": resamples, "reference": reference,
           "ece": {name: band(draws[name], point[name]) for name in calibrations}, "ratio": {}}
    for name in calibrations:
        if name != reference:
            ratios = [e / r for e, r in zip(draws[name], ref) if r > 0]
            out["ratio"][name] = band(ratios, point[name] / point[reference] if point[reference] > 0 else float("nan"))
    return out


def _equal_mass_bins(m: int, bins: int) -> list[torch.Tensor]:
    """The index ranges of ``min(bins, m)`` contiguous equal-mass bins over ``m`` sorted predictions
    (sizes differ by at most one; none empty; ``[]`` for ``m = 0``).

    Raises:
        SpeculatorsError: ``bins`` not an integer >= 1.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise SpeculatorsError(f"bins must be an integer >= 1, got {bins!r}")
    return [idx for idx in torch.tensor_split(torch.arange(m), min(bins, max(m, 1))) if idx.numel()]


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> list[dict]:
    """Equal-mass bins of predictions ``probs [M]`` in [0, 1] against 0/1 ``labels [M]``: sorted by
    prediction and split into ``min(bins, M)`` contiguous groups whose sizes differ by at most one.

    Returns:
        one dict per non-empty bin: ``lo`` / ``hi`` (smallest / largest prediction in it), ``mean_pred``,
        ``frac_pos`` (observed frequency), ``count``.
    Raises:
        SpeculatorsError: ``bins`` < 1 or shapes that differ.
    """
    p, y = probs.double().reshape(-1), labels.double().reshape(-1)
    if p.shape != y.shape:
        raise SpeculatorsError(f"reliability_bins: {p.numel()} predictions for {y.numel()} labels")
    order = torch.argsort(p, stable=True)
    p, y = p[order], y[order]
    out = []
    for idx in _equal_mass_bins(p.numel(), bins):
        out.append({"lo": float(p[idx[0]]), "hi": float(p[idx[-1]]), "mean_pred": float(p[idx].mean()),
                    "frac_pos": float(y[idx].mean()), "count": int(idx.numel())})
    return out


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """ECE with equal-mass bins (:func:`reliability_bins`): ``sum_b (n_b / M) |mean_pred_b - frac_pos_b|``
    (0 = perfectly calibrated; 0.0 without pairs)."""
    table = reliability_bins(probs, labels, bins)
    m = sum(b["count"] for b in table)
    return sum(b["count"] / m * abs(b["mean_pred"] - b["frac_pos"]) for b in table) if m else 0.0


NOISE_DRAWS = 200  # label redraws of :func:`ece_noise_floor`


def ece_noise_floor(probs: torch.Tensor, bins: int = DEFAULT_BINS, draws: int = NOISE_DRAWS,
                    seed: int = 0) -> dict:
    """The ECE that a PERFECTLY calibrated head making the same predictions would score on this many pairs:
    outcomes redrawn ``draws`` times as ``y ~ Bernoulli(probs)`` and binned like
    :func:`expected_calibration_error` (equal-mass bins, the same bin edges since the predictions do not
    change). The plug-in ECE is biased upwards by sampling noise; an ECE inside this band is what a
    perfectly calibrated head would score, so it is no evidence of miscalibration (the band is the
    resolution of one ECE, not a test of the difference between two on the same outcomes).

    Args:
        probs: ``[M]`` predictions in [0, 1] (any float dtype).
        bins: equal-mass bins (>= 1). draws: redraws (>= 1). seed: the redraws' generator seed.
    Returns:
        ``{"mean", "lo", "hi"}``: the mean and the 5% / 95% quantiles of the redrawn ECEs (all 0.0 without
        pairs).
    Raises:
        SpeculatorsError: ``bins`` or ``draws`` < 1.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise SpeculatorsError(f"draws must be an integer >= 1, got {draws!r}")
    p = torch.sort(probs.double().reshape(-1).clamp(0.0, 1.0), stable=True).values
    m = p.numel()
    sizes = torch.tensor([idx.numel() for idx in _equal_mass_bins(m, bins)], dtype=torch.int64)
    if m == 0:
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    bin_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    mean_pred = torch.zeros(sizes.numel(), dtype=torch.float64).index_add_(0, bin_of, p) / sizes
    gen = torch.Generator().manual_seed(seed)
    chunk = max(1, min(draws, (1 << 22) // m))  # at most ~4M redrawn outcomes (32 MB) at a time
    eces = []
    for d in range(0, draws, chunk):
        y = torch.bernoulli(p.expand(min(chunk, draws - d), m), generator=gen)
        frac = torch.zeros(y.shape[0], sizes.numel(), dtype=torch.float64).index_add_(1, bin_of, y) / sizes
        eces.append(((frac - mean_pred).abs() * sizes / m).sum(dim=1))
    eces = torch.cat(eces)
    lo, hi = torch.quantile(eces, torch.tensor([0.05, 0.95], dtype=torch.float64)).tolist()
    return {"mean": float(eces.mean()), "lo": lo, "hi": hi}


def bernoulli_nll(s: torch.Tensor, y: torch.Tensor) -> float:
    """Mean Bernoulli negative log-likelihood (nats) of predictions ``s [M]`` (clamped to [1e-12, 1 - 1e-12])
    against targets ``y [M]`` in [0, 1]; 0.0 without pairs."""
    s = s.clamp(1e-12, 1.0 - 1e-12)
    return float(-(y * s.log() + (1.0 - y) * torch.log1p(-s)).mean()) if s.numel() else 0.0


def calibration_summary(record: ConfidenceRecord, temperature: torch.Tensor | None,
                        bins: int = DEFAULT_BINS, bias: torch.Tensor | None = None, floors: bool = True) -> dict:
    """ECE, NLL, Brier score and the reliability table of the survival probabilities of ``record`` under
    ``temperature`` and ``bias`` (None: all 1 / all 0), plus per position: pairs, mean predicted survival,
    observed survival rate and the ECE of that position's pairs alone (the pooled ECE is dominated by
    late positions whose survival and outcome are both near 0; slot 1 carries most of the signal).
    Beside each ECE (with ``floors``), ``ece_floor`` (:func:`ece_noise_floor`): what a perfectly
    calibrated head with the same predictions would score on as many pairs, the resolution of that ECE."""
    s, y, pos = survival_pairs(record, temperature, bias)
    per = []
    for k in range(1, record.k + 1):
        m = pos == k
        if bool(m.any()):
            per.append({"k": k, "pairs": int(m.sum()), "mean_survival_pred": float(s[m].mean()),
                        "survival_rate": float(y[m].mean()), "ece": expected_calibration_error(s[m], y[m], bins),
                        **({"ece_floor": ece_noise_floor(s[m], bins, seed=k)} if floors else {})})
    out = {"ece": expected_calibration_error(s, y, bins), "nll": bernoulli_nll(s, y),
           "brier": float(((s - y) ** 2).mean()) if s.numel() else 0.0, "pairs": int(s.numel()),
           "reliability": reliability_bins(s, y, bins) if s.numel() else [], "per_position": per}
    if floors:
        out["ece_floor"] = ece_noise_floor(s, bins)
    return out
