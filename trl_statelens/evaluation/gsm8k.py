"""GSM8K accuracy by greedy generation, with strict (``####``) and flexible (last number) answer extraction."""

from __future__ import annotations

import random

import torch

from ..answers import (
    EXTRACTION_MODES,
    LM_EVAL_INVALID,
    answers_match,
    clean_format,
    extract_answer,
    lm_eval_exact_match,
    lm_eval_extract,
    repeats_itself,
)
from ..data import GSM8K_HUB_ID, PROMPT_FORMATS, gsm8k_example, pick_shots, read_gsm8k_rows, shots_for
from .protocols import SUBSET_RULES, check_protocol
from .scoring import greedy_generate, mean, model_device, subset_rows

LM_EVAL_FEWSHOT_SEED = 1234  # lm-eval's simple_evaluate default fewshot_random_seed
GSM8K_PROTOCOLS = {
    "statelens": {
        "num_shots": 0,
        "shot_sampling": "fixed",  # one seeded set of train shots for every question (never the question itself)
        "stop_strings": ("Question:",),
        "answer_filters": "statelens",  # answers.extract_answer, compared as numbers
    },
    "lm-eval": {
        "num_shots": 5,
        "shot_sampling": "per-question",  # random.Random(1234).sample(train, k) for each question in turn
        "stop_strings": ("Question:", "</s>", "<|im_end|>"),  # and the tokenizer's eos, as HFLM adds it
        "answer_filters": "lm-eval",  # answers.lm_eval_extract + lm_eval_exact_match against the whole solution
    },
}


def per_question_shots(rows: list[dict], pool: list[dict], num_shots: int, seed: int, same_split: bool) -> list:
    """lm-eval's ``default`` sampler: one ``random.Random(seed)`` draws ``num_shots`` pool rows for each row in
    order; when the pool is the evaluated split, it draws one more and drops the row itself."""
    rnd = random.Random(seed)
    shots = []
    for row in rows:
        if same_split:
            shots.append([s for s in rnd.sample(pool, num_shots + 1) if s != row][:num_shots])
        else:
            shots.append(rnd.sample(pool, num_shots))
    return shots


class GSM8KTask:
    """GSM8K accuracy by greedy generation from ``Question: ...\\nAnswer:`` prompts.

    Args:
        source: ``"openai/gsm8k"``, a local file or folder, or ``"lab"``.
        split: evaluation split (``"test"``; the lab also has ``"dev"``).
        protocol: ``"statelens"`` or ``"lm-eval"`` (see :mod:`trl_statelens.evaluation.protocols`); it sets the
            defaults of the arguments below left at ``None``, the shot sampling and the answer filters.
        num_shots: solved train problems before each question (protocol default: 0 for ``statelens``, 5 for
            ``lm-eval``).
        prompt_format: ``"plain"`` or ``"chat"`` (the tokenizer's chat template, for instruct models;
            ``statelens`` protocol only).
        max_new_tokens: generation budget; an answer not finished by then scores 0.
        limit / seed: evaluate ``limit`` rows: under ``statelens`` chosen by a hash of the question seeded with
            ``seed`` (it also seeds the fixed shots), under ``lm-eval`` the first ones.
        batch_size: prompts per ``generate`` call.
        stop_strings: generation stops at these (a base model goes on to invent the next question), and at eos;
            ``()`` for eos only.
        lab_seed: seed of the lab world when ``source="lab"``.
        num_samples: also sample this many completions per problem at ``sample_temperature`` and report
            ``accuracy_sampled`` (strict answers, mean over every sample): how often the policy the learner trains on
            gets the answer, next to what greedy decoding gets. Sampling is seeded with ``seed`` on a forked RNG, so
            the same model gives the same score. 0 (default) samples nothing.
        sample_temperature: temperature of those samples (1.0: the policy itself, as on-policy trainers sample it).
    """

    name = "gsm8k"
    primary_metric = "accuracy_strict"

    def __init__(
        self,
        source: str = GSM8K_HUB_ID,
        split: str | None = None,
        *,
        protocol: str = "statelens",
        num_shots: int | None = None,
        prompt_format: str = "plain",
        max_new_tokens: int = 256,
        limit: int | None = None,
        seed: int = 0,
        batch_size: int = 16,
        stop_strings: tuple[str, ...] | None = None,
        lab_seed: int = 0,
        num_samples: int = 0,
        sample_temperature: float = 1.0,
    ):
        if num_samples < 0:
            raise ValueError(f"num_samples is a number of completions per problem (0 for none), got {num_samples}")
        if sample_temperature <= 0:
            raise ValueError(
                f"sample_temperature must be positive (greedy is the main score), got {sample_temperature}"
            )
        defaults = GSM8K_PROTOCOLS[check_protocol(protocol)]
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"unknown prompt_format {prompt_format!r}: use one of {PROMPT_FORMATS}")
        if protocol == "lm-eval" and prompt_format != "plain":
            raise ValueError("the lm-eval protocol uses plain prompts: leave prompt_format at 'plain'")
        self.source, self.split, self.protocol = str(source), split or "test", protocol
        self.num_shots = defaults["num_shots"] if num_shots is None else num_shots
        self.stop_strings = tuple(defaults["stop_strings"] if stop_strings is None else stop_strings)
        self.prompt_format, self.max_new_tokens = prompt_format, max_new_tokens
        self.limit, self.seed, self.batch_size, self.lab_seed = limit, seed, batch_size, lab_seed
        self.num_samples, self.sample_temperature = num_samples, sample_temperature
        self._examples = None

    def settings(self) -> dict:
        sampling = GSM8K_PROTOCOLS[self.protocol]["shot_sampling"]
        return {
            "protocol": self.protocol,
            "source": self.source,
            "split": self.split,
            "num_shots": self.num_shots,
            "shot_sampling": sampling,
            "fewshot_seed": LM_EVAL_FEWSHOT_SEED if sampling == "per-question" else self.seed,
            "prompt_format": self.prompt_format,
            "max_new_tokens": self.max_new_tokens,
            "stop_strings": list(self.stop_strings) + ["<eos>"],
            "answer_filters": GSM8K_PROTOCOLS[self.protocol]["answer_filters"],
            "limit": self.limit,
            "subset": SUBSET_RULES[self.protocol],
            "seed": self.seed,
            **(
                {"num_samples": self.num_samples, "sample_temperature": self.sample_temperature}
                if self.num_samples
                else {}
            ),
        }

    def examples(self) -> list[dict]:
        """The evaluated items (prompt, question, answer, ground_truth), loaded once."""
        if self._examples is None:
            rows = read_gsm8k_rows(self.source, self.split, self.lab_seed)
            pool = []
            if self.num_shots > 0:  # exemplars always come from the train split
                pool = rows if self.split == "train" else read_gsm8k_rows(self.source, "train", self.lab_seed)
                if self.num_shots >= len(pool):
                    raise ValueError(f"num_shots={self.num_shots} needs more than {len(pool)} train rows")
            if GSM8K_PROTOCOLS[self.protocol]["shot_sampling"] == "per-question" and self.num_shots > 0:
                shots = per_question_shots(rows, pool, self.num_shots, LM_EVAL_FEWSHOT_SEED, self.split == "train")
            else:
                fixed = pick_shots(pool, self.num_shots, self.seed)
                shots = [shots_for(r["question"], fixed, self.num_shots) for r in rows]
            items = [gsm8k_example(r, self.prompt_format, s) for r, s in zip(rows, shots)]
            self._examples = subset_rows(items, self.limit, self.seed, SUBSET_RULES[self.protocol])
        return self._examples

    load = examples

    def prompt_texts(self, tokenizer) -> list[str]:
        if self.prompt_format == "plain":
            return [e["prompt"] for e in self.examples()]
        return [
            tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=False)
            for e in self.examples()
        ]

    def generate(
        self, model, tokenizer, prompts: list[str], progress: bool = True, sample_temperature: float | None = None
    ) -> list[str]:
        """Greedy (or, with ``sample_temperature``, sampled) completions of ``prompts``, cut at the first stop string
        and at eos."""
        eos = getattr(tokenizer, "eos_token", None)
        return greedy_generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=self.max_new_tokens,
            stop_strings=self.stop_strings + ((eos,) if eos else ()),
            add_special_tokens=self.prompt_format == "plain",
            batch_size=self.batch_size,
            desc="gsm8k: generating" if sample_temperature is None else "gsm8k: sampling",
            progress=progress,
            sample_temperature=sample_temperature,
        )

    def score(self, output: str, example: dict) -> dict:
        """The extracted answers of one completion and whether each is right, under the protocol's filters."""
        record, lm_eval_filters = {}, GSM8K_PROTOCOLS[self.protocol]["answer_filters"] == "lm-eval"
        for mode in EXTRACTION_MODES:
            if lm_eval_filters:
                record[mode] = lm_eval_extract(output, mode)
                record[f"correct_{mode}"] = lm_eval_exact_match(record[mode], example["answer"])
            else:
                record[mode] = extract_answer(output, mode)
                record[f"correct_{mode}"] = answers_match(record[mode], example["ground_truth"])
        record["answer_found"] = record["strict"] not in (None, LM_EVAL_INVALID)
        # The guards beside answer_found, which a looping answer also satisfies (answer_shape's docstring).
        record["clean_format"] = clean_format(output)
        record["repeats"] = repeats_itself(output)
        return record

    def evaluate(self, model, tokenizer, progress: bool = True) -> dict:
        examples = self.examples()
        outputs = self.generate(model, tokenizer, self.prompt_texts(tokenizer), progress)
        records = [
            {"question": e["question"], "ground_truth": e["ground_truth"], "output": output, **self.score(output, e)}
            for e, output in zip(examples, outputs)
        ]
        metrics = {f"accuracy_{mode}": mean([r[f"correct_{mode}"] for r in records]) for mode in EXTRACTION_MODES}
        for shape in ("answer_found", "clean_format", "repeats"):
            metrics[shape] = mean([r[shape] for r in records])
        metrics["num_items"] = len(records)
        if self.num_samples:
            metrics["accuracy_sampled"] = self._sampled_accuracy(model, tokenizer, examples, progress)
        return {"metrics": metrics, "records": records}

    def _sampled_accuracy(self, model, tokenizer, examples: list[dict], progress: bool) -> float:
        prompts = [p for p in self.prompt_texts(tokenizer) for _ in range(self.num_samples)]
        devices = [model_device(model)] if model_device(model).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the caller's (training) randomness does not move
            torch.manual_seed(self.seed)
            outputs = self.generate(model, tokenizer, prompts, progress, sample_temperature=self.sample_temperature)
        repeated = [e for e in examples for _ in range(self.num_samples)]
        return mean([self.score(output, e)["correct_strict"] for output, e in zip(outputs, repeated)])
