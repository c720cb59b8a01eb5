"""The memory the chat model's weights take as the chat recipes load them: float32, ``--dtype bfloat16`` (the frozen
base under LoRA), and ``--load_in_4bit`` (QLoRA: the linear layers in 4-bit NF4 with double quantization), with the
rest in float32 or bfloat16.

    python bench/qlora_memory.py        # under a minute; writes bench/results/qlora-memory.json

SmolLM2-135M-Instruct, each way loaded in a process of its own by ``finetune.tasks.causal_lm``'s loading options:
the bytes of every weight and buffer the loaded model holds (each storage once, the 4-bit blocks' scales counted),
and those of its linear layers alone. (Resident memory would blur them: float32 weights stay mapped from the file,
and quantizing leaves freed blocks with the C allocator.) The output head shares the input embedding's weights, which
are a fifth of this model's (a smaller share in larger models), and stay unquantized.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from finetune.models.loading import default_chat_model_path, load_model
from finetune.tasks.causal_lm import ChatModelArguments

REPO = Path(__file__).resolve().parent.parent
WAYS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "nf4_rest_float32": {"load_in_4bit": True},
        "nf4_rest_bfloat16": {"load_in_4bit": True, "dtype": "bfloat16"}}


def loaded(way: str) -> dict:
    """The MiB of the model's weights loaded ``way``, in a process of its own."""
    path = default_chat_model_path()
    options = ChatModelArguments(**WAYS[way]).loading_options(SimpleNamespace(fsdp=False, mixed_precision="no"))
    model = load_model(transformers.AutoModelForCausalLM, path, **options)
    storages: dict[int, int] = {}
    linear: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings():
            weight = module.weight
            linear[weight.untyped_storage().data_ptr()] = weight.untyped_storage().nbytes()
            state = getattr(weight, "quant_state", None)  # the 4-bit blocks' scales, themselves quantized
            if state is not None:
                nested = (state.state2.absmax, state.state2.code) if state.nested else ()
                for part in (state.absmax, state.code, *nested):
                    linear[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
                    storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "embedding_parameters_m": round(model.get_input_embeddings().weight.numel() / 1e6, 1),
            "weights_mib": round(sum(storages.values()) / 2**20, 1),
            "linear_layers_mib": round(sum(linear.values()) / 2**20, 1)}


def main(results_file: Path) -> None:
    measured = {}
    for way in WAYS:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            measured[way] = pool.submit(loaded, way).result()
        if way != "float32":  # counts of a 4-bit model's packed bytes, not of its weights
            del measured[way]["parameters_m"], measured[way]["embedding_parameters_m"]
    full = measured["float32"]
    results = {"model": "SmolLM2-135M-Instruct", "parameters_m": full.pop("parameters_m"),
               "embedding_parameters_m": full.pop("embedding_parameters_m"), "measured": measured,
               "weights_vs_float32": {way: round(m["weights_mib"] / full["weights_mib"], 3)
                                      for way, m in measured.items()},
               "linear_layers_vs_float32": {way: round(m["linear_layers_mib"] / full["linear_layers_mib"], 3)
                                            for way, m in measured.items()}}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "qlora-memory.json")
    main(parser.parse_args().results_file)
