"""Fine-tune Hugging Face transformers on one process or many, under Accelerate or raw torch DDP."""

from finetune.checkpoint import load_state_dict_unwrapped, save_model
from finetune.config import ClassifyConfig, parse_config
from finetune.data import GlobalBatchSampler, load_classification_data
from finetune.errors import UserError, run_main
from finetune.runtime import Runtime, make_runtime

__version__ = "0.1.0"

__all__ = [
    "ClassifyConfig",
    "GlobalBatchSampler",
    "Runtime",
    "UserError",
    "load_classification_data",
    "load_state_dict_unwrapped",
    "make_runtime",
    "parse_config",
    "run_main",
    "save_model",
]
