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
    "StateLoggingCallback": "lens.callback",
    "load_gsm8k": "data",
    "GSM8KTask": "evaluation",
    "MMLUTask": "evaluation",
    "RetentionEvalCallback": "evaluation",
    "ForgettingForecast": "lens.forecast",
    "RunGuards": "guards",
    "replay_guards": "guards_replay",
    "TruthfulQATask": "evaluation",
    "evaluate_model": "evaluation",
    "retention_summary": "evaluation",
    "StateLensGRPOTrainer": "trainers.grpo",
    "OnPolicyDistillConfig": "opd.config",
    "OnPolicyDistillTrainer": "opd.trainer",
    "STATE_SOURCES": "lens.records",
    "StateRecorderMixin": "lens.recorder",
    "StateRecords": "lens.records",
    "aggregate_states": "lens.records",
    "gsm8k_accuracy_reward": "evaluation.rewards",
    "gsm8k_format_reward": "evaluation.rewards",
    "StateLensSFTTrainer": "trainers.sft",
}
__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
