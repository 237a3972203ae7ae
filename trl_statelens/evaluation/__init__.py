"""Evaluation of any ``from_pretrained`` causal LM on GSM8K (the target task) and TruthfulQA and MMLU (retention),
plus Forgetting and Retention as the study defines them.

One module per task (:mod:`.gsm8k`, :mod:`.truthfulqa`, :mod:`.mmlu`), each with its prompt, shots and scoring and a
table of its settings per protocol; :mod:`.scoring` holds the log-likelihood, generation and subset code they share;
:mod:`.protocols` describes the two protocols, ``"statelens"`` (the package's own, the default) and ``"lm-eval"``
(lm-evaluation-harness 0.4.x, checked item by item against it); :mod:`.runner` runs tasks and writes results;
:mod:`.callback` evaluates during training; :mod:`.cli` is ``statelens eval``.

Each task loads its rows (hub id, local file or folder, or ``"lab"``), runs the model batched and returns
``{"metrics": {...}, "records": [...]}``: the scores and one record per item, so every number can be traced back to
what the model did.

- :class:`GSM8KTask`: greedy generation from ``Question: ...\\nAnswer:`` prompts, stopped at the next ``Question:``
  or eos; accuracy under ``strict`` (number after ``####``) and ``flexible`` (last number) extraction.
- :class:`TruthfulQATask`: MC1 (best answer vs incorrect answers, argmax) and MC2 (probability mass on the true
  answers) from the summed log-likelihood of each answer, and ``_norm`` variants per character of the answer.
- :class:`MMLUTask`: ``letter`` scoring (log-likelihood of `` A``..`` D`` after the question with its lettered
  choices, the usual MMLU protocol) or ``continuation`` scoring (log-likelihood of each choice's text);
  per-subject and micro-averaged accuracy.

With ``source="lab"`` the tasks use the offline lab world: ``math`` for GSM8K, ``truth`` for TruthfulQA and ``kb``
for MMLU. Lab MMLU defaults to ``continuation`` scoring: the lab base model was pretrained on questions followed by
the answer text and never learned to answer with a letter, so letter scoring would only measure that.

Forgetting and Retention (:func:`retention_summary`): over the retention tasks scored for both models,
``forgetting = mean(base - post)`` and ``retention = mean(post / base)``.
"""

from .callback import RetentionEvalCallback
from .cli import add_eval_arguments, parse_limit, run_eval_cli
from .gsm8k import GSM8K_PROTOCOLS, LM_EVAL_FEWSHOT_SEED, GSM8KTask, per_question_shots
from .mmlu import LETTERS, MMLU_HUB_ID, MMLU_PROTOCOLS, MMLU_SCORING, MMLUTask, read_mmlu_rows
from .protocols import PROTOCOLS, SUBSET_RULES, check_protocol
from .runner import (
    RETENTION_TASKS,
    STUDY_LIMITS,
    TASK_NAMES,
    TASKS,
    build_tasks,
    evaluate_model,
    item_scores,
    load_model_and_tokenizer,
    make_task,
    paired_interval,
    retention_summary,
    run_tasks,
    scalar_metrics,
    task_source,
    write_results,
)
from .scoring import (
    argmax,
    choice_logprobs,
    context_window,
    continuation_logprobs,
    encode_pair,
    greedy_generate,
    mean,
    model_device,
    pad_token_id,
    question_subset,
    true_mass,
)
from .truthfulqa import (
    QA_PRIMER,
    TRUTHFULQA_HUB_ID,
    TRUTHFULQA_PROTOCOLS,
    TruthfulQATask,
    read_truthfulqa_rows,
    truthfulqa_rows_from_csv,
)

__all__ = [
    "GSM8K_PROTOCOLS",
    "LETTERS",
    "LM_EVAL_FEWSHOT_SEED",
    "MMLU_HUB_ID",
    "MMLU_PROTOCOLS",
    "MMLU_SCORING",
    "PROTOCOLS",
    "QA_PRIMER",
    "RETENTION_TASKS",
    "STUDY_LIMITS",
    "SUBSET_RULES",
    "TASKS",
    "TASK_NAMES",
    "TRUTHFULQA_HUB_ID",
    "TRUTHFULQA_PROTOCOLS",
    "GSM8KTask",
    "MMLUTask",
    "RetentionEvalCallback",
    "TruthfulQATask",
    "add_eval_arguments",
    "argmax",
    "build_tasks",
    "check_protocol",
    "choice_logprobs",
    "context_window",
    "continuation_logprobs",
    "encode_pair",
    "evaluate_model",
    "greedy_generate",
    "item_scores",
    "load_model_and_tokenizer",
    "make_task",
    "mean",
    "model_device",
    "pad_token_id",
    "paired_interval",
    "parse_limit",
    "per_question_shots",
    "question_subset",
    "read_mmlu_rows",
    "read_truthfulqa_rows",
    "retention_summary",
    "run_eval_cli",
    "run_tasks",
    "scalar_metrics",
    "task_source",
    "true_mass",
    "truthfulqa_rows_from_csv",
    "write_results",
]
