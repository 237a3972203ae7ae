"""Evaluation of any ``from_pretrained`` causal LM on GSM8K (the target task) and TruthfulQA and MMLU (retention),
plus Forgetting and Retention as the study defines them.

Each task is a small class in the nanochat style: it loads its rows (hub id, local file or folder, or ``"lab"``),
runs the model batched with a progress bar and returns ``{"metrics": {...}, "records": [...]}``: the scores and one
record per item, so every number can be traced back to what the model did.

- :class:`GSM8KTask`: greedy generation from the plain ``Question: ...\\nAnswer:`` prompt, stopped at the next
  ``Question:`` or eos; accuracy under ``strict`` (number after ``####``) and ``flexible`` (last number) extraction.
- :class:`TruthfulQATask`: MC1 (best answer vs incorrect answers, argmax) and MC2 (probability mass on the true
  answers among all answers) from the summed log-likelihood of each answer after ``Question: {q}\\nAnswer:``; the
  ``_norm`` variants divide each log-likelihood by the answer's length in characters, since summed
  log-likelihood favours short answers.
- :class:`MMLUTask`: ``letter`` scoring (log-likelihood of `` A``..`` D`` after the question with its lettered
  choices, the usual MMLU protocol) or ``continuation`` scoring (log-likelihood of each choice's text);
  per-subject and micro-averaged accuracy.

With ``source="lab"`` the tasks use the offline lab world: ``math`` for GSM8K, ``truth`` for TruthfulQA and ``kb``
for MMLU. Lab MMLU defaults to ``continuation`` scoring: the lab base model was pretrained on questions followed by
the answer text and never learned to answer with a letter, so letter scoring would only measure that.

Forgetting and Retention (:func:`retention_summary`): over the retention tasks scored for both models,
``forgetting = mean(base - post)`` and ``retention = mean(post / base)``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.utils import logging

from .answers import EXTRACTION_MODES, answers_match, extract_answer
from .data import (
    GSM8K_HUB_ID,
    PROMPT_FORMATS,
    gsm8k_examples,
    read_source_rows,
    require_columns,
    seeded_subset,
)
from .rewards import STOP_STRINGS, cut_at_stop

logger = logging.get_logger(__name__)

TRUTHFULQA_HUB_ID = "truthfulqa/truthful_qa"
MMLU_HUB_ID = "cais/mmlu"
TASK_NAMES = ("gsm8k", "truthfulqa", "mmlu")
RETENTION_TASKS = ("truthfulqa", "mmlu")
# Subset sizes that fit the study's reported numbers (it does not state them).
STUDY_LIMITS = {"gsm8k": 500, "mmlu": 500, "truthfulqa": 200}
LETTERS = "ABCDEFGHIJ"


# ----- helpers shared by the tasks ------------------------------------------------------------------------------
def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def pad_token_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token: set tokenizer.pad_token")
    return pad


def model_max_length(model) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """Token ids of ``context + continuation`` and how many of the last ones are the continuation.

    Encoding the joined text keeps the tokenization the model would see; when the context's tokens are not a prefix
    of it (a merge across the boundary), the two parts are encoded separately and concatenated instead.
    """
    context_ids = list(tokenizer(context)["input_ids"])
    full_ids = list(tokenizer(context + continuation)["input_ids"])
    if context_ids and full_ids[: len(context_ids)] == context_ids and len(full_ids) > len(context_ids):
        return full_ids, len(full_ids) - len(context_ids)
    continuation_ids = list(tokenizer(continuation, add_special_tokens=False)["input_ids"])
    if not context_ids:  # something must come before the first scored token
        start = getattr(tokenizer, "bos_token_id", None)
        context_ids = [start if start is not None else tokenizer.eos_token_id]
    return context_ids + continuation_ids, len(continuation_ids)


@torch.no_grad()
def continuation_logprobs(
    model,
    tokenizer,
    requests: list[tuple[str, str]],
    batch_size: int = 16,
    desc: str = "log-likelihood",
    progress: bool = True,
) -> list[tuple[float, int]]:
    """Summed log-probability and token count of each ``continuation`` given its ``context``.

    Several sequences share a forward pass (right-padded, longest first so batches pad little); log-softmax is taken
    in fp32 and only at the scored positions, so a large vocabulary costs no full ``batch x length x vocab`` copy.
    """
    encoded = [encode_pair(tokenizer, context, continuation) for context, continuation in requests]
    limit = model_max_length(model)
    if limit is not None:  # drop the oldest context tokens of sequences longer than the model's window
        encoded = [(ids[-limit:], min(n, limit - 1)) for ids, n in encoded]
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    pad, device = pad_token_id(tokenizer), model_device(model)
    results: list[tuple[float, int]] = [(0.0, 0)] * len(encoded)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress, leave=False):
        batch = order[start : start + batch_size]
        lengths = torch.tensor([len(encoded[i][0]) for i in batch])
        num_scored = torch.tensor([encoded[i][1] for i in batch])
        width = int(lengths.max())
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        for row, i in enumerate(batch):
            input_ids[row, : lengths[row]] = torch.tensor(encoded[i][0])
        positions = torch.arange(width)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        # The logit at position t predicts token t + 1; the continuation is tokens [length - n, length).
        predicts = positions[None, :-1]
        scored = (predicts >= (lengths - num_scored - 1)[:, None]) & (predicts < (lengths - 1)[:, None])
        scored = scored.to(logits.device)
        targets = input_ids[:, 1:].to(logits.device)[scored]
        token_logps = logits[:, :-1][scored].float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        rows = scored.nonzero()[:, 0]
        sums = torch.zeros(len(batch), dtype=torch.float32, device=logits.device).index_add_(0, rows, token_logps)
        for row, i in enumerate(batch):
            results[i] = (float(sums[row]), int(num_scored[row]))
    return results


def choice_logprobs(
    model,
    tokenizer,
    items: list[tuple[str, list[str]]],
    batch_size: int = 16,
    desc: str = "log-likelihood",
    progress: bool = True,
) -> list[list[tuple[float, int]]]:
    """For each ``(context, continuations)`` item, ``(summed log-prob, tokens)`` of every continuation."""
    requests = [(context, continuation) for context, continuations in items for continuation in continuations]
    flat = continuation_logprobs(model, tokenizer, requests, batch_size, desc, progress)
    out, at = [], 0
    for _, continuations in items:
        out.append(flat[at : at + len(continuations)])
        at += len(continuations)
    return out


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# ----- GSM8K ------------------------------------------------------------------------------------------------------
class GSM8KTask:
    """GSM8K accuracy by greedy generation.

    Args:
        source: ``"openai/gsm8k"``, a local file or folder, or ``"lab"``.
        split: evaluation split (``"test"``; the lab also has ``"dev"``).
        num_shots: solved train problems before each question (0 is the study's setting for its base model).
        prompt_format: ``"plain"`` or ``"chat"`` (the tokenizer's chat template, for instruct models).
        max_new_tokens: generation budget; an answer not finished by then scores 0.
        limit / seed: evaluate a random subset of ``limit`` rows drawn with ``seed``.
        batch_size: prompts per ``generate`` call.
        stop_strings: generation stops at these (a base model goes on to invent the next question); ``None`` to
            generate until eos or ``max_new_tokens``.
    """

    name = "gsm8k"
    primary_metric = "accuracy_strict"

    def __init__(
        self,
        source: str = GSM8K_HUB_ID,
        split: str | None = None,
        *,
        num_shots: int = 0,
        prompt_format: str = "plain",
        max_new_tokens: int = 256,
        limit: int | None = None,
        seed: int = 0,
        batch_size: int = 16,
        stop_strings: tuple[str, ...] | None = STOP_STRINGS,
        lab_seed: int = 0,
    ):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"unknown prompt_format {prompt_format!r}: use one of {PROMPT_FORMATS}")
        self.source, self.split = str(source), split or "test"
        self.num_shots, self.prompt_format, self.max_new_tokens = num_shots, prompt_format, max_new_tokens
        self.limit, self.seed, self.batch_size, self.lab_seed = limit, seed, batch_size, lab_seed
        self.stop_strings = tuple(stop_strings) if stop_strings else ()
        self._examples = None

    def settings(self) -> dict:
        return {
            "source": self.source,
            "split": self.split,
            "num_shots": self.num_shots,
            "prompt_format": self.prompt_format,
            "max_new_tokens": self.max_new_tokens,
            "limit": self.limit,
            "seed": self.seed,
            "stop_strings": list(self.stop_strings),
        }

    def examples(self) -> list[dict]:
        if self._examples is None:
            self._examples = gsm8k_examples(
                self.source,
                self.split,
                prompt_format=self.prompt_format,
                num_shots=self.num_shots,
                limit=self.limit,
                seed=self.seed,
                lab_seed=self.lab_seed,
            )
        return self._examples

    def prompt_texts(self, tokenizer) -> list[str]:
        if self.prompt_format == "plain":
            return [e["prompt"] for e in self.examples()]
        return [
            tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=False)
            for e in self.examples()
        ]

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[str], progress: bool = True) -> list[str]:
        """Greedy completions of ``prompts``, cut at the first stop string."""
        if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token  # batched generation needs a pad token; eos is the usual one
        stop = {"stop_strings": list(self.stop_strings), "tokenizer": tokenizer} if self.stop_strings else {}
        device, outputs = model_device(model), []
        for start in tqdm(range(0, len(prompts), self.batch_size), desc="gsm8k: generating", disable=not progress):
            batch = prompts[start : start + self.batch_size]
            encoded = tokenizer(
                batch,
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=self.prompt_format == "plain",
            ).to(device)
            generated = model.generate(
                **encoded,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id(tokenizer),
                **stop,
            )
            texts = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            outputs += [cut_at_stop(t, self.stop_strings) for t in texts]
        return outputs

    def evaluate(self, model, tokenizer, progress: bool = True) -> dict:
        examples = self.examples()
        outputs = self.generate(model, tokenizer, self.prompt_texts(tokenizer), progress)
        records = []
        for example, output in zip(examples, outputs):
            record = {"question": example["question"], "ground_truth": example["ground_truth"], "output": output}
            for mode in EXTRACTION_MODES:
                record[mode] = extract_answer(output, mode)
                record[f"correct_{mode}"] = answers_match(record[mode], example["ground_truth"])
            records.append(record)
        metrics = {f"accuracy_{mode}": mean([r[f"correct_{mode}"] for r in records]) for mode in EXTRACTION_MODES}
        metrics["answer_found"] = mean([r["strict"] is not None for r in records])
        metrics["num_items"] = len(records)
        return {"metrics": metrics, "records": records}


# ----- TruthfulQA -------------------------------------------------------------------------------------------------
def _closed(answer: str) -> str:
    """An answer as a sentence ending in a period, as the hub's ``multiple_choice`` choices are written."""
    answer = answer.strip()
    return answer if answer.endswith((".", "?", "!")) else answer + "."


def truthfulqa_rows_from_csv(rows: list[dict]) -> list[dict]:
    """Original TruthfulQA CSV rows -> the hub's ``multiple_choice`` layout.

    MC1: the best answer (label 1) and the incorrect answers; MC2: all correct answers (label 1) and all
    incorrect answers. Answers in a cell are separated by ``"; "``.
    """
    out = []
    for row in rows:
        correct = [_closed(a) for a in row["Correct Answers"].split(";") if a.strip()]
        incorrect = [_closed(a) for a in row["Incorrect Answers"].split(";") if a.strip()]
        best = _closed(row["Best Answer"])
        if best not in correct:
            correct.insert(0, best)
        out.append(
            {
                "question": row["Question"].strip(),
                "mc1_targets": {"choices": [best] + incorrect, "labels": [1] + [0] * len(incorrect)},
                "mc2_targets": {"choices": correct + incorrect, "labels": [1] * len(correct) + [0] * len(incorrect)},
            }
        )
    return out


def read_truthfulqa_rows(source: str, split: str, lab_seed: int = 0) -> list[dict]:
    from .lab import LabWorld

    hub_config = "multiple_choice"
    rows = read_source_rows(source, split, hub_config, lab_rows=lambda s: LabWorld(seed=lab_seed).truth(s))
    if rows and "Best Answer" in rows[0]:
        require_columns(rows, ("Question", "Best Answer", "Correct Answers", "Incorrect Answers"), "TruthfulQA CSV")
        return truthfulqa_rows_from_csv(rows)
    require_columns(rows, ("question", "mc1_targets", "mc2_targets"), f"TruthfulQA source {source!r}")
    return rows


class TruthfulQATask:
    """TruthfulQA multiple choice: MC1 and MC2 by log-likelihood, and their length-normalised variants.

    Args:
        source: ``"truthfulqa/truthful_qa"`` (config ``multiple_choice``), the original ``TruthfulQA.csv`` or a
            folder holding it, a file in the ``multiple_choice`` layout, or ``"lab"``.
        split: default ``"validation"`` (the hub's only split), ``"test"`` for the lab.
        limit / seed: a random subset of ``limit`` questions drawn with ``seed``.
    """

    name = "truthfulqa"
    primary_metric = "mc1"  # the study's 0.300 for Qwen3-0.6B-Base fits MC1; MC2 is reported beside it

    def __init__(
        self,
        source: str = TRUTHFULQA_HUB_ID,
        split: str | None = None,
        *,
        limit: int | None = None,
        seed: int = 0,
        batch_size: int = 16,
        lab_seed: int = 0,
    ):
        self.source = str(source)
        self.split = split or ("test" if self.source == "lab" else "validation")
        self.limit, self.seed, self.batch_size, self.lab_seed = limit, seed, batch_size, lab_seed
        self._rows = None

    def settings(self) -> dict:
        return {
            "source": self.source,
            "split": self.split,
            "limit": self.limit,
            "seed": self.seed,
            "prompt": "Question: {question}\\nAnswer: {choice}",
        }

    def rows(self) -> list[dict]:
        if self._rows is None:
            self._rows = seeded_subset(
                read_truthfulqa_rows(self.source, self.split, self.lab_seed), self.limit, self.seed
            )
        return self._rows

    def evaluate(self, model, tokenizer, progress: bool = True) -> dict:
        rows = self.rows()
        # Score each distinct answer of a question once: MC1's answers are mostly among MC2's.
        choices = [list(dict.fromkeys(r["mc1_targets"]["choices"] + r["mc2_targets"]["choices"])) for r in rows]
        items = [(f"Question: {r['question']}\nAnswer:", [" " + c for c in cs]) for r, cs in zip(rows, choices)]
        scores = choice_logprobs(model, tokenizer, items, self.batch_size, "truthfulqa: scoring", progress)
        records = []
        for row, row_choices, row_scores in zip(rows, choices, scores):
            logprob = {c: s for c, (s, _) in zip(row_choices, row_scores)}
            per_char = {c: logprob[c] / len(" " + c) for c in row_choices}
            record = {"question": row["question"]}
            for name, values in (("", logprob), ("_norm", per_char)):
                mc1_values = [values[c] for c in row["mc1_targets"]["choices"]]
                mc1_gold = row["mc1_targets"]["labels"].index(1)
                record[f"mc1{name}"] = float(argmax(mc1_values) == mc1_gold)
                mc2 = torch.tensor([values[c] for c in row["mc2_targets"]["choices"]], dtype=torch.float64)
                true = torch.tensor(row["mc2_targets"]["labels"]) == 1
                record[f"mc2{name}"] = float(mc2.softmax(0)[true].sum())
            record["choices"] = row_choices
            record["logprobs"] = [logprob[c] for c in row_choices]
            records.append(record)
        metrics = {key: mean([r[key] for r in records]) for key in ("mc1", "mc2", "mc1_norm", "mc2_norm")}
        metrics["num_items"] = len(records)
        return {"metrics": metrics, "records": records}


# ----- MMLU -------------------------------------------------------------------------------------------------------
MMLU_SCORING = ("letter", "continuation")


def _answer_index(answer) -> int:
    if isinstance(answer, str) and answer.strip().upper() in LETTERS:
        return LETTERS.index(answer.strip().upper())
    return int(answer)


def read_mmlu_rows(source: str, split: str, lab_seed: int = 0) -> list[dict]:
    from .lab import LabWorld

    rows = read_source_rows(source, split, "all", lab_rows=lambda s: LabWorld(seed=lab_seed).kb(s))
    require_columns(rows, ("question", "choices", "answer"), f"MMLU source {source!r} split {split!r}")
    return [
        {
            "question": r["question"],
            "subject": r.get("subject") or "all",
            "choices": list(r["choices"]),
            "answer": _answer_index(r["answer"]),
        }
        for r in rows
    ]


class MMLUTask:
    """MMLU accuracy by log-likelihood, per subject and micro-averaged over all items.

    Args:
        source: ``"cais/mmlu"`` (config ``all``), a local file or a folder with ``test.jsonl`` (and ``dev.jsonl``
            for shots) in the ``cais/mmlu`` columns ``question, subject, choices, answer``, or ``"lab"``.
        split: ``"test"``.
        num_shots: exemplars from the ``dev`` split, of the same subject where it has enough.
        scoring: ``"letter"`` (log-likelihood of the answer letter after the lettered choices) or
            ``"continuation"`` (log-likelihood of each choice's text after ``Question: ...\\nAnswer:``). Default:
            ``letter``, and ``continuation`` for the lab (its base model never learned letter answers).
        subjects: only these subjects.
        limit / seed: a random subset of ``limit`` questions drawn with ``seed`` (after the subject filter).
    """

    name = "mmlu"
    primary_metric = "accuracy"

    def __init__(
        self,
        source: str = MMLU_HUB_ID,
        split: str | None = None,
        *,
        num_shots: int = 0,
        scoring: str | None = None,
        subjects: list[str] | None = None,
        limit: int | None = None,
        seed: int = 0,
        batch_size: int = 16,
        lab_seed: int = 0,
    ):
        self.source, self.split = str(source), split or "test"
        self.scoring = scoring or ("continuation" if self.source == "lab" else "letter")
        if self.scoring not in MMLU_SCORING:
            raise ValueError(f"unknown MMLU scoring {self.scoring!r}: use one of {MMLU_SCORING}")
        self.num_shots, self.subjects = num_shots, subjects
        self.limit, self.seed, self.batch_size, self.lab_seed = limit, seed, batch_size, lab_seed
        self._rows = None
        self._dev = None

    def settings(self) -> dict:
        return {
            "source": self.source,
            "split": self.split,
            "num_shots": self.num_shots,
            "scoring": self.scoring,
            "subjects": self.subjects,
            "limit": self.limit,
            "seed": self.seed,
        }

    def rows(self) -> list[dict]:
        if self._rows is None:
            rows = read_mmlu_rows(self.source, self.split, self.lab_seed)
            if self.subjects:
                rows = [r for r in rows if r["subject"] in set(self.subjects)]
                if not rows:
                    raise ValueError(f"no MMLU rows for subjects {self.subjects}: check the subject names")
            self._rows = seeded_subset(rows, self.limit, self.seed)
        return self._rows

    def shots(self, subject: str) -> list[dict]:
        if self.num_shots <= 0:
            return []
        if self._dev is None:
            self._dev = read_mmlu_rows(self.source, "dev", self.lab_seed)
        same = [r for r in self._dev if r["subject"] == subject]
        pool = same if len(same) >= self.num_shots else same + [r for r in self._dev if r["subject"] != subject]
        return pool[: self.num_shots]

    def letter_block(self, row: dict, with_answer: bool) -> str:
        lines = [row["question"].strip()] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(row["choices"])]
        answer = f"Answer: {LETTERS[row['answer']]}" if with_answer else "Answer:"
        return "\n".join(lines + [answer])

    def context(self, row: dict) -> str:
        shots = self.shots(row["subject"])
        if self.scoring == "letter":
            header = (
                f"The following are multiple choice questions (with answers) about {row['subject'].replace('_', ' ')}."
            )
            blocks = [self.letter_block(s, True) for s in shots] + [self.letter_block(row, False)]
            return header + "\n\n" + "\n\n".join(blocks)
        blocks = [f"Question: {s['question']}\nAnswer: {s['choices'][s['answer']]}" for s in shots]
        return "\n\n".join(blocks + [f"Question: {row['question']}\nAnswer:"])

    def continuations(self, row: dict) -> list[str]:
        if self.scoring == "letter":
            return [f" {LETTERS[i]}" for i in range(len(row["choices"]))]
        return [f" {c}" for c in row["choices"]]

    def evaluate(self, model, tokenizer, progress: bool = True) -> dict:
        rows = self.rows()
        items = [(self.context(r), self.continuations(r)) for r in rows]
        scores = choice_logprobs(model, tokenizer, items, self.batch_size, "mmlu: scoring", progress)
        records = []
        for row, (_, continuations), row_scores in zip(rows, items, scores):
            logprobs = [s for s, _ in row_scores]
            per_char = [s / len(c) for s, c in zip(logprobs, continuations)]
            records.append(
                {
                    "question": row["question"],
                    "subject": row["subject"],
                    "answer": row["answer"],
                    "logprobs": logprobs,
                    "prediction": argmax(logprobs),
                    "correct": float(argmax(logprobs) == row["answer"]),
                    "correct_norm": float(argmax(per_char) == row["answer"]),
                }
            )
        subjects = sorted({r["subject"] for r in records})
        per_subject = {s: mean([r["correct"] for r in records if r["subject"] == s]) for s in subjects}
        metrics = {
            "accuracy": mean([r["correct"] for r in records]),
            "accuracy_macro": mean(list(per_subject.values())),
            "num_items": len(records),
        }
        if self.scoring == "continuation":  # a letter has one length: normalising changes nothing
            metrics["accuracy_norm"] = mean([r["correct_norm"] for r in records])
        return {"metrics": metrics, "subjects": per_subject, "records": records}


# ----- running tasks ----------------------------------------------------------------------------------------------
TASKS = {"gsm8k": GSM8KTask, "truthfulqa": TruthfulQATask, "mmlu": MMLUTask}


def task_source(name: str, data_dir: str | Path | None) -> str | None:
    """Where a task's rows come from: ``None`` (its hub id), ``"lab"``, or ``data_dir/<name>``."""
    if data_dir is None:
        return None
    if str(data_dir) == "lab":
        return "lab"
    folder = Path(data_dir).expanduser() / name
    if not folder.exists():
        raise ValueError(
            f"--data-dir {str(data_dir)!r} has no {name}/ folder: put the {name} files in {folder} "
            "or leave --data-dir out to load from the hub"
        )
    return str(folder)


def make_task(name: str, *, data_dir: str | Path | None = None, **kwargs):
    """A task by name (``gsm8k``, ``truthfulqa``, ``mmlu``) reading from ``data_dir`` (see :func:`task_source`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {sorted(TASKS)}")
    source = task_source(name, data_dir)
    if source is not None:
        kwargs["source"] = source
    return TASKS[name](**kwargs)


def scalar_metrics(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "num_items"}


def run_tasks(model, tokenizer, tasks: list, progress: bool = True) -> dict[str, dict]:
    """Evaluate ``model`` on ``tasks`` without gradients and in eval mode, restoring its training mode after."""
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with torch.no_grad():
            return {task.name: task.evaluate(model, tokenizer, progress=progress) for task in tasks}
    finally:
        if was_training:
            model.train()


def load_model_and_tokenizer(path: str | Path, device: str | None = None):
    """A causal LM and its tokenizer from a local folder or hub id; fp32 on CPU, the checkpoint's dtype on GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _limit_for(limit, name: str) -> int | None:
    return limit.get(name) if isinstance(limit, dict) else limit


def evaluate_model(
    model_or_path,
    tasks=TASK_NAMES,
    *,
    tokenizer=None,
    data_dir: str | Path | None = None,
    limit: int | dict | None = None,
    seed: int = 0,
    batch_size: int = 16,
    task_kwargs: dict | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate one model on several tasks; optionally write ``out`` (results JSON) and ``<out>.items.jsonl``.

    Args:
        model_or_path: a loaded causal LM (then pass ``tokenizer``) or a path / hub id for ``from_pretrained``.
        tasks: task names or task instances.
        data_dir: ``None`` (hub ids), ``"lab"``, or a folder with ``gsm8k/``, ``truthfulqa/`` and ``mmlu/``.
        limit: rows per task (an int for all, or ``{"gsm8k": 500, ...}``, e.g. :data:`STUDY_LIMITS`).
        seed: seed of the row subsets.
        task_kwargs: extra arguments per task name, e.g. ``{"mmlu": {"num_shots": 5}}``.

    Returns:
        ``{"model", "scores": {task: primary metric}, "metrics": {task: {...}}, "settings": {task: {...}}, ...}``.
    """
    started = time.perf_counter()
    if isinstance(model_or_path, (str, Path)):
        model_name = str(model_or_path)
        model, loaded_tokenizer = load_model_and_tokenizer(model_or_path, device)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model, model_name = model_or_path, getattr(getattr(model_or_path, "config", None), "_name_or_path", "")
        if tokenizer is None:
            raise ValueError("evaluate_model got a model object without a tokenizer: pass tokenizer=...")
    task_kwargs = task_kwargs or {}
    unknown = [t for t in task_kwargs if t not in TASKS]
    if unknown:
        raise ValueError(f"task_kwargs names unknown tasks {unknown}: choose from {sorted(TASKS)}")
    common = {"seed": seed, "batch_size": batch_size}  # task_kwargs override these per task
    task_objects = [
        make_task(t, data_dir=data_dir, **{**common, "limit": _limit_for(limit, t), **task_kwargs.get(t, {})})
        if isinstance(t, str)
        else t
        for t in tasks
    ]
    outputs = run_tasks(model, tokenizer, task_objects, progress)
    results = {
        "model": model_name,
        "scores": {t.name: outputs[t.name]["metrics"][t.primary_metric] for t in task_objects},
        "primary_metrics": {t.name: t.primary_metric for t in task_objects},
        "metrics": {name: output["metrics"] for name, output in outputs.items()},
        "subjects": {name: output["subjects"] for name, output in outputs.items() if "subjects" in output},
        "settings": {t.name: t.settings() for t in task_objects},
        "seed": seed,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    records = {name: output["records"] for name, output in outputs.items()}
    if out is not None:
        write_results(results, records, out)
    results["records"] = records
    return results


def write_results(results: dict, records: dict[str, list[dict]], out: str | Path) -> Path:
    """``out``: the results JSON (without records); ``<out stem>.items.jsonl``: one line per evaluated item."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    items_path = out.with_name(out.stem + ".items.jsonl")
    results["items_file"] = items_path.name
    with items_path.open("w") as f:
        for name, task_records in records.items():
            for index, record in enumerate(task_records):
                f.write(json.dumps({"task": name, "index": index, **record}) + "\n")
    out.write_text(json.dumps({k: v for k, v in results.items() if k != "records"}, indent=2))
    return items_path


def _task_scores(results: dict) -> dict:
    """Accept a flat ``{task: score}`` mapping or a results dict of :func:`evaluate_model` (its ``scores``)."""
    return results["scores"] if isinstance(results.get("scores"), dict) else results


def retention_summary(base: dict, post: dict, tasks=RETENTION_TASKS) -> dict[str, float]:
    """Forgetting ``mean(base - post)`` and Retention ``mean(post / base)`` over the ``tasks`` scored in both.

    ``base`` and ``post`` are ``{task: score}`` mappings or results of :func:`evaluate_model`.
    """
    base, post = _task_scores(base), _task_scores(post)
    present = [t for t in tasks if base.get(t) is not None and post.get(t) is not None]
    if not present:
        raise ValueError(
            f"no retention task among {list(tasks)} was scored for both models "
            f"(base has {sorted(base)}, post has {sorted(post)})"
        )
    zero = [t for t in present if base[t] == 0]
    if zero:
        raise ValueError(f"base score of {zero} is 0: retention (post / base) is undefined")
    return {
        "forgetting": mean([base[t] - post[t] for t in present]),
        "retention": mean([post[t] / base[t] for t in present]),
    }


# ----- during training --------------------------------------------------------------------------------------------
class RetentionEvalCallback(TrainerCallback):
    """Run evaluation tasks on the training model every ``eval_steps`` steps and log the scores.

    Scores are logged as ``eval/<task>/<metric>``; with ``eval_on_start`` the step-0 scores become the base and
    every later evaluation also logs ``eval/forgetting`` and ``eval/retention`` against them. Pass ``trainer`` (TRL's
    convention for callbacks that log, e.g. ``callback = RetentionEvalCallback(...); trainer.add_callback(callback);
    callback.trainer = trainer``) so scores go through ``trainer.log`` to every reporting integration; without it
    they are appended to ``state.log_history`` only. Every process evaluates (ZeRO-3 needs all ranks in the forward
    pass); the trainer reports from the main process. Keep ``limit`` small: this runs inside the training loop.

    Args:
        tasks: task names (built with ``data_dir``, ``limit``, ``seed``, ``task_kwargs``) or task instances.
        eval_steps: evaluate when ``global_step`` is a multiple of this.
        eval_on_start: also evaluate before the first step (the base for forgetting and retention).
        tokenizer: defaults to the trainer's ``processing_class``.
    """

    def __init__(
        self,
        tasks=RETENTION_TASKS,
        eval_steps: int = 100,
        *,
        trainer=None,
        tokenizer=None,
        data_dir: str | Path | None = None,
        limit: int | dict | None = 50,
        seed: int = 0,
        batch_size: int = 16,
        task_kwargs: dict | None = None,
        eval_on_start: bool = True,
        prefix: str = "eval/",
    ):
        if eval_steps < 1:
            raise ValueError(f"eval_steps must be a positive number of steps, got {eval_steps}")
        task_kwargs = task_kwargs or {}
        common = {"seed": seed, "batch_size": batch_size}
        self.tasks = [
            make_task(t, data_dir=data_dir, **{**common, "limit": _limit_for(limit, t), **task_kwargs.get(t, {})})
            if isinstance(t, str)
            else t
            for t in tasks
        ]
        self.eval_steps, self.trainer, self.tokenizer = eval_steps, trainer, tokenizer
        self.eval_on_start, self.prefix = eval_on_start, prefix
        self.base_scores: dict | None = None
        self.history: list[dict] = []

    def _tokenizer(self, kwargs):
        tokenizer = self.tokenizer or kwargs.get("processing_class")
        if tokenizer is None and self.trainer is not None:
            tokenizer = self.trainer.processing_class
        if tokenizer is None:
            raise ValueError("RetentionEvalCallback has no tokenizer: pass tokenizer=... or a trainer")
        return getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer

    def evaluate(self, state, model, tokenizer) -> dict[str, float]:
        outputs = run_tasks(model, tokenizer, self.tasks, progress=False)
        scores = {t.name: outputs[t.name]["metrics"][t.primary_metric] for t in self.tasks}
        logs = {
            f"{self.prefix}{name}/{key}": value
            for name, output in outputs.items()
            for key, value in scalar_metrics(output["metrics"]).items()
        }
        if self.base_scores is None:
            self.base_scores = scores
        elif any(t in scores for t in RETENTION_TASKS):
            try:
                summary = retention_summary(self.base_scores, scores)
                logs.update({f"{self.prefix}{key}": value for key, value in summary.items()})
            except ValueError as err:  # a base score of 0 leaves retention undefined: log the scores only
                logger.warning_once(f"RetentionEvalCallback logs no forgetting/retention: {err}")
        self.history.append({"step": state.global_step, **logs})
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append({**logs, "step": state.global_step})
        return logs

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.eval_on_start and model is not None:
            self.evaluate(state, model, self._tokenizer(kwargs))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step % self.eval_steps == 0:
            self.evaluate(state, model, self._tokenizer(kwargs))


# ----- command line -----------------------------------------------------------------------------------------------
def parse_limit(text: str | None) -> int | dict | None:
    """``"200"`` -> 200; ``"gsm8k=500,mmlu=500"`` -> a dict; ``"study"`` -> :data:`STUDY_LIMITS`."""
    if text is None:
        return None
    if text == "study":
        return dict(STUDY_LIMITS)
    usage = "--limit takes N, 'study', or per-task counts such as 'gsm8k=500,mmlu=500,truthfulqa=200'"
    try:
        if "=" not in text:
            return int(text)
        limits = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            limits[name.strip()] = int(value)
    except ValueError as err:
        raise ValueError(f"{usage}, got {text!r}") from err
    unknown = [name for name in limits if name not in TASKS]
    if unknown:
        raise ValueError(f"--limit names unknown task(s) {unknown}: choose from {sorted(TASKS)}")
    return limits


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``statelens eval``."""
    parser.add_argument("--model", required=True, help="model folder or hub id (loaded with from_pretrained)")
    parser.add_argument("--tasks", default=",".join(TASK_NAMES), help="comma-separated: gsm8k,truthfulqa,mmlu")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder with gsm8k/, truthfulqa/ and mmlu/ data files, or 'lab' for the offline lab "
        "world; default: the hub data sets",
    )
    parser.add_argument(
        "--limit",
        default=None,
        help="items per task: N, or per task 'gsm8k=500,mmlu=500,truthfulqa=200', or 'study' (those)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the item subsets and exemplars")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-shots", type=int, default=0, help="exemplars for gsm8k and mmlu")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="gsm8k generation budget")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="plain", help="gsm8k prompt format")
    parser.add_argument(
        "--mmlu-scoring", choices=MMLU_SCORING, default=None, help="default: letter (continuation for the lab)"
    )
    parser.add_argument("--lab-seed", type=int, default=0, help="seed of the lab world with --data-dir lab")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--base", default=None, help="results JSON of the base model: adds forgetting/retention")
    parser.add_argument("--out", required=True, help="results JSON; per-item records go beside it (.items.jsonl)")
    return parser


def run_eval_cli(args: argparse.Namespace) -> dict:
    """``statelens eval``: evaluate, write the results JSON, print a summary."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown} in --tasks: choose from {sorted(TASKS)}")
    lab = {"lab_seed": args.lab_seed}
    task_kwargs = {
        "gsm8k": {
            "num_shots": args.num_shots,
            "max_new_tokens": args.max_new_tokens,
            "prompt_format": args.prompt_format,
            **lab,
        },
        "truthfulqa": lab,
        "mmlu": {"num_shots": args.num_shots, "scoring": args.mmlu_scoring, **lab},
    }
    results = evaluate_model(
        args.model,
        [t for t in TASK_NAMES if t in tasks],
        data_dir=args.data_dir,
        limit=parse_limit(args.limit),
        seed=args.seed,
        batch_size=args.batch_size,
        task_kwargs={t: task_kwargs[t] for t in tasks},
        out=None,
        device=args.device,
    )
    records = results.pop("records")
    if args.base is not None:
        base = json.loads(Path(args.base).read_text())
        results["retention_summary"] = retention_summary(base, results)
    items_path = write_results(results, records, args.out)
    for name, score in results["scores"].items():
        print(f"{name:<12} {results['primary_metrics'][name]:<16} {score:.4f}")
    for key, value in results.get("retention_summary", {}).items():
        print(f"{key:<29} {value:.4f}")
    print(f"wrote {args.out} and {items_path}")
    return results
