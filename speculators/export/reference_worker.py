"""Reference side of the parity gate: run BY PATH with the reference venv's python, never imported.

    <reference-python> reference_worker.py REQUEST.json

It loads an exported checkpoint directory with vllm-project/speculators' own ``from_pretrained`` (the
package this script imports as ``speculators`` is the REFERENCE, installed in that venv; our package
must not be importable here, so the script's own directory is taken off ``sys.path`` first and the
imported package is checked to be the reference), runs the first drafting step on the inputs
:mod:`speculators.export.parity` wrote, and writes back:

* ``OUTPUT.safetensors``: ``{seq}.logits`` (and ``{seq}.confidence_logits`` for DSpark), the draft
  logits exactly as the reference computes them (captured at the family's ``compute_metrics`` call,
  i.e. after DSpark's Markov bias), and ``{seq}.hook.{module}``: the output of every module that owns
  parameters, and of every decoder layer, on the first call (forward hooks);
* ``OUTPUT.json``: reference version, missing / unexpected keys (against the file), weights that differ
  from the file, the loaded config (``to_dict``), and the order in which hooked modules ran.

How each family's first step is driven is the family's to say (our ``ServingFormat.reference_parity_step``,
in the family's own file): the reference's forwards are training forwards, so each sequence's ``pin``
names the reference module whose ``compute_metrics`` receives the logits (``metrics_module``, and
``confidence_arg``: the positional index of confidence logits), the random choices to pin so that the
step is the one the engine runs (``patches``: module, attribute, the tensors it returns), and the rows
of the logits to return (``logits_rows``). This script knows no family.

REQUEST.json: ``{"checkpoint": dir, "family": str, "verifier": dir|null, "inputs": file,
"output": file, "report": file, "attn_implementation": "eager", "sequences": [{"name": str,
"kwargs": {...}, "pin": {...}}]}``; tensors of sequence ``s`` are ``{s}.{argument}`` in ``inputs``.
"""

import importlib
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
UNAVAILABLE = 3  # exit status: the reference cannot be imported here (the caller reports it, not a failure)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]


def _first_tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def main(request_file):
    """Run one request (module docstring): load, compare with the file, run every sequence, write back."""
    with open(request_file) as f:
        req = json.load(f)
    import torch
    from safetensors.torch import save_file

    version = _import_reference(req)
    torch.manual_seed(0)
    model, cfg = _load(req)
    missing, unexpected, unequal = _against_file(model, req["checkpoint"])
    outputs, orders = _run_sequences(model, req)
    save_file(outputs, req["output"])
    report = {"version": version, "model_class": type(model).__name__, "missing_keys": missing,
              "unexpected_keys": unexpected, "unequal_weights": unequal,
              "use_draft_vocab": bool(getattr(model, "use_draft_vocab", True)), "config": cfg.to_dict(),
              "hook_order": orders}
    with open(req["report"], "w") as f:
        json.dump(report, f, default=str)


def _import_reference(req) -> str:
    """Import the reference package and check it is the reference at the expected version (else exit with
    :data:`UNAVAILABLE`); returns its version."""
    try:
        import speculators
        from speculators.version import version
    except ImportError as e:
        print(f"cannot import vllm-project/speculators: {e}", file=sys.stderr)
        sys.exit(UNAVAILABLE)
    root = os.path.dirname(os.path.abspath(speculators.__file__))
    if os.path.exists(os.path.join(root, "drafters")):  # our package has drafters/, the reference does not
        print(f"the package imported as speculators ({root}) is not the reference implementation", file=sys.stderr)
        sys.exit(UNAVAILABLE)
    if req.get("expect_version") and version != req["expect_version"]:
        print(f"speculators {version} is installed, the gate follows {req['expect_version']}", file=sys.stderr)
        sys.exit(UNAVAILABLE)
    return version


def _use_local_verifier(verifier: str) -> None:
    """The verifier (for the reference's layer-id check and its verifier weights) is the caller's local copy
    of the target, whatever name the checkpoint records."""
    import speculators.models.utils as ref_utils
    import speculators.utils.loading as loading

    real = ref_utils.get_verifier_config

    def get_verifier_config(_name, trust_remote_code=False):
        return real(verifier, trust_remote_code=trust_remote_code)

    ref_utils.get_verifier_config = get_verifier_config
    real_layers = loading.load_model_layers

    def load_model_layers(names, _path, *a, **k):
        return real_layers(names, verifier, *a, **k)

    loading.load_model_layers = load_model_layers


def _load(req):
    """The checkpoint loaded by the reference's own ``from_pretrained``, in float32 (weights the checkpoint
    lacks, taken from the verifier, must not pass through its dtype); returns ``(model, config)``."""
    import torch
    from speculators.config import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    ckpt = req["checkpoint"]
    if req.get("verifier"):
        _use_local_verifier(req["verifier"])
    cfg = SpeculatorModelConfig.from_pretrained(ckpt)
    if req.get("verifier"):
        cfg.speculators_config.verifier.name_or_path = req["verifier"]
    cfg.transformer_layer_config._attn_implementation = req.get("attn_implementation", "eager")
    model = SpeculatorModel.from_pretrained(ckpt, config=cfg, dtype=torch.float32).float().eval()
    return model, cfg


def _against_file(model, ckpt: str):
    """Keys and weights of the loaded model against the file, as exported: ``(missing, unexpected, unequal)``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        file_keys = list(f.keys())
    file_weights = load_file(os.path.join(ckpt, "model.safetensors"))
    ignore_save = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    state = {k: v for k, v in model.state_dict().items() if k not in ignore_save}
    missing = sorted(k for k in state if k not in file_weights)
    unexpected = sorted(k for k in file_keys if k not in state)
    unequal = []
    for k, v in file_weights.items():
        if k in state and (state[k].shape != v.shape or not torch.equal(state[k], v.to(state[k].dtype))):
            d = None if state[k].shape != v.shape else float((state[k].float() - v.float()).abs().max())
            unequal.append({"name": k, "max_abs_diff": d, "shape_file": list(v.shape),
                            "shape_reference": list(state[k].shape)})
    return missing, unexpected, unequal


def _capture_metrics(pin, captured: dict) -> None:
    """Patch the module whose ``compute_metrics`` receives the family's logits (``pin["metrics_module"]``)
    so that the step's logits (and, at positional index ``pin["confidence_arg"]``, its confidence logits)
    are captured into ``captured`` where the family hands them to its loss."""
    import torch

    core = importlib.import_module(pin["metrics_module"])
    conf_arg = pin.get("confidence_arg")

    def compute_metrics(*args, **kwargs):
        logits = kwargs.get("logits", args[0] if args else None)
        captured.setdefault("logits", logits.detach().float().reshape(-1, logits.shape[-1]).clone())
        conf = kwargs.get("confidence_logits",
                          args[conf_arg] if conf_arg is not None and len(args) > conf_arg else None)
        if conf is not None:
            captured.setdefault("confidence_logits", conf.detach().float().reshape(-1).clone())
        return torch.zeros((), requires_grad=False), {}

    core.compute_metrics = compute_metrics


def _pin_choices(pin) -> None:
    """Replace each random choice the family names (``pin["patches"]``: module, attribute and the tensors it
    must return) by a function returning the caller's choice."""
    import torch

    for p in pin.get("patches", []):
        values = tuple(torch.tensor(r["values"], dtype=getattr(torch, r["dtype"])) for r in p["returns"])
        setattr(importlib.import_module(p["module"]), p["attr"], lambda *_a, _v=values, **_k: _v)


def _run_sequences(model, req):
    """Each sequence's first drafting step through the reference's forward, with forward hooks on every
    module that owns parameters and every decoder layer: ``(outputs by "{seq}.{name}", hook order per
    sequence)``."""
    import torch
    from safetensors.torch import load_file

    captured, hooks, order = {}, {}, []

    def hook_for(name):
        def hook(_m, _a, out):
            t = _first_tensor(out)
            if t is not None and name not in hooks:
                hooks[name] = t.detach().float().clone()
                order.append(name)
        return hook

    for name, m in model.named_modules():
        owns = any(True for _ in m.parameters(recurse=False))
        is_layer = name.count(".") == 1 and name.startswith("layers.")
        if name and (owns or is_layer):
            m.register_forward_hook(hook_for(name))
    inputs = load_file(req["inputs"])
    outputs, orders = {}, {}
    for seq in req["sequences"]:
        s = seq["name"]
        kw = {k[len(s) + 1:]: v for k, v in inputs.items() if k.startswith(s + ".")}
        kw.update(seq.get("kwargs", {}))
        pin = seq.get("pin", {})
        _capture_metrics(pin, captured)
        _pin_choices(pin)
        captured.clear()
        hooks.clear()
        order.clear()
        with torch.no_grad():
            model(**kw)
        rows = pin.get("logits_rows")
        for k, v in captured.items():
            outputs[f"{s}.{k}"] = (v[rows[0]:rows[1]] if rows and k == "logits" else v).contiguous()
        for k, v in hooks.items():
            outputs[f"{s}.hook.{k}"] = v.contiguous()
        orders[s] = list(order)
    return outputs, orders


if __name__ == "__main__":
    main(sys.argv[1])
