"""Evaluation protocols: which prompts, shots, stop strings, answer filters and subsets the tasks use.

A protocol is data: each task module keeps a table ``{protocol: settings}`` (``GSM8K_PROTOCOLS``,
``TRUTHFULQA_PROTOCOLS``, ``MMLU_PROTOCOLS``) and a task reads its defaults from it; explicit arguments override them
and every setting in effect is recorded in the results.

- ``"lm-eval"`` reproduces lm-evaluation-harness 0.4.x (checked item by item against 0.4.13 in
  ``tests/test_lm_eval_parity.py``): ``gsm8k`` 5-shot, shots drawn for each question in turn from one
  ``random.Random(1234)``, stop at ``Question:``, ``</s>``, ``<|im_end|>`` and eos, the ``strict-match`` and
  ``flexible-extract`` regex filters and ``exact_match`` with lm-eval's ignore rules; ``truthfulqa_mc1`` /
  ``truthfulqa_mc2`` 0-shot after lm-eval's 6-question ``Q:``/``A:`` primer; ``mmlu`` with its header, lettered
  choices, ``first_n`` dev shots of the same subject, 0 shots by default; ``limit`` takes the first rows (of
  each subject for MMLU), as lm-eval's ``--limit``.
- ``"statelens"`` (the default) is the package's own: plain ``Question: ...\\nAnswer:`` prompts for every task
  (the study's plain GSM8K format, and the lab's), 0 shots, one fixed seeded set of shots for every
  question when shots are asked for, GSM8K answers compared as numbers (``#### 18.00``, ``####18`` and
  ``#### $18`` count as 18, where lm-eval's strict filter rejects them), MMLU shots padded from other subjects, and
  subsets keyed on the question text (the same questions from the hub and from a local copy in another order).

Log-likelihoods and generation are computed the same way under both (see :mod:`.scoring`).
"""

from __future__ import annotations

PROTOCOLS = ("statelens", "lm-eval")
# How `limit` picks rows: a seeded hash of the question text, or the first rows as lm-eval's --limit does.
SUBSET_RULES = {"statelens": "question-hash", "lm-eval": "first"}


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown evaluation protocol {protocol!r}: use one of {PROTOCOLS}")
    return protocol
