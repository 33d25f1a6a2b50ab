"""Push a trained drafter checkpoint to the Hugging Face Hub, in the layout vLLM loads.

``speculators push CHECKPOINT REPO_ID`` uploads, with ``huggingface_hub``, only what serving needs:
``config.json`` and ``model.safetensors`` (the vllm-project/speculators format, or vLLM's native Medusa
layout, as written by ``save_pretrained``), ``recipe.yaml`` (how it was trained), a joint run's
``target_adapter/`` (the verifier is the base target with this LoRA merged), and a Hub model card
(``README.md``). Trainer state and optimizer files in ``checkpoints/step-*`` never leave the machine.

The model card is the run's own card (``final/README.md``) below a YAML header (``base_model``,
``library_name``, tags), a ``vllm serve`` command for the family, and every acceptance report that
``speculators eval`` wrote beside the checkpoint (``eval-*/report.md``).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .drafters.base import CONFIG_NAME, RECIPE_NAME, TRAINING_KEY, WEIGHTS_NAME
from .drafters.joint import ADAPTER_DIR
from .errors import SpeculatorsError

CARD_NAME = "README.md"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def pull_checkpoint(repo_id: str, *, revision: str | None = None, token: str | None = None) -> Path:
    """Download a pushed drafter from the Hub (``snapshot_download``, cached) and return its local directory.

    Raises:
        SpeculatorsError: the download fails (unknown repo, no access, offline), or what arrived is not a
            drafter checkpoint.
    """
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, token=token, repo_type="model"))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many error types (HTTP, auth, offline)
        raise SpeculatorsError(f"download of {repo_id} failed: {type(e).__name__}: {e}".splitlines()[0]) from None
    checkpoint_files(path)
    return path


def looks_like_hub_id(text: str) -> bool:
    """``namespace/name`` with Hub-legal characters (a local path that exists is never treated as one)."""
    return bool(_HUB_ID.match(text)) and not Path(text).exists()


def checkpoint_files(ckpt: str | Path) -> list[str]:
    """Paths (relative to ``ckpt``, sorted, ``/``-separated) of the files a push uploads.

    The run's ``README.md`` is not listed: the push writes a Hub card in its place (:func:`hub_card`).

    Raises:
        SpeculatorsError: ``ckpt`` lacks ``config.json`` or ``model.safetensors``, or its config is not
            a speculators checkpoint config.
    """
    ckpt = Path(ckpt)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (ckpt / name).is_file():
            raise SpeculatorsError(f"{ckpt} is not a drafter checkpoint: {name} is missing")
    _read_config(ckpt)
    files = [CONFIG_NAME, WEIGHTS_NAME]
    if (ckpt / RECIPE_NAME).is_file():
        files.append(RECIPE_NAME)
    adapter = ckpt / ADAPTER_DIR
    if adapter.is_dir():
        files += [p.relative_to(ckpt).as_posix() for p in sorted(adapter.rglob("*")) if p.is_file()]
    return sorted(files)


def _read_config(ckpt: Path) -> dict:
    try:
        cfg = json.loads((ckpt / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise SpeculatorsError(f"{ckpt / CONFIG_NAME}: not valid JSON ({e})") from None
    if TRAINING_KEY not in cfg:
        raise SpeculatorsError(f"{ckpt / CONFIG_NAME}: no {TRAINING_KEY!r} block; not written by speculators")
    return cfg


def _facts(cfg: dict) -> dict:
    """Family, verifier, K and aux-layer facts of a checkpoint config, for the card."""
    training = cfg[TRAINING_KEY]
    verifier = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or \
        training.get("target", {}).get("name_or_path", "?")
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens") or cfg.get("num_heads") or training["drafter"].get("num_heads")
    return {
        "algorithm": training["drafter"].get("algorithm", "?"),
        "verifier": verifier,
        "k": k,
        "adapter": (cfg.get("speculators_config") or {}).get("verifier", {}).get("lora_adapter"),
    }


def hub_card(ckpt: str | Path, repo_id: str) -> str:
    """The Hub ``README.md`` for checkpoint ``ckpt`` pushed as ``repo_id`` (markdown with a YAML header).

    Raises:
        SpeculatorsError: as :func:`checkpoint_files`.
    """
    ckpt = Path(ckpt)
    checkpoint_files(ckpt)
    facts = _facts(_read_config(ckpt))
    algo, verifier, k = facts["algorithm"], facts["verifier"], facts["k"]
    header = ["---", "library_name: speculators", "tags:", "- speculative-decoding", f"- {algo}", "- speculators"]
    if _HUB_ID.match(str(verifier)):
        header.append(f"base_model: {verifier}")
    header.append("---")
    spec = json.dumps({"model": repo_id, "num_speculative_tokens": k, "method": algo})
    lines = header + [
        "",
        f"# {repo_id}",
        "",
        (f"Speculative-decoding drafter (`{algo}`) for `{verifier}`, trained with speculators on responses "
         f"regenerated by that model. The drafter proposes {k} tokens per step and the verifier checks them "
         "by rejection sampling, so the output distribution is the verifier's own."),
        "",
        "## Serve with vLLM",
        "",
        "```bash",
        f"vllm serve {verifier} --speculative-config '{spec}'",
        "```",
        "",
    ]
    if facts["adapter"]:
        lines += [
            (f"This drafter was trained jointly with a LoRA adapter on the verifier (`{facts['adapter']}/`): "
             "merge it into the base model and serve the merged model as the verifier."),
            "",
        ]
    run_card = ckpt / CARD_NAME
    if run_card.is_file():
        lines += ["## Training run", "", _demote(run_card.read_text()).strip(), ""]
    for report in sorted(ckpt.parent.glob("eval-*/report.md")):
        lines += [f"## Acceptance: `{report.parent.name}`", "", _demote(report.read_text()).strip(), ""]
    return "\n".join(lines)


def _demote(markdown: str) -> str:
    """Push markdown headings two levels down (``#`` -> ``###``) so they nest under the card's sections."""
    return re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", markdown, flags=re.MULTILINE)


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
    """Upload a drafter checkpoint to the Hub model repo ``repo_id`` (created if missing).

    Files (:func:`checkpoint_files`) and the generated card (:func:`hub_card`) are staged in a temporary
    directory, then sent in one commit with ``HfApi.upload_folder``; the checkpoint itself is not
    modified. ``token=None`` uses huggingface_hub's own lookup (``HF_TOKEN``, ``hf auth login``).

    Returns:
        ``{"repo_id", "files": [uploaded paths], "url": commit URL or None (dry run)}``.

    Raises:
        SpeculatorsError: not a checkpoint (:func:`checkpoint_files`), an invalid ``repo_id``, or any
            Hub failure (authentication, network, permissions), with the Hub's message.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    ckpt = Path(ckpt)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise SpeculatorsError(f"repo id {repo_id!r}: {e}") from None
    if "/" not in repo_id:
        raise SpeculatorsError(f"repo id {repo_id!r}: expected 'namespace/name'")
    files = checkpoint_files(ckpt)
    card = hub_card(ckpt, repo_id)
    uploaded = sorted(files + [CARD_NAME])
    size = sum((ckpt / f).stat().st_size for f in files) + len(card.encode())
    note = ", dry run: nothing is sent" if dry_run else ""
    log(f"push: {ckpt} -> {repo_id} ({len(uploaded)} files, {size / 1e6:.1f} MB{note})")
    for f in uploaded:
        log(f"  {f}")
    if dry_run:
        return {"repo_id": repo_id, "files": uploaded, "url": None}
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="speculators-push-") as tmp:
        stage = Path(tmp)
        for f in files:
            dst = stage / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ckpt / f, dst)
        (stage / CARD_NAME).write_text(card)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            info = api.upload_folder(
                folder_path=str(stage), repo_id=repo_id, repo_type="model", revision=revision,
                commit_message=commit_message or f"Upload {_facts(_read_config(ckpt))['algorithm']} drafter "
                "(speculators)",
            )
        except Exception as e:  # noqa: BLE001 - huggingface_hub raises many error types (HTTP, auth, offline)
            raise SpeculatorsError(f"push to {repo_id} failed: {type(e).__name__}: {e}".splitlines()[0]) from None
    url = getattr(info, "commit_url", None) or str(info)
    log(f"push: done {url}")
    return {"repo_id": repo_id, "files": uploaded, "url": url}
