"""[`StateLoggingCallback`]'s probes: the probe prompts sampled by the current policy (seeded, every rank alike), the
step-0 reference it keeps (`drift_reference.json`: the step-0 completions and what the step-0 policy gives their
tokens), and what is measured on them at each probe step besides the drift of the prefix states (`drift.py`):
`base_kl`, `base_kl_topk` and the teacher's disagreement (`teacher_kl/exact*`). The callback's docstring defines each
metric."""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager

import torch
from transformers import GenerationConfig
from trl.models.utils import unwrap_model_for_generation

from ..checks import check_probe_lengths, context_length
from ..merged_lora import student_sampling
from .endings import answer_end_position, end_kinds, end_token_ids, mean_or_nan

logger = logging.getLogger(__name__)

DRIFT_REFERENCE_FILE = "drift_reference.json"
DEFAULT_PROBE_MAX_NEW_TOKENS = 64


class ProbeMixin:
    """The probe side of [`StateLoggingCallback`] (which holds the settings: `probe_prompts`, `probe_seed`,
    `probe_max_new_tokens`, `base_kl_top_k`), mixed into it."""

    # ----- probe drift -----------------------------------------------------------------------------------------------
    def _load_or_make_reference(self, state) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
        """The step-0 probe completions and what the step-0 policy gives their tokens ([`base_policy_row`], one per
        completion): made now on a fresh run, read back from the ledger on a resumed one."""
        path = self.ledger_dir / DRIFT_REFERENCE_FILE
        reference = json.loads(path.read_text()) if state.global_step > 0 and path.exists() else {}
        if state.global_step > 0 and "completions" not in reference:
            logger.warning("Resumed without %s: probe drift is measured against the resumed policy.", path)
        elif state.global_step > 0 and "base_policy" not in reference:
            logger.warning("%s has no step-0 log-probs: base_kl is measured against the resumed policy.", path)
        completions = reference.get("completions") or self._sample_probes()
        if "base_policy" in reference:
            return completions, [read_base_policy_row(row) for row in reference["base_policy"]]
        base_policy = [
            base_policy_row(token_ids, logps, self.base_kl_top_k)
            for token_ids, logps, _ in self._score_completions(completions, with_teacher=False)
        ]
        if state.is_world_process_zero:
            rows = [{name: v.tolist() for name, v in row.items()} for row in base_policy]
            partial = path.with_suffix(".partial")  # written whole, then renamed: a kill never leaves half of it
            partial.write_text(
                json.dumps({"step": state.global_step, "completions": completions, "base_policy": rows})
            )
            partial.replace(path)
        return completions, base_policy

    def _probe_texts(self, tokenizer) -> list[str]:
        """The probe prompts as text: conversations formatted with the tokenizer's chat template."""
        return [
            p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in self.probe_prompts
        ]

    def _probe_generation_config(self, model) -> GenerationConfig:
        """The trainer's sampling settings when it has them (GRPO-like trainers), else the model's, with sampling."""
        config = trainer_generation_config(self.trainer)
        if config is None:
            config = GenerationConfig.from_dict(model.generation_config.to_dict())
            config.do_sample = True
            config.max_new_tokens = DEFAULT_PROBE_MAX_NEW_TOKENS
        if self.probe_max_new_tokens is not None:
            config.max_new_tokens = self.probe_max_new_tokens
        return config

    def _check_probe_lengths(self) -> None:
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        model = self.trainer.model
        max_new_tokens = self._probe_generation_config(model).max_new_tokens
        check_probe_lengths(tokenizer, prompts, max_new_tokens, context_length(model))

    @torch.no_grad()
    def _sample_probes(self) -> list[str]:
        """Completions of the current policy on the probe prompts, sampled with a fixed seed.

        Every rank samples the same completions (same seed, same weights), which keeps sharded models (ZeRO-3) in
        step; the training RNG is forked, so probing does not change the training run.
        """
        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        device = trainer.accelerator.device
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        inputs = inputs.to(device)
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                # GRPO-like trainers' setting: False samples from the ZeRO-3 shards, without gathering the whole model
                gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
                generation_kwargs=getattr(trainer, "generation_kwargs", None),
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,  # re-enabled as it was
            ) as model,
            seeded_rng(device, self.probe_seed),
            student_sampling(trainer, model),
        ):
            was_training = model.training
            model.eval()
            config = self._probe_generation_config(model)
            output = model.generate(**inputs, generation_config=config)
            model.train(was_training)
        completion_ids = output[:, inputs["input_ids"].size(1) :]
        # how each probe ended (`lens.endings`), read by the step's `drift/ends_*` and the teacher's end view
        ends = end_token_ids(tokenizer, model)
        self._probe_end_kinds = end_kinds(completion_ids, ends, config.max_new_tokens, tokenizer.pad_token_id)
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    # ----- teacher disagreement on probe states ----------------------------------------------------------------------
    def _has_teacher(self) -> bool:
        return probe_teacher_model(self.trainer) is not None

    @torch.no_grad()
    def _score_completions(self, completions: list[str], with_teacher: bool, with_end: bool = False):
        """Score each probe prompt followed by its completion with the current policy (and the teacher): yields, per
        completion, its token ids and the `(tokens, vocabulary)` log-probs each model gives at its positions, at the
        trainer's sampling temperature, over the tokenizer's ids (a padded head's extra rows left out).

        Every rank scores the same rows (ZeRO-3 forwards are collective); four rows at a time bound the
        `(rows, length, vocabulary)` logits. `with_end`: each completion also yields the student's and the teacher's
        log-prob of ending (any end token) at each of its `len + 1` states, the last one after its final token.
        """
        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        prompts = self._probe_texts(tokenizer)
        temperature = getattr(trainer, "temperature", 1.0) or 1.0
        device = trainer.accelerator.device
        student = trainer.model
        student_was_training = student.training
        student.eval()
        end_ids = torch.tensor(end_token_ids(tokenizer, student), device=device)
        try:
            for start in range(0, len(prompts), 4):
                rows = []
                for prompt, completion in zip(prompts[start : start + 4], completions[start : start + 4]):
                    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
                    rows.append((prompt_ids, completion_ids))
                width = max(len(p) + len(c) for p, c in rows)
                input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)
                attention_mask = torch.zeros_like(input_ids)
                for i, (p, c) in enumerate(rows):
                    input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
                    attention_mask[i, : len(p) + len(c)] = 1
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                logits = student(input_ids=input_ids, attention_mask=attention_mask).logits
                vocab = min(logits.size(-1), len(tokenizer))
                student_logps = torch.log_softmax(logits[..., :vocab].float() / temperature, dim=-1)
                teacher_logps = None
                if with_teacher:
                    teacher = probe_teacher_model(trainer)
                    logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits
                    teacher_logps = torch.log_softmax(logits[..., :vocab].float() / temperature, dim=-1)
                for i, (p, c) in enumerate(rows):
                    # the token at position len(p) + k is predicted from position len(p) + k - 1
                    span = slice(len(p) - 1, len(p) + len(c) - 1)
                    scored = (
                        torch.tensor(c, dtype=torch.long, device=device),
                        student_logps[i, span],
                        None if teacher_logps is None else teacher_logps[i, span],
                    )
                    if with_end:
                        states = slice(len(p) - 1, len(p) + len(c))
                        ending = [
                            None if logps is None else logps[i, states][:, end_ids].logsumexp(-1)
                            for logps in (student_logps, teacher_logps)
                        ]
                        scored = (*scored, *ending)
                    yield scored
        finally:
            student.train(student_was_training)

    def _teacher_disagreement(self, completions: list[str]) -> tuple[dict[str, float], list[list[float]]]:
        """Exact reverse KL of the student from the teacher at every token of the probe completions (each probe
        prompt followed by its completion), overall, by token kind and by prefix-length bin; and the teacher's view
        of the end (`lens.endings`): its log-prob of ending right after each completion's final-answer line (the
        student's beside it) and after the completions that ended with the end token."""
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        kinds = getattr(self, "_probe_end_kinds", None) or [None] * len(completions)
        scored, after_answer, student_after_answer, at_end = [], [], [], []
        for kind, (token_ids, student, teacher, student_end, teacher_end) in zip(
            kinds, self._score_completions(completions, with_teacher=True, with_end=True)
        ):
            scored.append((token_ids.cpu(), reverse_kl(student, teacher)))
            answered = answer_end_position(tokenizer.batch_decode(token_ids[:, None]))
            if answered is not None:
                after_answer.append(teacher_end[answered].item())
                student_after_answer.append(student_end[answered].item())
            if kind == "end_token":
                at_end.append(teacher_end[-1].item())
        metrics, by_prefix = self._teacher_kl_metrics(scored)
        metrics["teacher_end/logp_after_answer"] = mean_or_nan(after_answer)
        metrics["student_end/logp_after_answer"] = mean_or_nan(student_after_answer)
        metrics["teacher_end/logp_at_end"] = mean_or_nan(at_end)
        metrics["answer_frac"] = len(after_answer) / max(len(completions), 1)
        return metrics, by_prefix

    def _reference_divergences(self) -> dict[str, float]:
        """`base_kl` and `base_kl_topk` on the step-0 completions, and `teacher_kl/exact_fixed` there with a teacher: one
        forward pass of the policy (and the teacher) over them."""
        base_kl, base_kl_topk, teacher = [], [], []
        scored = self._score_completions(self._reference_texts, with_teacher=self._has_teacher())
        for base, (token_ids, logps, teacher_logps) in zip(self._base_policy, scored, strict=True):
            log_ratio, topk_kl = base_divergences(base, token_ids, logps)
            base_kl.append(log_ratio)
            base_kl_topk.append(topk_kl)
            if teacher_logps is not None:
                teacher.append((token_ids.cpu(), reverse_kl(logps, teacher_logps)))
        tokens = max(sum(len(row) for row in base_kl), 1)
        metrics = {
            "base_kl": sum(row.sum().item() for row in base_kl) / tokens,
            "base_kl_topk": sum(row.sum().item() for row in base_kl_topk) / tokens,
        }
        if teacher:
            metrics["teacher_kl/exact_fixed"] = self._teacher_kl_metrics(teacher)[0]["teacher_kl/exact"]
        return metrics

    def _teacher_kl_metrics(self, scored: list[tuple[torch.Tensor, torch.Tensor]]):
        """Per-token reverse KLs (`(token_ids, kl)` per completion) summed up overall, by token kind and by
        prefix-length bin."""
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        digit = self._number_token_table(tokenizer)
        kl = torch.cat([row_kl for _, row_kl in scored]).double()
        number = torch.cat([digit[token_ids] for token_ids, _ in scored])
        prefix_len = torch.cat([torch.arange(len(token_ids)) for token_ids, _ in scored])
        tokens = max(kl.numel(), 1)
        metrics = {
            "teacher_kl/exact": kl.sum().item() / tokens,
            "teacher_kl/exact_number": kl[number].mean().item() if number.any() else float("nan"),
            "teacher_kl/exact_other": kl[~number].mean().item() if (~number).any() else float("nan"),
            "number_frac": number.double().sum().item() / tokens,
            "probe_tokens": kl.numel() / len(scored),
        }
        bins = torch.log2(prefix_len.double() + 1).floor().long()
        by_prefix = [
            [int((bins == b).sum()), kl[bins == b].mean().item() if (bins == b).any() else None]
            for b in range(int(bins.max()) + 1 if bins.numel() else 0)
        ]
        return metrics, by_prefix

    def _number_token_table(self, tokenizer) -> torch.Tensor:
        """`table[id]`: whether token `id`'s text holds a digit (built once per run)."""
        if getattr(self, "_number_tokens", None) is None:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            self._number_tokens = torch.tensor([any(ch.isdigit() for ch in str(p)) for p in pieces])
        return self._number_tokens


@contextmanager
def seeded_rng(device: torch.device, seed: int):
    """Inside, the CPU generator and `device`'s (CUDA, MPS, ...) are seeded with `seed`; on exit both are as they were.
    No other generator is touched: `torch.manual_seed` would also reseed every other device type's (MPS's on a Mac)
    without restoring it."""
    accelerated = device.type != "cpu"
    with torch.random.fork_rng(
        devices=[device] if accelerated else [], device_type=device.type if accelerated else None
    ):
        torch.default_generator.manual_seed(seed)
        if accelerated:
            torch.get_device_module(device.type).manual_seed(seed)
        yield


def reverse_kl(student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """Exact `KL(p_S || p_T)` over the vocabulary at each position, from `(positions, vocabulary)` log-probs."""
    return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1).cpu()


def base_policy_row(token_ids: torch.Tensor, logps: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """What the step-0 policy gives one probe completion, for `base_kl` later: at each of its positions the log-prob
    of its token (`logps`), the `top_k` most likely ids with their log-probs (`top_ids`, `top_logps`) and the
    probability left outside them (`tail_mass`). `logps` is `(tokens, vocabulary)`; float32 values on the CPU."""
    top_logps, top_ids = logps.topk(min(top_k, logps.size(-1)), dim=-1)
    return {
        "logps": logps.gather(-1, token_ids[:, None])[:, 0].cpu(),
        "top_ids": top_ids.cpu(),
        "top_logps": top_logps.cpu(),
        "tail_mass": logps.scatter(-1, top_ids, float("-inf")).logsumexp(-1).exp().cpu(),
    }


def read_base_policy_row(row: dict[str, list]) -> dict[str, torch.Tensor]:
    """A [`base_policy_row`] read back from `drift_reference.json`, the same values and shapes (an empty completion's
    `top_ids` and `top_logps` are `(0, 0)`)."""
    tokens = len(row["logps"])
    top_shape = (tokens, -1 if tokens else 0)
    return {
        "logps": torch.tensor(row["logps"], dtype=torch.float32),
        "top_ids": torch.tensor(row["top_ids"], dtype=torch.long).reshape(top_shape),
        "top_logps": torch.tensor(row["top_logps"], dtype=torch.float32).reshape(top_shape),
        "tail_mass": torch.tensor(row["tail_mass"], dtype=torch.float32),
    }


def base_divergences(base: dict[str, torch.Tensor], token_ids: torch.Tensor, logps: torch.Tensor):
    """Per token of one step-0 completion: `log pi_0(y_t) - log pi_theta(y_t)` (the sampled estimate of the forward
    KL) and the exact KL between `pi_0` and `pi_theta` bucketed into `pi_0`'s top-k ids plus the rest
    (see [`StateLoggingCallback`]). `base` is the completion's [`base_policy_row`], `logps` the current policy's
    `(tokens, vocabulary)` log-probs. Float64 on the CPU; both exactly 0 for an unchanged policy."""
    log_ratio = base["logps"].double() - logps.gather(-1, token_ids[:, None])[:, 0].double().cpu()
    top_ids = base["top_ids"].to(logps.device)
    current_top = logps.gather(-1, top_ids).double().cpu()
    current_tail = logps.scatter(-1, top_ids, float("-inf")).logsumexp(-1).exp().double().cpu()
    base_top, base_tail = base["top_logps"].double(), base["tail_mass"].double()
    top = (base_top.exp() * (base_top - current_top)).sum(-1)
    # 0 log(0 / q) = 0: with k = vocabulary size there is no tail
    tail = torch.where(base_tail > 0, base_tail * (base_tail.log() - current_tail.log()), 0.0)
    return log_ratio, top + tail


def probe_teacher_model(trainer):
    """The teacher model the probe measures disagreement with: the trainer's `probe_teacher_model` where it names one
    ([`OnPolicyDistillTrainer`], `None` for a teacher that reads prompts of its own), else TRL's `teacher_model` (a
    stock `DistillationTrainer`), else `None`. Not TRL's `SDFTTrainer`'s: its `teacher_model` is the student or its
    copy, which teaches reading a privileged prompt that probe prompts do not have (scored on them it would give 0 for
    a live or PEFT base teacher, `base_kl` reversed for a copy); the stock arm then logs no probe `teacher_kl`, as ours
    with a self teacher."""
    if hasattr(trainer, "probe_teacher_model"):
        return trainer.probe_teacher_model
    sdft = sys.modules.get("trl.experimental.sdft.sdft_trainer")  # imported only if the trainer is one
    if sdft is not None and isinstance(trainer, sdft.SDFTTrainer):
        return None
    return getattr(trainer, "teacher_model", None)


def trainer_generation_config(trainer) -> GenerationConfig | None:
    """A copy of the sampling settings a GRPO-like trainer generates with, at its full length (`max_completion_length`,
    whatever rollout horizon is set); `None` for a trainer that does not sample.

    With `use_vllm=True` GRPO keeps no `generation_config`: the same settings are then built from the trainer's own
    fields (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, eos and pad tokens), the
    ones GRPO builds its `generate` settings from.
    """
    config = getattr(trainer, "generation_config", None)
    if config is not None:
        config = GenerationConfig.from_dict(config.to_dict())
        if getattr(trainer, "max_completion_length", None) is not None:
            # An OPD rollout horizon shortens the rollouts' own setting between generation batches; what reads this
            # copy (the probes, a teacher's generation) samples at the run's full length
            config.max_new_tokens = trainer.max_completion_length
        return config
    if getattr(trainer, "max_completion_length", None) is None or getattr(trainer, "temperature", None) is None:
        return None
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return GenerationConfig(
        max_new_tokens=trainer.max_completion_length,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=getattr(trainer, "eos_token_ids", tokenizer.eos_token_id),
        temperature=trainer.temperature,
        top_p=getattr(trainer, "top_p", 1.0),
        top_k=getattr(trainer, "top_k", 0),
        min_p=getattr(trainer, "min_p", None),
        repetition_penalty=getattr(trainer, "repetition_penalty", 1.0),
        disable_compile=True,
    )
