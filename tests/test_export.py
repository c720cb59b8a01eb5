"""``python -m finetune.export``: a trained folder as a GGUF file that transformers' own GGUF reader loads back as
the model that trained (weights, tokenizer, chat template), with its Ollama Modelfile; as a merged folder that
generates what the adapter on its base generates; and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import refused_here, save_tiny_llama

from finetune.errors import run_main
from finetune.export.__main__ import main as export

PROMPTS = [f"Order {n}: my {item} arrived {state}, can I get a refund of ${n * 7}.{n % 10}0?"
           for n, (item, state) in enumerate([(i, s) for i in ("lamp", "kettle", "router", "chair")
                                              for s in ("broken", "late", "twice", "open", "wet", "cold", "torn",
                                                        "empty")])]
assert len(PROMPTS) == 32
CORPUS = [*PROMPTS[:4], "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\tand a tab\n\n", "é ü 中文 🙂 12345",
          "<|endoftext|>end"]
CONVERSATIONS = [[{"role": "user", "content": "Where is my order?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund, please."},
                  {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks!"}]]


def read_back(path: Path):
    """The model and tokenizer transformers reads from the GGUF file alone (not the run's files beside it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    alone = path.parent / f"{path.stem}-alone"
    alone.mkdir()
    os.link(path, alone / path.name)
    model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(alone, gguf_file=path.name)


@torch.no_grad()
def logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model(**batch).logits.masked_fill(~batch.attention_mask.bool()[..., None], 0)


def exported(folder: Path, *flags: str) -> Path:
    run_main(export, [str(folder), *flags])
    return next(folder.glob("*.gguf")) if "gguf" in flags else folder / "merged"


@pytest.fixture
def chat_model(tmp_path, chat_tokenizer) -> Path:
    """The tiny Llama with SmolLM2's tokenizer, saved as a full fine-tune saves it (stopping at ``<|im_end|>``)."""
    return save_tiny_llama(tmp_path / "run", chat_tokenizer, initializer_range=0.05)


def test_a_gguf_file_converts_to_the_model_folder_transformers_reads_parsing_it_once(chat_model, tmp_path,
                                                                                     monkeypatch):
    """How the default chat model and Gemma's tests get their folders: transformers reads the file three times (the
    tokenizer's config, the model's, the weights), gguf's reader parses it once; the weights are the file's."""
    import gguf
    from transformers import AutoModelForCausalLM

    from finetune.models.loading import dequantized_gguf_folder

    path = exported(chat_model, "--to", "gguf", "--quant", "f16")
    parsed = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    folder = dequantized_gguf_folder(path, tmp_path / "folder", "a/name")
    assert parsed == [str(path)] and gguf.GGUFReader is Counted
    converted = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).state_dict()
    assert converted.keys() == trained.keys()
    for name, weight in trained.items():  # f16: the matrices rounded, the norms kept
        assert torch.equal(converted[name], weight.half().float() if weight.ndim == 2 else weight), name


def test_a_gguf_file_reads_back_as_the_model_that_trained_its_tokenizer_and_its_template(chat_model,
                                                                                         chat_tokenizer):
    """f16: transformers reads the file as the model with its matrices rounded to float16 (norms stay float32),
    logits equal to 1e-5 over 32 prompts; the tokenizer gives the same ids on text with special tokens and
    renders the same chat template; the Modelfile carries the template in Go's syntax and stops at the end of
    turn."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    path = exported(chat_model, "--to", "gguf", "--quant", "f16")
    assert path.name == "run-f16.gguf"
    model, tokenizer = read_back(path)
    rounded = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    for weight in rounded.parameters():
        if weight.ndim == 2:
            weight.data = weight.data.half().float()
    expected = logits(rounded, chat_tokenizer)
    torch.testing.assert_close(logits(model, chat_tokenizer), expected, atol=1e-5, rtol=0)
    assert (logits(trained, chat_tokenizer) - expected).abs().max() > 1e-4  # the rounding is seen, and matched
    for text in CORPUS:
        assert tokenizer(text).input_ids == chat_tokenizer(text).input_ids, text
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt) == \
                chat_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (chat_tokenizer.bos_token, chat_tokenizer.eos_token)
    modelfile = path.with_suffix(".Modelfile").read_text()
    assert modelfile.startswith('FROM ./run-f16.gguf\nTEMPLATE """{{- $system') and \
        modelfile.endswith('<|im_start|>assistant\n"""\nPARAMETER stop "<|im_end|>"\n')
    # SmolLM2's template opens a conversation without a system message with its own (bench/export_check.py renders
    # the whole template with Go's text/template against the Jinja one)
    assert "{{- if not $system }}<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in modelfile



CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(split: str | None = None):
    """A byte-level BPE of 300 tokens learned from the prompts, with ChatML's special tokens and template; text
    split as GPT-2 splits it, or by ``split`` first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHATML)


def tiny_model(model_type: str, vocab_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.1}
    # transformers' reader takes Gemma 3's query scale from its defaults (256), as llama.cpp takes the head size
    extra = {"qwen2": {"tie_word_embeddings": False},
             "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 32}}.get(model_type, {})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **extra))
    with torch.no_grad():  # norms and biases away from their initial ones and zeros, so that a wrong shift shows
        for weight in model.parameters():
            if weight.ndim == 1:
                weight.add_(torch.randn_like(weight) * 0.1)
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_each_architecture_reads_back_as_written(model_type, tmp_path):
    """Each architecture the writer supports, float32 (biases on Qwen2's attention, an untied head, q and k norms
    on Qwen3 and Gemma 3, Gemma 3's shifted norms and sliding window): the same logits to 1e-5, and its
    configuration read back as written. (transformers reads a Qwen file's text split as Qwen2's, whatever the
    file says: the Qwen models' tokenizers split so.)"""
    from finetune.export.gguf_file import QWEN2_SPLIT

    tokenizer = tiny_tokenizer(QWEN2_SPLIT if model_type.startswith("qwen") else None)
    model = tiny_model(model_type, len(tokenizer)).eval()
    model.save_pretrained(tmp_path / "run")
    tokenizer.save_pretrained(tmp_path / "run")
    back, back_tokenizer = read_back(exported(tmp_path / "run", "--to", "gguf", "--quant", "f32"))
    torch.testing.assert_close(logits(back, tokenizer), logits(model, tokenizer), atol=1e-5, rtol=0)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "vocab_size"):
        assert getattr(back.config, key, None) == pytest.approx(getattr(model.config, key, None)), key
    assert [back_tokenizer(text).input_ids for text in CORPUS] == [tokenizer(text).input_ids for text in CORPUS]


@pytest.mark.parametrize(("tokenizer_class", "prefixed"), [("LlamaTokenizer", True), ("GemmaTokenizer", False)])
def test_a_sentencepiece_style_vocabulary_says_whether_its_text_takes_a_space_before_it(tokenizer_class, prefixed,
                                                                                        tmp_path):
    """llama.cpp puts a space before the text of a ``llama`` vocabulary unless the file says not to: Llama's
    tokenizer prepends ``▁`` (so must the file), Gemma's only replaces spaces. (transformers reads the key back but
    never uses it, so the files' logits cannot show it.)"""
    import types

    import gguf
    import transformers

    from finetune.export.gguf_file import vocabulary

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁": 259, "h": 260, "i": 261, "▁h": 262, "▁hi": 263}
    tokenizer = getattr(transformers, tokenizer_class)(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")])
    tokenizer.save_pretrained(tmp_path / "run")
    assert (tokenizer.tokenize("hi")[0] == "▁hi") is prefixed
    writer = gguf.GGUFWriter(tmp_path / "vocabulary.gguf", "llama")
    vocabulary(tokenizer, types.SimpleNamespace(vocab_size=len(tokenizer)), tmp_path / "run")(writer, [])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    field = gguf.GGUFReader(tmp_path / "vocabulary.gguf").get_field("tokenizer.ggml.add_space_prefix")
    assert field.contents() is prefixed


@pytest.mark.parametrize("quant", ["q8_0", "bf16"])
def test_each_quantized_weight_is_the_gguf_package_s_own_rounding_of_the_trained_one(quant, tmp_path):
    """q8_0 (blocks of 32 with a scale each) and bf16: every matrix read back is what ``gguf``'s quantizer makes
    of the trained one (bf16: torch's rounding too), the norms as trained."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", len(tokenizer))
    model.save_pretrained(tmp_path / "run")
    tokenizer.save_pretrained(tmp_path / "run")
    back, _ = read_back(exported(tmp_path / "run", "--to", "gguf", "--quant", quant))
    kind = GGMLQuantizationType[quant.upper()]
    read = back.state_dict()
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the embedding
        expected = weight if weight.ndim == 1 else torch.from_numpy(dequantize(quantize(weight.numpy(), kind), kind))
        torch.testing.assert_close(read[name], expected.float(), atol=0, rtol=0, msg=name)
        if quant == "bf16" and weight.ndim == 2:
            torch.testing.assert_close(read[name], weight.bfloat16().float(), atol=0, rtol=0, msg=name)


def saved_adapter(chat_model: Path, folder: Path) -> Path:
    """A LoRA adapter on the tiny Llama with weights away from zero, saved as the chat recipe saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            init_lora_weights=False))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(chat_model).save_pretrained(folder)
    model.generation_config.eos_token_id = [2]
    model.generation_config.save_pretrained(folder)
    return folder


def test_an_adapter_merges_into_a_folder_that_generates_what_it_generated_on_its_base(chat_model, chat_tokenizer,
                                                                                       tmp_path):
    """``--to merged --dtype float32``: a plain folder transformers loads, whose logits are the adapter's on its
    base (to 1e-5) and whose greedy replies are the same, stopping at the end of turn it was saved with."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = saved_adapter(chat_model, tmp_path / "adapter")
    merged_folder = exported(adapter, "--to", "merged", "--dtype", "float32")
    merged = AutoModelForCausalLM.from_pretrained(merged_folder).eval()
    assert merged.dtype == torch.float32 and not (merged_folder / "adapter_config.json").exists()
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32),
                                        adapter).eval()
    torch.testing.assert_close(logits(merged, chat_tokenizer), logits(on_base, chat_tokenizer), atol=1e-5, rtol=0)
    assert json.loads((merged_folder / "generation_config.json").read_text())["eos_token_id"] == [2]
    for conversation in CONVERSATIONS:
        ids = chat_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)
        replies = [m.generate(**ids, max_new_tokens=12, do_sample=False) for m in (merged, on_base)]
        assert torch.equal(*replies)



def test_what_cannot_be_exported_is_refused_in_one_line_before_anything_loads_or_is_written(chat_model, tmp_path,
                                                                                            capsys, monkeypatch):
    """Not a trained folder, an adapter whose base is gone, a classifier, an architecture or a tokenizer the GGUF
    writer lacks, an output that exists, or the Modelfile beside it (kept as they were), or whose folder is not
    one: one ``error:`` line and exit status 2. A write that fails halfway leaves no file."""
    import gguf
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from finetune.export import gguf_file
    from finetune.models.loading import default_model_path
    from finetune.models.trained import load_trained

    adapter = saved_adapter(chat_model, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path":
                                                             str(tmp_path / "gone")}))
    BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(tmp_path / "classifier")
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "empty").mkdir()
    (chat_model / "taken.gguf").write_text("mine")
    (chat_model / "free.Modelfile").write_text("mine")
    wordpiece = AutoTokenizer.from_pretrained(default_model_path())
    tiny_model("llama", len(wordpiece)).save_pretrained(tmp_path / "wordpiece")
    wordpiece.save_pretrained(tmp_path / "wordpiece")
    refused = subprocess.run([sys.executable, "-m", "finetune.export", str(tmp_path / "empty"), "--to", "gguf"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        f"error: {tmp_path / 'empty'} holds no trained model (no config.json or adapter_config.json): give a "
        "recipe's --output_dir"]
    cases = {
        "adapter": ([str(adapter), "--to", "merged"], "the adapter's base model could not be loaded"),
        "classifier": ([str(tmp_path / "classifier"), "--to", "merged"], "not a causal language model"),
        "gpt2": ([str(tmp_path / "gpt2"), "--to", "gguf"], "the GGUF writer has no gpt2 models"),
        "tokenizer": ([str(tmp_path / "wordpiece"), "--to", "gguf"], "writes BPE tokenizers; this one is WordPiece"),
        "exists": ([str(chat_model), "--to", "gguf", "--out", str(chat_model / "taken.gguf")], "exists"),
        "its Modelfile exists": ([str(chat_model), "--to", "gguf", "--out", str(chat_model / "free.gguf")],
                                 f"--out's Modelfile {chat_model / 'free.Modelfile'} exists"),
        "not .gguf": ([str(chat_model), "--to", "gguf", "--out", str(chat_model / "free.Modelfile")],
                      "a GGUF file's name ends in .gguf"),
        "not a folder": ([str(chat_model), "--to", "gguf", "--out", str(chat_model / "config.json" / "x.gguf")],
                         "is not a folder this user can write"),
    }
    loaded = []
    monkeypatch.setattr("finetune.export.__main__.load_trained", lambda *args: loaded.append(args))
    for argv, expected in cases.values():
        refused_here(export, argv, capsys, expected)
    assert loaded == [] and [(chat_model / name).read_text() for name in ("taken.gguf", "free.Modelfile")] == [
        "mine", "mine"]

    monkeypatch.undo()
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gguf_file.write_gguf(load_trained(chat_model), tmp_path / "half.gguf", "f16")
    assert list(tmp_path.glob("half*")) == []


def test_the_ollama_template_ends_with_the_generation_prompt_the_run_trained_after(chat_tokenizer):
    """Qwen3's template saved with ``enable_thinking`` false by default (a run's ``--chat_template_kwargs``) prompts
    a reply after an empty think block: so does the Modelfile's Go template; SmolLM2's after the assistant turn's
    opening alone."""
    import copy

    import trl

    from finetune.export.ollama import go_template
    from finetune.tasks.chat import template_with_defaults

    qwen3 = copy.deepcopy(chat_tokenizer)
    qwen3.chat_template = template_with_defaults(
        (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(), {"enable_thinking": False})
    for tokenizer, prompt in ((qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                              (chat_tokenizer, "<|im_start|>assistant\n")):
        template = go_template(tokenizer.chat_template, lambda messages, t=tokenizer: t.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True))
        assert template.endswith("{{ end }}" + prompt)
