"""A trained model as a GGUF file: llama.cpp's tensor names and layouts, the architecture's hyperparameters, and
the tokenizer with its chat template, written with the ``gguf`` package (its writer, tensor name map, special
vocabulary and numpy quantizers). llama.cpp's own converter is not on PyPI; the per-architecture part is here.

Architectures, and why these: Llama (SmolLM2, the default chat model, and every Llama-shaped model), Qwen2 and
Qwen3 (the same layout, rotary embeddings on halves: no permutation) and Gemma 3 (the second family the package
trains; its norms are stored as llama.cpp multiplies them, ``1 + w``). docs/export.md says what was checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.checkpointing.files import replacing
from finetune.errors import UserError

__all__ = ["ARCHITECTURES", "QUANTS", "architecture_of", "vocabulary", "write_gguf"]

QUANTS = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class Architecture:
    name: str  # llama.cpp's
    hyperparameters: Callable[[object, object], None]  # (config, writer)
    transform: Callable[[str, np.ndarray, object], np.ndarray]  # (Hugging Face name, weights, config)


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    parameters = parameters.get("full_attention", parameters)  # Gemma 3: global layers' and local layers'
    if parameters.get("rope_type", "default") != "default":
        raise UserError(f"the model's rotary embeddings are scaled ({parameters['rope_type']}); the GGUF writer "
                        "writes unscaled ones only: export --to merged")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _common(config, writer) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))


def _llama_hyperparameters(config, writer) -> None:
    _common(config, writer)
    writer.add_rope_dimension_count(_head_dim(config))


def _llama_transform(name: str, weights: np.ndarray, config) -> np.ndarray:
    """llama.cpp rotates adjacent pairs, transformers the two halves of each head: q and k rows reordered."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
    if heads is None:
        return weights
    return weights.reshape(heads, 2, -1, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _unchanged(name: str, weights: np.ndarray, config) -> np.ndarray:
    return weights


def _gemma3_hyperparameters(config, writer) -> None:
    # llama.cpp fixes what transformers reads from the configuration: every sixth layer global, local layers'
    # rotary base 10,000, queries scaled by the head size. A model that differs would run differently there.
    layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]
    local = (config.rope_parameters or {}).get("sliding_attention", {})
    if (config.layer_types != layers or local.get("rope_theta", 10000.0) != 10000.0
            or config.query_pre_attn_scalar != _head_dim(config) or config.final_logit_softcapping
            or config.attn_logit_softcapping):
        raise UserError("this Gemma 3 differs from what llama.cpp assumes of the family (global attention every "
                        "sixth layer, local rotary base 10000, queries scaled by the head size, no soft-capping): "
                        "export --to merged")
    _common(config, writer)
    writer.add_sliding_window(config.sliding_window)


def _gemma3_transform(name: str, weights: np.ndarray, config) -> np.ndarray:
    return weights + 1 if name.endswith("norm.weight") else weights  # transformers' norms multiply by 1 + w


ARCHITECTURES = {
    "llama": Architecture("llama", _llama_hyperparameters, _llama_transform),
    "qwen2": Architecture("qwen2", _common, _unchanged),
    "qwen3": Architecture("qwen3", _common, _unchanged),
    "gemma3_text": Architecture("gemma3", _gemma3_hyperparameters, _gemma3_transform),
}


def architecture_of(config) -> Architecture:
    if config.model_type not in ARCHITECTURES:
        raise UserError(f"the GGUF writer has no {config.model_type} models (it writes "
                        f"{', '.join(sorted(ARCHITECTURES))}); export --to merged for vLLM or TGI")
    return ARCHITECTURES[config.model_type]


def write_gguf(trained, path: Path, quant: str) -> None:
    """``trained`` (``finetune.models.trained.Trained``) as a GGUF file at ``path``, its 2-D weights in
    ``quant`` (1-D ones, norms and biases, in float32 as llama.cpp keeps them), written beside and renamed into
    place so a failed export leaves nothing half-written."""
    import gguf

    model, config = trained.model, trained.model.config
    architecture = architecture_of(config)
    vocab = vocabulary(trained.tokenizer, config, trained.folder)
    with replacing(path) as partial:
        writer = gguf.GGUFWriter(partial, architecture.name)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(Path(getattr(config, "name_or_path", "") or trained.folder.name).name)
        architecture.hyperparameters(config, writer)
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab(writer, trained.stops)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.name.upper()], config.num_hidden_layers)
        for name, tensor in model.state_dict().items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # llama.cpp reads the embedding as the output head when there is none
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise UserError(f"the GGUF writer has no name for {name} in a {config.model_type} model")
            weights = architecture.transform(name, tensor.detach().float().numpy(), config)
            writer.add_tensor(gguf_name, *_quantized(weights, quant))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _quantized(weights: np.ndarray, quant: str) -> tuple[np.ndarray, tuple, object]:
    """``(data, raw_shape, raw_dtype)`` for ``GGUFWriter.add_tensor``: rows llama.cpp cannot block by 32 in f16."""
    import gguf

    qtype = gguf.GGMLQuantizationType
    if weights.ndim == 1 or quant == "f32":
        return weights.astype(np.float32), None, None
    if quant == "q8_0" and weights.shape[-1] % gguf.GGML_QUANT_SIZES[qtype.Q8_0][0]:
        quant = "f16"
    if quant == "f16":
        return weights.astype(np.float16), None, None
    kind = qtype.BF16 if quant == "bf16" else qtype.Q8_0
    return gguf.quants.quantize(weights, kind), None, kind


# -- the tokenizer

PRE_TOKENIZERS = {
    # tokenizer.json's pre-tokenizer (as json.dumps writes it, sorted) -> llama.cpp's name for the same split
    '{"add_prefix_space": false, "trim_offsets": true, "type": "ByteLevel", "use_regex": true}': "gpt-2",
    '{"pretokenizers": [{"individual_digits": true, "type": "Digits"}, {"add_prefix_space": false, "trim_offsets": '
    'true, "type": "ByteLevel", "use_regex": true}], "type": "Sequence"}': "smollm",
}
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")


def _pre_tokenizer_name(pre_tokenizer: dict) -> str | None:
    key = json.dumps(pre_tokenizer, sort_keys=True)
    if key in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[key]
    parts = pre_tokenizer.get("pretokenizers", [])
    if [part.get("type") for part in parts] == ["Split", "ByteLevel"] and \
            parts[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT:
        return "qwen2"
    return None


def _adds_space_prefix(spec: dict) -> bool:
    """Whether a sentencepiece-style tokenizer (``spec``, its ``tokenizer.json``) puts ``▁`` before its text: a
    ``Prepend`` normalizer (Llama 2's) or a ``Metaspace`` pre-tokenizer that prepends (Llama's as transformers
    builds it now); not Gemma's, which only replaces spaces. llama.cpp's ``llama`` vocabulary prefixes unless the
    file says not to."""
    normalizer, pre_tokenizer = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    steps = [*normalizer.get("normalizers", [normalizer]), *pre_tokenizer.get("pretokenizers", [pre_tokenizer])]
    return any((step.get("type") == "Prepend" and step.get("prepend") == "▁")
               or (step.get("type") == "Metaspace" and step.get(
                   "prepend_scheme", "always" if step.get("add_prefix_space", True) else "never") != "never")
               for step in steps)


def vocabulary(tokenizer, config, folder: Path) -> Callable[[object, list[int]], None]:
    """What writes ``tokenizer`` (saved in ``folder``) into a GGUF writer, given the stops a reply ends at:
    byte-level BPE as llama.cpp's ``gpt2`` model (tokens, merges, the pre-tokenizer's name), a sentencepiece-style
    BPE (``▁`` for spaces, byte fallback) as its ``llama`` model (tokens with scores, and whether the text takes a
    ``▁`` before it: ``_adds_space_prefix``); the special tokens, the end
    of turn and the chat template. Cheap: the command calls it to refuse a tokenizer before the weights load.

    Raises:
        UserError: a tokenizer of another kind, or a byte-level one whose split llama.cpp has no name for.
    """
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    byte_level = model["type"] == "BPE" and (spec.get("pre_tokenizer") or {}).get("type") != "Metaspace" and \
        not model.get("byte_fallback")
    if model["type"] != "BPE":
        raise UserError(f"the GGUF writer writes BPE tokenizers; this one is {model['type']}")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer") or {}) if byte_level else "default"
    if pre is None:
        raise UserError("the tokenizer splits text in a way the GGUF writer has no llama.cpp name for (it knows "
                        "GPT-2's, SmolLM's and Qwen2's byte-level splits); export --to merged")

    ids = {token: index for token, index in tokenizer.get_vocab().items() if index < config.vocab_size}
    tokens = [f"[PAD{index}]" for index in range(config.vocab_size)]
    types = [gguf.TokenType.UNUSED] * config.vocab_size
    for token, index in ids.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
        if not byte_level and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types[index] = gguf.TokenType.BYTE
    for index, added in tokenizer.added_tokens_decoder.items():
        if index < config.vocab_size:
            types[index] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model.get("merges", [])]
    scores = None
    if not byte_level:
        # llama.cpp's sentencepiece tokenizer joins the pair whose result scores highest: the merge order.
        rank = {}
        for order, merge in enumerate(merges):
            rank.setdefault(merge.replace(" ", ""), order + 1)
        scores = [-float(rank.get(token, 0)) for token in tokens]

    def write(writer, stops: list[int]) -> None:
        writer.add_tokenizer_model("gpt2" if byte_level else "llama")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if scores is not None:
            writer.add_token_scores(scores)
            writer.add_add_space_prefix(_adds_space_prefix(spec))
        special = gguf.SpecialVocab(folder, load_merges=byte_level, n_vocab=config.vocab_size)
        special.chat_template = tokenizer.chat_template
        special.add_to_gguf(writer, quiet=True)
        end_of_turn = [stop for stop in stops if stop != tokenizer.eos_token_id]
        if end_of_turn:
            writer.add_eot_token_id(end_of_turn[0])

    return write
