"""trl-statelens: see and control which states LLM post-training supervises.

The public names below are imported on first use (PEP 562 module ``__getattr__``): ``from trl_statelens import
StateLensSFTTrainer`` works as usual, while ``statelens --help`` and ``statelens lab info`` never import torch.
"""

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "answers_match": "answers",
    "extract_answer": "answers",
    "normalize_number": "answers",
    "StateLoggingCallback": "callback",
    "load_gsm8k": "data",
    "GSM8KTask": "evaluation",
    "MMLUTask": "evaluation",
    "RetentionEvalCallback": "evaluation",
    "ForgettingForecast": "forecast",
    "TruthfulQATask": "evaluation",
    "evaluate_model": "evaluation",
    "retention_summary": "evaluation",
    "StateLensGRPOTrainer": "grpo_trainer",
    "OnPolicyDistillConfig": "opd_config",
    "OnPolicyDistillTrainer": "opd_trainer",
    "STATE_SOURCES": "records",
    "StateRecorderMixin": "records",
    "StateRecords": "records",
    "aggregate_states": "records",
    "gsm8k_accuracy_reward": "rewards",
    "gsm8k_format_reward": "rewards",
    "StateLensSFTTrainer": "sft_trainer",
}
__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
