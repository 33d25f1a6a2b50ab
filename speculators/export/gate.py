"""The export gate on one checkpoint directory: the static vLLM layout check (fast, first), the parity check
against the reference implementation, and the export served by vLLM itself (:mod:`.vllm_served`).

Used by ``speculators check DIR`` and at the end of ``speculators train`` (``train.parity_check``; the vLLM step
with ``train.vllm_check``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .parity import ParityResult, check_parity
from .vllm_layout import VLLM_VERSION, check_layout, known_layout
from .vllm_served import ServedResult, check_served


@dataclass
class GateResult:
    """``layout_problems`` (:func:`.vllm_layout.check_layout`), ``parity`` (:func:`.parity.check_parity`) and
    ``served`` (:func:`.vllm_served.check_served`). ``passed``: False on a layout problem or a failed check; else
    True when parity passed and vLLM's check passed or was not run for a named reason; None when parity could
    not run.
    ``layout_checked``: False when no vLLM loader is known for the layout (a new family: not checked);
    ``notes``: why a check did not run."""

    checkpoint: str
    layout_problems: list[str] = field(default_factory=list)
    parity: ParityResult | None = None
    serving: str = ""
    layout_checked: bool = True
    notes: list[str] = field(default_factory=list)
    served: ServedResult | None = None

    @property
    def passed(self) -> bool | None:
        if self.layout_problems or (self.served is not None and self.served.passed is False):
            return False
        return None if self.parity is None or self.parity.passed is None else self.parity.passed

    def to_markdown(self) -> str:
        """Markdown for the run card, the model card and ``speculators check``."""
        lines = [f"## vLLM {VLLM_VERSION} weight layout", ""]
        if not self.layout_checked:
            lines.append(f"No vLLM {VLLM_VERSION} loader is known for this layout: its tensors were not checked.")
        elif self.layout_problems:
            lines += [f"- {p}" for p in self.layout_problems]
        else:
            lines.append(f"Every tensor in model.safetensors is one vLLM {VLLM_VERSION}'s loader places, at its shape."
                         if not self.serving.startswith("vLLM cannot") else
                         "Every tensor in model.safetensors has the name and shape of the family's layout (below: "
                         "vLLM has no loader for it as written).")
        if self.serving:
            lines += ["", self.serving]
        lines.append("")
        if self.parity is not None:
            lines.append(self.parity.to_markdown())
        if self.served is not None:
            lines += ["", self.served.to_markdown()]
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "vllm_version": VLLM_VERSION, "layout_problems": self.layout_problems,
                "layout_checked": self.layout_checked, "notes": self.notes, "serving": self.serving,
                "parity": None if self.parity is None else self.parity.to_json(),
                "served": None if self.served is None else self.served.to_json(), "passed": self.passed}


def check_checkpoint(checkpoint: str | Path, target=None, sequences=None, num_sequences: int = 3,
                     reference_python=None, build: bool = True, parity: bool = True, log=print,
                     inputs_label: str | None = None, drafter=None, serve: bool = False, prompts=None,
                     vllm_python=None) -> GateResult:
    """Run the static layout check, (``parity``) the parity gate and (``serve``) vLLM's serving check on
    ``checkpoint``; arguments as :func:`.parity.check_parity`, and ``prompts`` (prompt token ids; None: built-in
    chat prompts) / ``vllm_python`` as :func:`.vllm_served.check_served`. vLLM serves only a checkpoint whose
    layout check is clean.

    Raises:
        SpeculatorsError: the directory is not a readable checkpoint, or the target cannot be loaded.
    """
    import json

    config = json.loads((Path(checkpoint) / "config.json").read_text()) \
        if (Path(checkpoint) / "config.json").is_file() else {}
    checked = not config or known_layout(config)  # a directory without config.json: check_layout names it
    res = GateResult(str(checkpoint), check_layout(checkpoint) if checked else [], serving=_serving(checkpoint),
                     layout_checked=checked)
    if parity:
        res.parity = check_parity(checkpoint, target=target, sequences=sequences, num_sequences=num_sequences,
                                  reference_python=reference_python, build=build, log=log,
                                  inputs_label=inputs_label, drafter=drafter)
    if serve and not res.layout_problems:
        res.served = check_served(checkpoint, target=target, prompts=prompts, num_prompts=num_sequences,
                                  python=vllm_python, log=log)
    return res


def _serving(checkpoint) -> str:
    """How vLLM serves the layout (the family's ``ServingFormat.vllm_serving``): its ``method``, or why it cannot as written."""
    import json

    from ..drafters import registry

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    algo = ((cfg.get("speculators_training") or {}).get("drafter") or {}).get("algorithm")
    if algo not in registry.names():
        return ""
    serving = registry.get(algo).serving
    method, note = serving.vllm_serving(cfg)
    extra = "".join(f", `{k}: {json.dumps(v)}`" for k, v in serving.vllm_extra.items())
    return f"vLLM serves it with `--speculative-config` method `{method}`{extra}." if method else \
        f"vLLM cannot load this layout as written: {note}."


__all__ = ["GateResult", "check_checkpoint"]
