"""The KL reference worker (`reference:` section, ROLL's reference role) of the learners.

Two tiny models share the embedded character tokenizer: the actor (`tiny_model`, seed 0) and a
reference drawn with another seed and peakier weights. The KL the torch learner reports before
any update is checked against a closed form computed here, one unpadded sequence at a time; the
Megatron learner's (CPU emulation, slow) against the torch learner's, step by step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.learner.reference import ReferenceConfigError
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup
from tests.helpers import random_qwen2
from tests.test_torch_learner import _groups, _learner

TEMPERATURE = 0.7  # the temperature `_learner` builds with


def build_reference_model(actor_dir: Path, dst: Path, seed: int = 1, std: float = 0.15) -> Path:
    """A model with the actor's architecture and tokenizer but other weights: every matrix
    re-drawn from N(0, std) (norms kept at 1), so its next-token distributions are peaked
    where the actor's (init std 0.02) are nearly uniform."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(AutoConfig.from_pretrained(actor_dir))
    for p in model.parameters():
        if p.dim() >= 2:
            p.data.normal_(0, std)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(actor_dir).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def reference_dir(tiny_model, tmp_path_factory):
    return build_reference_model(tiny_model, tmp_path_factory.mktemp("reference-model"))


def _with_reference(path: Path, *overrides: str) -> list[str]:
    return ["actor.use_kl_loss=true", f"reference.model_args.model_name_or_path={path}", *overrides]


def _sequence_logprobs(model: torch.nn.Module, groups: list[TrajectoryGroup]) -> torch.Tensor:
    """log π(token | prefix) of every response token, one unpadded sequence per forward."""
    out = []
    for g in groups:
        for i in range(g.n):
            ids = torch.tensor(np.concatenate([g.prompt_ids, g.response(i)]))[None].long()
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float() / TEMPERATURE
            p = len(g.prompt_ids)
            logp = torch.log_softmax(logits[p - 1 : -1], -1)
            out.append(logp.gather(-1, ids[0, p:, None])[:, 0])
    return torch.cat(out).double()


def _closed_form_kl(logp: torch.Tensor, ref: torch.Tensor, kl_type: str) -> float:
    """The token-mean over the batch of verl's estimator, written out (every token counts)."""
    lr = logp - ref
    per_token = {
        "kl": lr,
        "mse": 0.5 * lr**2,
        "low_var_kl": torch.exp(-lr) + lr - 1,  # k3 = e^(ref - logp) - (ref - logp) - 1
    }[kl_type]
    if kl_type == "low_var_kl":  # inside k3's clamps, where the closed form is exact
        assert (lr.abs() < 20).all() and (per_token.abs() < 10).all()
    return float(per_token.mean())


def _hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("kl_type", ["low_var_kl", "kl", "mse"])
def test_kl_at_step_zero_is_the_closed_form_kl_between_the_two_models(
    tiny_model, reference_dir, kl_type
):
    overrides = _with_reference(
        reference_dir,
        f"actor.kl_loss_type={kl_type}",
        "reference.infer_batch_size=2",
        "actor_train.training_args.per_device_train_batch_size=4",  # micro-batches of the KL
    )
    learner = _learner(tiny_model, *overrides)
    groups = _groups()
    want = _closed_form_kl(_sequence_logprobs(_hf(tiny_model), groups),
                           _sequence_logprobs(_hf(reference_dir), groups), kl_type)  # fmt: skip
    metrics = learner.step(groups)
    assert abs(want) > 0.05  # the two models really differ
    assert metrics["actor/kl_loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_reference_stays_frozen_while_the_actor_trains(tiny_model, reference_dir):
    learner = _learner(tiny_model, *_with_reference(reference_dir, "actor.kl_loss_coef=0.5"))
    before = {n: t.clone() for n, t in learner.reference.state_dict().items()}
    actor_before = {n: t.clone() for n, t in learner.model.state_dict().items()}
    kls = [learner.step(_groups(seed=s))["actor/kl_loss"] for s in range(3)]
    assert not learner.reference.training
    assert not any(p.requires_grad for p in learner.reference.parameters())
    for name, tensor in learner.reference.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    from_disk = _hf(reference_dir).state_dict()
    for name, tensor in before.items():
        assert torch.equal(tensor, from_disk[name]), name  # the configured model, not the actor
    moved = [
        n for n, t in learner.model.state_dict().items() if not torch.equal(t, actor_before[n])
    ]
    assert moved  # the actor did train
    assert all(k > 0 for k in kls)


def test_without_a_reference_section_the_kl_at_step_zero_is_zero(tiny_model):
    learner = _learner(tiny_model, "actor.use_kl_loss=true")
    metrics = learner.step(_groups())
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)  # the initial actor itself
    assert learner.reference_spec is None


def test_an_empty_reference_path_means_the_actors_own_model(tiny_model):
    learner = _learner(tiny_model, "actor.use_kl_loss=true", "reference.infer_batch_size=3")
    assert learner.reference_spec.path == Path(tiny_model)
    assert learner.reference_batch_size == 3
    metrics = learner.step(_groups())
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)


def test_a_reference_of_another_vocabulary_is_refused_in_one_line(tiny_model, tmp_path):
    other = tmp_path / "vocab64"
    random_qwen2(other)  # a 64-token vocabulary; the embedded tokenizer has more
    with pytest.raises(ReferenceConfigError) as err:
        _learner(tiny_model, *_with_reference(other))
    message = str(err.value)
    assert "\n" not in message
    assert str(other) in message and str(tiny_model) in message and "vocab_size 64" in message


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["reference.model_args.dtype=bf16"], "actor.use_kl_loss is false"),
        (["actor.use_kl_loss=true", "reference.device_mapping=[1]"], "reference.device_mapping"),
    ],
)
def test_a_reference_section_the_learner_cannot_honour_is_refused(
    tiny_model, overrides, words, monkeypatch
):
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words):  # `config validate` says it first
        load_config(None, list(overrides))
    monkeypatch.setattr("asyncrl.config.loader.validate", lambda cfg: None)
    with pytest.raises(ReferenceConfigError, match=words) as err:  # and the learner too
        _learner(tiny_model, *overrides)
    assert "\n" not in str(err.value)


def test_a_missing_reference_directory_is_refused_in_one_line(tiny_model, tmp_path):
    with pytest.raises(ReferenceConfigError, match="not a Hugging Face model directory"):
        _learner(tiny_model, *_with_reference(tmp_path / "nowhere"))


def test_a_bf16_reference_loads_in_bf16(tiny_model, reference_dir):
    learner = _learner(
        tiny_model, *_with_reference(reference_dir, "reference.model_args.dtype=bf16")
    )
    assert {p.dtype for p in learner.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    groups = _groups()
    ref = _sequence_logprobs(_hf(reference_dir, torch.bfloat16), groups)
    want = _closed_form_kl(_sequence_logprobs(_hf(tiny_model), groups), ref, "low_var_kl")
    metrics = learner.step(groups)
    assert metrics["actor/kl_loss"] == pytest.approx(want, rel=2e-2)


def test_a_configured_reference_is_not_checkpointed_but_reloaded(tiny_model, reference_dir):
    a = _learner(tiny_model, *_with_reference(reference_dir))
    a.step(_groups())
    state = a.state_dict()
    assert state["reference"] is None  # it lives in its own model directory
    # Resuming a run whose checkpoint holds a frozen initial actor: the configured model wins.
    frozen = _learner(tiny_model, "actor.use_kl_loss=true").state_dict()["reference"]
    b = _learner(tiny_model, *_with_reference(reference_dir))
    b.load_state_dict({**state, "reference": frozen})
    for name, tensor in b.reference.state_dict().items():
        assert torch.equal(tensor, a.reference.state_dict()[name]), name


def test_the_frozen_initial_actor_round_trips_through_a_checkpoint(tiny_model, reference_dir):
    a = _learner(tiny_model, "actor.use_kl_loss=true")
    a.step(_groups())
    state = a.state_dict()
    assert state["reference"] is not None  # training overwrote its source: it must be saved
    # Built from other weights, b's frozen copy must become a's initial actor on resume.
    b = TorchLearner(reference_dir, a.train, a.actor, a.algorithm, TEMPERATURE, total_steps=10)
    b.load_state_dict(state)
    for name, tensor in b.reference.state_dict().items():
        assert torch.equal(tensor, state["reference"][name]), name


def test_make_learner_passes_the_reference_section_through(tiny_model, reference_dir):
    from asyncrl.config import load_config
    from asyncrl.learner.base import make_learner

    overrides = _with_reference(reference_dir)
    cfg = load_config(
        None, [*overrides, "actor_train.model_args.disable_gradient_checkpointing=true"]
    )
    learner = make_learner("fsdp2_train", model_path=tiny_model, train=cfg.actor_train,
                           actor=cfg.actor, algorithm=cfg.algorithm, temperature=TEMPERATURE,
                           total_steps=10, reference=cfg.reference)  # fmt: skip
    assert learner.reference_spec.path == reference_dir


def test_data_parallel_learner_refuses_before_any_rank_starts(tiny_model, tmp_path, monkeypatch):
    from asyncrl.config import load_config
    from asyncrl.learner.torch.distributed import DistributedTorchLearner

    other = tmp_path / "vocab64"
    random_qwen2(other)
    cfg = load_config(None, _with_reference(other))
    ray_started = []  # Ray may be up already from another test: watch the call instead
    monkeypatch.setattr("asyncrl.net.init_ray", lambda: ray_started.append(True))
    with pytest.raises(ReferenceConfigError, match="vocab_size 64"):
        DistributedTorchLearner(
            2, model_path=tiny_model, train=cfg.actor_train, actor=cfg.actor,
            algorithm=cfg.algorithm, temperature=TEMPERATURE, total_steps=10,
            reference=cfg.reference,
        )  # fmt: skip
    assert not ray_started  # refused before Ray or any rank process


# -- the Megatron learner: the same reference rules, the same KL ----------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _architecture_variant(actor_dir: Path, dst: Path) -> Path:
    """The actor's vocabulary and tokenizer, one more layer: another architecture."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(actor_dir)
    cfg.num_hidden_layers += 1
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    Qwen2ForCausalLM(cfg).save_pretrained(dst)
    AutoTokenizer.from_pretrained(actor_dir).save_pretrained(dst)
    return dst


def _megatron_config(*overrides: str):
    from asyncrl.config import load_config

    cfg = load_config(None, ["actor_train.strategy_args.strategy_name=megatron_train",
                             "actor_train.model_args.dtype=fp32", *overrides])  # fmt: skip
    cfg.actor_train.strategy_args.strategy_config = {"transformer_impl": "local",
                                                     "use_bridge": False}  # fmt: skip
    return cfg


@pytest.mark.parametrize(
    ("variant", "overrides", "words"),
    [
        ("vocab", [], "vocab_size 64"),
        ("architecture", [], "is not the architecture of the actor"),
        ("same", ["reference.model_args.dtype=bf16"], "reference.model_args.dtype bf16"),
    ],
)
def test_megatron_refuses_a_reference_it_cannot_build_with_the_actors_layout(
    tiny_model, reference_dir, tmp_path, variant, overrides, words, monkeypatch
):
    from asyncrl.learner.megatron.reference import megatron_reference

    # What `config validate` can see (the dtype) it refuses first (the test below);
    # the learner's own check must hold for a config built without it.
    monkeypatch.setattr("asyncrl.config.loader.validate", lambda cfg: None)

    if variant == "vocab":
        path = tmp_path / "vocab64"
        random_qwen2(path)
    elif variant == "architecture":
        path = _architecture_variant(tiny_model, tmp_path / "deeper")
    else:
        path = reference_dir
    cfg = _megatron_config(*_with_reference(path, *overrides))
    with pytest.raises(ReferenceConfigError, match=words) as err:
        megatron_reference(cfg.reference, tiny_model, cfg.actor_train, cfg.actor, builtin=True)
    assert "\n" not in str(err.value)


def test_megatron_accepts_a_reference_of_the_actors_architecture(tiny_model, reference_dir):
    from asyncrl.learner.megatron.reference import megatron_reference

    cfg = _megatron_config(*_with_reference(reference_dir, "reference.model_args.dtype=fp32"))
    spec = megatron_reference(cfg.reference, tiny_model, cfg.actor_train, cfg.actor, True)
    assert spec.path == reference_dir
    cfg = _megatron_config("actor.use_kl_loss=true")  # no section: the initial actor
    assert megatron_reference(cfg.reference, tiny_model, cfg.actor_train, cfg.actor, True) is None


def _kl_overrides(reference: Path) -> list[str]:
    return _with_reference(reference, "actor.kl_loss_coef=0.5", "reference.infer_batch_size=2",
                           "actor_train.training_args.learning_rate=1e-3",
                           "actor_train.model_args.disable_gradient_checkpointing=true",
                           "actor_train.training_args.per_device_train_batch_size=2")  # fmt: skip


def _megatron_rank(rank: int, world: int, init: str, actor: str, reference: str, out: str) -> None:
    """One rank of the real MegatronWorker on the CPU (tests/megatron_emulation.py): two
    steps with the configured reference, then the exported weights."""
    from tests.megatron_emulation import apply

    apply()
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.worker import MegatronWorker

    cfg = _megatron_config(*_kl_overrides(Path(reference)), "actor_train.device_mapping=[0,1]")
    worker = MegatronWorker(actor, cfg.actor_train, cfg.actor, cfg.algorithm, TEMPERATURE, 10,
                            rank=rank, world_size=world, init_method=init, device=SPECS["cpu"],
                            reference=cfg.reference)  # fmt: skip
    metrics = [worker.step(_groups(seed=seed)) for seed in (0, 1)]
    weights = {n: t.float().clone() for n, t in worker.export()}
    torch.save({"metrics": metrics, "weights": weights}, f"{out}/rank{rank}.pt")


def megatron_main(actor: str, reference: str, out: str) -> None:
    """Two data-parallel Megatron ranks (gloo) in spawned processes."""
    import torch.multiprocessing as mp

    init = f"file://{Path(out) / 'rendezvous'}"  # no port another process could take first
    mp.spawn(_megatron_rank, args=(2, init, actor, reference, out), nprocs=2)


@pytest.mark.slow
def test_megatron_reference_kl_matches_the_torch_learner(tiny_model, reference_dir, tmp_path):
    """The real Megatron learner (two DP ranks, CPU emulation) with the configured reference:
    the same KL as the torch learner at both steps (so its reference stayed put) and the same
    weights after the KL-regularised updates."""
    pytest.importorskip("megatron.core")
    import subprocess
    import sys

    code = (
        "import sys; from tests.test_reference_worker import megatron_main as m; m(*sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", code, str(tiny_model), str(reference_dir), str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = _learner(tiny_model, *_kl_overrides(reference_dir))
    for seed in (0, 1):
        expected = want.step(_groups(seed=seed))
        got = ranks[0]["metrics"][seed]
        assert expected["actor/kl_loss"] > 0.05
        for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (seed, key)
    after = dict(want.weights_for_sync())
    for name, tensor in ranks[0]["weights"].items():
        torch.testing.assert_close(tensor, after[name].float(), atol=1e-5, rtol=1e-4, msg=name)


def test_config_validate_refuses_a_megatron_reference_of_another_dtype(reference_dir):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="reference.model_args.dtype bf16 with megatron_train"):
        _megatron_config(*_with_reference(reference_dir, "reference.model_args.dtype=bf16"))
