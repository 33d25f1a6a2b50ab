"""The parity gate: an exported checkpoint, loaded by the reference implementation, drafts what ours does.

vLLM's team keeps vllm-project/speculators (:data:`.reference_env.REFERENCE_VERSION`) in step with vLLM's
speculative-decoding models. :func:`check_parity` loads a checkpoint directory AS EXPORTED with the
reference's ``from_pretrained`` (in its own venv, :mod:`.reference_worker`), runs the first drafting step
on the same inputs on both sides and compares:

* load: no missing or unexpected keys against the file, every weight equal to the file, the config
  fields the reference parses equal to the file's;
* outputs, in float32: max |delta logit| <= :data:`TOLERANCE` and equal argmax at every compared row
  (EAGLE-3: TTT step 0 at every position; P-EAGLE: every depth of one parallel step; DFlash: every
  slot of one block; DSpark: every slot of one block, Markov-corrected along our greedy chain, and
  the confidence logits).

The inputs are token ids and the target's hidden states at the layers the CHECKPOINT'S config names
(vLLM ids - 1), while our drafter reads the layers it was trained on: a config whose aux ids are off
by one is caught. On a failure the first divergence is named: a config/aux-id mismatch, else the first
weight that differs, else the first hooked module (in the reference's forward order) whose output
differs beyond the tolerance.

Each family's first step is the family's own (:meth:`speculators.drafters.serving_format.ServingFormat.reference_parity_step`,
in ``drafters/<family>.py``); this module holds the driver and the typed
result.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpeculatorsError
from ..target.architecture import LogitsRule
from . import reference_env
from .reference_env import REFERENCE_VERSION, ReferenceUnavailable

#: Pass threshold: max |delta| of any compared logit, float32 on both sides.
TOLERANCE = 1e-4
#: Built-in text for ``speculators check`` when no sequences are given (tokenised by the target's tokenizer).
DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the window.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Speculative decoding drafts several tokens cheaply and lets the target verify them in one pass.",
)
WORKER = Path(__file__).with_name("reference_worker.py")
#: Shortest sequence compared (context before the first drafting step); shorter held-out rows are passed over.
MIN_TOKENS = 4


def reference_implements(family: str) -> bool:
    """Whether the reference implementation has a model for registered family ``family`` in our export
    layout: the family's serving format overrides
    :meth:`speculators.drafters.serving_format.ServingFormat.reference_parity_step` (unregistered names: False)."""
    from ..drafters import ServingFormat, registry

    if family not in registry.names():
        return False
    return type(registry.get(family).serving).reference_parity_step is not ServingFormat.reference_parity_step


def _config_aux_ids(config: dict[str, Any], key: str | None) -> list[int]:
    """The aux layer ids (vLLM convention) a checkpoint's ``config.json`` names under the family's ``key``.

    Raises:
        SpeculatorsError: the key is missing or not a list of ints.
    """
    ids = config.get(key) if key else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SpeculatorsError(f"config.json `{key}`: {ids!r} is not a list of layer ids")
    return list(ids)


@dataclass
class OutputDelta:
    """One compared output: ``name`` (e.g. ``seq0.logits``), ``max_abs_delta`` (float32), the fraction of
    rows whose argmax agrees (None for scalar-per-row outputs such as DSpark's confidence logits), rows."""

    name: str
    max_abs_delta: float
    argmax_agreement: float | None
    rows: int


@dataclass
class ParityResult:
    """What the gate checked and found (:func:`check_parity`). ``passed`` is None when it could not run
    (``skipped`` says why: the reference is unavailable or does not implement the family)."""

    checkpoint: str
    family: str
    reference_version: str = REFERENCE_VERSION
    inputs: str = ""
    tolerance: float = TOLERANCE
    outputs: list[OutputDelta] = field(default_factory=list)
    load_problems: list[str] = field(default_factory=list)
    first_divergence: str | None = None
    notes: list[str] = field(default_factory=list)
    passed: bool | None = None
    skipped: str | None = None

    @property
    def max_abs_delta(self) -> float | None:
        """The largest ``max_abs_delta`` over all outputs (None when nothing was compared)."""
        return max((o.max_abs_delta for o in self.outputs), default=None)

    @property
    def argmax_agreement(self) -> float | None:
        """The lowest argmax agreement over all logit outputs."""
        vals = [o.argmax_agreement for o in self.outputs if o.argmax_agreement is not None]
        return min(vals) if vals else None

    def summary(self) -> str:
        """One line: verdict, family, reference version, max difference, argmax agreement."""
        ref = f"vllm-project/speculators {self.reference_version}"
        if self.passed is None:
            return f"parity vs {ref}: not checked ({self.skipped})"
        verdict = "PASS" if self.passed else "FAIL"
        d = self.max_abs_delta
        a = self.argmax_agreement
        line = (f"parity vs {ref}: {verdict} ({self.family}; max |delta logit| "
                f"{'n/a' if d is None else f'{d:.2e}'} (tolerance {self.tolerance:.0e}), argmax agreement "
                f"{'n/a' if a is None else f'{100 * a:.1f}%'}; inputs: {self.inputs})")
        if self.first_divergence:
            line += f"; first divergence: {self.first_divergence}"
        return line

    def to_markdown(self) -> str:
        """A short Markdown section (run card, model card, ``speculators check``)."""
        lines = ["## Parity with the reference implementation", "", self.summary(), ""]
        if self.outputs:
            lines += ["| output | max abs delta | argmax agreement | rows |", "|---|---|---|---|"]
            for o in self.outputs:
                agree = "-" if o.argmax_agreement is None else f"{100 * o.argmax_agreement:.1f}%"
                lines.append(f"| {o.name} | {o.max_abs_delta:.2e} | {agree} | {o.rows} |")
            lines.append("")
        if self.load_problems:
            lines += ["Load problems:", ""] + [f"- {p}" for p in self.load_problems] + [""]
        if self.notes:
            lines += ["Notes:", ""] + [f"- {p}" for p in self.notes] + [""]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Plain dict (``parity.json``), with the derived maxima."""
        d = asdict(self)
        d["max_abs_delta"] = self.max_abs_delta
        d["argmax_agreement"] = self.argmax_agreement
        return d


def _hook_modules(module: torch.nn.Module, store: dict[str, torch.Tensor], order: list[str]):
    """Forward hooks on every submodule that owns parameters: the output of its last call, float32."""
    handles = []

    def hook_for(name):
        def hook(_m, _a, out):
            t = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, (tuple, list)) else None)
            if isinstance(t, torch.Tensor):  # the last call wins: a family's full-sequence step runs last
                if name not in store:
                    order.append(name)
                store[name] = t.detach().float().clone()
        return hook

    for name, m in module.named_modules():
        if name and any(True for _ in m.parameters(recurse=False)):
            handles.append(m.register_forward_hook(hook_for(name)))
    return handles


def export_module_names(drafter) -> dict[str, str]:
    """``{our module name: exported (reference) module name}`` from the serving format's ``state_dict``: a
    parameter ``M.weight`` written as ``R.weight`` maps module ``M`` to ``R`` (matched by storage, else by name)."""
    exported = drafter.serving.state_dict(drafter)
    by_ptr = {t.data_ptr(): n for n, t in exported.items() if isinstance(t, torch.Tensor) and t.numel()}
    out = {}
    for name, p in drafter.named_parameters():
        exp = by_ptr.get(p.data_ptr()) or (name if name in exported else None)
        if exp is None:
            continue
        mod, _, leaf = name.rpartition(".")
        emod, _, eleaf = exp.rpartition(".")
        if leaf == eleaf:
            out[mod] = emod
    return out


def _run_worker(python: Path, request: dict[str, Any], workdir: Path, timeout: int = 1800) -> dict[str, Any]:
    req_file = workdir / "request.json"
    req_file.write_text(json.dumps(request))
    r = subprocess.run([str(python), str(WORKER), str(req_file)], capture_output=True, text=True,
                       cwd=str(workdir), env=reference_env._clean_env(), timeout=timeout)
    if r.returncode == 3:  # reference_worker.UNAVAILABLE
        raise ReferenceUnavailable(f"{python}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-6:])
        raise _WorkerFailed(tail or f"exit status {r.returncode}")
    return json.loads(Path(request["report"]).read_text())


class _WorkerFailed(Exception):
    pass


def _config_problems(file_cfg: dict[str, Any], ref_cfg: dict[str, Any]) -> list[str]:
    """Top-level keys of ``config.json`` (and of its ``transformer_layer_config``) that the reference
    parsed to a different value. Our own block and bookkeeping keys are not compared."""
    skip = {"speculators_training", "speculators_version", "torch_dtype", "dtype", "transformers_version",
            "speculators_config", "architectures"}
    out = []
    for k, v in file_cfg.items():
        if k in skip or k not in ref_cfg:
            continue
        if k == "transformer_layer_config" and isinstance(v, dict):
            rv = ref_cfg[k] or {}
            for kk, vv in v.items():
                if kk in rv and kk not in ("architectures", "torch_dtype", "dtype", "transformers_version") \
                        and rv[kk] != vv and not (isinstance(vv, (int, float)) and rv[kk] == vv):
                    out.append(f"config transformer_layer_config.{kk}: file {vv!r}, reference {rv[kk]!r}")
        elif ref_cfg[k] != v:
            out.append(f"config {k}: file {v!r}, reference parsed {ref_cfg[k]!r}")
    return out


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tolerance: float = TOLERANCE
            ) -> list[OutputDelta]:
    """Compare each output of ours with the reference's of the same name (float32): ``[..., N]`` logits get
    max |delta| and per-row argmax agreement; other outputs max |delta| only.

    Raises:
        SpeculatorsError: an output missing on the reference side or of another shape (named).
    """
    out = []
    for name, a in ours.items():
        if name not in ref:
            raise SpeculatorsError(f"parity: the reference produced no `{name}`")
        b = ref[name]
        if tuple(a.shape) != tuple(b.shape):
            raise SpeculatorsError(f"parity: `{name}` has shape {tuple(a.shape)} here, {tuple(b.shape)} in the reference")
        a, b = a.float(), b.float()
        d = float((a - b).abs().max()) if a.numel() else 0.0
        agree = None
        if name.endswith("logits") and not name.endswith("confidence_logits") and a.dim() >= 1:
            agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        out.append(OutputDelta(name, d, agree, int(a.numel() // a.shape[-1]) if a.dim() >= 2 else int(a.numel())))
    return out


def first_hook_divergence(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], ref_order: list[str],
                          names: dict[str, str], tolerance: float = TOLERANCE) -> str | None:
    """The first module, in the reference's forward order, whose output differs beyond ``tolerance``
    (``names`` maps our module names to the reference's); None when all shared ones agree."""
    ours_by_ref = {names.get(k, k): v for k, v in ours.items()}
    for r in ref_order:
        if r not in ours_by_ref:
            continue
        a, b = ours_by_ref[r].float(), ref[r].float()
        if a.shape != b.shape:
            if a.numel() == b.numel():
                b = b.reshape(a.shape)
            else:
                continue
        d = float((a - b).abs().max()) if a.numel() else 0.0
        if d > tolerance:
            return f"module `{r}` output (max |delta| {d:.2e})"
    return None


def check_parity(checkpoint: str | Path, target=None, sequences: list[list[int]] | None = None,
                 num_sequences: int = 3, reference_python: str | Path | None = None, build: bool = True,
                 log=print, inputs_label: str | None = None, drafter=None) -> ParityResult:
    """Run the parity gate on ``checkpoint`` (module docstring).

    Args:
        checkpoint: an exported directory (``config.json`` + ``model.safetensors``), ours or trained elsewhere
            with our ``speculators_training`` block.
        target: a :class:`speculators.target.Target` (its hidden states feed both sides); None loads the
            checkpoint's recorded target (``speculators_training.target.name_or_path``).
        sequences: token id lists (held-out sequences of the run; those shorter than :data:`MIN_TOKENS` are
            passed over); None or none usable: :data:`DEFAULT_TEXTS` tokenised by the target's tokenizer
            (seeded random ids, labelled synthetic, when it has none).
        num_sequences: how many sequences to compare at most.
        reference_python: the reference venv's interpreter (:func:`.reference_env.ensure_reference_python`).
        build: build the cached reference venv when none is found.
        log: progress lines.
        inputs_label: how the inputs are described in the result (default: from where they came).
        drafter: the in-memory drafter the checkpoint was exported from (end of training): its exported
            weights are compared with the file by name first. Our side always drafts with the file as our
            own loader reads it (the published weights); the in-memory drafter stands in only when our
            loader refuses the file (which is then a named problem).
    Returns:
        A :class:`ParityResult`; ``passed`` None (with ``skipped``) when the reference is unavailable
        or does not implement the family.
    Raises:
        SpeculatorsError: the checkpoint cannot be read by our own loader (and no ``drafter`` was given),
            or neither the recorded target nor a synthetic one of its recorded config can be built.
    """
    from ..drafters import registry
    from ..drafters.checkpoint import read_checkpoint_config

    checkpoint = Path(checkpoint)
    cfg = read_checkpoint_config(checkpoint)
    family = cfg.get("speculators_model_type") or ((cfg.get("speculators_training") or {}).get("drafter") or {}).get(
        "algorithm") or "?"  # vLLM's native layouts and plain transformers models carry no speculators block
    result = ParityResult(str(checkpoint), family)
    if not reference_implements(family):
        result.skipped = f"vllm-project/speculators {REFERENCE_VERSION} has no `{family}` model in this layout"
        return result
    try:
        python = reference_env.ensure_reference_python(reference_python, build=build, log=log, check=False)
    except ReferenceUnavailable as e:
        result.skipped = str(e)
        return result
    problems: list[str] = []
    drafter, target, synthetic = _our_side(checkpoint, drafter, target, problems, log)
    seqs, label = _sequences(target, sequences, num_sequences)
    result.inputs = inputs_label or (f"{synthetic}; {label}" if synthetic else label)
    cfg_ids = _config_aux_ids(cfg, registry.get(family).serving.serving_aux_ids_key)
    ours_ids = list(drafter.meta.aux_layer_ids)
    if cfg_ids != [i + 1 for i in ours_ids]:
        problems.append(f"config.json aux layer ids {cfg_ids} (vLLM convention) tap layers "
                        f"{[i - 1 for i in cfg_ids]}, the drafter was trained on {ours_ids}")
    problems += export_config_problems(cfg, drafter)
    with tempfile.TemporaryDirectory(prefix="speculators-parity-") as tmp:
        tmp = Path(tmp)
        ref_inputs, requests, ours_out, ours_hooks = _first_steps(drafter, target, cfg, cfg_ids, seqs, problems)
        save_file(ref_inputs, str(tmp / "inputs.safetensors"))
        request = {"checkpoint": str(checkpoint.resolve()), "family": family,
                   "verifier": str(_verifier_dir(target, tmp / "verifier")),
                   "inputs": str(tmp / "inputs.safetensors"), "output": str(tmp / "out.safetensors"),
                   "report": str(tmp / "report.json"), "attn_implementation": "eager", "sequences": requests,
                   "expect_version": REFERENCE_VERSION}
        log(f"parity: running the reference ({python})")
        try:
            rep = _run_worker(python, request, tmp)
        except ReferenceUnavailable as e:
            result.skipped = str(e)
            return result
        except _WorkerFailed as e:
            result.load_problems = problems + [f"the reference failed to load or run the checkpoint: {e}"]
            result.first_divergence = result.load_problems[0]
            result.passed = False
            return result
        ref_out = load_file(str(tmp / "out.safetensors"))
    _judge(result, checkpoint, cfg, rep, problems, ours_out, ref_out, ours_hooks, export_module_names(drafter))
    return result


def _our_side(checkpoint: Path, drafter, target, problems: list[str], log):
    """Our drafter as the file's weights read by our own loader (float32; the in-memory ``drafter`` stands in,
    with a named problem, when our loader refuses the file), attached to ``target`` (None: the recorded one,
    else a SYNTHETIC random target of its recorded config). Returns ``(drafter, target, synthetic label or
    None)``; appends to ``problems``."""
    from ..drafters import Drafter

    if drafter is not None:
        problems += _file_vs_drafter(checkpoint, drafter)
    try:  # our side drafts with the weights as published (e.g. bfloat16), read by our own loader
        ours = Drafter.from_pretrained(checkpoint).float()
    except SpeculatorsError as e:
        if drafter is None:
            raise
        problems.append(f"our own loader refuses the checkpoint: {e}")
        ours = copy.deepcopy(drafter).float()
    synthetic = None
    if target is None:
        name = ours.meta.name_or_path
        try:
            target = ours.meta.load_target(log=log)
        except SpeculatorsError as e:
            log(f"parity: {e}; using SYNTHETIC inputs")
            target = synthetic_target(ours.meta)
            synthetic = (f"SYNTHETIC: a random target of the recorded config (the real target {name!r} could not "
                         "be loaded)")
    ours.attach_target(_TargetPieces(target))  # frozen copies a published checkpoint left out, head, norm
    ours.eval()
    return ours, target, synthetic


def _first_steps(drafter, target, cfg: dict[str, Any], cfg_ids: list[int], seqs: list[list[int]],
                 problems: list[str]):
    """Our first drafting step on every sequence (the family's ``reference_parity_step``) with the target's
    features tapped at our layers, the reference's inputs tapped at the layers the config names. Returns
    ``(reference inputs by "seq{i}.{name}", per-sequence requests, our outputs by "seq{i}.{name}", our hooked
    module outputs of the first sequence)``; appends to ``problems``."""
    ref_inputs, requests, ours_out, ours_hooks = {}, [], {}, {}
    ours_ids = list(drafter.meta.aux_layer_ids)
    for i, ids in enumerate(seqs):
        s = f"seq{i}"
        feats_ref = _features(target, ids, [v - 1 for v in cfg_ids] if min(cfg_ids, default=1) >= 1 else None)
        feats_ours = _features(target, ids, ours_ids)
        if feats_ref is None:
            problems.append(f"config.json aux layer ids {cfg_ids}: an id below 1 names no decoder layer output")
            feats_ref = feats_ours
        store, order = {}, []
        handles = _hook_modules(drafter, store, order)
        try:
            step = drafter.serving.reference_parity_step(drafter, cfg, ids, feats_ours, feats_ref)
        finally:
            for h in handles:
                h.remove()
        ref_inputs.update({f"{s}.{k}": v.contiguous() for k, v in step.ref_tensors.items()})
        requests.append({"name": s, "kwargs": step.ref_kwargs, "pin": step.pin})
        ours_out.update({f"{s}.{k}": v.detach().float() for k, v in step.outputs.items()})
        if i == 0:
            ours_hooks = store
    return ref_inputs, requests, ours_out, ours_hooks


def _judge(result: ParityResult, checkpoint: Path, cfg: dict[str, Any], rep: dict, problems: list[str],
           ours_out: dict, ref_out: dict, ours_hooks: dict, names: dict) -> None:
    """Fill ``result`` from the reference's report ``rep`` and outputs: load problems (missing, unexpected,
    unequal weights; config fields), the compared outputs, the verdict and the first divergence (a load
    problem, else the first hooked module whose outputs differ, else the first failing output)."""
    result.reference_version = rep.get("version", REFERENCE_VERSION)
    for k in rep["missing_keys"]:
        problems.append(f"weight `{k}` missing from model.safetensors (the reference keeps its init)")
    notes = []
    for k in rep["unexpected_keys"]:
        if k in ("d2t", "t2d") and not rep.get("use_draft_vocab", True) and _identity_map(checkpoint, k):
            notes.append(f"`{k}` is the identity map of a full vocabulary: the reference has no such buffer "
                         "then and ignores it (vLLM loads d2t, skips t2d)")
            continue
        problems.append(f"weight `{k}` in model.safetensors reaches no reference parameter (vLLM refuses it)")
    for u in rep["unequal_weights"]:
        problems.append(f"weight `{u['name']}` loaded unequal to the file (max |delta| {u['max_abs_diff']})")
    problems += _config_problems(cfg, rep["config"])
    result.outputs = compare(ours_out, ref_out)
    bad_out = [o for o in result.outputs if o.max_abs_delta > TOLERANCE
               or (o.argmax_agreement is not None and o.argmax_agreement < 1.0)]
    result.load_problems = problems
    result.notes = notes
    result.passed = not problems and not bad_out
    if problems:
        result.first_divergence = problems[0]
    elif bad_out:
        hooked = {k[len("seq0.hook."):]: v for k, v in ref_out.items() if k.startswith("seq0.hook.")}
        result.first_divergence = (first_hook_divergence(ours_hooks, hooked, rep["hook_order"].get("seq0", []),
                                                         names) or f"output `{bad_out[0].name}`")


_OWN_KEYS = ("speculators_training", "speculators_version", "torch_dtype", "dtype", "transformers_version")


def export_config_problems(config: dict[str, Any], drafter) -> list[str]:
    """Keys of ``config.json`` that differ from what ``drafter`` (read from the same directory's
    ``speculators_training`` block) exports (its serving format's ``config``): the serving engines read the
    former, our drafter was built from the latter, so a difference serves another model. Our own
    bookkeeping keys and ``speculators_config.verifier`` (a name) are not compared."""
    mine = json.loads(json.dumps(drafter.serving.config(drafter), default=str))
    out = []
    for k in sorted(set(config) | set(mine)):
        if k in _OWN_KEYS:
            continue
        a, b = config.get(k, "<absent>"), mine.get(k, "<absent>")
        if k == "speculators_config" and isinstance(a, dict) and isinstance(b, dict):
            a = {kk: vv for kk, vv in a.items() if kk != "verifier"}
            b = {kk: vv for kk, vv in b.items() if kk != "verifier"}
        if a != b:
            out.append(f"config.json `{k}` is {a!r}; the drafter (speculators_training) exports {b!r}")
    return out


def _identity_map(checkpoint: Path, name: str) -> bool:
    """``d2t`` all zeros (draft id i is target id i) or ``t2d`` all true: a full vocabulary's identity map."""
    t = load_file(str(checkpoint / "model.safetensors"))[name]
    return bool((t == 0).all()) if name == "d2t" else bool(t.bool().all())


def _file_vs_drafter(checkpoint: Path, drafter) -> list[str]:
    """Tensors of ``model.safetensors`` that differ from what ``drafter`` exports (by name, cast to the file's
    dtype; the frozen target copies a published checkpoint leaves out are skipped)."""
    file = load_file(str(checkpoint / "model.safetensors"))
    out = []
    for name, t in drafter.serving.state_dict(drafter).items():
        if name not in file:
            continue
        f = file[name]
        mine = t.detach().cpu().to(f.dtype)
        if f.shape != mine.shape or not torch.equal(f, mine):
            d = float((f.float() - mine.float()).abs().max()) if f.shape == mine.shape else None
            out.append(f"weight `{name}` in model.safetensors differs from the trained drafter's "
                       f"(max |delta| {d})")
    return out


class _TargetPieces:
    """The target pieces a drafter takes at ``attach_target`` (embedding, output head, final norm) as float32
    CPU copies, so that our side computes in float32 on the CPU like the reference, whatever the target's
    dtype and device (the hidden states come from the target itself, :func:`_features`)."""

    def __init__(self, target):
        self.embed_tokens = copy.deepcopy(target.embed_tokens).float().cpu()
        self.lm_head_weight = target.lm_head_weight.detach().float().cpu().clone()
        self.final_norm = copy.deepcopy(target.final_norm).float().cpu()
        # vLLM's drafters compute logits with their own logits processor, without the verifier's soft-cap or
        # logit scaling (docs/FORMATS.md, "Targets"): parity compares those raw drafter logits
        self.logits_rule = LogitsRule()


def synthetic_target(meta, seed: int = 0):
    """A random target of the architecture a checkpoint records (``speculators_training.target.target_config``),
    for parity inputs when the real target cannot be loaded: both sides see the same (meaningless) hidden
    states, so the check still compares the two implementations, not the drafter's quality.

    Raises:
        SpeculatorsError: the recorded config cannot build a transformers model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..target import Target

    cfg = dict(meta.target_config)
    model_type = cfg.pop("model_type", "llama")
    for k in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    except (ValueError, KeyError, TypeError) as e:
        raise SpeculatorsError(f"parity: the recorded target config cannot build a model ({e})") from None
    return Target(model, None, name_or_path=meta.name_or_path, aux_layer_ids=list(meta.aux_layer_ids))


def _features(target, ids: list[int], layer_ids: list[int] | None):
    """Target features of ``ids`` (one row) tapped at ``layer_ids`` (our convention), float32 on the CPU;
    None when an id is out of range."""
    if layer_ids is None or any(not 0 <= i < target.num_layers for i in layer_ids):
        return None
    saved = target.aux_layer_ids
    target.aux_layer_ids = list(layer_ids)
    try:
        with torch.no_grad():
            f = target.features(torch.tensor([ids], dtype=torch.long), with_logits=False)
    finally:
        target.aux_layer_ids = saved
    return type(f)(f.aux.float().cpu(), f.top.float().cpu(), None)


def _sequences(target, sequences, n: int) -> tuple[list[list[int]], str]:
    usable = [list(map(int, s)) for s in (sequences or []) if len(s) >= MIN_TOKENS]
    if usable:
        seqs = usable[:n]
        return seqs, f"{len(seqs)} held-out sequences of the run, target features"
    tok = getattr(target, "tokenizer", None)
    if tok is not None:
        seqs = [tok(t, add_special_tokens=False)["input_ids"][:48] for t in DEFAULT_TEXTS[:n]]
        seqs = [s for s in seqs if len(s) >= MIN_TOKENS] or [list(range(MIN_TOKENS * 4))]
        return seqs, f"{len(seqs)} built-in texts, target features"
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, target.vocab_size, (32,), generator=g).tolist() for _ in range(n)]
    return seqs, f"{len(seqs)} SYNTHETIC random token sequences (target has no tokenizer), target features"


def _verifier_dir(target, path: Path) -> Path:
    """The target as a local HF directory for the reference (its config, embedding, head and final norm):
    the reference reads the verifier's layer count and copies those weights when a checkpoint lacks them. They
    keep the target's dtype: the reference loads them into float32 parameters, an exact upcast."""
    from safetensors.torch import save_file as save

    path.mkdir(parents=True, exist_ok=True)
    target.config.to_json_file(str(path / "config.json"))
    sd = {"model.embed_tokens.weight": target.embed_tokens.weight.detach().cpu().clone(),  # untied
          "lm_head.weight": target.lm_head_weight.detach().cpu().clone(),
          "model.norm.weight": target.final_norm.weight.detach().cpu().clone()}
    save(sd, str(path / "model.safetensors"))
    return path


__all__ = ["OutputDelta", "ParityResult", "TOLERANCE", "reference_implements", "check_parity", "compare",
           "export_config_problems", "export_module_names", "first_hook_divergence", "synthetic_target"]
