"""The offline lab: a procedurally generated world, a tokenizer trained on it and tiny Qwen3 models.

`statelens lab build` writes everything under `lab_dir(seed)`; models and tokenizers there load with
`from_pretrained` exactly as hub models do.
"""

from .build import (
    build_lab,
    build_teacher,
    evaluate_base,
    lab_dir,
    lab_home,
    lab_info,
    pretrain,
    score_math,
    score_multiple_choice,
)
from .model import MODEL_SIZES, build_model, build_qwen3
from .tokenizer import CHAT_TEMPLATE, build_tokenizer
from .world import LabWorld, check_math_answer, format_plain

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_SIZES",
    "LabWorld",
    "build_lab",
    "build_model",
    "build_qwen3",
    "build_teacher",
    "build_tokenizer",
    "check_math_answer",
    "evaluate_base",
    "format_plain",
    "lab_dir",
    "lab_home",
    "lab_info",
    "pretrain",
    "score_math",
    "score_multiple_choice",
]
