"""Sequence packing under a token budget (`actor.use_dynamic_bsz`): the partition's properties,
packed forwards equal to padded ones, and the same loss, gradients and step as the padded path
for every loss_agg_mode."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import ConfigError, load_config
from asyncrl.config.rules import LOSS_AGG_MODES
from asyncrl.learner import logprobs as lp
from asyncrl.learner import packing
from asyncrl.learner.collate import collate
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup

TEMPERATURE = 0.7


# ------------------------------------------------------------------------------ partition
def _check_partition(parts: list[list[int]], lengths: list[int], budget: int) -> None:
    rows = sorted(r for part in parts for r in part)
    assert rows == list(range(len(lengths)))  # every row exactly once
    for part in parts:
        load = sum(lengths[r] for r in part)
        assert load <= budget or len(part) == 1, (part, load)  # budget, or one long row alone


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 120), max_size=40),
    budget=st.integers(1, 150),
)
def test_partition_respects_budget_and_places_every_row_once(lengths, budget):
    parts = packing.partition(lengths, budget)
    _check_partition(parts, lengths, budget)
    # The fewest parts the rule allows is a lower bound; greedy balancing stays close to it.
    over = sum(1 for n in lengths if n > budget)
    bound = over + -(-sum(n for n in lengths if n <= budget) // budget)
    assert bound <= len(parts) <= max(bound, 1) * 2 + 1


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=40), parts=st.integers(1, 8))
def test_balanced_loads_differ_by_at_most_the_longest_row(lengths, parts):
    found = packing.balanced(lengths, 10**9, parts)
    assert found is not None and len(found) == parts
    _check_partition(found, lengths, 10**9)
    loads = [sum(lengths[r] for r in p) for p in found]
    assert max(loads) - min(loads) <= max(lengths)


def test_partition_of_ragged_rows_with_one_longer_than_the_budget():
    lengths = [3, 40, 7, 7, 12, 1, 9, 5]
    parts = packing.partition(lengths, 16)
    _check_partition(parts, lengths, 16)
    assert [1] in parts  # the 40-token row alone
    assert len(parts) == 1 + 3  # the 44 other tokens fit the fewest parts of 16: 3
    with pytest.raises(ValueError, match="budget must be > 0"):
        packing.partition(lengths, 0)


def test_pad_fraction():
    assert packing.pad_fraction([4, 4]) == 0.0
    assert packing.pad_fraction([1, 3]) == pytest.approx(1 / 3)
    assert packing.pad_fraction([2, 2], width=8) == pytest.approx(0.75)
    assert packing.pad_fraction([]) == 0.0


def _rank_counts(rank: int, world: int, init: str, out: str, model_dir: str) -> None:
    """One gloo rank: partition its own rows, count forwards of every no-grad logprob path."""
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM

    lengths = [[5, 5, 5, 5, 30], [50]][rank]  # rank 0 needs 2 parts, rank 1 one
    parts = packing.micro_batches(lengths, 32)
    data = collate(_groups(n_groups=1 + 2 * rank, n=2, seed=rank), 0).to_torch()

    def forwards(model) -> dict[str, int]:
        calls = [0]
        model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        counts = {}
        for name, run in {
            "budget": lambda: lp.budget_logprobs(model, data, TEMPERATURE, 10),
            "batched": lambda: lp.batched_logprobs(model, data, TEMPERATURE, 1),
            "packed": lambda: lp.packed_logprobs(model, data, TEMPERATURE, 12),
        }.items():
            calls[0] = 0
            run()
            counts[name] = calls[0]
        return counts

    # A model that is not sharded runs no collective: its own forwards only, group or not.
    plain = forwards(AutoModelForCausalLM.from_pretrained(model_dir))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = AutoModelForCausalLM.from_pretrained(model_dir)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    counts = forwards(sharded)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"parts": parts, "forwards": counts, "plain": plain}, f)
    _leave_group()


def test_every_rank_gets_the_same_number_of_micro_batches_and_forwards(tmp_path, tiny_model):
    _spawn_two_ranks(_rank_counts, (2, _init_method(), str(tmp_path), str(tiny_model)))
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert len(results[0]["parts"]) == len(results[1]["parts"]) == 2
    _check_partition(results[0]["parts"], [5, 5, 5, 5, 30], 32)
    assert sorted(map(len, results[1]["parts"])) == [0, 1]  # re-balanced: one row, one empty
    assert results[0]["forwards"] == results[1]["forwards"]
    assert results[1]["forwards"]["batched"] == 6  # rank 1 holds 6 rows, rank 0 only 2
    assert results[0]["plain"]["batched"] == 2 and results[1]["plain"]["batched"] == 6


def _spawn_two_ranks(fn, args: tuple) -> None:
    """Run `fn(rank, *args)` in two spawned processes; wait for both to the deadline."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        # join returns False when one rank ended and another still runs: wait on, to the deadline
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "a rank did not finish in 300 s"
    finally:  # a rank stuck in a collective whose peer failed: never leave it running
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
    assert all(p.exitcode == 0 for p in ctx.processes)


def _init_method() -> str:
    from asyncrl.net import free_port

    return f"tcp://127.0.0.1:{free_port('127.0.0.1')}"


def _rank_steps(rank: int, init: str, out: str, model_dir: str, overrides: list[str]) -> None:
    """One rank of a 2-rank sharded learner: two packed steps; rank 0 saves loss and weights."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    learner = _learner(model_dir, True, *overrides, rank=rank, world_size=2)
    losses = [learner.step(_groups(seed=seed))["actor/pg_loss"] for seed in (0, 1)]
    state = learner.model.state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if rank == 0:
        torch.save({"losses": losses, "weights": full}, os.path.join(out, "rank0.pt"))
    _leave_group()


def _leave_group() -> None:
    """Both ranks done with every collective before either tears its group down: a rank that
    left while its peer still wrote its results once died of SIGABRT in gloo's teardown
    ("terminate called without an active exception", a clean-clone CI run)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_ranks_packed_equal_one_process(tmp_path, tiny_model):
    """Ranks holding different rows (and so different micro-batch counts) stay in step: the
    sharded learner's packed steps equal one process's."""
    over = ["actor.ppo_max_token_len_per_gpu=12", "actor.use_kl_loss=true"]
    _spawn_two_ranks(_rank_steps, (_init_method(), str(tmp_path), str(tiny_model), over))
    got = torch.load(tmp_path / "rank0.pt")
    single = _learner(tiny_model, True, *over)
    losses = [single.step(_groups(seed=seed))["actor/pg_loss"] for seed in (0, 1)]
    assert got["losses"] == pytest.approx(losses, abs=1e-6)
    for name, want in single.model.state_dict().items():
        torch.testing.assert_close(got["weights"][name], want, atol=1e-5, rtol=0, msg=name)


# ------------------------------------------------------------------------------ the model
def _groups(n_groups=3, n=3, seed=0, long_row=False):
    """Ragged prompts and responses (log-normal lengths, a long tail); `long_row`: one response
    of 30 tokens, longer than the budgets used below."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        responses = []
        for i in range(n):
            length = int(np.clip(rng.lognormal(1.3, 0.7), 1, 24))
            if long_row and g == 0 and i == 0:
                length = 30
            responses.append(
                {
                    "response_ids": rng.integers(5, 40, length),
                    "rollout_logprobs": -rng.random(length) * 6,
                    "versions": np.zeros(length),
                    "reward": float(i % 2),
                    "finish_reason": "stop",
                    "advantages": rng.normal(size=length),
                }
            )
        prompt = rng.integers(5, 40, 2 + 3 * g)
        groups.append(TrajectoryGroup.from_responses(f"g{seed}-{g}", prompt, responses))
    return groups


def _learner(model_dir, packed: bool, *overrides, rank: int = 0, world_size: int = 1):
    cfg = load_config(
        None,
        [
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.training_args.per_device_train_batch_size=2",
            "actor_train.training_args.max_grad_norm=0",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            f"actor.use_dynamic_bsz={str(packed).lower()}",
            "actor.ppo_max_token_len_per_gpu=24",
            *overrides,
        ],
    )
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=TEMPERATURE,
        total_steps=10, reference=cfg.reference, rank=rank, world_size=world_size,
    )  # fmt: skip


def _data(groups):
    data = collate(groups, 0).to_torch()
    data["response_mask"] = data["response_mask"].float()
    return data


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_equal_padded_per_row(tiny_model, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn)
    data = _data(_groups(long_row=True))
    want, want_h = lp.token_logprobs(model, data, TEMPERATURE, with_entropy=True)
    got, got_h = lp.token_logprobs(model, data, TEMPERATURE, with_entropy=True, packed=True)
    real = data["attention_mask"][:, -want.shape[1] :].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=0)
    torch.testing.assert_close(got_h[real], want_h[real], atol=1e-6, rtol=0)
    assert (got[~real] == 0).all() and (got_h[~real] == 0).all()
    # One packed row of exactly the real tokens, positions restarting per sequence.
    packed = packing.pack(data)
    lengths = packing.real_lengths(data["attention_mask"])
    assert packed.input_ids.shape == (1, sum(lengths))
    starts = (packed.position_ids[0] == 0).nonzero()[:, 0].tolist()
    assert starts == np.cumsum([0, *lengths[:-1]]).tolist()
    # Under token budgets that split the rows (one row alone: longer than 12).
    for budget in (12, 24, 1000):
        split = lp.packed_logprobs(model, data, TEMPERATURE, budget)
        torch.testing.assert_close(split[real], want.detach()[real], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("lengths", "capacity"), [([5, 3, 9, 2, 2, 7], 9), ([4, 4, 4], 4), ([1], 1), ([6, 20, 3], 8)]
)
def test_fill_rows_keeps_every_sequence_whole_within_the_capacity(lengths, capacity):
    rows = packing.fill_rows(lengths, capacity)
    assert sorted(s for row in rows for s in row) == list(range(len(lengths)))
    for row in rows:
        assert sum(lengths[s] for s in row) <= capacity or len(row) == 1
    # first fit by decreasing length: no two rows could have been one
    loads = sorted(sum(lengths[s] for s in row) for row in rows)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity


def test_rows_as_long_as_the_longest_sequence_equal_one_row_and_padded(tiny_model):
    """Without a varlen attention (eager) the packed rows are as long as the longest
    sequence: each sequence sits whole in one row, the row's tail is a segment of its own,
    and the logprobs equal one packed row's (a dense block mask from the position ids) and the
    padded batch's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    assert not packing.one_row(model)
    model.config._attn_implementation = "flash_attention_2"  # read only, not run here
    assert packing.one_row(model)
    model.config._attn_implementation = "eager"
    data = _data(_groups(long_row=True))
    lengths = packing.real_lengths(data["attention_mask"])
    rows = packing.pack(data, one_row=False)
    assert rows.input_ids.shape[1] == max(lengths) and rows.input_ids.shape[0] < len(lengths)
    assert int((rows.position_ids == 0).sum()) >= len(lengths)  # every sequence starts at 0
    want, _ = lp.token_logprobs(model, data, TEMPERATURE)
    got, _ = lp.token_logprobs(model, data, TEMPERATURE, packed=True)  # rows: eager
    real = data["attention_mask"][:, -want.shape[1] :].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=0)
    one = packing.pack(data)
    out = model(input_ids=one.input_ids, position_ids=one.position_ids, use_cache=False)
    logits = out.logits[0, one.logit_index].float() / TEMPERATURE
    one_row = logits.gather(-1, one.targets[:, None])[:, 0] - logits.logsumexp(-1)
    torch.testing.assert_close(packing.unpack(one_row, one)[real], got[real], atol=1e-6, rtol=0)


def test_packed_rows_without_response_tokens_give_zeros_and_a_connected_graph(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    data = _data(_groups(n_groups=1, n=2))
    resp_len = data["response_mask"].shape[1]
    data["attention_mask"][:, -resp_len:] = 0  # prompts only
    data["response_mask"].zero_()
    logp, entropy = lp.token_logprobs(model, data, TEMPERATURE, True, packed=True)
    assert logp.shape == entropy.shape == data["response_mask"].shape
    assert (logp == 0).all() and (entropy == 0).all()
    logp.sum().backward()  # every parameter that the forward used gets a (zero) gradient
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


def test_packed_hidden_states_equal_padded(tiny_model):
    """What a critic's value head reads (`asyncrl.learner.critic.ValueModel`), packed."""
    from transformers import AutoModel

    trunk = AutoModel.from_pretrained(tiny_model)
    data = _data(_groups(long_row=True, seed=4))
    resp_len = data["response_mask"].shape[1]
    prompt_len = data["input_ids"].shape[1] - resp_len
    with torch.no_grad():
        out = trunk(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            position_ids=data["position_ids"],
            use_cache=False,
        )
        want = out.last_hidden_state[:, prompt_len - 1 : prompt_len - 1 + resp_len]
        got = packing.packed_hidden_states(trunk, data)
    real = data["attention_mask"][:, prompt_len:].bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-6)
    assert (got[~real] == 0).all()


def test_packed_recompute_and_reference_equal_padded(tiny_model):
    over = ("actor.use_kl_loss=true",)
    padded, packed = _learner(tiny_model, False, *over), _learner(tiny_model, True, *over)
    data = _data(_groups(long_row=True, seed=3))
    prep_a, _ = padded._prepare(data)
    prep_b, _ = packed._prepare(data)
    mask = data["response_mask"].bool()
    for key in ("old", "ref"):
        torch.testing.assert_close(prep_b[key][mask], prep_a[key][mask], atol=1e-6, rtol=0)


def _loss_and_grads(learner: TorchLearner, data: dict[str, torch.Tensor]):
    """The mini-batch loss (sum of the micro-batches' scaled losses) and its gradients, through
    the learner's own micro-batching and `_micro_loss`."""
    prep, _ = learner._prepare(data)
    rows = torch.arange(data["input_ids"].shape[0])
    totals = {"tokens": prep["mask"].sum().clamp(min=1.0), "seqs": float(len(rows))}
    micro = learner.train.training_args.per_device_train_batch_size
    chunks = lp.train_micro_batches(data["attention_mask"], rows, micro, learner.actor)
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for idx in chunks:
        loss, _, _ = learner._micro_loss(data, prep, idx, totals)
        loss.backward()
        total += loss.detach()
    grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    return total, grads, len(chunks)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_loss_and_grads_equal_padded_for_every_agg_mode(tiny_model, mode):
    over = (f"actor.loss_agg_mode={mode}", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01")
    padded, packed = _learner(tiny_model, False, *over), _learner(tiny_model, True, *over)
    data = _data(_groups(n_groups=4, long_row=True, seed=1))
    loss_a, grads_a, chunks_a = _loss_and_grads(padded, data)
    loss_b, grads_b, chunks_b = _loss_and_grads(packed, data)
    assert chunks_b > 1 and chunks_b != chunks_a  # the packing really splits differently
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # decoupled: recomputed proximal logprobs, one mini-batch
        ("actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.shuffle=true"),
        ("actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.use_kl_loss=true"),
        ("actor.loss_agg_mode=seq-mean-token-mean", "algorithm.correction_mode=bypass"),
        ("actor_train.model_args.disable_gradient_checkpointing=false",),
        ("actor_train.model_args.lora_rank=4", "actor_train.model_args.lora_alpha=8"),
    ],
)
def test_packed_step_equals_padded_step(tiny_model, overrides):
    # SGD at a large rate: the weights move by lr · grad, so a gradient that differs shows
    # (AdamW divides by sqrt(v) + 1e-8: float noise of 1e-9 on a 3e-9 gradient moves a weight
    # by ~1e-6 whatever the packing, which would test the optimizer's conditioning instead).
    over = ("actor.optim.name=sgd", "actor_train.training_args.learning_rate=0.1", *overrides)
    padded, packed = _learner(tiny_model, False, *over), _learner(tiny_model, True, *over)
    before = [p.detach().clone() for p in padded.model.parameters()]
    groups = _groups(n_groups=3, long_row=True, seed=2)
    ma, mb = padded.step(groups), packed.step(groups)
    pairs = zip(padded.model.named_parameters(), packed.model.parameters(), strict=True)
    for (name, pa), pb in pairs:
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=0, msg=name)
    moved = max(
        float((p.detach() - b).abs().max()) for p, b in zip(packed.model.parameters(), before)
    )
    assert moved > 1e-3  # the step did something
    keys = ["actor/pg_loss", "actor/entropy", "actor/grad_norm"]
    if packed.actor.loss_agg_mode == "token-mean":
        # The loss function's own token means (ppo_kl, clipfrac) are weighted by each micro-batch's
        # sequence share under the seq-mean modes, so they depend on the micro-batching (padded
        # micro-batch sizes too); under token-mean they do not.
        keys.append("actor/ppo_kl")
    for key in keys:
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-6), key


def test_validation_of_the_packing_keys():
    with pytest.raises(ConfigError, match=r"^actor.ppo_max_token_len_per_gpu must be > 0"):
        load_config(None, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=0"])
    with pytest.raises(ConfigError, match=r"^actor.use_dynamic_bsz: .*megatron_train") as info:
        load_config(
            None,
            [
                "actor.use_dynamic_bsz=true",
                "actor_train.strategy_args.strategy_name=megatron_train",
            ],
        )
    assert "\n" not in str(info.value)
    assert load_config(None, ["actor.use_dynamic_bsz=true"]).actor.use_dynamic_bsz


def _critic(model_dir, packed: bool):
    from asyncrl.learner.torch.critic import build_critic

    cfg = load_config(None, [
        "actor.optim.name=sgd", f"critic.model_args.model_name_or_path={model_dir}",
        "critic.training_args.learning_rate=0.1", "critic.training_args.max_grad_norm=0",
        "critic.training_args.per_device_train_batch_size=2", "critic.infer_batch_size=2",
        "critic.model_args.disable_gradient_checkpointing=true", "algorithm.adv_estimator=gae",
        f"actor.use_dynamic_bsz={str(packed).lower()}", "actor.ppo_max_token_len_per_gpu=24",
    ])  # fmt: skip
    torch.manual_seed(0)
    return build_critic(cfg.critic, model_dir, cfg.actor, cfg.algorithm, "cpu", total_steps=10)


def test_packed_critic_values_and_update_equal_padded(tiny_model):
    """The value pass and the critic's update run packed with `use_dynamic_bsz`: the same
    values, loss and updated weights as the padded passes."""
    data = collate(_groups(long_row=True), 0).to_torch()
    data["response_mask"] = data["response_mask"].float()
    padded, packed = _critic(tiny_model, False), _critic(tiny_model, True)
    assert packed.settings.pack_budget == 24 and padded.settings.pack_budget is None
    v_pad, v_pack = padded.values(data), packed.values(data)
    torch.testing.assert_close(v_pack, v_pad, atol=1e-6, rtol=0)
    returns = v_pad + torch.linspace(-1, 1, v_pad.shape[1])  # something to regress toward
    mask = data["response_mask"]
    m_pad = padded.update(data, v_pad, returns, mask)
    m_pack = packed.update(data, v_pack, returns, mask)
    assert m_pack["critic/vf_loss"] == pytest.approx(m_pad["critic/vf_loss"], abs=1e-6)
    for (name, a), b in zip(padded.model.state_dict().items(), packed.model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
