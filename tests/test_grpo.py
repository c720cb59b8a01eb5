"""GRPO: its arithmetic (group advantages, the loss types' units, clipping, the KL term, a global batch's loss and
gradient the same however its completions are split), its sampling and plan of rollouts (finetune.tasks.grpo), and
the recipe: the same completions and training on any layout and launcher, exact resume, reward functions that fail,
bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_refused,
    assert_same_steps,
    log_history,
    max_weight_diff,
    one_error_line,
    read_jsonl,
    read_results,
    read_weights,
    run_on,
    tiny_llama,
    train_here,
    write_jsonl,
)
from safetensors.torch import load_file

from finetune.data.batching import PlannedBatch
from finetune.data.embedded.support_chats import make_support_prompts
from finetune.errors import UserError
from finetune.tasks.grpo import (
    check_grpo_options,
    check_whole_groups,
    completion_loss_units,
    group_advantages,
    policy_loss,
)
from finetune.tasks.rollout import RolloutSampler, sample_completions, widest_micro_batch

NAN = math.nan


def test_a_groups_advantage_is_its_reward_against_the_groups_mean_over_the_groups_sample_std():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0], [0.2], [0.4], [0.6], [0.8]])
    result = group_advantages(rewards, torch.tensor([1.0]), num_generations=4, scale="group")
    std = math.sqrt(4 * 0.5 ** 2 / 3)  # Bessel-corrected, as TRL's
    expected = [0.5 / (std + 1e-4) * s for s in (1, -1, -1, 1)]
    std = math.sqrt((0.3 ** 2 + 0.1 ** 2) * 2 / 3)
    expected += [d / (std + 1e-4) for d in (-0.3, -0.1, 0.1, 0.3)]
    assert result.advantages.tolist() == pytest.approx(expected, rel=1e-6)
    assert result.zero_std.tolist() == [False, False]


def test_batch_scaling_divides_by_the_whole_rollouts_std_and_none_only_centres():
    rewards = torch.tensor([[2.0], [0.0], [5.0], [1.0]])
    batch = group_advantages(rewards, torch.tensor([1.0]), num_generations=2, scale="batch")
    std = torch.tensor([2.0, 0.0, 5.0, 1.0]).std().item()
    assert batch.advantages.tolist() == pytest.approx([1 / (std + 1e-4), -1 / (std + 1e-4),
                                                       2 / (std + 1e-4), -2 / (std + 1e-4)], rel=1e-6)
    assert group_advantages(rewards, torch.tensor([1.0]), 2, "none").advantages.tolist() == [1.0, -1.0, 2.0, -2.0]


def test_weighted_functions_sum_and_an_unscored_completion_counts_in_no_mean_and_gets_no_advantage():
    # Two functions weighted 1 and 0.5; NaN: the function returned None or failed for that completion.
    rewards = torch.tensor([[1.0, 1.0], [0.0, NAN], [NAN, NAN], [1.0, 0.0],
                            [1.0, 0.0], [1.0, 0.0], [NAN, 0.0], [NAN, 0.0]])
    result = group_advantages(rewards, torch.tensor([1.0, 0.5]), num_generations=4, scale="none")
    assert result.rewards[:2].tolist() == [1.5, 0.0] and result.rewards[2].isnan()
    mean = (1.5 + 0.0 + 1.0) / 3  # the unscored third completion is not in its group's mean
    assert result.advantages.tolist() == pytest.approx([1.5 - mean, -mean, 0.0, 1.0 - mean, 0.5, 0.5, -0.5, -0.5])
    assert result.zero_std.tolist() == [False, False]


def test_a_completion_a_function_failed_on_has_no_reward_whatever_the_others_scored():
    """Format and accuracy rewards; accuracy raises on the group's one correct, well-formatted completion. Scored 0
    in its place, that completion would get the group's lowest total, 1, and a negative advantage."""
    rewards = torch.tensor([[1.0, NAN], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    failed = torch.tensor([[0, 1], [0, 0], [0, 0], [0, 0]], dtype=torch.float64)
    result = group_advantages(rewards, torch.tensor([1.0, 1.0]), num_generations=4, scale="none", failed=failed)
    assert result.rewards[0].isnan() and result.rewards[1:].tolist() == [2.0, 1.0, 1.0]
    mean = 4 / 3
    assert result.advantages.tolist() == pytest.approx([0.0, 2 - mean, 1 - mean, 1 - mean])
    not_failed = group_advantages(rewards, torch.tensor([1.0, 1.0]), 4, "none")  # NaN alone: it returned None
    assert not_failed.rewards.tolist() == [1.0, 2.0, 1.0, 1.0]


def test_a_function_s_failures_are_judged_over_the_newest_completions_and_never_fewer_than_64():
    from finetune.tasks.rewards import RewardFailures
    from finetune.tasks.scoring import RewardJudge

    def judge(share: float) -> RewardJudge:
        return RewardJudge(RewardFailures(["f"]), share)

    judge(0.05).judge_failures(torch.tensor([1.0]), 16)  # one of a first step's 16: not 6% of the run
    with pytest.raises(UserError, match=r"failed on 16 of the last 16 completions"):
        judge(0.05).judge_failures(torch.tensor([16.0]), 16)  # 16 > 5% of 64
    late = judge(0.05)
    for _ in range(1000):
        late.judge_failures(torch.tensor([0.0]), 16)
    # Over the whole run 16 of 16,016 would pass; the newest 256 completions hold all 16.
    with pytest.raises(UserError, match=r"failed on 16 of the last 256 completions .* --max_reward_failures 0.05"):
        late.judge_failures(torch.tensor([16.0]), 16)
    with pytest.raises(UserError, match=r"failed on 1 of the last 16"):
        judge(0.0).judge_failures(torch.tensor([1.0]), 16)
    assert late.failed.tolist() == [16.0]


def test_a_judge_restored_from_its_checkpointed_state_judges_as_the_one_that_went_on():
    """A resumed run's judge starts from the checkpoint's counters, through JSON as ``progress.json`` holds them:
    not from an empty window (where 16 failures of 16 stop a run) nor one that forgot the newest failures."""
    from finetune.tasks.rewards import RewardFailures
    from finetune.tasks.scoring import RewardJudge

    went_on = RewardJudge(RewardFailures(["f", "g"]), 0.1)
    for step in range(20):
        went_on.judge_failures(torch.tensor([2.0 * (step % 2), 0.0]), 16)  # 16 of the newest 256: 6%
    went_on.judge_scored(torch.tensor([NAN] * 4))
    restored = RewardJudge(RewardFailures(["f", "g"]), 0.1)
    restored.load_state_dict(json.loads(json.dumps(went_on.state_dict())))
    assert restored.state_dict() == went_on.state_dict()
    assert restored.failed.tolist() == [20.0, 0.0] and restored.unscored_in_a_row == 1
    for judge in (went_on, restored):
        judge.judge_failures(torch.tensor([8.0, 0.0]), 16)  # 24 of the newest 256: still under 10%
        with pytest.raises(UserError, match=r"reward function f failed on 26 of the last 256"):
            judge.judge_failures(torch.tensor([4.0, 0.0]), 16)
    fresh = RewardJudge(RewardFailures(["f", "g"]), 0.1)
    with pytest.raises(UserError, match=r"failed on 8 of the last 16"):
        fresh.judge_failures(torch.tensor([8.0, 0.0]), 16)


def test_groups_whose_rewards_are_all_equal_are_counted_and_give_no_gradient():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [0.0], [0.0]])
    result = group_advantages(rewards, torch.tensor([1.0]), num_generations=2, scale="group")
    assert result.zero_std.tolist() == [True, False, True]
    assert result.advantages[[0, 1, 4, 5]].tolist() == [0.0] * 4
    log_probs = torch.zeros(6, 3, requires_grad=True)
    loss, _ = policy_loss(log_probs, result.advantages, torch.ones(6, 3), loss_type="dapo", epsilon=0.2)
    loss.backward()
    assert log_probs.grad[[0, 1, 4, 5]].abs().sum() == 0 and log_probs.grad[[2, 3]].abs().sum() > 0


def test_each_loss_types_units_and_per_completion_weighting():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert completion_loss_units(mask, "dapo", 4).tolist() == [3, 1]
    assert completion_loss_units(mask, "grpo", 4).tolist() == [1, 1]
    assert completion_loss_units(mask, "dr_grpo", 4).tolist() == [4, 4]
    # On its first pass over a rollout the ratio is 1: a token's loss is -advantage.
    log_probs, advantages = torch.zeros(2, 4), torch.tensor([1.0, -2.0])
    sums = {t: policy_loss(log_probs, advantages, mask, loss_type=t, epsilon=0.2)[0].item() for t in
            ("dapo", "grpo", "dr_grpo")}
    assert sums == {"dapo": -3.0 + 2.0, "grpo": -1.0 + 2.0, "dr_grpo": -3.0 + 2.0}


def test_the_ratio_is_clipped_on_the_side_the_advantage_pushes_and_clipped_tokens_get_no_gradient():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 0.7; advantage +1: 1.5 is clipped to 1 + epsilon_high = 1.28, 0.5 is not (min keeps it)
    log_probs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_()
    loss, figures = policy_loss(log_probs, torch.tensor([1.0]), torch.ones(1, 4), loss_type="dapo", epsilon=0.2,
                                epsilon_high=0.28, old_log_probs=old)
    assert loss.item() == pytest.approx(-(1.28 + 0.5 + 1.1 + 0.7))
    assert figures["clipped_high"] == 1 and figures["clipped_low"] == 0 and figures["tokens"] == 4
    loss.backward()
    assert log_probs.grad.tolist()[0] == pytest.approx([0.0, -0.5, -1.1, -0.7])  # d(-ratio)/dlogp = -ratio
    # advantage -1: 0.5 and 0.7 are clipped up to 1 - epsilon (the min takes -ratio x -1 at its floor)
    loss, figures = policy_loss(log_probs.detach(), torch.tensor([-1.0]), torch.ones(1, 4), loss_type="dapo",
                                epsilon=0.2, epsilon_high=0.28, old_log_probs=old)
    assert loss.item() == pytest.approx(1.5 + 0.8 + 1.1 + 0.8) and figures["clipped_low"] == 2


def test_the_kl_term_is_k3_against_the_reference_per_token():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]])
    reference = torch.tensor([[-1.0, -1.5, -1.5]])
    mask = torch.tensor([[1, 1, 0]])
    loss, figures = policy_loss(log_probs, torch.tensor([0.0]), mask, loss_type="dapo", epsilon=0.2,
                                ref_log_probs=reference, beta=0.1)
    kl = [0.0, math.exp(0.5) - 0.5 - 1]  # the third token is masked
    assert figures["kl"].item() == pytest.approx(sum(kl)) and loss.item() == pytest.approx(0.1 * sum(kl))
    assert "kl" not in policy_loss(log_probs, torch.tensor([0.0]), mask, loss_type="dapo", epsilon=0.2)[1]


class TinyPolicy(torch.nn.Module):
    """Per-token log-probabilities of fixed completions from a table of logits: enough to compare gradients."""

    def __init__(self, length: int, vocabulary: int = 5):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(length, vocabulary, generator=torch.Generator().manual_seed(0),
                                                  dtype=torch.float64))

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        table = torch.log_softmax(self.logits[None] + offsets[:, None, None], -1).expand(len(tokens), -1, -1)
        return table.gather(2, tokens[..., None]).squeeze(2)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_a_global_batch_gives_the_same_loss_and_gradient_at_any_world_size_and_accumulation(loss_type):
    """8 completions (2 groups of 4) of lengths 1 to 6, with a second pass's ratios and a KL term: the loss and the
    gradient are the same on 1 process x 8, 2 processes x 4 (DDP averages their gradients) and 1 process x 4 x
    accumulation 2, the loss normalised as the loop does: ``world_size / units in the global batch``. In float64,
    so that only the order of the sums differs."""
    generator = torch.Generator().manual_seed(1)
    length, count = 6, 8
    tokens = torch.randint(0, 5, (count, length), generator=generator)
    offsets = torch.linspace(-0.5, 0.5, count, dtype=torch.float64)
    mask = (torch.arange(length)[None] < torch.tensor([1, 6, 3, 2, 5, 4, 6, 2])[:, None]).long()
    rewards = torch.tensor([[1.0], [0.0], [0.5], [0.0], [1.0], [1.0], [0.0], [0.25]], dtype=torch.float64)
    advantages = group_advantages(rewards, torch.tensor([1.0], dtype=torch.float64), 4, "group").advantages
    old = torch.log_softmax(torch.randn(count, length, 5, generator=generator, dtype=torch.float64), -1).gather(
        2, tokens[..., None]).squeeze(2) * 0.1 + TinyPolicy(length)(tokens, offsets).detach()
    reference = old - 0.05
    units = completion_loss_units(mask, loss_type, length).sum()

    def step(shares: list[list[list[int]]]) -> tuple[float, torch.Tensor]:
        """``shares[rank][micro_batch]``: the completions each process takes in each micro-batch."""
        world, loss, grads = len(shares), 0.0, []
        for micro_batches in shares:
            model = TinyPolicy(length)
            for rows in micro_batches:
                summed, _ = policy_loss(model(tokens[rows], offsets[rows]), advantages[rows], mask[rows],
                                        loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, old_log_probs=old[rows],
                                        ref_log_probs=reference[rows], beta=0.04)
                (summed * world / units).backward()
                loss += summed.item() / units.item()
            grads.append(model.logits.grad)
        return loss, torch.stack(grads).mean(0)

    loss, grad = step([[list(range(8))]])
    two_processes, accumulation_2 = [[[0, 2, 4, 6]], [[1, 3, 5, 7]]], [[[7, 1, 2, 0], [3, 4, 5, 6]]]
    uneven = [[[0], [5, 6]], [[1, 2, 3, 4], [7]]]  # 2 processes x accumulation 2, micro-batches of 1 to 4
    for shares in (two_processes, accumulation_2, uneven):
        other_loss, other_grad = step(shares)
        assert other_loss == pytest.approx(loss, rel=1e-12, abs=0)
        assert torch.allclose(other_grad, grad, rtol=1e-12, atol=0)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("options, message", [
    ({"num_generations": 1}, "--num_generations is 1"),
    ({"loss_type": "bnpo"}, "--loss_type 'bnpo' is unknown"),
    ({"scale_rewards": "yes"}, "--scale_rewards 'yes' is unknown"),
    ({"epsilon_high": 0.1}, "--epsilon_high 0.1 is below --epsilon 0.2"),
    ({"beta": -1.0}, "--beta is -1.0"),
    ({"num_iterations": 0}, "--num_iterations is 0"),
])
def test_options_that_cannot_work_are_refused_by_name(options, message):
    good = dict(num_generations=8, loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=None,
                beta=0.0, num_iterations=1)
    check_grpo_options(**good)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        check_grpo_options(**{**good, **options})


def test_a_step_must_hold_whole_groups():
    check_whole_groups(16, 8)
    with pytest.raises(UserError, match="a step's 12 completions .* do not hold whole groups of --num_generations 8"):
        check_whole_groups(12, 8)


# -- sampling and the plan of rollouts


def test_a_completion_depends_on_its_prompt_and_seed_not_on_what_shares_its_batch(chat_tokenizer):
    model = tiny_llama(chat_tokenizer, initializer_range=0.05)
    model.generation_config.eos_token_id = [2]
    long, short = chat_tokenizer.encode("hello there, how are you doing today"), chat_tokenizer.encode("a b")
    options = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, pad_token_id=2)
    together = sample_completions(model, [long, short], [3, 2], [1, 2, 3, 4, 5], **options)
    assert sample_completions(model, [long], [3], [1, 2, 3], **options) == together[:3]
    assert sample_completions(model, [short, long], [1, 1], [5, 1], **options) == [together[4], together[0]]
    assert len({tuple(c) for c in together[:3]}) == 3, "the same prompt, other seeds: other completions"
    assert model.training, "sampling leaves the model's mode as it found it"


def test_a_model_deepspeed_zero3_partitioned_samples_in_step_with_the_other_processes(chat_tokenizer, monkeypatch):
    """Under DeepSpeed ZeRO-3, as under FSDP, each forward gathers the weights from every process: at each step
    sampling asks whether a row of any process still samples, not only its own, so none waits on a gather the
    others never join. ZeRO-3 marks its parameters with a ``ds_id`` (DeepSpeed's own ``is_zero_param`` reads it;
    DeepSpeed itself is not installed here)."""
    import finetune.tasks.rollout as rollout

    model = tiny_llama(chat_tokenizer)
    model.generation_config.eos_token_id = [2]
    asked = []
    monkeypatch.setattr(rollout, "all_reduce_max", lambda tensor: asked.append(tensor) or tensor.clone())
    options = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, pad_token_id=2)
    alone = sample_completions(model, [chat_tokenizer.encode("a b")], [1], [1], **options)
    assert asked == []
    next(model.parameters()).ds_id = 0
    assert sample_completions(model, [chat_tokenizer.encode("a b")], [1], [1], **options) == alone
    assert len(asked) == len(alone[0]) > 0


def test_a_resumed_rollout_is_trained_on_only_where_every_process_kept_its_own(tmp_path, monkeypatch):
    """A process that crashed between two windows may have kept the older rollout while another kept the newer:
    resumed, each must sample again (sampling and scoring take part in collectives) rather than one train on its
    kept rollout while another samples. The other process is stood in for by its answer to the all-reduce."""
    import finetune.tasks.rollout as rollout

    rollouts = rollout.Rollouts.__new__(rollout.Rollouts)
    rollouts.kept = tmp_path / "rollout-rank0.pt"
    planned = PlannedBatch([0, 1], 2, 2, 0.5, 3, (4, 5))
    rollouts._keep(["key"], [({"input_ids": torch.arange(6).view(2, 3)}, planned)])
    [(batch, again)] = rollouts._kept_rollout(["key"], torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[0, 1, 2], [3, 4, 5]] and (again, vars(again)) == (planned, vars(planned))
    monkeypatch.setattr(rollout, "all_reduce_max", lambda flag: torch.ones_like(flag))  # another has none
    with pytest.warns(UserWarning, match="on this process or another"):
        assert rollouts._kept_rollout(["key"], torch.device("cpu")) is None


STOPS = [2, 2716, 4201, 13504]
"""End-of-turn ids for the tiny model's completions below: tokens that its seeds sample, so replies end at different
lengths."""


def test_sampling_keeps_no_logits_of_the_prompt(chat_tokenizer):
    """The prompt's run before the first sampled token needs its KV cache only: a logit for each of its tokens and
    each vocabulary entry would be the largest tensor of the sampling (0.8 GB for a 4k-token prompt of SmolLM2)."""
    from test_memory import LiveBytes

    model = tiny_llama(chat_tokenizer)
    prompt = chat_tokenizer.encode("tell me about the order " * 80)
    with LiveBytes() as live:
        sample_completions(model, [prompt], [2], [1, 2], max_new_tokens=4, temperature=1.0, top_p=1.0, pad_token_id=2)
    one_copy_of_its_logits = len(prompt) * model.config.vocab_size * 4
    assert live.peak < one_copy_of_its_logits / 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_turn_run_on_from_its_kept_cache_samples_what_the_whole_context_run_again_samples(chat_tokenizer,
                                                                                           temperature):
    model = tiny_llama(chat_tokenizer, initializer_range=0.05)
    model.generation_config.eos_token_id = STOPS
    long, short = chat_tokenizer.encode("hello there, how are you doing today"), chat_tokenizer.encode("a b")
    options = dict(max_new_tokens=12, temperature=temperature, top_p=0.9, pad_token_id=2)
    first, kept = sample_completions(model, [long, short], [2, 1], [1, 2, 3], keep=True, **options)
    assert sorted(map(len, first))[0] < len(max(first, key=len)), "a row ended before the others: its tail is masked"
    # The next turn of rows 2 and 0 (another order, one left out), after tool results of other lengths
    contexts = [short + first[2] + chat_tokenizer.encode("result: ok"),
                long + first[0] + chat_tokenizer.encode("result: the order has shipped")]
    again = sample_completions(model, contexts, [1, 1], [7, 8], **options)
    run_on, kept = sample_completions(model, contexts, [1, 1], [7, 8], past=kept.select([2, 0]), keep=True, **options)
    assert run_on == again
    assert kept.attention.sum(1).tolist() == [len(c) + len(r) - (len(r) == max(map(len, again)))
                                              for c, r in zip(contexts, run_on, strict=True)]
    # A third turn, from the cache the second kept (its rows packed again)
    contexts = [contexts[1] + run_on[1] + chat_tokenizer.encode("ok"), contexts[0] + run_on[0] + [5]]
    assert (sample_completions(model, contexts, [1, 1], [9, 10], past=kept.select([1, 0]), **options)
            == sample_completions(model, contexts, [1, 1], [9, 10], **options))


def test_nucleus_sampling_draws_only_from_the_smallest_set_that_reaches_top_p():
    model = tiny_llama_with_logits([0.5, 0.3, 0.15, 0.05])
    draws = sample_completions(model, [[0]], [200], list(range(200)), max_new_tokens=1, temperature=1.0, top_p=0.75,
                               pad_token_id=3)
    drawn = [c[0] for c in draws]
    assert set(drawn) == {0, 1} and 0.5 < drawn.count(0) / 200 < 0.75  # 0.5 / 0.8 of the draws, give or take


def tiny_llama_with_logits(probabilities: list[float]):
    """A stand-in model whose next token has ``probabilities`` whatever it reads (a vocabulary of their length)."""

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.log(torch.tensor(probabilities)))
            self.generation_config = type("Config", (), {"eos_token_id": [len(probabilities) - 1]})()

        def forward(self, input_ids, **kwargs):
            logits = self.bias.expand(*input_ids.shape, -1)
            return type("Out", (), {"logits": logits, "cache": FakeCache(), "past_key_values": FakeCache()})()

    return Fixed()


class FakeCache:
    def reorder_cache(self, rows):
        pass


def test_a_rollout_plan_holds_whole_groups_in_a_row_and_repeats_a_window_for_each_iteration():
    sampler = RolloutSampler(np.full(10, 7), per_device_batch_size=4, num_replicas=2, seed=0, accumulation_steps=1,
                             num_generations=4, num_iterations=2)
    assert (sampler.prompts_per_window, sampler.windows, sampler.batches_per_rank) == (2, 5, 10)
    batches = sampler.global_batches(0)
    assert len(batches) == 10 and all(len(b) == 8 for b in batches)
    for first, again in zip(batches[::2], batches[1::2], strict=True):
        assert first.tolist() == again.tolist()  # the second iteration trains on the same rollout
        assert first[:4].tolist() == [first[0]] * 4 and first[4:].tolist() == [first[4]] * 4
    prompts = [b[0] for b in batches[::2]] + [b[4] for b in batches[::2]]
    assert sorted(prompts) == list(range(10))
    plan = sampler.plan(0, rank=1)
    assert plan[0] == batches[0][1::2].tolist() and [plan[k].window for k in range(4)] == [0, 0, 1, 1]
    assert sampler.global_batches(1)[0].tolist() != batches[0].tolist(), "each epoch its own order"


# -- the recipe (a tiny Llama with SmolLM2's tokenizer, on the embedded prompts)

REWARDS = '''
import os
import time


def distinct(prompts, completions, **columns):
    """Replies of a random model differ in how many distinct characters they hold: a group's rewards differ."""
    return [len(set(c[-1]["content"])) / 10 for c in completions]


def refuses_accounts(prompts, completions, team, **columns):
    if "account" in team:
        raise ValueError("no scorer for account tickets")
    return [1.0] * len(completions)


def kills_its_worker_on_billing(prompts, completions, team, **columns):
    if "billing" in team:
        os._exit(3)
    return [0.5] * len(completions)


def wrong_signature(completions):
    return [0.0] * len(completions)


def sleeps_for_an_hour(prompts, completions, **columns):
    time.sleep(3600)


def reads_a_misnamed_column(prompts, completions, **columns):
    return [None if columns.get("teams") is None else 1.0 for _ in completions]
'''
FLAGS = ["--max_completion_length", "8", "--num_generations", "4", "--logging_steps", "1", "--lora_dropout", "0",
         "--per_device_eval_batch_size", "16", "--learning_rate", "1e-2"]


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> str:
    """The test's reward functions, as a file a spec names: ``{rewards}:distinct``."""
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


@pytest.fixture(scope="module")
def parity_runs(tiny_chat_model_with_distinct_replies, rewards, tmp_path_factory) -> dict[str, Path]:
    """4 steps of 8 completions (2 prompts x 4) with two passes over each rollout and a KL term: on 1 process, on 1
    with accumulation 2, on 2 processes under each launcher, sharded (``--fsdp``), and with accumulation under
    torchrun; checkpoints every 2 steps."""
    flags = [*FLAGS, "--reward_funcs", f"{rewards}:distinct", "--num_iterations", "2", "--beta", "0.04",
             "--max_train_steps", "4", "--checkpointing_steps", "2"]
    outs = {name: tmp_path_factory.mktemp("grpo") / name
            for name in ("one", "accumulation", "accelerate", "torchrun", "fsdp", "torchrun_accumulation")}
    model = tiny_chat_model_with_distinct_replies
    run_on("grpo", model, [], outs["one"], *flags, "--per_device_train_batch_size", "8")
    run_on("grpo", model, [], outs["accumulation"], *flags, "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "2")
    for name, launcher, sharded in (("accelerate", "accelerate", []), ("torchrun", "torchrun", []),
                                    ("fsdp", "torchrun", ["--fsdp"])):
        run_on("grpo", model, [], outs[name], *flags, *sharded, "--per_device_train_batch_size", "4",
               launcher=launcher, processes=2)
    # (the raw runtime takes each window whole from the loader before it trains, so only the plan says where a
    # window ends)
    run_on("grpo", model, [], outs["torchrun_accumulation"], *flags, "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "2", launcher="torchrun", processes=2)
    return outs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_two_and_accumulation_sample_score_and_train_alike_under_both_launchers_and_sharded(parity_runs):
    """A completion's seed is its place in the step's global order, so every layout samples the same completions;
    the groups are scored across processes and the loss is per completion token of the whole step."""
    reference = log_history(parity_runs["one"])
    assert [h["step"] for h in reference] == [1, 2, 3, 4]
    assert [("reward" in h) for h in reference] == [True, False, True, False], "a rollout every second step"
    assert 0 <= reference[0]["frac_reward_zero_std"] < 1 and reference[0]["reward_std"] > 0
    assert reference[1]["clip_ratio/region"] >= 0 and reference[1]["kl"] > 0 and reference[0]["kl"] == 0
    adapter = load_file(parity_runs["one"] / "adapter_model.safetensors")
    for name in ("accumulation", "accelerate", "torchrun", "fsdp", "torchrun_accumulation"):
        history = log_history(parity_runs[name])
        assert [h["step"] for h in history] == [1, 2, 3, 4], name
        for ours, theirs in zip(history, reference, strict=True):
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (name, ours, theirs)
            # (a first pass's loss is the mean advantage per token, 0 up to rounding where completions are as long)
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7), (name, ours, theirs)
            assert ours.keys() == theirs.keys(), (name, ours["step"])
            for key in ("reward", "reward_std", "completions/mean_length", "kl", "clip_ratio/region"):
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (name, key)
        other = load_file(parity_runs[name] / "adapter_model.safetensors")
        # (AdamW's steps are about the learning rate, 1e-2: this is float rounding in the order of the sums)
        assert max((other[k] - adapter[k]).abs().max().item() for k in adapter) < 1e-4
        assert read_results(parity_runs[name])["eval_reward"] == read_results(parity_runs["one"])["eval_reward"]
    generations = read_jsonl(parity_runs["torchrun"] / "eval_generations.jsonl")
    assert len(generations) == 47 and generations == read_jsonl(parity_runs["one"] / "eval_generations.jsonl")
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json"} <= {
        p.name for p in parity_runs["torchrun"].iterdir()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_resumed_from_its_checkpoint_samples_and_trains_as_the_uninterrupted_one(
        parity_runs, tiny_chat_model_with_distinct_replies, rewards, tmp_path):
    out = tmp_path / "resumed"
    flags = [*FLAGS, "--reward_funcs", f"{rewards}:distinct", "--num_iterations", "2", "--beta", "0.04",
             "--max_train_steps", "4", "--per_device_train_batch_size", "4", "--checkpointing_steps", "2",
             "--resume_from_checkpoint", str(parity_runs["torchrun"] / "checkpoints" / "step_2")]
    run_on("grpo", tiny_chat_model_with_distinct_replies, [], out, *flags, launcher="torchrun", processes=2)
    history = log_history(out)
    assert [h["step"] for h in history] == [3, 4]
    for ours, theirs in zip(history, log_history(parity_runs["torchrun"])[2:], strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"])
    assert history[0]["reward"] == log_history(parity_runs["torchrun"])[2]["reward"]
    assert read_weights(out, "adapter_model.safetensors").keys() == read_weights(
        parity_runs["torchrun"], "adapter_model.safetensors").keys()
    assert max_weight_diff(out, parity_runs["torchrun"], "adapter_model.safetensors") == 0
    # the reward judge's window went on from the checkpoint's: both rollouts of 8 completions in it
    judges = [json.loads((run / "checkpoints" / "step_4" / "progress.json").read_text())["task_state"]["reward_judge"]
              for run in (out, parity_runs["torchrun"])]
    assert judges[0] == judges[1] and [scored for _, scored in judges[0]["recent"]] == [8, 8]


def test_a_reward_function_that_fails_past_its_share_stops_the_run_naming_the_row_and_the_exception(
        tiny_chat_model_with_distinct_replies, rewards, tmp_path):
    out = tmp_path / "out"
    result = run_on_refused(tiny_chat_model_with_distinct_replies, out, "--reward_funcs", f"{rewards}:distinct",
                            f"{rewards}:refuses_accounts", "--max_reward_failures", "0", "--max_train_steps", "20",
                            "--per_device_train_batch_size", "8", "--checkpointing_steps", "1",
                            "--seed", "49")  # whose 4th step is the first with an account ticket
    line = one_error_line(result.returncode, result.stderr, "reward function", "refuses_accounts",
                          "ValueError: no scorer for account tickets", "--max_reward_failures")
    row = int(re.search(r"on row (\d+)", line).group(1))
    assert make_support_prompts()["train"][row - 1]["team"] == "account"
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
    assert steps == [1, 2, 3] and not (out / "adapter_model.safetensors").exists(), "the steps before it kept"


def test_rewards_that_score_nothing_are_said_at_each_step_and_stop_the_run_at_the_third(tiny_chat_model, rewards,
                                                                                         tmp_path):
    """A function reading a column the data lacks returns None (its "not mine") for every completion: all advantages
    are 0, the loss is 0, and without a word the run would train nothing."""
    result = run_on_refused(tiny_chat_model, tmp_path / "out", "--reward_funcs", f"{rewards}:reads_a_misnamed_column",
                            "--max_train_steps", "10", "--per_device_train_batch_size", "8")
    one_error_line(result.returncode, result.stderr, "no reward function scored any of this step's 8 completions",
                   "3 rollouts in a row", "columns the data has")
    assert result.stderr.count("warning: no reward function scored any") == 2


def test_prepare_only_predicts_on_two_cut_models_with_one_pool_of_reward_workers_closed_at_the_end(
        tiny_chat_model, rewards, tmp_path, monkeypatch):
    from finetune.tasks.rewards import RewardPool

    started, closed = [], []
    start, close = RewardPool.__init__, RewardPool.close
    monkeypatch.setattr(RewardPool, "__init__", lambda pool, *args, **kwargs: (started.append(pool),
                                                                              start(pool, *args, **kwargs))[1])
    monkeypatch.setattr(RewardPool, "close", lambda pool: (closed.append(pool), close(pool))[1])
    out = tmp_path / "out"
    result = run_on("grpo", tiny_chat_model, [], out, *FLAGS, "--reward_funcs", f"{rewards}:distinct",
                    "--prepare_only")
    assert "activations of the longest micro-batch (16 x " in result.stdout
    assert len(started) == 1 and closed and set(closed) == set(started) and not out.exists()


def test_the_micro_batch_counted_for_memory_is_the_one_spanning_the_most_prompts():
    # 3 completions a prompt, micro-batches of 2, 3 of them a step on one process: groups [0, 0], [0, 1], [1, 1]
    assert widest_micro_batch(list(range(6)), 2, 3) == [0, 1]
    # two processes, micro-batches of 3, 4 a prompt: this rank's completions 1, 3, 5 then 7, 9, 11 ...
    assert widest_micro_batch([1, 3, 5, 7, 9, 11], 3, 4) == [0, 0, 1]


@pytest.mark.parametrize("checkpointing", ["--gradient_checkpointing", "--no_gradient_checkpointing"])
def test_the_predicted_activations_are_a_micro_batch_s_of_the_longest_prompt_and_completions_at_the_limit(
        checkpointing, tiny_chat_model, rewards, tmp_path, monkeypatch):
    """GRPO's batches are sampled as the run goes: the prediction counts the largest micro-batch it can train on,
    the longest prompt with completions of --max_completion_length tokens, as a real one of those keeps it (each
    prompt run once for its completions, or each completion a row with it where the layers are recomputed)."""
    from finetune.models.estimate import kept_for_backward
    from finetune.tasks.rollout import Rollouts

    prompt = [{"role": "user", "content": "Name a colour and say why it is yours."}]
    files = ["--train_file", write_jsonl(tmp_path / "train.jsonl", [{"prompt": prompt}] * 8),
             "--validation_file", write_jsonl(tmp_path / "validation.jsonl", [{"prompt": prompt}] * 2)]
    seen, loss = [], Rollouts.loss

    def counting(rollouts, model, batch):
        if not seen:
            largest = rollouts.largest_micro_batch()
            seen.append((batch["reply_mask"].sum(1).tolist(), int(batch["prompt_mask"].sum(1).max()), largest.tokens,
                         kept_for_backward(lambda: rollouts._loss_and_figures(model, dict(batch)), model),
                         kept_for_backward(lambda: largest.loss(model, largest.collate(largest.rows)), model)))
        return loss(rollouts, model, batch)

    monkeypatch.setattr(Rollouts, "loss", counting)
    result = run_on("grpo", tiny_chat_model, files, tmp_path / "out", *FLAGS, "--reward_funcs",
                    f"{rewards}:distinct", "--per_device_train_batch_size", "4", "--max_train_steps", "1",
                    checkpointing)
    (lengths, prompt_tokens, tokens, real, counted), = seen
    assert lengths == [8] * 4, "every completion reached --max_completion_length"
    assert tokens == f"4 x {prompt_tokens + 8}" and f"activations of the longest micro-batch ({tokens} tokens" in (
        result.stdout)
    assert counted == real > 0


def test_a_reward_function_that_kills_its_worker_is_counted_and_training_goes_on(
        tiny_chat_model_with_distinct_replies, rewards, tmp_path):
    from finetune.data.embedded.support_chats import make_support_prompts

    out = tmp_path / "out"
    run_on("grpo", tiny_chat_model_with_distinct_replies, [], out, *FLAGS, "--reward_funcs", f"{rewards}:distinct",
           f"{rewards}:kills_its_worker_on_billing", "--max_reward_failures", "1", "--max_train_steps", "6",
           "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4")
    history = log_history(out)
    assert [h["step"] for h in history] == list(range(1, 7))
    failures = history[-1]["reward_failures/kills_its_worker_on_billing"]
    assert failures > 0 and failures % 8 == 0, "a dead worker fails its whole call: every completion of the step"
    # Where it scored, it scored 0.5: its failures count in no mean as 0.
    scored = [h["rewards/kills_its_worker_on_billing/mean"] for h in history]
    assert all(value == 0.5 or math.isnan(value) for value in scored) and 0.5 in scored
    # The evaluation scores its 47 replies where they were generated, a batch of 4 at a time: the dead worker
    # fails the batches that hold a billing ticket whole (each reply failed and counted, none with a sum: the other
    # function's score alone is not its reward), and only those (before, one call for all 47 failed them all).
    teams = make_support_prompts()["validation"]["team"]
    failing = sum(len(batch) for batch in (teams[start:start + 4] for start in range(0, 47, 4)) if "billing" in batch)
    results = read_results(out)
    assert 0 < failing < 47 and results["eval_reward_failures/kills_its_worker_on_billing"] == failing
    assert "eval_reward" in results
    assert results["eval_reward_failures/distinct"] == 0 and results["eval_rewards/distinct/mean"] > 0


def test_gradient_checkpointing_trains_exactly_as_keeping_the_activations(tiny_chat_model, rewards, tmp_path):
    """Sampling, the old log-probabilities and the reference run without gradients, so nothing of them is
    recomputed; the policy's layers keep no KV cache when recomputed, so each completion runs as one row with its
    prompt, to the values of the shared prompt pass."""
    flags = [*FLAGS, "--reward_funcs", f"{rewards}:distinct", "--max_train_steps", "2", "--num_iterations", "2",
             "--beta", "0.04", "--per_device_train_batch_size", "8"]
    run_on("grpo", tiny_chat_model, [], tmp_path / "kept", *flags)
    run_on("grpo", tiny_chat_model, [], tmp_path / "recomputed", *flags, "--gradient_checkpointing")
    history = log_history(tmp_path / "recomputed")
    assert_same_steps(history, log_history(tmp_path / "kept"), rel=1e-6)
    assert history[1]["kl"] > 0 and history[0]["reward_std"] > 0
    # AdamW's first steps move a weight by about the learning rate, whatever the size of its gradient: rounding in
    # another order of the sums (rows instead of a shared cache) moves one by a thousandth of a step at most
    assert max_weight_diff(tmp_path / "recomputed", tmp_path / "kept", "adapter_model.safetensors") <= 1e-5


def test_each_step_splits_its_time_into_sampling_scoring_and_training(tiny_chat_model, rewards, tmp_path):
    out = tmp_path / "out"
    run_on("grpo", tiny_chat_model, [], out, *FLAGS, "--reward_funcs", f"{rewards}:distinct", "--max_train_steps",
           "3", "--per_device_train_batch_size", "8")
    for step in log_history(out):
        parts = [step[name] for name in ("generation_seconds", "reward_seconds", "training_seconds")]
        wall = 8 / step["samples_per_second"]  # the step's 8 completions over the seconds since the last log
        assert all(part > 0 for part in parts) and sum(parts) <= wall, (step["step"], parts, wall)


def run_on_refused(model, out, *flags):
    return train_here("grpo", *FLAGS, "--model_name_or_path", str(model), "--output_dir", str(out), *flags,
                      check=False)


@pytest.mark.parametrize("flags, expected", [
    (["--reward_funcs", "no_such_module_for_rewards:score"], ["no_such_module_for_rewards"]),
    (["--reward_funcs", "{rewards}:missing"], ["missing"]),
    (["--reward_funcs", "{rewards}:wrong_signature"], ["wrong_signature", "TRL's signature"]),
    (["--num_generations", "1"], ["--num_generations is 1"]),
    (["--per_device_train_batch_size", "6"], ["do not hold whole groups of --num_generations 4"]),
    (["--gradient_accumulation_steps", "50"], ["training prompts are fewer than a step's 200"]),
    (["--epsilon_high", "0.1"], ["--epsilon_high 0.1 is below --epsilon 0.2"]),
    (["--reward_weights", "1", "2"], ["2 --reward_weights for 1 --reward_funcs"]),
    (["--eval_generate", "3"], ["--eval_generate is the chat recipe's", "--max_completion_length"]),
    (["--max_new_tokens", "48"], ["--max_new_tokens is the chat recipe's", "--max_completion_length"]),
])
def test_bad_input_is_refused_in_one_line_before_training(flags, expected, tiny_chat_model, rewards, tmp_path):
    flags = [flag.format(rewards=rewards) for flag in flags]
    out = tmp_path / "out"
    assert_refused("grpo", [*FLAGS, "--model_name_or_path", str(tiny_chat_model), "--output_dir", str(out), *flags],
                   tmp_path, *expected)
    assert not out.exists()


def test_a_column_json_cannot_carry_to_the_reward_functions_is_refused_by_row_and_name(tiny_chat_model, rewards,
                                                                                       tmp_path):
    """A parquet file's timestamp column: refused in one line before training (a bare TypeError before)."""
    import datetime

    import datasets

    rows = datasets.Dataset.from_dict({"prompt": ["Where is my order?"] * 8,
                                       "opened": [datetime.datetime(2026, 12, 7, hour) for hour in range(8)]})
    for split in ("train", "validation"):
        rows.to_parquet(tmp_path / f"{split}.parquet")
    out = tmp_path / "out"
    result = run_on_refused(tiny_chat_model, out, "--train_file", str(tmp_path / "train.parquet"),
                            "--validation_file", str(tmp_path / "validation.parquet"), "--reward_funcs",
                            f"{rewards}:distinct")
    one_error_line(result.returncode, result.stderr, "train row 1: column 'opened' holds a datetime, which cannot "
                   "reach the reward functions (they get a row's columns as JSON)")
    assert not out.exists()


def test_a_reward_function_that_hangs_at_the_check_is_refused_within_its_timeout(tiny_chat_model, rewards, tmp_path):
    out, start = tmp_path / "out", time.monotonic()
    assert_refused("grpo", [*FLAGS, "--model_name_or_path", str(tiny_chat_model), "--output_dir", str(out),
                            "--reward_funcs", f"{rewards}:sleeps_for_an_hour", "--reward_timeout", "3"],
                   tmp_path, "sleeps_for_an_hour timed out after 3 s", "--reward_timeout")
    assert time.monotonic() - start < 60 and not out.exists()


def test_a_tokenizer_without_a_pad_token_samples_and_replies_with_its_end_of_text(tiny_chat_model_without_pad_token,
                                                                                   rewards, tmp_path):
    """GRPO replies to every validation prompt: without a pad token its first evaluation, before the final save,
    would end the run."""
    out = tmp_path / "out"
    run_on("grpo", tiny_chat_model_without_pad_token, [], out, *FLAGS, "--reward_funcs", f"{rewards}:distinct",
           "--max_train_steps", "1", "--per_device_train_batch_size", "8")
    assert len(read_jsonl(out / "eval_generations.jsonl")) == 47 and "eval_reward" in read_results(out)


def test_under_bf16_the_frozen_reference_runs_as_the_policy_so_the_first_kl_is_0(tiny_chat_model, rewards, tmp_path):
    out = tmp_path / "out"
    run_on("grpo", tiny_chat_model, [], out, *FLAGS, "--reward_funcs", f"{rewards}:distinct", "--beta", "0.04",
           "--no_use_lora", "--mixed_precision", "bf16", "--max_train_steps", "1", "--per_device_train_batch_size", "8",
           launcher="python")  # (a process of its own: this one's Accelerator state is float32)
    assert log_history(out)[0]["kl"] == 0.0


def test_data_of_ones_own_needs_reward_functions_of_its_own(tiny_chat_model, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 2 + 2?", "answer": "4"}] * 4)
    assert_refused("grpo", ["--train_file", data, "--validation_file", data, "--model_name_or_path",
                            str(tiny_chat_model), "--output_dir", str(tmp_path / "out")], tmp_path, "--reward_funcs")


@pytest.mark.slow
def test_a_run_resumed_between_two_passes_over_a_rollout_trains_on_that_rollout(
        tiny_chat_model_with_distinct_replies, rewards, tmp_path):
    """Two passes over each rollout: a run stopped after the first pass of its first rollout (a one-step run with a
    constant learning rate, checkpointed) and resumed in its folder ends where the uninterrupted run does."""
    flags = [*FLAGS, "--reward_funcs", f"{rewards}:distinct", "--num_iterations", "2", "--lr_scheduler_type",
             "constant", "--per_device_train_batch_size", "8", "--checkpointing_steps", "1"]
    model = tiny_chat_model_with_distinct_replies
    run_on("grpo", model, [], tmp_path / "whole", *flags, "--max_train_steps", "4")
    run_on("grpo", model, [], tmp_path / "stopped", *flags, "--max_train_steps", "1")
    assert (tmp_path / "stopped" / "rollout-rank0.pt").is_file()
    # Resumed with another loss (grpo, not the default dapo), the kept rollout, its loss scale dapo's, is sampled again.
    shutil.copytree(tmp_path / "stopped", tmp_path / "other_loss")
    with pytest.warns(UserWarning, match="sampling it again"):
        run_on("grpo", model, [], tmp_path / "other_loss", *flags, "--max_train_steps", "2", "--loss_type", "grpo",
               "--resume_from_checkpoint", "latest")
    assert "reward" in log_history(tmp_path / "other_loss")[1]
    run_on("grpo", model, [], tmp_path / "stopped", *flags, "--max_train_steps", "4", "--resume_from_checkpoint",
           "latest")
    whole, resumed = log_history(tmp_path / "whole"), log_history(tmp_path / "stopped")
    assert [h["step"] for h in resumed] == [1, 2, 3, 4] and "reward" not in resumed[1], "step 2 reuses the rollout"
    for ours, theirs in zip(resumed, whole, strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"])
    assert max_weight_diff(tmp_path / "stopped", tmp_path / "whole", "adapter_model.safetensors") == 0
