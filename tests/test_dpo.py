"""The preference recipe: the default run, reward metrics in the log and at evaluation, world-size and launcher
parity, exact resume with a precomputed reference, the start from a chat run's adapter, bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import (
    HUB_TOKEN,
    assert_refused,
    assert_same_steps,
    log_history,
    max_weight_diff,
    python_cmd,
    read_jsonl,
    read_results,
    recipe_path,
    run,
    run_on,
    save_tiny_llama,
    timeless_history,
    tokenizing,
    train_here,
    write_jsonl,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.preference_pairs import make_preference_pairs
from finetune.tasks.causal_lm import load_causal_lm
from finetune.tasks.preference import PromptRepliesCollator, pair_log_probs, tokenize_pairs

METRICS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
           "logps_rejected")


@pytest.fixture
def tiny_model(tiny_chat_model_with_distinct_replies) -> Path:
    return tiny_chat_model_with_distinct_replies


@pytest.fixture(scope="session")
def pair_files(tmp_path_factory) -> list[str]:
    """20 training pairs and 9 validation pairs of the default data, as flags."""
    folder = tmp_path_factory.mktemp("pairs")
    data = make_preference_pairs()

    def rows(split, count):
        return [{k: row[k] for k in ("prompt", "chosen", "rejected")} for row in data[split].select(range(count))]

    return ["--train_file", write_jsonl(folder / "train.jsonl", rows("train", 20)),
            "--validation_file", write_jsonl(folder / "validation.jsonl", rows("validation", 9)),
            "--per_device_eval_batch_size", "4", "--logging_steps", "1"]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> tuple[Path, str]:
    """The recipe with no flags but the output folder, once per session: (output folder, stdout)."""
    out = tmp_path_factory.mktemp("dpo_default") / "out"
    result = run(python_cmd("--output_dir", str(out), script=recipe_path("dpo")), timeout=600)
    return out, result.stdout


@pytest.mark.slow
def test_the_default_run_rewards_the_right_team_on_tickets_it_never_saw(default_run):
    out, stdout = default_run
    results = read_results(out)
    assert results["eval_rewards_accuracy"] >= 0.9 and results["eval_loss"] < math.log(2), results
    assert f"saved the model to {out}" in stdout and "120 examples (0 cut" in stdout
    assert results["global_step"] == 15 and results["world_size"] == 1  # 120 pairs, batches of 8, 1 epoch
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()}
    # eval_predictions.jsonl: every validation pair, in order, its margin the metrics' mean
    predictions = read_jsonl(out / "eval_predictions.jsonl")
    assert [p["index"] for p in predictions] == list(range(32))
    margins = [p["rewards_margin"] for p in predictions]
    assert results["eval_rewards_margin"] == pytest.approx(sum(margins) / 32, rel=1e-5)
    assert results["eval_rewards_accuracy"] == sum(m > 0 for m in margins) / 32
    assert results["eval_logps_chosen"] == pytest.approx(sum(p["policy_logps_chosen"] for p in predictions) / 32,
                                                         rel=1e-5)
    logged = log_history(out)
    assert [h["step"] for h in logged] == [10, 15] and all(set(METRICS) <= h.keys() for h in logged)


def test_a_tokenizer_without_a_pad_token_pads_and_replies_with_its_end_of_text(tiny_chat_model_without_pad_token,
                                                                               pair_files, tmp_path):
    out = tmp_path / "out"
    run_on("dpo", tiny_chat_model_without_pad_token, pair_files, out, "--max_train_steps", "1", "--eval_generate", "4")
    assert len(read_jsonl(out / "eval_generations.jsonl")) == 4 and "eval_rewards_accuracy" in read_results(out)


def test_default_validation_prompts_are_not_in_the_training_pairs():
    data = make_preference_pairs()
    seen = {json.dumps(prompt) for prompt in data["train"]["prompt"]}
    assert len(data["validation"]) == 32 and not any(json.dumps(p) in seen for p in data["validation"]["prompt"])
    kinds = [row[0]["content"].startswith("Team: ") for row in data["train"]["rejected"]]
    assert 0 < sum(kinds) < len(kinds), "rejected replies name a wrong team or none"
    for chosen, rejected, team in zip(data["train"]["chosen"], data["train"]["rejected"], data["train"]["team"],
                                      strict=True):
        assert chosen[0]["content"].startswith(f"Team: {team}\n") and f"Team: {team}" not in rejected[0]["content"]


def test_the_first_step_logs_ln_2_and_zero_rewards_and_a_frozen_copy_is_the_reference_without_lora(
        tiny_model, pair_files, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    full, validation = (tokenize_pairs(Dataset.from_json(path), tokenizer, 1024, "train", tokenizing(tmp_path))
                        for path in pair_files[1:4:2])
    limit = max(len(ids) for ids in [*full["prompt_ids"], *validation["prompt_ids"]]) + 8  # room for every reply
    cut = sum(len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"])) > limit for row in full)
    assert 0 < cut < 20
    out = tmp_path / "out"
    result = run_on("dpo", tiny_model, pair_files, out, "--max_train_steps", "2", "--no_use_lora", "--learning_rate",
                    "1e-3", "--per_device_train_batch_size", "4", "--max_seq_length", str(limit))
    assert f"20 examples ({cut} cut to --max_seq_length {limit})" in result.stdout
    first, second = log_history(out)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert all(first[name] == 0.0 for name in ("rewards_chosen", "rewards_rejected", "rewards_margin",
                                               "rewards_accuracy"))
    assert second["loss"] != first["loss"] and second["rewards_margin"] != 0
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()


def test_the_policy_trains_without_its_dropout_as_trl_s_so_the_first_step_logs_ln_2(chat_tokenizer, pair_files,
                                                                                       tmp_path):
    """A GPT-2 (dropout 0.1 on its embeddings, attention and residuals) trains with it off, as TRL's DPOTrainer
    (``disable_dropout``): before any step the policy's log-probabilities are the reference's, taken without."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(chat_tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=1024,
                               bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(model)
    chat_tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    run_on("dpo", model, pair_files, out, "--max_train_steps", "1", "--no_use_lora", "--per_device_train_batch_size",
           "4")
    first = log_history(out)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7) and first["rewards_margin"] == 0.0, first


def test_gradient_checkpointing_trains_exactly_as_keeping_the_activations(tiny_model, pair_files, tmp_path):
    """The reference (the adapters off, without gradients) is not recomputed; the policy's layers keep no KV cache
    when recomputed, so each reply runs as one row with its prompt, to the values of the shared prompt pass."""
    flags = ["--max_train_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2"]
    run_on("dpo", tiny_model, pair_files, tmp_path / "kept", *flags)
    run_on("dpo", tiny_model, pair_files, tmp_path / "recomputed", *flags, "--gradient_checkpointing")
    recomputed, kept = log_history(tmp_path / "recomputed"), log_history(tmp_path / "kept")
    # Rows instead of a shared prompt's cache add the same float32 terms in another order: each reply's log-prob sum
    # (about -180) rounds apart (1.7e-7 of itself seen on an AMD EPYC, where the loss then moved by 1.1e-6 of itself
    # through beta and the sigmoid; 5e-6 is about five times that); a cache read in a recomputed layer moves the
    # sums by far more than 1e-6 (this run has no dropout: DPO's LoRA dropout is 0 by default)
    for ours, theirs in zip(recomputed, kept, strict=True):
        for name in ("logps_chosen", "logps_rejected"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-6), (name, ours, theirs)
    assert_same_steps(recomputed, kept, rel=5e-6)
    # AdamW's first steps move a weight by about the learning rate, whatever the size of its gradient: rounding in
    # another order of the sums (rows instead of a shared cache) moves one by a thousandth of a step at most
    assert max_weight_diff(tmp_path / "recomputed", tmp_path / "kept", "adapter_model.safetensors") <= 1e-5


@pytest.mark.parametrize("sharded", [[], ["--fsdp"]], ids=["accelerate", "fsdp"])
def test_under_bf16_the_frozen_reference_runs_as_the_policy_so_the_first_rewards_are_0(tiny_model, pair_files,
                                                                                         tmp_path, sharded):
    """Accelerate runs the policy's forward under bf16 autocast, --fsdp with its weights gathered in bf16 and no
    autocast; a frozen copy run in float32 beside the one, or under autocast beside the other, gives rewards
    (0.1 x the log-probabilities' difference) that are not 0 before any step (-0.0002 under --fsdp)."""
    out = tmp_path / "out"
    run_on("dpo", tiny_model, pair_files, out, "--max_train_steps", "1", "--no_use_lora", "--mixed_precision", "bf16",
           "--per_device_train_batch_size", "4", *sharded, launcher="python")  # (this process's Accelerator is float32)
    first = log_history(out)[0]
    assert first["rewards_chosen"] == first["rewards_rejected"] == 0.0 and first["loss"] == pytest.approx(math.log(2))


PARITY_FLAGS = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "2", "--learning_rate", "1e-2"]


def within_rounding(metric: str) -> dict:
    """How far one process and two may differ: batches of other shapes round float32 sums of about -160 by up to
    1e-6 of them, and a reward is beta (0.1) x the difference of two such sums (a wrong normalisation is off by
    half or more)."""
    return {"abs": 1e-4} if metric.startswith("rewards_") else {"rel": 1e-5, "abs": 1e-5}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_and_two_train_alike_under_both_launchers(tiny_model, pair_files, tmp_path):
    """A pair is the loss unit: the mean over the pairs of a whole window on all ranks, so 1 x 4 equals 2 x 2. The
    torchrun run precomputes its reference, each pair on one of the two processes."""
    outs = {"one": tmp_path / "one", "accelerate": tmp_path / "accelerate", "torchrun": tmp_path / "torchrun"}
    run_on("dpo", tiny_model, pair_files, outs["one"], *PARITY_FLAGS, "--per_device_train_batch_size", "4")
    for launcher, extra in (("accelerate", []), ("torchrun", ["--precompute_ref_log_probs"])):
        run_on("dpo", tiny_model, pair_files, outs[launcher], *PARITY_FLAGS, *extra, "--per_device_train_batch_size",
               "2", launcher=launcher, processes=2)
    reference = log_history(outs["one"])
    assert [h["step"] for h in reference] == list(range(1, 7))  # 20 pairs, windows of 8, 2 epochs
    assert load_file(outs["torchrun"] / "ref_log_probs.safetensors")["log_probs"].shape == (20, 2)
    adapter = load_file(outs["one"] / "adapter_model.safetensors")
    for launcher in ("accelerate", "torchrun"):
        ours = log_history(outs[launcher])
        assert [h["step"] for h in ours] == [h["step"] for h in reference]
        for a, b in zip(ours, reference, strict=True):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
            for name in METRICS:  # (at step 1 a precomputed reference's rewards are float rounding from 0)
                if name != "rewards_accuracy" or a["step"] > 1 or launcher == "accelerate":
                    assert a[name] == pytest.approx(b[name], **within_rounding(name)), (launcher, name, a, b)
        # Adam turns the rounding of a near-zero gradient entry into a step of up to the learning rate: a few of
        # the 32,768 entries differ by up to 1e-3, the rest by about 1e-7. Other pairs or another loss would move
        # nearly every entry apart, by steps of about 1e-2.
        other = load_file(outs[launcher] / "adapter_model.safetensors")
        apart = sum(((other[k] - adapter[k]) ** 2).sum() for k in adapter) ** 0.5
        assert apart / sum((adapter[k] ** 2).sum() for k in adapter) ** 0.5 < 5e-4
        results, expected = read_results(outs[launcher]), read_results(outs["one"])
        assert (results["world_size"], expected["world_size"]) == (2, 1)
        for name in METRICS:
            assert results[f"eval_{name}"] == pytest.approx(expected[f"eval_{name}"], **within_rounding(name))
        predictions = read_jsonl(outs[launcher] / "eval_predictions.jsonl")
        alone = read_jsonl(outs["one"] / "eval_predictions.jsonl")
        assert [p["index"] for p in predictions] == list(range(9))
        for a, b in zip(predictions, alone, strict=True):
            assert a["reference_logps_chosen"] == pytest.approx(b["reference_logps_chosen"], rel=1e-6)
            assert a["policy_logps_rejected"] == pytest.approx(b["policy_logps_rejected"], rel=1e-5)


def test_a_resumed_run_with_a_precomputed_reference_ends_where_an_uninterrupted_live_one_does(
        tiny_model, pair_files, tmp_path):
    flags = ["--num_train_epochs", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
             "--checkpointing_steps", "4"]
    run_on("dpo", tiny_model, pair_files, tmp_path / "full", *flags, "--precompute_ref_log_probs")
    # the run as it was when stopped after step 4's checkpoint, continued in its own folder
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_4", tmp_path / "resumed" / "checkpoints" / "step_4")
    shutil.copy2(tmp_path / "full" / "ref_log_probs.safetensors", tmp_path / "resumed")
    logged = (tmp_path / "full" / "log_history.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed" / "log_history.jsonl").write_text("".join(logged[:4]))
    stored = tmp_path / "resumed" / "ref_log_probs.safetensors"
    written = stored.stat().st_mtime_ns
    run_on("dpo", tiny_model, pair_files, tmp_path / "resumed", *flags, "--precompute_ref_log_probs",
           "--resume_from_checkpoint", str(tmp_path / "resumed" / "checkpoints" / "step_4"))
    assert stored.stat().st_mtime_ns == written, "read, not computed again (computing writes it)"
    full = load_file(tmp_path / "full" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert timeless_history(tmp_path / "resumed") == timeless_history(tmp_path / "full")
    assert len(log_history(tmp_path / "full")) == 10
    # The live reference trains the same way. The precomputed one comes from batches of other shapes, which round
    # sums of about -150 differently (1e-5): at step 1 its rewards are that far from 0, of either sign, so the share
    # of pairs with a positive margin is compared from step 2 on, when margins are far larger.
    run_on("dpo", tiny_model, pair_files, tmp_path / "live", *flags)
    assert len(load_file(stored)["log_probs"]) == 20
    for a, b in zip(log_history(tmp_path / "live"), log_history(tmp_path / "full"), strict=True):
        for name in METRICS:
            if name != "rewards_accuracy" or a["step"] > 1:
                assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-5), (name, a, b)
        assert abs(b["rewards_margin"]) > 1e-3 or b["step"] == 1


def test_a_chat_run_s_adapter_is_the_start_and_the_reference(tiny_model, pair_files, tmp_path):
    sft_out = tmp_path / "sft"
    chats = tmp_path / "chats.jsonl"
    conversations = [{"messages": [*row["prompt"], *row["chosen"]]} for row in make_preference_pairs()["train"]]
    write_jsonl(chats, conversations[:16])
    run_on("sft", tiny_model, ["--train_file", str(chats), "--validation_file", str(chats)], sft_out,
           "--max_train_steps", "3", "--learning_rate", "1e-2", "--eval_generate", "0")
    # The pairs as whole conversations with no prompt column, in parquet: the same tokens (test_preference.py).
    conversation_files = []
    for flag, path in zip(pair_files[0:4:2], pair_files[1:4:2], strict=True):
        pairs = Dataset.from_json(path)
        whole = Dataset.from_dict({side: [p + r for p, r in zip(pairs["prompt"], pairs[side], strict=True)]
                                   for side in ("chosen", "rejected")})
        whole.to_parquet(tmp_path / Path(path).with_suffix(".parquet").name)
        conversation_files += [flag, str(tmp_path / Path(path).with_suffix(".parquet").name)]
    out = tmp_path / "dpo"
    result = run_on("dpo", sft_out, [*conversation_files, *pair_files[4:]], out, "--max_train_steps", "1")
    assert f"from {sft_out} folded into its base model" in result.stdout
    validation = Dataset.from_json(pair_files[3])
    tokenizer = AutoTokenizer.from_pretrained(sft_out)
    pairs = TokenizedDataset(tokenize_pairs(validation, tokenizer, 1024, "validation", tokenizing(tmp_path)),
                             ["prompt_ids", "chosen_ids", "rejected_ids", "index"])
    batch = PromptRepliesCollator(tokenizer.pad_token_id)(pairs.__getitems__(range(len(pairs))))
    batch.pop("index")
    with torch.no_grad():
        merged = pair_log_probs(load_causal_lm(str(sft_out)).eval(), batch)[0]
        base = pair_log_probs(AutoModelForCausalLM.from_pretrained(tiny_model).eval(), batch)[0]
    predictions = read_jsonl(out / "eval_predictions.jsonl")
    reference = torch.tensor([[p["reference_logps_chosen"], p["reference_logps_rejected"]] for p in predictions])
    torch.testing.assert_close(reference, merged, rtol=1e-6, atol=1e-5)
    assert (reference - base).abs().min() > 1e-3, "the adapter changed the reference"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)


@pytest.mark.slow
def test_the_hub_gets_a_card_that_says_dpo_and_replies_are_generated_when_asked(hub, tiny_model, pair_files, tmp_path):
    run_on("dpo", tiny_model, pair_files, tmp_path / "out", "--max_train_steps", "1", "--eval_generate", "2",
           "--max_new_tokens", "4", "--push_to_hub", "--hub_model_id", "alice/support-dpo", "--hub_token", HUB_TOKEN,
           "--hub_strategy", "end", launcher="python", env=hub.env)
    files = hub.files("alice/support-dpo")
    card = files["README.md"].decode()
    assert "for preference tuning (DPO)" in card and "recipes/dpo.py" in card and "eval_rewards_accuracy" in card
    assert {"adapter_model.safetensors", "eval_predictions.jsonl", "all_results.json"} <= files.keys()
    generations = read_jsonl(tmp_path / "out" / "eval_generations.jsonl")
    assert [g["reference"] for g in generations] == [row["chosen"][0]["content"]
                                                     for row in make_preference_pairs()["validation"].select(range(2))]


def pair(prompt, chosen, rejected) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


GOOD = [pair("Refund order 42?", "Team: billing\nDone.", "No.")] * 2
BAD = {
    "no rejected column": ([{"prompt": "hi", "chosen": "a"}], None,
                           "train data has no 'chosen' and 'rejected' columns"),
    "an empty reply": ([*GOOD, pair("hi", "", "b")], None, "train row 3: the chosen reply is empty"),
    "a reply that is not an assistant turn": (
        None, [pair("hi", "a", [{"role": "user", "content": "b"}])],
        "validation row 1: the rejected reply must be one assistant turn, not user"),
    "prompts that differ": ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                              "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}],
                            None, "train row 1: chosen and rejected differ at message 1"),
    "a prompt that leaves no room for a reply": (
        None, [*GOOD, pair("word " * 80, "ok", "no")],
        "validation row 3: the prompt takes 111 tokens, which leaves no room for a reply within --max_seq_length 64"),
    "an unknown loss type": (None, None, "--loss_type 'hinge' is unknown; use one of sigmoid, ipo, robust",
                             "--loss_type", "hinge"),
    "label smoothing without the robust loss": (None, None, "--label_smoothing is 0.1; give a share in [0, 0.5) with "
                                                "--loss_type robust", "--label_smoothing", "0.1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_and_changes_nothing(tiny_model, tmp_path, case):
    train, validation, expected, *extra_flags = BAD[case]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    flags = ["--train_file", write_jsonl(tmp_path / "train.jsonl", train or GOOD), "--validation_file",
             write_jsonl(tmp_path / "validation.jsonl", validation or GOOD), "--output_dir", str(tmp_path / "out"),
             "--model_name_or_path", str(tiny_model), "--max_seq_length", "64", *extra_flags]
    assert_refused("dpo", flags, tmp_path, expected)



def test_the_precomputed_reference_is_the_model_s_of_this_run(pair_files, chat_tokenizer, tmp_path):
    """New weights written into the model folder between two runs: the second's first loss is ln 2 (its reference
    is its starting model), not what the first run's table gives. A fresh start with the same model computes the
    table again; a resume reads it."""
    model = save_tiny_llama(tmp_path / "model", chat_tokenizer, initializer_range=0.05)
    out = tmp_path / "out"
    flags = [*pair_files, "--model_name_or_path", str(model), "--output_dir", str(out), "--max_train_steps", "2",
             "--per_device_train_batch_size", "4", "--precompute_ref_log_probs", "--checkpointing_steps", "1"]
    train_here("dpo", *flags)
    table = out / "ref_log_probs.safetensors"
    first = load_file(table)["log_probs"]
    save_tiny_llama(model, chat_tokenizer, initializer_range=0.2)  # retrained in place, as it were
    train_here("dpo", *flags, "--overwrite_output_dir")
    assert log_history(out)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    second = load_file(table)["log_probs"]
    assert (second - first).abs().min() > 1e-3
    written = table.stat().st_mtime_ns
    train_here("dpo", *flags, "--overwrite_output_dir", "--max_train_steps", "1")
    assert table.stat().st_mtime_ns != written and torch.equal(load_file(table)["log_probs"], second)
    written = table.stat().st_mtime_ns
    train_here("dpo", *flags, "--resume_from_checkpoint", str(out / "checkpoints" / "step_1"))
    assert table.stat().st_mtime_ns == written, "read, not computed again"


def test_pairs_whose_replies_are_the_same_tokens_are_counted_at_start_up(tiny_model, tmp_path):
    """They train nothing (loss ln 2, no gradient): one is the same text, one differs only past the cut."""
    same = [pair("Refund order 42?", "Team: billing\nDone.", "Team: billing\nDone."),
            pair("Refund order 43?", "Team: billing " + "x " * 80 + "one", "Team: billing " + "x " * 80 + "two")]
    flags = ["--train_file", write_jsonl(tmp_path / "train.jsonl", [*GOOD, *same]), "--validation_file",
             write_jsonl(tmp_path / "validation.jsonl", GOOD), "--output_dir", str(tmp_path / "out"),
             "--model_name_or_path", str(tiny_model), "--max_seq_length", "64", "--max_train_steps", "1"]
    result = train_here("dpo", *flags)
    assert ", 2 pair(s) whose chosen and rejected replies are the same tokens (they train nothing)" in result.stdout
