"""The offline lab: a procedurally generated world, a tokenizer trained on it and tiny Qwen3 models.

`statelens lab build` writes everything under `lab_dir(seed)`; models and tokenizers there load with
`from_pretrained` exactly as hub models do. The names below are imported on first use, so reading what is cached
(`lab_dir`, `lab_info`) does not import torch.
"""

from .._lazy import lazy_exports

# public name -> submodule that defines it
_EXPORTS = {
    "build_lab": "build",
    "build_teacher": "build",
    "evaluate_base": "build",
    "fine_tune_on_answers": "build",
    "pretrain": "build",
    "score_math": "build",
    "score_multiple_choice": "build",
    "lab_dir": "paths",
    "lab_home": "paths",
    "lab_info": "paths",
    "MODEL_SIZES": "model",
    "build_model": "model",
    "build_qwen3": "model",
    "CHAT_TEMPLATE": "tokenizer",
    "build_tokenizer": "tokenizer",
    "LabWorld": "world",
    "check_math_answer": "world",
    "format_plain": "world",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
