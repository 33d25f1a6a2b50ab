"""Push a trained drafter checkpoint to the Hugging Face Hub (and pull one back), with ``huggingface_hub``.

``speculators push CHECKPOINT REPO_ID`` uploads only what serving needs, in one commit:

* ``config.json`` and ``model.safetensors`` as ``save_pretrained`` wrote them (the vllm-project/speculators
  format, or a family's own vLLM layout);
* ``recipe.yaml`` (how it was trained; it names the data sources, local paths included);
* a joint run's ``target_adapter/`` (the verifier is the base target with this LoRA merged);
* a Hub model card ``README.md`` (:func:`hub_card`).

Trainer and optimizer state (``checkpoints/step-*/trainer_state.pt``) never leave the machine, and remote
files the new commit does not contain are deleted in the same commit, so the repo always holds exactly
one checkpoint. ``speculators eval NAMESPACE/NAME`` pulls a pushed drafter back (:func:`pull_checkpoint`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .drafters import registry
from .drafters.checkpoint import (
    CONFIG_NAME,
    RECIPE_NAME,
    TRAINING_KEY,
    WEIGHTS_NAME,
    TargetMeta,
    read_checkpoint_config,
)
from .drafters.checkpoint import ADAPTER_DIR
from .errors import SpeculatorsError

CARD_NAME = "README.md"
KEEP_REMOTE = (".gitattributes",)


def checkpoint_files(ckpt: str | Path) -> list[str]:
    """Paths (relative to ``ckpt``, sorted, ``/``-separated) of the checkpoint files a push uploads.

    The run's ``README.md`` is not listed: the push writes a Hub card in its place (:func:`hub_card`).

    Raises:
        SpeculatorsError: ``ckpt`` lacks ``config.json`` or ``model.safetensors``, or its config is not
            a speculators checkpoint config.
    """
    ckpt = Path(ckpt)
    read_checkpoint_config(ckpt)
    files = [CONFIG_NAME, WEIGHTS_NAME]
    if (ckpt / RECIPE_NAME).is_file():
        files.append(RECIPE_NAME)
    if (ckpt / PARITY_NAME).is_file():
        files.append(PARITY_NAME)
    adapter = ckpt / ADAPTER_DIR
    if adapter.is_dir():
        files += [p.relative_to(ckpt).as_posix() for p in sorted(adapter.rglob("*")) if p.is_file()]
    return sorted(files)


#: The export gate's result beside a checkpoint (``speculators train``'s end step, :mod:`speculators.export.gate`).
PARITY_NAME = "parity.json"


def checked_lines(ckpt: str | Path) -> list[str]:
    """Model-card lines saying what the export gate checked on ``ckpt`` (its ``parity.json``): the vLLM
    version of the layout check and its verdict, the reference implementation and version, the max
    |delta logit| and argmax agreement, what vLLM did when it served the directory (lossless, acceptance
    against our loop's, the negative control); or that nothing was checked (and how to check)."""
    f = Path(ckpt) / PARITY_NAME
    if not f.is_file():
        return ["Not checked against vLLM's loader or the reference implementation: run `speculators check DIR`."]
    try:
        g = json.loads(f.read_text())
    except (OSError, ValueError):
        return [f"`{PARITY_NAME}` is unreadable: run `speculators check DIR`."]
    bad = g.get("layout_problems") or []
    if g.get("layout_checked", True) is False:  # no vLLM loader known for the layout: nothing was checked
        out = [f"- vLLM {g.get('vllm_version', '?')} weight layout: not checked (no vLLM loader is known for it)."]
    else:
        out = [f"- vLLM {g.get('vllm_version', '?')} weight layout: "
               + ("every tensor is one its loader places, at its shape." if not bad else
                  f"{len(bad)} problem(s): {bad[0]}")]
    p = g.get("parity") or {}
    ref = f"vllm-project/speculators {p.get('reference_version', '?')}"
    if p.get("passed") is None:
        out.append(f"- parity with {ref}: not checked ({p.get('skipped') or 'no result'}).")
    else:
        d, a = p.get("max_abs_delta"), p.get("argmax_agreement")
        out.append(f"- parity with {ref} (first drafting step, float32, {p.get('inputs', '')}): "
                   f"{'PASS' if p['passed'] else 'FAIL'}, max |delta logit| {d if d is None else f'{d:.2e}'} "
                   f"(tolerance {p.get('tolerance', 1e-4):.0e}), argmax agreement "
                   f"{'n/a' if a is None else f'{100 * a:.1f}%'}"
                   + (f"; first divergence: {p['first_divergence']}" if p.get("first_divergence") else "") + ".")
    v = g.get("served")
    if v is None:
        out.append("- served by vLLM: not run (`speculators check DIR` serves it when `make vllm` installed vLLM).")
    elif v.get("skipped"):
        out.append(f"- served by vLLM: not run ({v['skipped']}).")
    elif v.get("error"):
        out.append(f"- served by vLLM {v.get('vllm_version', '?')}: FAIL, it could not serve the export: {v['error']}")
    else:
        a, c, ls = v.get("acceptance") or {}, v.get("control") or {}, v.get("lossless") or {}
        out.append(f"- served by vLLM {v.get('vllm_version', '?')} (method `{v.get('method')}`, K={v.get('k')}, "
                   f"float32, {v.get('num_prompts')} prompts, temperature 0): {'PASS' if v.get('passed') else 'FAIL'}; "
                   f"{ls.get('equal')} of {v.get('num_prompts')} outputs equal vLLM's plain output; accepted drafts "
                   f"per position {a.get('vllm_per_pos')} (vLLM) against {a.get('loop_per_pos')} (our loop), "
                   f"{a.get('steps_equal')} of {a.get('steps_compared')} steps equal; a copy with its head perturbed "
                   f"{'told apart' if c.get('breaks') else 'not told apart' if c.get('informative') else 'not informative'}.")
    return out


def _facts(cfg: dict) -> dict:
    """Family (class or ``None`` when unknown), verifier, K and adapter of a checkpoint config (any layout).

    The verifier is the speculators block's, else the recorded target's (:class:`TargetMeta`), else ``"?"``
    (a config from a newer or foreign speculators whose target facts do not validate).
    """
    training = cfg[TRAINING_KEY]
    algo = (training.get("drafter") or {}).get("algorithm", "?")
    try:
        family = registry.get(algo)
    except SpeculatorsError:  # a config from a newer or foreign speculators: say nothing family-specific
        family = None
    try:
        recorded = TargetMeta.from_json(training.get("target")).name_or_path
    except SpeculatorsError:
        recorded = "?"
    spec = cfg.get("speculators_config") or {}
    return {
        "algorithm": algo,
        "family": family,
        "verifier": (spec.get("verifier") or {}).get("name_or_path") or recorded,
        "k": family.serving.speculative_tokens(cfg) if family is not None else None,
        "adapter": training.get("target_adapter"),
    }


def hub_card(ckpt: str | Path, repo_id: str) -> str:
    """The Hub ``README.md`` for checkpoint ``ckpt`` pushed as ``repo_id`` (markdown with a metadata header).

    Header: ``huggingface_hub.ModelCardData`` (``library_name``, tags, ``base_model`` when the verifier is
    a Hub id). Body: how vLLM serves it (``vllm serve VERIFIER --speculative-config {...}`` with the
    family's ``method`` from :meth:`ServingFormat.vllm_serving`, or why it cannot yet), the LoRA note of a joint
    run, the run's own card (``README.md`` in ``ckpt``) and every ``eval-*/report.md`` beside ``ckpt``.

    Raises:
        SpeculatorsError: as :func:`checkpoint_files`.
    """
    from huggingface_hub import ModelCardData

    ckpt = Path(ckpt)
    checkpoint_files(ckpt)
    cfg = read_checkpoint_config(ckpt)
    facts = _facts(cfg)
    algo, verifier, k = facts["algorithm"], str(facts["verifier"]), facts["k"]
    data = ModelCardData(library_name="speculators", tags=["speculative-decoding", algo, "speculators"],
                         base_model=verifier if _is_hub_id(verifier) and not Path(verifier).exists() else None)
    family = facts["family"]
    method, why_not = family.serving.vllm_serving(cfg) if family is not None else (None, f"unknown family `{algo}`")
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id}", "",
        (f"Speculative-decoding drafter (`{algo}`) for `{verifier}`, trained with speculators. It proposes "
         f"{k} tokens per step; the verifier accepts or rejects them by rejection sampling, so the output "
         "distribution is the verifier's own."),
        "", "## Serving", "",
    ]
    if method is not None:
        base = family.serving.vllm_speculative_config(cfg, repo_id, k)
        lines += ["With vLLM:", "", "```bash", f"vllm serve {verifier} --speculative-config '{json.dumps(base)}'",
                  "```", ""]
        if family.serving.vllm_tree:
            lines += _tree_serving_lines(ckpt, verifier, base)
    else:
        lines += [f"Not loadable by vLLM as written: {why_not}.", ""]
    lines += _llamacpp_serving_lines(ckpt, family)
    lines += ["## Checked", ""] + checked_lines(ckpt) + [""]
    if facts["adapter"]:
        lines += [(f"Trained jointly with a LoRA adapter on the verifier (`{facts['adapter']}/`): merge it into "
                   "the base model and serve the merged model as the verifier."), ""]
    run_card = ckpt / CARD_NAME
    if run_card.is_file():
        lines += ["## Training run", "", _demote(run_card.read_text()).strip(), ""]
    for report in sorted(ckpt.parent.glob("eval-*/report.md")):
        lines += [f"## Acceptance: `{report.parent.name}`", "", _demote(report.read_text()).strip(), ""]
    return "\n".join(lines)


def _llamacpp_serving_lines(ckpt: Path, family) -> list[str]:
    """The card's llama.cpp lines: how the drafter is served there (``speculators export gguf`` and the
    ``--spec-type``) and, when ``speculators eval --engine llama.cpp`` ran beside ``ckpt``
    (``eval-llamacpp/report.json``), the fastest setting it measured, or that none beat plain decoding there."""
    spec = getattr(getattr(family, "serving", None), "llamacpp_spec_type", None)
    if spec is None:
        return []
    lines = ["With llama.cpp (CPU): convert with `speculators export gguf RUN_DIR` (llama.cpp's converter), then "
             f"`llama-server -m TARGET.gguf -md draft-f16.gguf --spec-type {spec}`.", ""]
    path = ckpt.parent / "eval-llamacpp" / "report.json"
    try:
        report = json.loads(path.read_text())
        best = report["best"]
    except (OSError, ValueError, KeyError):
        return lines
    if best.get("row") is None:
        return lines
    verdict = ("faster than plain decoding and than llama.cpp's best model-free type" if best["beats_plain"]
               and best["beats_ngram"] else "NOT faster than " + ("plain decoding" if not best["beats_plain"] else
                                                                  f"llama.cpp's `{best['ngram_best']}`"))
    lines += [f"Measured in llama-server on the eval's machine (`eval-llamacpp/report.md`): the fastest drafter "
              f"setting, `{best['row']}`, ran {best['tokens_per_s']:.1f} tokens/s against {best['plain_tokens_per_s']:.1f} "
              f"plain: {verdict}.", ""]
    if best.get("serve"):
        lines += ["```bash", best["serve"], "```", ""]
    fastest, curve = report.get("fastest"), report.get("verify_cost")
    if fastest and fastest.get("serve") and fastest["row"] != best["row"]:
        lines += [f"The fastest setting there overall was `{fastest['row']}` ({fastest['tokens_per_s']:.1f} tokens/s):",
                  "", "```bash", fastest["serve"], "```", ""]
    if curve and curve.get("break_even"):
        be = ", ".join(f"K={k} {v:.2f}" for k, v in curve["break_even"].items() if v is not None)
        lines += [f"There a target forward of K+1 tokens cost T(K+1)/T(1) of one token (llama-bench): a drafter "
                  f"needs at least that tau even with free drafts ({be}).", ""]
    return lines


def _tree_serving_lines(ckpt: Path, verifier: str, base: dict) -> list[str]:
    """The card's draft-tree serving lines: the static tree the newest eval with ``--tree`` found best on its
    machine (``report.json`` ``trees.best_static_tree``, vLLM's ``speculative_token_tree`` syntax, with
    ``num_speculative_tokens`` = its node count as vLLM's tree mode takes it), or nothing without one; only
    reports of this checkpoint count, and only formats vLLM drafts trees for (``ServingFormat.vllm_tree``). vLLM's
    drafter expands one child count per level, so a tree whose levels differ is given with that caveat."""
    reports = sorted(ckpt.parent.glob("eval-*/report.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(reports):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        measured = report.get("checkpoint")
        if measured and Path(measured).resolve() != ckpt.resolve():
            continue  # an eval of another checkpoint of the run (a step checkpoint): not this drafter's tree
        best = (report.get("trees") or {}).get("best_static_tree") or {}
        tree = best.get("speculative_token_tree")
        if not tree:
            continue
        spec = json.dumps({**base, "num_speculative_tokens": best["num_nodes"], "speculative_token_tree": tree})
        note = "" if best.get("level_uniform", True) else (
            " Its levels give their nodes different numbers of children, which vLLM's tree drafting does not "
            "expand as written; prefer a tree with one child count per level there.")
        return [f"With the draft tree `{path.parent.name}` measured best on its machine ({best['num_nodes']} nodes, "
                f"{best['expected_tokens_per_step']:.2f} expected tokens per step).{note}", "", "```bash",
                f"vllm serve {verifier} --speculative-config '{spec}'", "```", ""]
    return []


def _demote(markdown: str) -> str:
    """Push markdown headings two levels down (``#`` -> ``###``) so they nest under the card's sections."""
    return re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", markdown, flags=re.MULTILINE)


def _is_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def looks_like_hub_id(text: str) -> bool:
    """True for a valid Hub ``namespace/name`` that is not a local path.

    Not when ``text`` exists locally, nor when its first component is an existing local directory (a
    mistyped ``outputs/run`` stays a local-path error instead of a download attempt).
    """
    return _is_hub_id(text) and not Path(text).exists() and not Path(text.split("/")[0]).is_dir()


def pull_checkpoint(repo_id: str, *, revision: str | None = None, token: str | None = None) -> Path:
    """Download a pushed drafter (cached in huggingface_hub's cache) and return its local directory.

    ``config.json`` is fetched first and checked, so a repo that is not a speculators drafter fails before
    its weights are downloaded; then only the files a push writes (:func:`checkpoint_files`, the card).

    Raises:
        SpeculatorsError: the download fails (unknown repo, no access, offline), or the repo is not a
            speculators drafter checkpoint.
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        cfg_path = Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision, token=token, repo_type="model"))
        read_checkpoint_config(cfg_path.parent, require_weights=False)
        path = Path(snapshot_download(
            repo_id, revision=revision, token=token, repo_type="model",
            allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, RECIPE_NAME, CARD_NAME, f"{ADAPTER_DIR}/*"],
        ))
    except SpeculatorsError as e:
        raise SpeculatorsError(f"{repo_id} on the Hub: {e}") from None
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many error types (HTTP, auth, offline)
        raise SpeculatorsError(f"download of {repo_id} failed: {type(e).__name__}: {e}".splitlines()[0]) from None
    checkpoint_files(path)
    return path


def push_checkpoint(
    ckpt: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Upload a drafter checkpoint to the Hub model repo ``repo_id`` in one commit.

    The repo is created if missing (``private`` applies then; an existing public repo is refused with
    ``private=True`` rather than silently left public). ``revision`` names a branch, created from the
    default branch if missing. The files (:func:`checkpoint_files`) are sent from ``ckpt`` as they are
    (no copy), the card (:func:`hub_card`) from memory, and remote files outside that set are deleted
    in the same commit. ``token=None`` uses huggingface_hub's lookup (``HF_TOKEN``, ``hf auth login``).

    Returns:
        ``{"repo_id", "files": [paths in the commit], "deleted": [remote paths removed], "url": commit URL
        or None (dry run)}``.

    Raises:
        SpeculatorsError: not a checkpoint (:func:`checkpoint_files`), an invalid ``repo_id``, an
            existing public repo with ``private=True``, or any Hub failure (authentication, network,
            permissions), with the Hub's message.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    ckpt = Path(ckpt)
    if not _is_hub_id(repo_id):
        raise SpeculatorsError(f"repo id {repo_id!r}: expected 'namespace/name' (letters, digits, '-', '_', '.')")
    files = checkpoint_files(ckpt)
    card = hub_card(ckpt, repo_id)
    uploaded = sorted(files + [CARD_NAME])
    size = sum((ckpt / f).stat().st_size for f in files) + len(card.encode())
    note = ", dry run: nothing is sent" if dry_run else ""
    log(f"push: {ckpt} -> {repo_id}{'@' + revision if revision else ''} ({len(uploaded)} files, "
        f"{size / 1e6:.1f} MB{note})")
    for f in uploaded:
        log(f"  {f}")
    if dry_run:
        return {"repo_id": repo_id, "files": uploaded, "deleted": [], "url": None}
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if private and not api.repo_info(repo_id, repo_type="model").private:
            raise SpeculatorsError(f"{repo_id} already exists and is public; --private only applies to a new repo "
                                   "(change its visibility on the Hub first)")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        stale = sorted(set(api.list_repo_files(repo_id, revision=revision, repo_type="model"))
                       - set(uploaded) - set(KEEP_REMOTE))
        ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=ckpt / f) for f in files]
        ops.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode()))
        ops += [CommitOperationDelete(path_in_repo=f) for f in stale]
        info = api.create_commit(
            repo_id, ops, repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload {_facts(read_checkpoint_config(ckpt))['algorithm']} drafter "
                                          "(speculators)",
        )
    except SpeculatorsError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many error types (HTTP, auth, offline)
        raise SpeculatorsError(f"push to {repo_id} failed: {type(e).__name__}: {e}".splitlines()[0]) from None
    url = getattr(info, "commit_url", None) or str(info)
    for f in stale:
        log(f"  deleted stale {f}")
    log(f"push: done {url}")
    return {"repo_id": repo_id, "files": uploaded, "deleted": stale, "url": url}
