"""``python -m finetune.predict``: every recipe's folder over a file, one JSON line a row in the input's order, the
same whether rows are batched or alone and on one process or two; and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import launch_cmd, read_jsonl, refused_here, save_tiny_llama, write_csv, write_jsonl

from finetune.errors import run_main
from finetune.predict.__main__ import main as predict

TICKETS = ["My invoice shows a double charge", "The app crashes when I log in", "How do I reset my password?",
           "Please cancel my subscription today", "Shipping label never arrived", "Refund still missing",
           "Two-factor codes are late", "Can I change the billing address?", "Export to CSV fails", "Hello"]


def predicted(folder: Path, *flags: str) -> list[dict]:
    run_main(predict, [str(folder), *flags])
    return read_jsonl(folder / "predictions.jsonl")


def labelled(auto_class, folder: Path, labels: list[str], bias: dict[str, float] | None = None) -> Path:
    """A random 2-layer MiniLM-shaped encoder with a head for ``labels``, saved as the recipes save one."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.models.loading import default_model_path

    config = AutoConfig.from_pretrained(default_model_path(), num_labels=len(labels),
                                        id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    config.update({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                   "initializer_range": 0.5})  # wide, so that texts get different labels
    torch.manual_seed(0)
    model = auto_class.from_config(config)
    if bias:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.tensor([bias.get(label, 0.0) for label in labels]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def test_a_classifier_labels_each_row_as_it_would_alone_in_the_input_order(tmp_path):
    """Batches of 4 padded texts: each row's label and probabilities are the model's for that text alone, the
    row's own columns kept beside them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = labelled(AutoModelForSequenceClassification, tmp_path / "classify", ["billing", "bug", "account"])
    file = write_csv(tmp_path / "tickets.csv", [{"id": i, "text": t} for i, t in enumerate(TICKETS)])
    rows = predicted(folder, "--input", str(file), "--batch_size", "4")
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert [row["id"] for row in rows] == list(range(len(TICKETS)))
    labels = set()
    for row, text in zip(rows, TICKETS, strict=True):
        with torch.no_grad():
            alone = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        assert row["text"] == text and row["predicted_label"] == model.config.id2label[int(alone.argmax())]
        assert list(row["probabilities"].values()) == pytest.approx(alone.tolist(), abs=1e-5)
        labels.add(row["predicted_label"])
    assert len(labels) > 1  # the rows are told apart: an answer copied from one row to all would fail


def test_a_tagger_tags_each_word_by_its_first_piece_and_spells_the_entities(tmp_path):
    """A CoNLL file (its tags ignored): each word's tag is the model's at the word's first piece, computed for the
    sentence alone; a tagger whose every position says I-ORG spells one ORG entity over the whole sentence
    (seqeval's reading of a leading I-), its words joined."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    labels = ["O", "B-ORG", "I-ORG", "B-PER", "I-PER"]
    sentences = [text.split() for text in TICKETS]
    conll = tmp_path / "tickets.conll"
    conll.write_text("\n\n".join("\n".join(f"{word} O" for word in words) for words in sentences) + "\n")
    random_tagger = labelled(AutoModelForTokenClassification, tmp_path / "tagger", labels)
    rows = predicted(random_tagger, "--input", str(conll), "--batch_size", "3")
    model, tokenizer = AutoModelForTokenClassification.from_pretrained(random_tagger), \
        AutoTokenizer.from_pretrained(random_tagger)
    for row, words in zip(rows, sentences, strict=True):
        ids = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            best = model(**ids).logits[0].argmax(-1).tolist()
        first = {word: position for position, word in reversed(list(enumerate(ids.word_ids()))) if word is not None}
        assert row["tokens"] == words and row["predicted_tags"] == [labels[best[first[w]]] for w in range(len(words))]
    always_inside = labelled(AutoModelForTokenClassification, tmp_path / "inside", labels, bias={"I-ORG": 5.0})
    rows = predicted(always_inside, "--input", str(conll))
    assert [row["entities"] for row in rows] == [[{"type": "ORG", "start": 0, "end": len(words),
                                                   "text": " ".join(words)}] for words in sentences]


CHATS = [[{"role": "user", "content": text}] for text in TICKETS[:6]] + [
    [{"role": "system", "content": "Route tickets."}, {"role": "user", "content": TICKETS[6]},
     {"role": "assistant", "content": "billing"}],  # a reference reply: not part of the prompt
]


@pytest.fixture
def chat_run(tmp_path, chat_tokenizer) -> tuple[Path, Path]:
    """A LoRA adapter on the tiny Llama (weights drawn wide, so replies differ by prompt), saved as the chat
    recipe saves one, and a file of conversations."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = save_tiny_llama(tmp_path / "base", chat_tokenizer, initializer_range=0.08)
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(tmp_path / "sft")
    chat_tokenizer.save_pretrained(tmp_path / "sft")
    model.generation_config.eos_token_id = [2]
    model.generation_config.save_pretrained(tmp_path / "sft")
    return tmp_path / "sft", Path(write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS]))


def alone_replies(adapter: Path, max_new_tokens: int, prompts: list[list[dict]]) -> list[str]:
    """Each prompt's greedy reply from the adapter on its base, generated alone (no padding), up to its stop."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model, tokenizer = AutoPeftModelForCausalLM.from_pretrained(adapter).eval(), AutoTokenizer.from_pretrained(adapter)
    replies = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[2],
                             pad_token_id=2)[0, ids["input_ids"].shape[1]:].tolist()
        replies.append(tokenizer.decode(out[:out.index(2)] if 2 in out else out, skip_special_tokens=True))
    return replies


def test_a_chat_adapter_replies_to_each_conversation_as_it_would_alone_on_one_process_or_two(chat_run):
    """Batches of 3, left-padded, greedy: each reply is the adapter's for its prompt alone (a conversation that
    ends with a reply is prompted up to it), in the input order; two processes under ``torchrun`` and under
    ``accelerate launch`` write the same file."""
    adapter, chats = chat_run
    rows = predicted(adapter, "--input", str(chats), "--batch_size", "3", "--max_new_tokens", "10")
    expected = alone_replies(adapter, 10, [m[:-1] if m[-1]["role"] == "assistant" else m for m in CHATS])
    assert [row["reply"] for row in rows] == expected and len(set(expected)) > 1
    assert [row["messages"] for row in rows] == CHATS

    for launcher in ("torchrun", "accelerate"):
        two = adapter.parent / f"{launcher}.jsonl"
        command = launch_cmd(launcher, str(adapter), "--input", str(chats), "--output", str(two), "--batch_size", "2",
                             "--max_new_tokens", "10", script="finetune.predict")
        command.insert(command.index("finetune.predict"), "-m")  # both launchers run a module so
        subprocess.run(command, check=True, timeout=300, capture_output=True)
        assert read_jsonl(two) == rows, launcher


def test_the_terminal_chat_streams_each_reply_keeps_the_conversation_and_starts_over_at_reset(chat_run):
    """Lines on standard input: each reply printed is the adapter's greedy one for the conversation so far (the
    second turn sees the first), and after ``/reset`` the first question gets its first answer again."""
    adapter, _ = chat_run
    first, second = TICKETS[0], TICKETS[1]
    chat = subprocess.run([sys.executable, "-m", "finetune.chat", str(adapter), "--max_new_tokens", "8"],
                          input=f"{first}\n{second}\n/reset\n{first}\n/exit\n", capture_output=True, text=True,
                          timeout=120, check=True)
    [one] = alone_replies(adapter, 8, [[{"role": "user", "content": first}]])
    [two] = alone_replies(adapter, 8, [[{"role": "user", "content": first}, {"role": "assistant", "content": one},
                                        {"role": "user", "content": second}]])
    assert chat.stdout == f"{one}\n{two}\n{one}\n" and one != two


def test_what_cannot_be_predicted_is_refused_in_one_line(chat_run, tmp_path, capsys):
    """A folder with no model, a file without the columns the model reads, an output that exists (kept): one
    ``error:`` line, exit status 2."""
    adapter, chats = chat_run
    (tmp_path / "empty").mkdir()
    texts = write_csv(tmp_path / "texts.csv", [{"body": "hi"}])
    (tmp_path / "taken.jsonl").write_text("mine\n")
    cases = {
        "empty": ([str(tmp_path / "empty"), "--input", str(chats)], "holds no trained model"),
        "columns": ([str(adapter), "--input", str(texts)], "--input has no 'messages' or 'prompt' column"),
        "exists": ([str(adapter), "--input", str(chats), "--output", str(tmp_path / "taken.jsonl")], "exists"),
        "no file": ([str(adapter), "--input", str(tmp_path / "nothing.jsonl")], "no such file"),
    }
    for argv, expected in cases.values():
        refused_here(predict, argv, capsys, expected)
    assert (tmp_path / "taken.jsonl").read_text() == "mine\n" and not (adapter / "predictions.jsonl").exists()
    assert json.loads(chats.read_text().splitlines()[0])["messages"] == CHATS[0]


def test_a_row_without_what_its_model_reads_is_refused_by_its_number_before_any_weights_load(tmp_path):
    """An empty cell, a tagger's words given as one string, a chat row with neither messages nor a prompt: one
    line naming the row (before, the empty cell reached the tokenizer, and a string of words was tagged a letter at
    a time); a file that mixes messages rows and prompt rows predicts each by what it has."""
    from datasets import Dataset

    from finetune.errors import UserError
    from finetune.predict.predictors import Plan, prompt_of

    cases = [("classify", ("text", "pair"), [{"text": "a", "pair": "b"}, {"text": "c", "pair": None}],
              "--input row 2: 'pair' is 'None' \\(NoneType\\), not a text; fill it in, or drop the row"),
             ("tag", ("tokens",), [{"tokens": "Ada in Paris"}],  # (a csv file's column)
              "--input row 1: 'tokens' is 'Ada in Paris' \\(str\\), not a list of words"),
             ("chat", ("messages", "prompt"), [{"messages": CHATS[0], "prompt": None},
                                               {"messages": None, "prompt": None}],
              "--input row 2 has neither messages nor a prompt"),
             ("chat", ("messages",), [{"messages": json.dumps(CHATS[0])}],  # (a csv file's cell)
              "--input row 1: messages is .*, not a list of messages"),
             ("chat", ("messages", "prompt"), [{"messages": [], "prompt": "Where is it?"}],
              "--input row 1: messages is '\\[\\]', not a list of messages")]
    for kind, columns, rows, expected in cases:
        with pytest.raises(UserError, match=expected):
            Plan(tmp_path, kind, columns).rows(Dataset.from_list(rows))
    mixed = Plan(tmp_path, "chat", ("messages", "prompt")).rows(
        Dataset.from_list([{"messages": CHATS[0], "prompt": None}, {"messages": None, "prompt": "Where is it?"}]))
    assert prompt_of(mixed[1]) == [{"role": "user", "content": "Where is it?"}]
    assert prompt_of(mixed[0])[0] == CHATS[0][0]


TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "An order's status.",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                                                          "required": ["id"]}}}]


def test_a_chat_run_s_template_options_and_a_row_s_tools_prompt_as_the_run_trained(tmp_path, chat_tokenizer, capsys):
    """A chat run saved with ``--chat_template_kwargs '{"enable_thinking": false}'`` (Qwen3's template as TRL ships
    it): its saved template renders without the option what the run's did with it (a caller's own option still
    wins), and predict prompts each row with it and the row's ``tools``; a row whose tools are not schemas is
    refused in one line before the model loads."""
    import copy
    import types

    import trl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.tasks.causal_lm import ChatModelArguments, ChatTask

    qwen3 = copy.deepcopy(chat_tokenizer)
    qwen3.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    base = save_tiny_llama(tmp_path / "base", qwen3, initializer_range=0.08)
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.generation_config.eos_token_id = [2]
    task = type("Chat", (ChatTask,), {"what": "chat"})(ChatModelArguments(
        chat_template_kwargs='{"enable_thinking": false}'))
    run_tokenizer = task.load_tokenizer(types.SimpleNamespace(model_name_or_path=str(base), trust_remote_code=False))
    task.save(model, model.state_dict(), run_tokenizer, str(tmp_path / "sft"))

    saved = AutoTokenizer.from_pretrained(tmp_path / "sft")
    chat = [{"role": "user", "content": TICKETS[0]}]
    for thinking in (False, True):
        options = {} if thinking is False else {"enable_thinking": True}
        assert saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **options) == \
            qwen3.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    assert "<think>" in saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    rows = [{"messages": chat, "tools": json.dumps(TOOLS)}, {"messages": [{"role": "user", "content": TICKETS[1]}]}]
    chats = write_jsonl(tmp_path / "chats.jsonl", rows)
    replies = [row["reply"] for row in predicted(tmp_path / "sft", "--input", str(chats), "--max_new_tokens", "8")]
    merged = model.merge_and_unload().eval()

    def reply(messages, **options):
        ids = qwen3.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                        **options)
        out = merged.generate(**ids, max_new_tokens=8, do_sample=False, eos_token_id=[2],
                              pad_token_id=2)[0, ids["input_ids"].shape[1]:].tolist()
        return qwen3.decode(out[:out.index(2)] if 2 in out else out, skip_special_tokens=True)

    expected = [reply(chat, tools=TOOLS, enable_thinking=False), reply(rows[1]["messages"], enable_thinking=False)]
    assert replies == expected
    assert expected != [reply(chat), reply(rows[1]["messages"])] and expected[0] != reply(chat, enable_thinking=False)

    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[1], {"messages": chat, "tools": "{not json"}])
    refused_here(predict, [str(tmp_path / "sft"), "--input", str(bad), "--output", str(tmp_path / "bad-out.jsonl")],
                 capsys, "--input row 2: tools is not JSON")
    assert not (tmp_path / "bad-out.jsonl").exists()
