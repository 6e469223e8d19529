"""FSDP2 (`fsdp2_train` over > 1 device): 2 gloo ranks equal 1 process, hold half the state
each, gather full tensors for weight sync, and checkpoint/resume across rank counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from asyncrl.checkpoint import Checkpointer, IncompleteCheckpoint
from asyncrl.config import load_config
from asyncrl.device import device_spec
from asyncrl.learner import lora
from asyncrl.learner.torch.distributed import DistributedTorchLearner
from tests.test_torch_learner import _groups, _learner


def _distributed(model_dir, single) -> DistributedTorchLearner:
    return DistributedTorchLearner(
        2, model_path=model_dir, train=single.train, actor=single.actor,
        algorithm=single.algorithm, temperature=0.7, total_steps=10, device=device_spec("cpu"),
    )  # fmt: skip


def _assert_same_weights(dist, ref: dict[str, torch.Tensor]) -> None:
    """The full tensors the 2 ranks gather (what weight sync sends) equal the 1-process ones
    (all but a tied model's head: the engines take it from the embedding)."""
    gathered = dict(dist.weights_for_sync())
    tied = lora.tied_copies(dist.local.model)
    assert tied == {"lm_head.weight"}  # the tiny model ties its embeddings
    assert gathered.keys() == ref.keys() - tied
    for name, tensor in gathered.items():
        assert not isinstance(tensor, DTensor), name
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=1e-4, msg=name)


def _state_bytes(learner) -> int:
    """This rank's parameter + optimizer-state bytes (a DTensor counts its local shard)."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local(p) for p in learner.model.parameters())
    for state in learner.optimizer.state.values():
        total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return total


@pytest.mark.parametrize(
    "settings",
    [
        [],
        ["actor_train.model_args.disable_gradient_checkpointing=false"],
        # the frozen initial actor as KL reference: sharded too, scored in sharded forwards
        [
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.5",
            "algorithm.correction_mode=bypass",
            "actor_train.infer_batch_size=4",
        ],  # fmt: skip
    ],
)
def test_two_fsdp2_ranks_equal_one_process_and_hold_half(tiny_model, tmp_path, settings):
    """Micro-batches of 1 row over 3 rows: rank 0 runs 2 passes, rank 1 one real pass and one
    zero-loss pass (the collectives match); loss, grad norm and weights agree to 1e-5."""
    extra = ["actor_train.training_args.per_device_train_batch_size=1", *settings]
    batches = [_groups(n_groups=1, n=3, seed=seed) for seed in range(3)]
    # The one-process run goes first: a learner of world 1 next to a live default process
    # group would still take part in the logprob passes' collectives.
    single = _learner(tiny_model, *extra)
    expected, states = [], []
    for groups in batches:
        expected.append(single.step(groups))
        states.append({k: v.clone() for k, v in single.model.state_dict().items()})
    dist = _distributed(tiny_model, single)
    try:
        for model in (dist.local.model, dist.local.reference):
            assert model is None or all(isinstance(p, DTensor) for p in model.parameters())
        for groups, m_single in zip(batches[:2], expected, strict=False):
            m_dist = dist.step(groups)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
                if key in m_single or key in m_dist:
                    assert m_dist[key] == pytest.approx(m_single[key], abs=1e-5), key
        _assert_same_weights(dist, states[1])
        # a synchronous sharded save: the DCP shards and the HF export hold the same weights
        saved = Checkpointer(tmp_path, ["model", "optimizer"]).save(2, dist, {})
        resumed = _learner(tiny_model, *extra)
        Checkpointer.open(saved).apply(resumed, {"model", "optimizer"})
        # transformers reads the export (the one-process policy may be the lean one)
        exported = AutoModelForCausalLM.from_pretrained(saved / "hf")
        for name, tensor in states[1].items():
            torch.testing.assert_close(resumed.model.state_dict()[name], tensor, msg=name)
            torch.testing.assert_close(exported.state_dict()[name], tensor, msg=name)
        # per-rank parameters + optimizer state: rank 0 holds the larger half of odd splits
        assert _state_bytes(dist.local) <= 0.55 * _state_bytes(single)
        # a weight-sync consumer that stops early: the ranks still finish the same gathers
        tensors = dist.weights_for_sync()
        next(tensors)
        tensors.close()
        m_dist = dist.step(batches[2])
        assert m_dist["actor/pg_loss"] == pytest.approx(expected[2]["actor/pg_loss"], abs=1e-5)
        _assert_same_weights(dist, states[2])
    finally:
        dist.close()


def test_sharded_checkpoint_resumes_onto_one_and_two_ranks(tiny_model, tmp_path):
    """1 process → 2 ranks, then 2 ranks → a sharded checkpoint (written in the background
    while the next step trains) → 1 process and → 2 ranks: each resumed learner takes the
    next step exactly as the uninterrupted one did (weights and optimizer state restored)."""
    contents = ["model", "optimizer"]
    batches = [_groups(seed=s) for s in range(3)]
    single = _learner(tiny_model)
    single.step(batches[0])
    full = Checkpointer(tmp_path / "one", contents).save(1, single, {})
    single.step(batches[1])

    dist = _distributed(tiny_model, _learner(tiny_model))
    try:
        Checkpointer.open(full).apply(dist, set(contents))  # 1 → 2
        dist.step(batches[1])
        _assert_same_weights(dist, single.model.state_dict())
        ckpt = Checkpointer(tmp_path / "two", contents, async_save=True)
        sharded = ckpt.save(2, dist, {})
        dist.step(batches[2])  # trains on while the shards are written
        ckpt.wait()
        expected = {k: v.clone() for k, v in dist.weights_for_sync()}
    finally:
        dist.close()

    state = torch.load(sharded / "learner.pt", weights_only=True)
    assert state["model"] == state["optimizer"] == "sharded" and state["version"] == 2
    hf = json.loads((sharded / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"]  # transformers' class of the model

    resumed = _learner(tiny_model)  # 2 → 1
    Checkpointer.open(sharded).apply(resumed, set(contents))
    assert resumed.version == 2
    resumed.step(batches[2])
    state = resumed.model.state_dict()
    assert expected.keys() == state.keys() - lora.tied_copies(resumed.model)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-5, rtol=1e-4, msg=name)

    again = _distributed(tiny_model, _learner(tiny_model))  # 2 → 2
    try:
        Checkpointer.open(sharded).apply(again, set(contents))
        again.step(batches[2])
        _assert_same_weights(again, resumed.model.state_dict())
    finally:
        again.close()

    (sharded / "learner" / ".metadata").unlink()  # a torn sharded save is not a checkpoint
    with pytest.raises(IncompleteCheckpoint, match="metadata"):
        Checkpointer.open(sharded)


# -- actor.checkpoint.async_save ------------------------------------------------------------
def _blocking_writer(monkeypatch, log: list[str], release=None, fail_on: int | None = None):
    """Make the learner.pt write (the edge: the disk) log its start and end, wait for `release`
    and raise for the save of version `fail_on`."""
    import asyncrl.checkpoint as checkpoint

    original = checkpoint.save_learner_file

    def write(state, path):
        log.append(f"start {state['version']}")
        if release is not None:
            assert release.wait(timeout=60), "the test never released the write"
        if state["version"] == fail_on:
            raise OSError("No space left on device")
        original(state, path)
        log.append(f"end {state['version']}")

    monkeypatch.setattr(checkpoint, "save_learner_file", write)


def test_async_save_returns_before_the_write_and_keeps_the_snapshot(
    tiny_model, tmp_path, monkeypatch
):
    import threading

    learner, log, release = _learner(tiny_model), [], threading.Event()
    learner.step(_groups(seed=0))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    _blocking_writer(monkeypatch, log, release)
    ckpt = Checkpointer(tmp_path, ["model", "optimizer"], async_save=True)
    path = ckpt.save(1, learner, {})  # returns while the write waits on `release`
    assert not path.exists() and not (ckpt.root / "latest").exists()
    learner.step(_groups(seed=1))  # the loop trains on meanwhile
    release.set()
    ckpt.wait()
    assert log == ["start 1", "end 1"] and (ckpt.root / "latest").read_text() == path.name
    resumed = _learner(tiny_model)
    Checkpointer.open(path).apply(resumed, {"model", "optimizer"})
    for name, tensor in resumed.model.state_dict().items():  # the weights at save time
        torch.testing.assert_close(tensor, before[name], msg=name)
    assert resumed.version == 1


def test_async_saves_run_one_at_a_time(tiny_model, tmp_path, monkeypatch):
    import threading

    learner, log, release = _learner(tiny_model), [], threading.Event()
    _blocking_writer(monkeypatch, log, release)
    ckpt = Checkpointer(tmp_path, ["model"], async_save=True)
    learner.version = 1
    ckpt.save(1, learner, {})
    learner.version = 2
    second = threading.Thread(target=ckpt.save, args=(2, learner, {}))
    second.start()  # waits in save() for the first write
    release.set()
    second.join(timeout=60)
    ckpt.wait()
    assert log == ["start 1", "end 1", "start 2", "end 2"]
    assert [p.name for p in ckpt.step_dirs()] == ["step_2", "step_1"]


def test_failed_async_save_keeps_the_previous_checkpoint_and_surfaces(
    tiny_model, tmp_path, monkeypatch
):
    from asyncrl.checkpoint import CheckpointSaveError

    learner, log = _learner(tiny_model), []
    _blocking_writer(monkeypatch, log, fail_on=2)
    ckpt = Checkpointer(tmp_path, ["model"], async_save=True)
    learner.version = 1
    ckpt.save(1, learner, {})
    learner.version = 2
    ckpt.save(2, learner, {})  # fails in the background: nothing raised here yet
    with pytest.raises(CheckpointSaveError, match="No space left on device") as failed:
        ckpt.wait()  # the end of the run (or the next save) raises it, in one line
    assert "\n" not in str(failed.value)
    assert (ckpt.root / "latest").read_text() == "step_1"
    assert [p.name for p in ckpt.step_dirs()] == ["step_1"]
    assert Checkpointer.open(ckpt.root / "step_1").state["version"] == 1
    learner.version = 3
    ckpt.save(3, learner, {})  # an error already raised is not raised again
    ckpt.wait()
    assert (ckpt.root / "latest").read_text() == "step_3"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # nothing is sharded on one device: nothing to offload
        (["actor_train.strategy_args.strategy_config.offload_params=true"], "FSDP2's shards"),
        (["actor_train.strategy_args.strategy_config.offload_optimizer=1"], "true or false"),
        (
            [
                "actor_train.device_mapping=[0,1]",
                "actor_train.strategy_args.strategy_config.offload_params=true",
                "actor_train.strategy_args.strategy_config.offload_optimizer=false",
            ],
            "offloads parameters, gradients and optimizer state together",
        ),
        # the models the learner holds beside the actor are sharded without offload
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.strategy_args.strategy_config.offload_params=true",
            ],
            "critic.strategy_args.strategy_config.offload_params: the critic is sharded without",
        ),
        (
            [
                "actor.use_kl_loss=true",
                "reference.strategy_args.strategy_config.offload_optimizer=true",
            ],
            "reference.strategy_args.strategy_config.offload_optimizer: the reference is",
        ),
    ],
)
def test_config_refuses_what_fsdp2_cannot_honour(overrides, message):
    from asyncrl.config import ConfigError, load_config
    from asyncrl.config.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides))


def test_offload_of_two_sharded_devices_validates_and_needs_an_accelerator():
    """Offload is FSDP2's CPUOffloadPolicy over actor_train's shards: accepted for >= 2
    devices; a machine whose ranks compute on the CPU refuses it before the run."""
    from asyncrl.config.validate import validate
    from asyncrl.preflight import missing_pieces

    keys = ["offload_params=true", "offload_optimizer=true"]
    cfg = load_config(None, ["actor_train.device_mapping=[0,1]"] + [
        f"actor_train.strategy_args.strategy_config.{k}" for k in keys])  # fmt: skip
    validate(cfg)
    assert missing_pieces(cfg, "cuda") == []
    (line,) = missing_pieces(cfg, "cpu")
    assert line.startswith("actor_train.strategy_args.strategy_config.offload_params: this ")
    assert "nothing to offload" in line


# -- the critic (gae) on 2 ranks -------------------------------------------------------------
def _critic_weights_through(root, learner, model_dir) -> dict[str, torch.Tensor]:
    """The critic's whole weights of `learner` (any rank count), read back through a
    checkpoint it writes under `root` into a one-process critic learner."""
    from tests.test_critic import _learner as critic_learner

    saved = Checkpointer(root, ["model", "optimizer"]).save(learner.version, learner, {})
    reader = critic_learner(model_dir)
    Checkpointer.open(saved).apply(reader, {"model", "optimizer"})
    return reader.critic.model.state_dict()


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_sharded_critic_checkpoint_resumes_onto_one_and_two_ranks(tiny_model, tmp_path):
    """The critic's model and optimizer across rank counts, as the actor's: 1 process → 2 ranks
    → a sharded checkpoint (its shards in the DCP directory beside the actor's) → 1 process
    and → 2 ranks; each resumed learner takes the next step as the uninterrupted one did."""
    from tests.test_critic import CRITIC
    from tests.test_critic import _learner as critic_learner

    contents, batches = ["model", "optimizer"], [_groups(seed=s) for s in range(3)]
    single = critic_learner(tiny_model)
    single.step(batches[0])
    full = Checkpointer(tmp_path / "one", contents).save(1, single, {})
    expected = [single.step(batches[1])]
    after_one = {k: v.clone() for k, v in single.critic.model.state_dict().items()}
    expected.append(single.step(batches[2]))
    cfg = load_config(None, list(CRITIC))
    kwargs = {"model_path": tiny_model, "train": cfg.actor_train, "actor": cfg.actor,
              "algorithm": cfg.algorithm, "temperature": 0.7, "total_steps": 10,
              "critic": cfg.critic}  # fmt: skip

    dist = DistributedTorchLearner(2, **kwargs)
    try:
        assert all(isinstance(p, DTensor) for p in dist.local.critic.model.parameters())
        Checkpointer.open(full).apply(dist, set(contents))  # 1 → 2
        assert dist.local.critic.updates == 1
        m_dist = dist.step(batches[1])
        assert m_dist["critic/vf_loss"] == pytest.approx(expected[0]["critic/vf_loss"], abs=1e-5)
        sharded = Checkpointer(tmp_path / "two", contents).save(2, dist, {})
    finally:
        dist.close()
    state = torch.load(sharded / "learner.pt", weights_only=True)
    assert state["critic"]["model"] == state["critic"]["optimizer"] == "sharded"

    resumed = critic_learner(tiny_model)  # 2 → 1
    Checkpointer.open(sharded).apply(resumed, set(contents))
    _assert_same_tensors(resumed.critic.model.state_dict(), after_one)
    assert resumed.critic.updates == 2
    m_one = resumed.step(batches[2])
    assert m_one["critic/vf_loss"] == pytest.approx(expected[1]["critic/vf_loss"], abs=1e-5)
    _assert_same_tensors(resumed.critic.model.state_dict(), single.critic.model.state_dict())

    again = DistributedTorchLearner(2, **kwargs)  # 2 → 2
    try:
        Checkpointer.open(sharded).apply(again, set(contents))
        m_two = again.step(batches[2])
        for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
            assert m_two[key] == pytest.approx(expected[1][key], abs=1e-5), key
        got = _critic_weights_through(tmp_path / "three", again, tiny_model)
    finally:
        again.close()
    _assert_same_tensors(got, single.critic.model.state_dict())


def test_a_bf16_critic_trains_packed_on_one_and_two_ranks(tiny_model):
    """`critic.model_args.dtype: bf16`: the trunk bf16, the value head fp32 (an FSDP unit of
    its own: one unit's parameters share a dtype), packed value passes read fp32 states."""
    from asyncrl.learner.torch.learner import TorchLearner
    from tests.test_critic import CRITIC

    cfg = load_config(None, [*CRITIC, "critic.model_args.dtype=bf16",
                             "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=64"])  # fmt: skip
    kwargs = {"model_path": tiny_model, "train": cfg.actor_train, "actor": cfg.actor,
              "algorithm": cfg.algorithm, "temperature": 0.7, "total_steps": 10,
              "critic": cfg.critic}  # fmt: skip
    single = TorchLearner(**kwargs)
    assert single.critic.model.trunk.dtype == torch.bfloat16
    assert single.step(_groups(seed=0))["critic/vf_loss"] > 0.0
    dist = DistributedTorchLearner(2, **kwargs)
    try:
        head = list(dist.local.critic.model.value_head.parameters())
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in head)
        metrics = dist.step(_groups(seed=0))
        assert metrics["critic/vf_loss"] > 0.0 and torch.isfinite(
            torch.tensor(metrics["critic/grad_norm"])
        )
    finally:
        dist.close()
