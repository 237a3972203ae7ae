"""trl-statelens: see and control which states LLM post-training supervises."""

__version__ = "0.1.0"

from .answers import answers_match, extract_answer, normalize_number
from .callback import StateLoggingCallback
from .data import load_gsm8k
from .evaluation import (
    GSM8KTask,
    MMLUTask,
    RetentionEvalCallback,
    TruthfulQATask,
    evaluate_model,
    retention_summary,
)
from .grpo_trainer import StateLensGRPOTrainer
from .opd_config import OnPolicyDistillConfig
from .opd_trainer import OnPolicyDistillTrainer
from .records import STATE_SOURCES, StateRecorderMixin, StateRecords, aggregate_states
from .rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from .sft_trainer import StateLensSFTTrainer
