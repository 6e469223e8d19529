"""The chunked LM head under FSDP2 on 2 gloo ranks (`learner/chunked.py`): the head's weight, a
DTensor sharded over the vocabulary, is gathered for the chunked function's forward and
backward and its gradient reduce-scattered onto the shards; logprobs, entropy and every
parameter's gradient equal one process's (fp32, 1e-5), for an untied head and one tied to the
embedding (whose gradient FSDP2 reduces itself), across two accumulated micro-batches, with an
odd vocabulary (uneven shards). The 2-rank test spawns processes (slow); a one-rank FSDP2
group in this process runs the same code path (a DTensor weight, its gather and
reduce-scatter) in the default suite."""

from __future__ import annotations

import os

import pytest
import torch
from test_packing import _init_method, _leave_group, _spawn_two_ranks
from test_prompt_rule import _batch
from test_shared_prompt import _tensors
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.learner import chunked
from asyncrl.learner import logprobs as lp
from asyncrl.learner import prompt_rule as pr

VOCAB = 67  # odd: the two ranks' vocabulary shards differ in size
HIDDEN = 32
#: Each rank's two micro-batches (row slices of `_tensors()`'s 9 rows): rank 1's differ in size.
ROWS = [[slice(0, 2), slice(2, 4)], [slice(4, 7), slice(7, 9)]]
#: (prompt lengths, response length) per rank: alone, rank 0 would run whole, rank 1 shared.
RULE_SHAPES = [([2], 48), ([40], 2)]


def _model(tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.train()


def _micro(model: torch.nn.Module, rows: slice, logits_fn=None) -> tuple[torch.Tensor, ...]:
    """One micro-batch's loss backward (a policy-gradient term and an entropy bonus, T = 0.7);
    its logprobs and entropy."""
    data = _tensors(rows)
    logp, ent = lp.token_logprobs(model, data, 0.7, True, False, logits_fn)
    mask = data["response_mask"]
    ((logp * data["advantages"] + 0.1 * ent) * mask).sum().backward()
    return logp.detach(), ent.detach()


def _rank(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from asyncrl.learner.torch import fsdp

    results = {}
    for tied, fn in ((False, None), (True, lp.shared_prompt_logits)):
        model = fsdp.shard(_model(tied), "cpu")
        assert chunked.output_head(model) is not None  # the chunked head, not the full logits
        scores = []
        for i, rows in enumerate(ROWS[rank]):
            fsdp.set_gradient_sync(model, i == len(ROWS[rank]) - 1)  # accumulate, then reduce
            scores.append(_micro(model, rows, fn))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[tied] = {"scores": scores, "grads": grads}
    # the shared-prompt rule on shapes whose local choices differ: the ranks agree
    rule = pr.SharedPromptRule(model, {pr.SHARED: None, pr.WHOLE: None}, agree=True)
    results["rule"] = rule.choose(_batch(*RULE_SHAPES[rank], n=4))
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    _leave_group()


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op makes whose last dimension is the
    vocabulary (logits, their softmax, their gradient), forward and backward."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[-1] != VOCAB:
                continue
            if t.shape != (HIDDEN, VOCAB):  # not the head's weight, transposed
                self.numel = max(self.numel, t.numel())
        return out


def test_the_chunked_head_of_a_one_rank_fsdp2_model_equals_the_plain_model(tmp_path, monkeypatch):
    from torch.distributed.tensor import DTensor

    from asyncrl.learner.torch import fsdp

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2 * 4 * VOCAB)  # two tokens' fp32 logits
    reduced = []
    shard_grad = chunked._shard_grad
    monkeypatch.setattr(chunked, "_shard_grad", lambda g, w: reduced.append(1) or shard_grad(g, w))
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        for tied in (False, True):
            model = fsdp.shard(_model(tied), "cpu")
            assert isinstance(chunked.output_head(model).weight, DTensor)
            with _LargestVocabTensor() as seen:  # 2-token chunks: 4 rows of 5 responses
                got = [_micro(model, rows) for rows in ROWS[0]]
            assert 0 < seen.numel <= 2 * 2 * VOCAB  # never [tokens x vocab]: a chunk's two at most
            plain = _model(tied)
            want = [_micro(plain, rows) for rows in ROWS[0]]
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(
                    p.grad.full_tensor(), q.grad, rtol=0, atol=1e-5, msg=name
                )
        _mixed_precision_matches_fp32()
    finally:
        torch.distributed.destroy_process_group()
    # every fp32 backward reduced the head's gradient onto its shard (under the bf16 policy the
    # root keeps its unsharded compute-dtype weight to backward: FSDP2 reduces that one itself)
    assert len(reduced) >= 4


def _mixed_precision_matches_fp32() -> None:
    """FSDP2 computing in bf16 over fp32 master shards (its accelerator policy): the chunked
    head computes in bf16 and the master gets an fp32 gradient near the fp32 model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    plain = _model(False)
    for rows in ROWS[0]:
        got, want = _micro(model, rows), _micro(plain, rows)
        torch.testing.assert_close(got[0], want[0], rtol=0.05, atol=0.1)
    head = model.lm_head.weight
    assert head.grad.dtype == torch.float32
    torch.testing.assert_close(
        head.grad.full_tensor(), plain.lm_head.weight.grad, rtol=0.05, atol=0.1
    )


@pytest.mark.slow
def test_the_chunked_head_under_fsdp2_equals_one_process(tmp_path):
    _spawn_two_ranks(_rank, (_init_method(), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    costs = pr.model_costs(_model(True))
    alone = [pr.cheapest([pr.SHARED, pr.WHOLE], pr.path_costs(costs, pr.shape_of(_batch(*shape, n=4)),
             [pr.SHARED, pr.WHOLE])) for shape in RULE_SHAPES]  # fmt: skip
    assert alone == [pr.WHOLE, pr.SHARED]
    assert ranks[0]["rule"] == ranks[1]["rule"]
    for tied, fn in ((False, None), (True, lp.shared_prompt_logits)):
        model = _model(tied)
        for rank in range(2):
            for rows, got in zip(ROWS[rank], ranks[rank][tied]["scores"], strict=True):
                want = _micro(model, rows, fn)
                torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
                torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        for name, p in model.named_parameters():  # FSDP2 averages the two ranks' gradients
            for rank in range(2):
                got = ranks[rank][tied]["grads"][name]
                torch.testing.assert_close(got, p.grad / 2, rtol=0, atol=1e-5, msg=name)
