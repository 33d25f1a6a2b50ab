"""FSDP2 across CPU processes (gloo): ``recipes/accelerate/fsdp.yaml`` on a machine without CUDA.

accelerate does not shard CPU processes; the same launcher config makes speculators shard the training
unit with torch's ``fully_shard`` (:mod:`speculators.train.fsdp`). Checked, 20 steps each, with a global batch of
2 micro-batches (1 process x ``grad_accum 2`` against 2 processes x ``grad_accum 1``):

* a drafter-only EAGLE-3 run and a joint (Medusa-2, LoRA-adapted target) run on 2 FSDP processes log the
  1-process run's loss at every step (1e-4 relative) and write the same ``final/`` and ``step-N`` (same
  files, names, dtypes, config; each weight tensor within 1e-4 of its largest entry): full state dicts;
* a 2-process FSDP run killed after its step-10 checkpoint (``SPECULATORS_TEST_CRASH_AT_STEP``) leaves the
  sharded weights + optimizer in ``engine_state/`` (``torch.distributed.checkpoint``) and ``--resume``
  reproduces the uninterrupted FSDP run, with 2 processes and with 1 (the checkpoint re-shards);
* the uninterrupted 2-process FSDP run takes the multi-node code path (``--num_machines 2``,
  ``--machine_rank 0/1``, 127.0.0.1: two single-process "machines" on this host);
* the FSDP ``final/`` loads in a 1-process ``speculators eval`` and passes the export gate (layout + parity
  against the reference implementation, ``speculators check``; parity needs ``make reference``).

The in-process tests (fast) run the same helpers in a 1-rank gloo group: the full-parameter context, the
``engine_state`` round trip and the clear errors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import _env, _free_port, _losses  # the process helpers shared with the DDP tests
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from speculators.cli import app
from speculators.errors import SpeculatorsError

ROOT = Path(__file__).resolve().parents[2]
FSDP_CONFIG = ROOT / "recipes" / "accelerate" / "fsdp.yaml"
EAGLE3, MEDUSA = ROOT / "recipes" / "tiny-eagle3.yaml", ROOT / "recipes" / "tiny-medusa.yaml"
JOINT = ("drafter.joint=true", "drafter.joint_target.lr=0.02")
STEPS, CRASH_AT, RTOL = 20, 10, 1e-4


def _no_gate() -> tuple[str, ...]:
    """The override that skips the end-of-training export gate (checked once, on the FSDP ``final/``, by
    ``test_fsdp_eagle3_final_passes_the_export_gate``), where the recipe has that switch."""
    from speculators.recipe import TrainSpec

    return ("train.parity_check=false",) if "parity_check" in TrainSpec.model_fields else ()


def _start(out: Path, recipe: Path, target_dir: Path, cache: Path, processes: int, *extra: str,
           crash_at: int | None = None, machine_rank: int | None = None, port: int | None = None,
           config: Path = FSDP_CONFIG):
    """``speculators train`` for 20 steps with a global batch of 2 micro-batches: 1 process x grad_accum 2,
    or 2 processes x grad_accum 1 through ``accelerate launch --config_file config`` (``machine_rank``:
    one of the two single-process "machines" of a ``--num_machines 2`` launch on this host)."""
    train = ["-m", "speculators.cli", "train", str(recipe), f"target.model={target_dir}", f"train.steps={STEPS}",
             "train.checkpoint_every=10", "train.eval_every=20", "train.report_to=[]",
             f"train.grad_accum={2 // processes}", *_no_gate(), "-o", str(out), *extra]
    if processes == 1:
        cmd = [sys.executable, *train]
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                  "--num_processes", str(processes), "--main_process_port", str(port or _free_port())]
        if machine_rank is not None:
            launch += ["--num_machines", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"]
        cmd = [*launch, *train]
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, env=_env(cache, crash_at), cwd=out.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        output, _ = p.communicate(timeout=500)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        pytest.fail(f"training subprocess timed out:\n{output[-5000:]}")
    return p.returncode, output


def _assert_losses_match(run: Path, ref: Path, steps=range(1, STEPS + 1), total: int = STEPS) -> None:
    """``train/loss`` of ``run`` equals ``ref``'s at ``steps`` (1e-4 relative); ``run`` logged steps 1..total."""
    a, b = _losses(run), _losses(ref)
    assert sorted(a) == list(range(1, total + 1)) and sorted(b) == list(range(1, STEPS + 1)), (sorted(a), sorted(b))
    for s in steps:
        assert a[s] == pytest.approx(b[s], rel=RTOL), (s, a[s], b[s])
    assert len({round(b[s], 6) for s in steps}) > len(steps) // 2  # the loss moves: the comparison can fail


def _dtypes(f: Path) -> dict[str, str]:
    with safe_open(str(f), "pt") as sf:
        return {k: str(sf.get_slice(k).get_dtype()) for k in sf.keys()}


def _assert_close_weights(fa: Path, fb: Path) -> None:
    """The same tensor names and dtypes; every floating-point tensor within RTOL of its largest magnitude
    (float32; plus 1e-7) or within one rounding step of its dtype (``final/`` is stored in
    ``train.save_dtype`` bfloat16: a last-bit difference of float32 sums taken in another order can round
    to the neighbouring bfloat16). Relative to the tensor, not to each entry: Adam turns the rounding noise
    of a reduce-scatter on near-zero gradient entries (LoRA A at B = 0) into lr-sized steps of tiny
    entries, which the loss does not see."""
    assert _dtypes(fa) == _dtypes(fb), fa
    wa, wb = load_file(str(fa)), load_file(str(fb))
    for k in wa:
        if not wa[k].is_floating_point():  # token maps
            assert torch.equal(wa[k], wb[k]), f"{fa}: {k}"
            continue
        rtol = RTOL if wa[k].dtype == torch.float32 else 2.0 * torch.finfo(wa[k].dtype).eps
        a, b = wa[k].double(), wb[k].double()
        diff, scale = float((a - b).abs().max()), float(b.abs().max())
        assert diff <= rtol * scale + 1e-7, f"{fa}: {k}: max |delta| {diff:.3g} > {rtol:g} x max |w| {scale:.3g}"


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Same files, same config, every weight file as :func:`_assert_close_weights`."""
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert files(a) == files(b)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    for wf in sorted(p.relative_to(a) for p in a.rglob("*.safetensors")):
        _assert_close_weights(a / wf, b / wf)


def _assert_same_step_weights(a: Path, b: Path, step: int = STEPS) -> None:
    """The float32 weight files of two runs' ``checkpoints/step-N`` (drafter and adapter) within RTOL
    (their ``engine_state/`` differs by engine)."""
    ca, cb = a / "checkpoints" / f"step-{step:06d}", b / "checkpoints" / f"step-{step:06d}"
    names = sorted(p.relative_to(ca) for p in ca.rglob("*.safetensors"))
    assert names and names == sorted(p.relative_to(cb) for p in cb.rglob("*.safetensors"))
    for wf in names:
        _assert_close_weights(ca / wf, cb / wf)


# ----------------------------------------------------------------------------- in-process (fast)


@pytest.fixture()
def one_rank_group(tmp_path):
    """A 1-rank gloo process group in this process (what a launch gives each rank), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)
        self.frozen = torch.nn.Embedding(7, 6).requires_grad_(False)

    def forward(self, ids):
        return self.b(self.a(self.frozen(ids))).pow(2).mean()


def test_full_parameters_shows_whole_weights_and_puts_the_shards_back(one_rank_group):
    from speculators.train.fsdp import full_parameters, is_sharded, shard_unit

    plain = _Toy()
    unit = shard_unit(_Toy())
    assert is_sharded(unit) and all(hasattr(p, "full_tensor") for p in unit.parameters())
    shards = [id(p) for p in unit.parameters()]
    with full_parameters(unit):
        sd = unit.state_dict()
        assert not any(hasattr(v, "full_tensor") for v in sd.values())
        for k, v in plain.state_dict().items():
            assert torch.equal(sd[k], v), k
        assert not unit.frozen.weight.requires_grad and unit.a.weight.requires_grad
    assert [id(p) for p in unit.parameters()] == shards  # the optimizer's parameters are back


def test_keep_full_parameters_leaves_the_trained_model_in_memory(one_rank_group):
    from speculators.train.fsdp import keep_full_parameters, shard_unit

    plain, unit = _Toy(), shard_unit(_Toy())
    keep_full_parameters(unit)
    assert not any(hasattr(p, "full_tensor") for p in unit.parameters())
    for (n, p), q in zip(unit.named_parameters(), plain.parameters()):
        assert torch.equal(p, q) and p.requires_grad == q.requires_grad, n
    assert not any(hasattr(v, "full_tensor") for v in unit.state_dict().values())


def test_engine_state_round_trip_restores_weights_and_optimizer(one_rank_group, tmp_path):
    from speculators.train.fsdp import is_engine_state, load_engine_state, save_engine_state, shard_unit

    def trained(steps):
        unit = shard_unit(_Toy())
        opt = torch.optim.AdamW([p for p in unit.parameters() if p.requires_grad], lr=0.1)
        for s in range(steps):
            unit(torch.tensor([[s % 7, 1, 2]])).backward()
            opt.step()
            opt.zero_grad()
        return unit, opt

    unit, opt = trained(3)
    save_engine_state(unit, opt, tmp_path / "engine")
    assert is_engine_state(tmp_path / "engine")
    fresh, fresh_opt = trained(0)
    assert not torch.equal(fresh.a.weight.full_tensor(), unit.a.weight.full_tensor())
    load_engine_state(fresh, fresh_opt, tmp_path / "engine")
    for (n, p), q in zip(unit.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n
    sa, sb = opt.state[unit.a.weight], fresh_opt.state[fresh.a.weight]
    assert torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor())
    assert float(sa["step"]) == float(sb["step"]) == 3
    with pytest.raises(SpeculatorsError, match="not a torch.distributed.checkpoint directory"):
        load_engine_state(fresh, fresh_opt, tmp_path)


def test_shard_unit_errors_name_the_problem(one_rank_group):
    from speculators.train.fsdp import shard_unit

    mixed = _Toy()
    mixed.b.to(torch.bfloat16)
    with pytest.raises(SpeculatorsError, match=r"one dtype; they have \['bfloat16', 'float32'\].*target.dtype"):
        shard_unit(mixed)


def test_shard_unit_needs_a_launch():
    from speculators.train.fsdp import shard_unit

    with pytest.raises(SpeculatorsError, match="accelerate launch --config_file recipes/accelerate/fsdp.yaml"):
        shard_unit(_Toy())


def test_fsdp_on_cpu_is_asked_by_the_launcher_config(monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    from speculators.train.fsdp import fsdp_on_cpu_requested

    cfg = load_config_from_file(str(FSDP_CONFIG))
    assert cfg.distributed_type == DistributedType.FSDP and cfg.fsdp_config["fsdp_version"] == 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch exports for this config
    assert fsdp_on_cpu_requested(DistributedType.MULTI_CPU)
    assert not fsdp_on_cpu_requested(DistributedType.FSDP)  # GPUs: accelerate's own FSDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not fsdp_on_cpu_requested(DistributedType.MULTI_CPU)  # the DDP config


# ----------------------------------------------------------------------------- launched (slow)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, tiny_target_dir) -> Path:
    cache = tmp_path_factory.mktemp("fsdp-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(cache))
    try:
        for recipe in (EAGLE3, MEDUSA):
            r = CliRunner().invoke(app, ["data", str(recipe), f"target.model={tiny_target_dir}"])
            assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    finally:
        mp.undo()
    return cache


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, warm_cache) -> dict:
    """one / joint1: EAGLE-3 / joint Medusa-2 with 1 process; crashed: EAGLE-3 on 2 FSDP processes killed
    after step 10; nodes: the uninterrupted 2-process FSDP run as 2 single-process "machines" on this
    host (the multi-node path); joint2: joint Medusa-2 on 2 FSDP processes; resumed2 / resumed1: copies of
    the killed run resumed with 2 / 1 processes. Two launches at a time; each phase checked at once."""
    root = tmp_path_factory.mktemp("fsdp-runs")
    d = {n: root / n for n in ("one", "joint1", "crashed", "nodes", "joint2", "resumed2", "resumed1")}
    t, c = tiny_target_dir, warm_cache
    outputs = {}

    def phase(**procs):
        done = {k: _finish(v) for k, v in procs.items()}
        for name, (rc, out) in done.items():
            if name == "crashed":
                assert rc != 0 and "done:" not in out, out[-5000:]
            else:
                assert rc == 0, f"{name}:\n{out[-5000:]}"
            outputs[name] = out

    phase(crashed=_start(d["crashed"], EAGLE3, t, c, 2, crash_at=CRASH_AT), one=_start(d["one"], EAGLE3, t, c, 1))
    shutil.copytree(d["crashed"], d["resumed2"])
    shutil.copytree(d["crashed"], d["resumed1"])
    port = _free_port()
    phase(nodes=_start(d["nodes"], EAGLE3, t, c, 2, machine_rank=0, port=port),
          nodes_rank1=_start(d["nodes"], EAGLE3, t, c, 2, machine_rank=1, port=port))
    phase(joint2=_start(d["joint2"], MEDUSA, t, c, 2, *JOINT), joint1=_start(d["joint1"], MEDUSA, t, c, 1, *JOINT))
    phase(resumed2=_start(d["resumed2"], EAGLE3, t, c, 2, "--resume"),
          resumed1=_start(d["resumed1"], EAGLE3, t, c, 1, "--resume"))
    return {**d, "_output": outputs}


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process_drafter_only(runs):
    for name in ("crashed", "nodes", "resumed2"):
        assert "x 2 processes (FSDP2 on CPU, gloo)" in runs["_output"][name], name  # sharded, not DDP
    # the first 10 steps on one node (the killed run), all 20 on two "machines"
    _assert_losses_match(runs["crashed"], runs["one"], steps=range(1, CRASH_AT + 1), total=CRASH_AT)
    _assert_losses_match(runs["nodes"], runs["one"])
    _assert_same_checkpoint(runs["nodes"] / "final", runs["one"] / "final")  # full weights, same format
    _assert_same_step_weights(runs["nodes"], runs["one"])


@pytest.mark.slow
def test_only_global_rank_zero_of_two_machines_writes(runs):
    assert runs["_output"]["nodes"].count("done:") == 1
    assert "done:" not in runs["_output"]["nodes_rank1"]  # machine 1's process is rank 1: it reports nothing
    assert [r for r in _losses(runs["nodes"])] == list(range(1, STEPS + 1))  # one log row per step


@pytest.mark.slow
def test_fsdp_joint_lora_run_equals_one_process(runs):
    assert "x 2 processes (FSDP2 on CPU, gloo)" in runs["_output"]["joint2"]
    _assert_losses_match(runs["joint2"], runs["joint1"])
    final = runs["joint2"] / "final"
    assert (final / "target_adapter" / "adapter_model.safetensors").is_file()
    _assert_same_checkpoint(final, runs["joint1"] / "final")  # drafter and LoRA adapter
    _assert_same_step_weights(runs["joint2"], runs["joint1"])


@pytest.mark.slow
def test_fsdp_checkpoint_holds_full_weights_and_sharded_engine_state(runs):
    ck = runs["crashed"] / "checkpoints" / f"step-{CRASH_AT:06d}"
    engine = ck / "engine_state"
    assert (engine / ".metadata").is_file() and len(list(engine.glob("*.distcp"))) == 2  # one shard file per rank
    state = torch.load(ck / "trainer_state.pt", weights_only=False)
    assert state["optimizer"] is None and state["num_processes"] == 2 and state["step"] == CRASH_AT
    # the drafter files are the full weights: those of the uninterrupted run's own step-10 checkpoint
    full = runs["nodes"] / "checkpoints" / f"step-{CRASH_AT:06d}"
    wa, wb = load_file(str(ck / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (runs["crashed"] / "final").exists()


@pytest.mark.slow
def test_killed_fsdp_run_resumes_with_two_or_one_processes(runs):
    for name in ("resumed2", "resumed1"):
        out = runs["_output"][name]
        assert "resume: continuing from" in out and f"step-{CRASH_AT:06d}" in out, out[-3000:]
        _assert_losses_match(runs[name], runs["nodes"], steps=range(CRASH_AT + 1, STEPS + 1))
        _assert_same_checkpoint(runs[name] / "final", runs["nodes"] / "final")
        _assert_same_step_weights(runs[name], runs["nodes"])


@pytest.mark.slow
def test_fsdp_final_loads_in_a_one_process_eval(runs, warm_cache, monkeypatch):
    monkeypatch.setenv("SPECULATORS_CACHE", str(warm_cache))
    run = runs["nodes"]
    r = CliRunner().invoke(app, ["eval", str(run), "--temperature", "0", "-k", "2", "--num-prompts", "2",
                                 "--max-new-tokens", "8"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    reports = sorted(run.glob("eval-*/report.json"))
    assert len(reports) == 1
    rep = json.loads(reports[0].read_text())
    assert rep["greedy_mismatches"] == []  # verified losslessly with the FSDP-trained drafter


@pytest.mark.slow
def test_fsdp_eagle3_final_passes_the_export_gate(runs):
    """The static vLLM layout check and the parity gate against the reference implementation
    (``speculators check DIR``'s :func:`speculators.export.gate.check_checkpoint`) on the FSDP run's
    EAGLE-3 ``final/``; the parity part needs the reference venv (``make reference``)."""
    from speculators.export import reference_env
    from speculators.export.gate import check_checkpoint

    python = reference_env.find_reference_python()
    res = check_checkpoint(runs["nodes"] / "final", reference_python=python, build=False, log=lambda *_: None)
    assert res.layout_problems == [], res.layout_problems
    if res.parity is None or res.parity.passed is None:
        pytest.skip(f"layout checked; parity not run: {getattr(res.parity, 'skipped', None) or 'no reference venv'} "
                    "(make reference builds it)")
    assert res.passed, res.to_markdown()
