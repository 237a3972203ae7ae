"""`OnPolicyDistillTrainer`: the student's states, the teacher's signal.

Built on [`StateLensGRPOTrainer`]: TRL's GRPO machinery samples the rollouts (plain `generate` or vLLM, PEFT,
gradient accumulation, accelerate/DeepSpeed all keep working), this trainer decides per sample whose states are
supervised (`state_source_mix`) and what the teacher says there (`signal`), and records every supervised state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl.kernels.chunked_logprob import _use_triton
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import pad

from .cache import CACHE_AGE, TeacherCache
from .collective import gather_counts
from .grpo_trainer import StateLensGRPOTrainer
from .heads import (
    _completion_hidden_states,
    _completion_hidden_states_and_aux_loss,
    _completion_logps_and_entropies,
    _head_logps,
)
from .opd_checks import check_datasets, check_rows, check_teacher_settings_are_read, row_columns
from .opd_config import MIX_SOURCES, OnPolicyDistillConfig
from .records import source_code
from .selection import SKIPPED, divergence_on_scored_rows, select_and_score
from .teachers import (
    InProcessTeacher,
    SelfTeacher,
    ServedTeacher,
    TeacherRouter,
    load_teacher,
    load_teachers,
    resolve_rows,
)

logger = logging.getLogger(__name__)
SOURCE_RNG_FILE = "statelens_source_rng_{rank}.pth"  # in each checkpoint, one per process

LEARNER, DATASET, TEACHER = (source_code(s) for s in ("learner", "dataset", "teacher"))


@dataclass
class RolloutBatch:
    """One generation batch on its way through GRPO's `_generate_and_score_completions`, row by row: what this
    trainer decided for each row before the rollouts (`rows`, the dataset rows; `sources`, whose states it
    supervises; `references`, its reference answer, for `dataset` states; `teachers`, its teacher from
    `Teacher.route`), and what `_generate` adds (`teacher_prompts`, the prompt the teacher reads; `teacher_scores`,
    the teacher's [`TeacherRow`]s, asked for as soon as the tokens are final; `scoring_rollouts`, set once GRPO goes
    on to score the rollouts with the student, a forward no OPD loss reads)."""

    rows: list[dict]
    sources: list[str]
    references: list
    teachers: list[str | None]
    teacher_prompts: list[list[int]] | None = None
    teacher_scores: list | None = None
    scoring_rollouts: bool = False
    completion_ids: list[list[int]] | None = None  # kept for the teacher until the rewards are in (state selection)


def no_reward(completions, **kwargs) -> list[float]:
    """Reward of 0 for every completion: GRPO needs a reward function, pure distillation has none."""
    return [0.0] * len(completions)


# What GRPO logs from the rewards each generation batch; with `no_reward` only, constants (0, 0, 1) that say nothing
REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/no_reward/mean", "rewards/no_reward/std")


class OnPolicyDistillTrainer(StateLensGRPOTrainer):
    """On-policy distillation: the student samples rollouts and a frozen teacher supervises the student's own states.

    Args:
        model (`str` or `PreTrainedModel`): the student, as for [`~trl.GRPOTrainer`].
        teacher_model (`str` or `PreTrainedModel`, *optional*): the teacher, an instance or a path/hub id loaded with
            `args.teacher_model_init_kwargs`. It must share the student's tokenizer (TRL's `GOLDTrainer` handles
            cross-tokenizer distillation); its output layer may be padded past the student's with `reverse_kl` and
            `continuation` (see `teachers.vocabulary.check_same_vocabulary`), not with an in-process `divergence`. It is frozen, kept in eval mode
            and prepared for the same device/DeepSpeed setup as the student. With `args.teacher_model_server_url` a
            vLLM server runs the teacher instead: omit it, or give its path/hub id to have its tokenizer checked (no
            weights are loaded).

            Several teachers: a dict name -> teacher, each an instance, a path/hub id/LoRA folder, or the URL of a
            vLLM server running it (a string starting with `http://` or `https://`), in-process and served mixed. Each
            row goes to the teacher its `teacher_id` column names (TRL's name); rows without the column, or with
            `None`, go to the first teacher of the dict. Every signal and state source works per row; the metrics add
            `teacher_kl/sampled/<name>`, and the state records `statelens/supervised_tokens/<name>` and
            `statelens/source_frac/teacher/<name>`; the ledger's sequences carry their `teacher`.

            The student as its own teacher: omit it and set `args.teacher_model_kind` ([`SelfTeacher`]); the teacher
            then reads each row's `privileged_context` through `args.teacher_prompt_template`, and the ledger's
            sequences carry the `teacher_prompt` it read and its `teacher_context_len` (its tokens over the student's
            prompt). Probe drift measures no teacher disagreement then: the probe prompts have no privileged context.

            Once made, the teacher is `self.teacher` (the `teachers` package: everything the trainer asks of it goes
            there); `self.teacher_model` is TRL's name for the teacher model in the training processes (as
            `DistillationTrainer`'s; a self teacher's is the student or its copy), `None` for a served teacher and
            several teachers; `self.probe_teacher_model` is the one `StateLoggingCallback`'s probe scores its
            disagreement with (`teacher_model`, or `None` for a self teacher, whose prompts the probe does not hold).
        args ([`OnPolicyDistillConfig`], *optional*): the configuration; `signal` and `state_source_mix` choose
            the method.
        train_dataset: rows with a `prompt` column (plain text or conversational), plus `args.reference_column`
            (a reference answer in every row) when the `dataset` state source is used, and `privileged_context` (not
            `None`; a conversational prompt then ends with a user message) with `args.teacher_model_kind`. Images
            (an `image` or `images` column, or `{"type": "image"}` parts in the prompt messages: where GRPO reads
            images from) are refused: neither the loss nor the teacher would see them. Checked before any model
            loads, every row of a map dataset; an `IterableDataset`'s rows are checked batch by batch, and a bad row
            on one process stops every process.
        eval_dataset: as `train_dataset` (a dataset or a dict of them), checked the same way: evaluation runs the
            same state sources, teachers and teacher prompts.
        reward_funcs (*optional*): reward functions as for GRPO, mixed into the `reverse_kl` advantage with
            `args.reward_weight`, and with `args.skip_correct_rollouts` (which needs them) what decides the rollouts
            the teacher does not score (`selection.py`). Without them nothing is rewarded: GRPO's reward metrics are not logged and the
            ledger's sequences carry no reward.
        processing_class, callbacks, optimizers, peft_config, state_logging: as for [`StateLensGRPOTrainer`].
    """

    _tag_names = ["trl", "statelens", "on-policy-distillation"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        teacher_model: str | PreTrainedModel | dict[str, str | PreTrainedModel] | None = None,
        args: OnPolicyDistillConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_funcs=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        state_logging: bool = True,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = OnPolicyDistillConfig(f"{name.split('/')[-1]}-OPD")
        if not isinstance(args, OnPolicyDistillConfig):
            raise TypeError(f"args must be an OnPolicyDistillConfig, got {type(args).__name__}")
        check_datasets(train_dataset, eval_dataset, teacher_model, args)
        check_teacher_settings_are_read(teacher_model, args)
        if args.skip_correct_rollouts and not reward_funcs:
            raise ValueError(
                "skip_correct_rollouts=True skips the rollouts whose reward reaches correct_reward, but no reward_funcs "
                "were given: without them every rollout is rewarded 0 by `no_reward` and nothing would ever be "
                "skipped. Pass reward_funcs (the lab's: trl_statelens.rewards.gsm8k_accuracy_reward), or leave "
                "skip_correct_rollouts=False"
            )
        if args.use_vllm and args.state_source_mix.get("learner", 0.0) < 1.0:
            raise ValueError(
                "state_source_mix with dataset or teacher states is not supported with use_vllm=True: the vLLM "
                "importance-sampling correction would see log-probs of tokens the student did not sample"
            )
        if args.teacher_model_kind is not None:
            if teacher_model is not None:
                raise ValueError(
                    f"teacher_model_kind={args.teacher_model_kind!r} makes the student its own teacher, so "
                    "teacher_model must be omitted; unset teacher_model_kind to distil from a separate teacher"
                )
            if (
                args.teacher_model_kind == "base"
                and peft_config is None
                and not isinstance(model, str)
                and is_peft_model(model)
            ):
                logger.warning(  # as TRL's SDFTTrainer warns
                    "The student is a PEFT model that already carries an adapter: teacher_model_kind='base' is its "
                    "base model with the adapter disabled, not the student's weights at the start (adapter included). "
                    "For a teacher that is the student as given, merge the adapter into the model first "
                    "(merge_and_unload) and pass a peft_config for a new one"
                )
        elif isinstance(teacher_model, dict):
            if args.teacher_cache_steps > 1:
                raise ValueError(
                    f"teacher_cache_steps={args.teacher_cache_steps} with several teachers (a teacher_model dict): the "
                    "cache keeps a single teacher's signal, several are not supported yet. Give one teacher, or leave "
                    "teacher_cache_steps=1"
                )
            if args.teacher_model_server_url is not None:
                raise ValueError(
                    "teacher_model_server_url serves a single teacher: with several teachers, give each served one's "
                    "URL as its value in the teacher_model dict"
                )
            loaded_teachers = load_teachers(teacher_model, args)
        elif args.teacher_model_server_url is not None:
            if not (teacher_model is None or isinstance(teacher_model, str)):
                raise ValueError(
                    "teacher_model_server_url serves the teacher, so teacher_model must not be a model instance: "
                    "omit it, or give the teacher's path or hub id to check its tokenizer against the student's "
                    "(its weights are not loaded)"
                )
            teacher_path, teacher_model = teacher_model, None
        elif teacher_model is None:
            raise ValueError(
                "OnPolicyDistillTrainer needs a teacher_model (an instance, a path or a hub id), or the address of a "
                "vLLM server running it in args.teacher_model_server_url"
            )
        elif isinstance(teacher_model, str):
            teacher_path = teacher_model
            teacher_model = load_teacher(teacher_model, args)
        else:
            teacher_path = None

        super().__init__(
            model=model,
            reward_funcs=reward_funcs if reward_funcs is not None else [no_reward],
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            state_logging=state_logging,
        )
        self._has_rewards = reward_funcs is not None
        # Per-sample state sources and cut points are drawn from their own generator, never the training RNG (so are
        # a served teacher's sampling seeds)
        self._source_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._source_probs = torch.tensor([args.state_source_mix.get(s, 0.0) for s in MIX_SOURCES])
        self._rollout_batch: RolloutBatch | None = None  # while a generation batch is made (see `RolloutBatch`)
        self._teacher_tokens = 0  # the records' `teacher_tokens` (`_count_teacher_tokens`)
        self._rollout_length = self.max_completion_length  # this generation batch's (`_set_rollout_length`)
        # State selection (`skip_correct_rollouts`): this rank's counts since the last optimizer step's ledger line
        # (skipped, rechecked, teacher_skipped_tokens), and which generation batch of which step is drawn next
        self._selection_counts, self._selection_batch = [0, 0, 0], (0, 0)
        self._forward_redirection = _ForwardRedirection()
        # Offline teacher cache (`teacher_cache_steps`, `cache.py`): which optimizer steps reuse the buffered batch
        self.teacher_cache = TeacherCache(self, LEARNER) if args.teacher_cache_steps > 1 else None
        # Everything the trainer asks of its teacher goes through `self.teacher` (the `teachers` package)
        if args.teacher_model_kind is not None:
            # The student's path, to load its copy again under ZeRO-3 (an instance has none)
            self.teacher = SelfTeacher(self, model if isinstance(model, str) else None)
        elif isinstance(teacher_model, dict):
            self.teacher = TeacherRouter.connect(self, loaded_teachers)
        elif args.teacher_model_server_url is not None:
            self.teacher = ServedTeacher.connect(self, teacher_path)
        else:
            self.teacher = InProcessTeacher.prepared(self, teacher_model, teacher_path)
        # TRL's name (as `DistillationTrainer`'s): the prepared teacher model in this process, None when none is (a
        # served teacher, several teachers)
        self.teacher_model = self.teacher.model
        # The teacher the probe's disagreement scores on the probe prompts (StateLoggingCallback): none for a teacher
        # that reads prompts of its own, which the probe prompts do not hold
        self.probe_teacher_model = None if self.teacher.reads_own_prompts else self.teacher.model
        if self.use_vllm and args.signal != "reverse_kl":
            # Only the reverse_kl policy gradient runs on tokens vLLM sampled; continuation trains on the teacher's
            # tokens and divergence on full distributions (TRL's DistillationTrainer applies no ratio either)
            self.vllm_importance_sampling_correction = False

    @property
    def state_teacher_names(self) -> tuple[str, ...]:  # the records tell the rows of several teachers apart
        return self.teacher.names

    def train(self, *args, **kwargs):
        with self.teacher.session():  # a served teacher's background requests, with `teacher_server_overlap`
            return super().train(*args, **kwargs)

    def _tokens_after_prompt(self) -> int:
        """A continuation can start at the rollout's last token: up to `continuation_length` more tokens."""
        extra = self.args.continuation_length if self.args.signal == "continuation" else 0
        return self.args.max_completion_length + extra

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # The `dataset` state source reads each row's reference answer: keep its column with remove_unused_columns
        if (
            self.args.state_source_mix.get("dataset", 0.0) > 0
            and self.args.reference_column not in self._signature_columns
        ):
            self._signature_columns = [*self._signature_columns, self.args.reference_column]
        # Each row's teacher (with several) and its privileged context (a self teacher's prompt)
        for column in ("teacher_id", "privileged_context"):
            if column not in self._signature_columns:
                self._signature_columns = [*self._signature_columns, column]

    # ----- checkpoints: the source/cut-point generator (and the teacher's state) travel with the RNG states -------
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        self.teacher.save_state(output_dir)  # an EMA self teacher's weights
        path = Path(output_dir) / SOURCE_RNG_FILE.format(rank=self.args.process_index)
        # `micro_step`: GRPO's count of micro-batches, to tell at resume whether the checkpoint is inside a generation
        torch.save({"source_generator": self._source_generator.get_state(), "micro_step": self._step}, path)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        self.teacher.load_state(checkpoint)
        path = Path(checkpoint) / SOURCE_RNG_FILE.format(rank=self.args.process_index)
        saved = torch.load(path, weights_only=True) if path.is_file() else {}
        self._check_resume_at_generation_boundary(checkpoint, saved.get("micro_step"))
        if not saved:
            logger.warning(
                "%s not found: state sources and cut points after this resume differ from an uninterrupted run's", path
            )
            return
        self._source_generator.set_state(saved["source_generator"])

    def _check_resume_at_generation_boundary(self, checkpoint: str, micro_step: int | None) -> None:
        """GRPO keeps a generation batch's rollouts in memory only (and restarts its micro-batch count at 0): resumed
        inside one, it would sample new rollouts for the rest of that batch and train some micro-batches twice."""
        if micro_step is None:  # a checkpoint from before the count was saved: every window was full
            micro_step = self.state.global_step * self.args.gradient_accumulation_steps
        spg = self.args.steps_per_generation
        if micro_step % spg != 0:
            steps = spg // math.gcd(spg, self.args.gradient_accumulation_steps)
            raise ValueError(
                f"cannot resume from {checkpoint}: it was saved after {micro_step} micro-batches, inside a generation "
                f"batch of steps_per_generation={spg} micro-batches (gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}), whose rollouts a checkpoint does not hold; resuming would "
                f"sample new ones for its rest and train some micro-batches twice. Resume from a checkpoint saved at a "
                f"multiple of {steps} steps (set save_steps to one), or restart the run."
            )

    # ----- the offline teacher cache (`teacher_cache_steps`): reused generation batches -----------------------------
    def _prepare_inputs(self, generation_batch):
        """With the teacher cache, at each optimizer step's first micro-batch the cache decides (on every rank alike)
        whether this step trains on the buffered generation batch again, without sampling or calling the teacher, or
        GRPO samples and scores a new one; each micro-batch says which (`cache.CACHE_AGE`)."""
        if self.teacher_cache is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        if self._step % spg == 0 and self.teacher_cache.serves_from_cache():
            inputs = self._buffered_inputs[0]
        else:  # a refresh (GRPO samples: the buffer was dropped), or a later micro-batch of this step
            inputs = super()._prepare_inputs(generation_batch)
        inputs[CACHE_AGE] = self.teacher_cache.age
        return inputs

    def _collect_state_records(self, sample_rate: float, seed: int = 0):
        """The step's records; with the teacher cache, each sampled sequence says whether it was trained from the
        cache (`from_cache`) and the cached batch's age (`cache_age`: 0 on a refresh)."""
        records = super()._collect_state_records(sample_rate, seed=seed)
        if self.teacher_cache is not None:
            for sample in records.samples or []:
                sample.update(from_cache=self.teacher_cache.refreshed is None, cache_age=self.teacher_cache.age)
        return records

    # ----- rollouts: whose states -----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        draws = torch.multinomial(self._source_probs, len(inputs), replacement=True, generator=self._source_generator)
        batch = RolloutBatch(
            rows=inputs,
            sources=[MIX_SOURCES[i] for i in draws.tolist()],
            references=[row.get(self.args.reference_column) for row in inputs],
            teachers=self._check_rows_on_every_rank(inputs),
        )
        # GRPO calls `_generate(prompts)` and `_get_per_token_logps_and_entropies` from inside its own method, with
        # arguments it fixes: the batch reaches them through this one attribute, held for the duration of the call
        self._rollout_batch = batch
        try:
            output = super()._generate_and_score_completions(inputs)  # calls `_generate` below, then the rewards
        finally:
            self._rollout_batch = None
        if not self._has_rewards:  # GRPO scored the rollouts with `no_reward`: drop what it logged of those zeros
            for key in REWARD_METRICS:
                self._metrics["train" if self.model.training else "eval"].pop(key, None)
            self._logs["rewards"].pop(no_reward.__name__, None)
            output.pop("rewards", None)  # the ledger's sequences then carry no reward
        device = output["completion_ids"].device
        output["row_source"] = torch.tensor([source_code(s) for s in batch.sources], device=device)
        output["teacher"] = batch.teachers  # a list: GRPO shuffles and splits it with the rows
        output["teacher_prompt_ids"] = batch.teacher_prompts  # the prompt the teacher reads, per row (a list too)
        if self.args.signal == "continuation":
            return self._continue_with_teacher(output)
        # One `TeacherRow` per row (read in the loss), or None: an in-process teacher's divergence is computed there
        if self._selects_states():  # the rewards are in: the teacher scores the rows not skipped
            output["teacher_scores"] = select_and_score(self, batch, output)
        else:
            output["teacher_scores"] = batch.teacher_scores
        return output

    def _selects_states(self) -> bool:
        """Whether this batch's rollouts are selected for the teacher by their rewards (`skip_correct_rollouts`; in
        training only, evaluation scores every rollout)."""
        return self.args.skip_correct_rollouts and self.model.training

    def _check_rows_on_every_rank(self, inputs: list[dict]) -> list[str | None]:
        """Each row's teacher, once this batch's rows hold what the run reads (`check_rows`). A bad row stops every
        process here, before the batch's first collective: raised on its own process only, it would leave the others
        waiting in the next one until the launcher's timeout. A map dataset's rows were checked when the trainer was
        built; this is what catches an IterableDataset's (one flag per process gathered, once per generation batch)."""
        error, teachers = None, None
        try:
            check_rows({name: [row.get(name) for row in inputs] for name in row_columns(self.args)}, self.args)
            teachers = self.teacher.route([row.get("teacher_id") for row in inputs])
        except ValueError as raised:
            error = raised
        failed = gather_counts(self.accelerator, int(error is not None))
        if error is not None:
            raise error
        if any(failed):
            raise ValueError(
                f"process {failed.index(1)} found a bad row in its batch (its error is in its log); every process "
                "stops here"
            )
        return teachers

    def _generate(self, prompts):
        length = self._set_rollout_length()
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(
            prompts
        )
        batch = self._rollout_batch
        # The teacher reads its own prompts (a self teacher's hold the row's privileged context), the student its own
        batch.teacher_prompts = teacher_prompts = self.teacher.prompts(prompt_ids, batch.rows)
        self._count_teacher_context(teacher_prompts, prompt_ids)
        swap = [i for i, s in enumerate(batch.sources) if s != "learner"]
        teacher_rows = [i for i in swap if batch.sources[i] == "teacher"]
        # Asked on every rank, with or without rows of its own (an in-process teacher's generation is collective)
        rollouts = self.teacher.generate(
            [teacher_prompts[i] for i in teacher_rows],
            length,
            teachers=[batch.teachers[i] for i in teacher_rows],
        )
        self._count_teacher_tokens(rollouts)
        replacement = dict(zip(teacher_rows, rollouts))
        if swap:
            for i in swap:
                ids = replacement[i] if i in replacement else self._reference_ids(batch.references[i], length)
                completion_ids[i] = ids
                text = self._tokenizer.decode(ids, skip_special_tokens=True)
                completions[i] = [{"role": "assistant", "content": text}] if isinstance(prompts[i], list) else text
        if self.args.signal != "continuation" and self._selects_states():
            batch.completion_ids = completion_ids  # scored once GRPO has the rewards (`selection.select_and_score`)
        elif self.args.signal != "continuation":
            # The tokens to score are final here: start scoring now, so that a served teacher's round trip (with
            # `teacher_server_overlap`) runs while GRPO pads the batch, computes rewards (and, under vLLM, the
            # student's old log-probs) and the first micro-batch's forward runs. Rows GRPO masks later (truncated
            # completions) are zeroed when the answer is read.
            distribution = self.args.signal == "divergence"
            batch.teacher_scores = self.teacher.score(
                teacher_prompts, completion_ids, distribution, teachers=batch.teachers
            )
            # (an in-process teacher's `divergence` scores them in the loss: the same rows, counted here)
            self._count_teacher_tokens(completion_ids)
        # From here until the batch is returned GRPO scores the rollouts with the student (its old log-probs), which
        # no OPD loss reads: `_get_per_token_logps_and_entropies` skips that forward. (The teacher's scoring above
        # runs first: a live self teacher is the student.)
        batch.scoring_rollouts = True
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    def _reference_ids(self, reference, length: int) -> list[int]:
        """The dataset's reference answer as completion tokens, ended by eos like a finished rollout; one that does not
        fit in the rollout `length` with its eos is cut there without one, like a rollout that hit the limit (so
        `mask_truncated_completions` masks it as GRPO masks those)."""
        text = reference[-1]["content"] if isinstance(reference, list) else reference
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return ids[:length]
        return ids + [self.eos_token_ids[0]]

    def _set_rollout_length(self) -> int:
        """This generation batch's tokens per rollout, set where GRPO's generation reads it: `max_completion_length`,
        or the `horizon` grown by `horizon_growth` per optimizer step so far, up to it. The same on every rank (it
        depends on the step only), and again after a resume."""
        length = self.max_completion_length
        if self.args.horizon is not None:
            length = min(self.args.horizon + self.args.horizon_growth * self.state.global_step, length)
        if self.use_vllm:
            self.vllm_generation.max_completion_length = length
        else:
            self.generation_config.max_new_tokens = self.generation_kwargs["max_new_tokens"] = length
        self._rollout_length = length
        return length

    def _step_trace(self) -> dict[str, float]:
        """The lever settings the optimizer step ran with, for its ledger line: the rollout `horizon` when one is set;
        with state selection, the rollouts the teacher skipped as correct and rechecked since the last line, and the
        prompt and completion tokens it did not read (`teacher_skipped_tokens`, all ranks: called on every rank); with
        the teacher cache, whether the step refreshed it and its staleness (`TeacherCache.step_trace`)."""
        trace = {} if self.args.horizon is None else {"horizon": float(self._rollout_length)}
        if self.teacher_cache is not None:
            trace.update(self.teacher_cache.step_trace())
        if self.args.skip_correct_rollouts:
            counts = self.accelerator.gather(torch.tensor([self._selection_counts], device=self.accelerator.device))
            skipped, rechecked, tokens = counts.sum(0).tolist()
            self._selection_counts = [0, 0, 0]
            trace.update(
                {
                    "selection/skipped": float(skipped),
                    "selection/rechecked": float(rechecked),
                    "selection/correct": float(skipped + rechecked),
                    "teacher_skipped_tokens": float(tokens),
                }
            )
        return trace

    def _continue_with_teacher(self, output: dict) -> dict:
        """Cut each rollout at a uniformly drawn prefix length and append a teacher continuation from there. A rollout
        GRPO masked whole (truncated, with `mask_truncated_completions`) is neither cut nor continued: it supervises
        nothing, as in GRPO, and is left as one masked padding token."""
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        lengths = completion_mask.sum(1).cpu()
        cuts = (torch.rand(len(lengths), generator=self._source_generator) * lengths.clamp(min=1)).long()
        cuts = torch.minimum(cuts, lengths)
        prefixes = [completion_ids[i, : cuts[i]].tolist() for i in range(len(cuts))]
        prompts = output["teacher_prompt_ids"]  # the teacher continues the student's prefix after its own prompt
        # Every rollout holds at least its first token (or eos) unless GRPO masked it whole
        kept = [i for i in range(len(cuts)) if lengths[i] > 0]
        continuations = [[] for _ in cuts]
        # Asked on every rank, even one whose rows are all masked (an in-process teacher's generation is collective)
        written = self.teacher.generate(
            [prompts[i] for i in kept],
            self.args.continuation_length,
            prefixes=[prefixes[i] for i in kept],
            teachers=[output["teacher"][i] for i in kept],
        )
        for i, continuation in zip(kept, written):
            continuations[i] = continuation
        self._count_teacher_tokens(written)

        device = completion_ids.device
        pad_id = self._tokenizer.pad_token_id
        sequences = [p + c for p, c in zip(prefixes, continuations)]
        rows = [torch.tensor(s or [pad_id], dtype=torch.long) for s in sequences]  # an empty row: one masked pad
        output["completion_ids"] = pad(rows, padding_value=pad_id).to(device)
        masks = [torch.full_like(r, int(bool(s))) for r, s in zip(rows, sequences)]
        output["completion_mask"] = pad(masks, padding_value=0).to(device)
        positions = torch.arange(output["completion_ids"].size(1), device=device)
        cut = cuts.to(device)[:, None]
        ends = cut + torch.tensor([len(c) for c in continuations], device=device)[:, None]
        output["loss_mask"] = ((positions >= cut) & (positions < ends)).long()
        # The first teacher token is predicted from the rollout's own state; later ones from states the teacher wrote
        output["token_source"] = torch.where(positions > cut, TEACHER, output["row_source"][:, None])
        output["num_items_in_batch"] = self.accelerator.gather(output["loss_mask"].sum()).sum()
        for stale in (
            "old_per_token_logps",
            "sampling_per_token_logps",
            "importance_sampling_ratio",
            "ref_per_token_logps",
        ):
            output.pop(stale, None)  # computed for the rollouts before the cut; the loss here does not use them
        output["teacher_scores"] = self.teacher.score(prompts, sequences, teachers=output["teacher"])
        self._count_teacher_tokens(sequences)
        return output

    def _resolve_teacher_logps(self, inputs: dict) -> torch.Tensor:
        """The teacher's log-prob of each completion token, `(B, T)` like `completion_ids`, 0 where `completion_mask`
        is 0, once the teacher's answer is in (a failed served request raises its `TeacherServerError` here, in the
        training thread)."""
        return resolve_rows(inputs["teacher_scores"], inputs["completion_ids"], inputs["completion_mask"]).logps

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """Log-probs (and entropies) of the completion tokens, `(B, T)`, projecting only the completion positions
        onto the vocabulary.

        On devices without Triton (CPU) TRL's fused LM head projects every position, the prompt's too, though only
        the completion is scored; at a large vocabulary that projection and its recomputation in the backward are
        most of the step (see BENCHMARKS.md). Same kernel, same values (LM-head bias, logit scale and final
        soft-capping included). Triton devices (where TRL's head already skips unscored positions), multimodal or MoE
        calls, heads that upcast their logits and tensor-parallel heads keep TRL's path.

        While GRPO scores freshly sampled rollouts with the student (its old log-probs, for clipped importance ratios
        when `steps_per_generation` does not divide `gradient_accumulation_steps`), no forward runs and `None` is
        returned: no OPD loss reads them. The one exception is the vLLM importance-sampling correction of `reverse_kl`.
        """
        if (
            self._rollout_batch is not None
            and self._rollout_batch.scoring_rollouts
            and model is self.model
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        ):
            return None, None, None
        unwrapped = self.accelerator.unwrap_model(model)
        if (
            kwargs.get("compute_aux_loss")
            or any(value is not None for key, value in kwargs.items() if key != "compute_aux_loss")
            or self.args.cast_lm_head_to_fp32
            or _use_triton(input_ids.device)  # there TRL's head already projects the scored positions only
            or isinstance(unwrapped.get_output_embeddings().weight, DTensor)
        ):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                **kwargs,
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                chunk_logps, chunk_entropies = self._forward_redirection(
                    model,
                    unwrapped,
                    _completion_logps_and_entropies,
                    unwrapped,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    self.temperature,
                    compute_entropy,
                )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
        logps = torch.cat(logps)
        entropies = torch.cat(entropies) if compute_entropy else None
        if compute_entropy:  # as StateLensGRPOTrainer does: the loss's own tensors, for the records
            self._loss_logps_and_entropies = (logps, entropies)
        return logps, entropies, None

    # ----- the loss: what the teacher says there ------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        num_completion = completion_ids.size(1)
        loss_mask = inputs.get("loss_mask", completion_mask).float()
        if "tool_mask" in inputs:  # tool and environment outputs are not the model's tokens: never supervised
            loss_mask = loss_mask * inputs["tool_mask"]
        token_source = inputs.get("token_source", inputs["row_source"][:, None].expand_as(completion_ids))
        # Token mean over one optimizer step, as GRPO's DAPO loss: `num_items_in_batch` counts the whole generation
        # batch (all processes), which spans steps_per_generation micro-batches, of which one step accumulates
        # gradient_accumulation_steps
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if self.model.training:
            # (the Trainer sets current_gradient_accumulation_steps in its loop; the last window of an epoch is shorter)
            accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            normalizer = normalizer * accumulation / self.args.steps_per_generation

        # State selection: each row's code (`selection.SKIPPED` rows have a zero loss_mask and no teacher scores)
        selection = inputs.get("teacher_selection")
        skipped = None if selection is None else (selection == SKIPPED)[:, None]
        if self.args.signal == "divergence":
            unwrapped = self.accelerator.unwrap_model(model)
            loss, logps, entropies, teacher_logps, aux_loss = self._forward_redirection(
                model,
                unwrapped,
                self._divergence_loss,
                unwrapped,
                inputs,
                input_ids,
                attention_mask,
                loss_mask,
                normalizer,
            )
            weights = 1.0
        else:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                num_completion,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
            )
            self._loss_logps_and_entropies = None  # recorded below, with per-token sources and teacher log-probs
            teacher_logps = self._resolve_teacher_logps(inputs)  # waits here for a served teacher's answer
            if self.args.signal == "reverse_kl":
                weights = self._reverse_kl_advantages(logps.detach(), teacher_logps, loss_mask)
                if self.args.reward_weight:
                    weights = weights + self.args.reward_weight * inputs["advantages"][:, None] * loss_mask
                per_token_loss = -weights * logps * loss_mask
                if self.use_vllm and self.vllm_importance_sampling_correction:  # as GRPO: vLLM sampled the tokens
                    per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
                loss = per_token_loss.sum() / normalizer
            else:  # continuation: cross-entropy on the teacher's tokens
                weights = 1.0
                loss = -(logps * loss_mask).sum() / normalizer
        if self.aux_loss_enabled:  # a MoE student's router load-balancing loss, added and logged as GRPO does
            loss = loss + self.router_aux_loss_coef * aux_loss / (accumulation if self.model.training else 1.0)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        if self.teacher_cache is not None and self.model.training:  # the staleness of the batch trained on
            self.teacher_cache.observe(inputs, logps)
        scored = completion_mask.bool() if skipped is None else completion_mask.bool() & ~skipped
        self._log_teacher_metrics(
            logps.detach(), teacher_logps, entropies, scored, loss_mask, token_source, inputs["teacher"]
        )
        if self.model.training:
            align = lambda x: F.pad(x, (prompt_ids.size(1), 0))  # noqa: E731 (completion -> full sequence)
            recorded = loss_mask.bool()
            if skipped is not None:  # a skipped rollout's states are recorded too, with weight 0 and no teacher
                model_tokens = completion_mask * inputs.get("tool_mask", torch.ones_like(completion_mask))
                recorded = recorded | (skipped & model_tokens.bool())
                weights = torch.as_tensor(weights, device=logps.device).expand_as(logps).masked_fill(skipped, 0.0)
                teacher_logps = teacher_logps.masked_fill(skipped, float("nan"))
            self._record_states(
                input_ids=input_ids,
                supervised_mask=align(recorded),
                logps=align(logps),
                entropy=align(entropies),
                source=align(token_source),
                prefix_len=align(torch.arange(num_completion, device=input_ids.device).expand_as(completion_ids)),
                attention_mask=attention_mask,
                # Continuation tokens are the teacher's own samples: the records' `teacher_kl/supervised` (over
                # tokens the learner sampled) has nothing to average there; `teacher_kl/sampled` covers the prefix.
                teacher_logps=None if self.args.signal == "continuation" else align(teacher_logps),
                weights=weights if isinstance(weights, float) else align(weights),
                rewards=inputs.get("rewards"),
                teachers=inputs["teacher"] if self.teacher.names else None,
                teacher_prompts=inputs["teacher_prompt_ids"] if self.teacher.reads_own_prompts else None,
                selection=selection,
            )
        return loss

    def _reverse_kl_advantages(self, logps, teacher_logps, mask):
        """`A_t = -sum_k gamma^k (log p_S - log p_T)_{t+k}` over the valid tokens of each row."""
        kl = (logps - teacher_logps) * mask
        if self.args.kl_discount > 0:
            kl = _discounted_reverse_cumsum(kl, self.args.kl_discount)
        return -kl * mask

    def _divergence_loss(self, unwrapped, inputs, input_ids, attention_mask, loss_mask, normalizer):
        """Runs inside the student wrapper's forward (so DDP/DeepSpeed see one forward): the teacher's divergence loss
        on the student's final hidden states (full-vocabulary generalised JSD in-process, top-k plus tail from a
        server), plus the per-token log-probs and entropies the records need (an in-process teacher's pass gives them),
        and a MoE student's router load-balancing loss (`None` unless GRPO's `aux_loss_enabled`)."""
        num_completion = inputs["completion_ids"].size(1)
        if self.aux_loss_enabled:
            student_hidden, aux_loss = _completion_hidden_states_and_aux_loss(
                unwrapped, input_ids, attention_mask, num_completion
            )
        else:
            student_hidden = _completion_hidden_states(unwrapped, input_ids, attention_mask, num_completion)
            aux_loss = None
        if "teacher_selection" in inputs:  # state selection: only the rows not skipped reach the teacher
            out = divergence_on_scored_rows(self, unwrapped, student_hidden, inputs, loss_mask, normalizer)
        else:
            out = self.teacher.divergence_loss(
                unwrapped, student_hidden, inputs, loss_mask, normalizer, self.args.jsd_beta, self.temperature
            )
        logps, entropies = out.logps, out.entropies
        if logps is None:  # a served teacher's loss projects the supervised positions only: one more pass here
            with torch.no_grad():
                tokens = inputs["completion_ids"]
                logps, entropies = _head_logps(unwrapped, student_hidden.detach(), tokens, self.temperature, True)
        return out.loss, logps, entropies, out.teacher_logps, aux_loss

    def _log_teacher_metrics(self, logps, teacher_logps, entropies, scored, loss_mask, token_source, teachers):
        """`teacher_kl/sampled` (the sampled reverse KL `log p_S - log p_T`, a one-sample estimate of KL(p_S || p_T))
        and `teacher_nll`, means over every completion token the student sampled itself (supervised or not) in the
        rows the teacher scored (`scored`: the completion mask, less the rows state selection skipped); with
        several teachers, `teacher_kl/sampled/<name>` per teacher too (each row's `teachers` entry). Supervised
        tokens per teacher are counted per optimizer step by the state records (`StateLoggingCallback`)."""
        mode = "train" if self.model.training else "eval"
        sampled = scored & (token_source == LEARNER)
        if self.args.signal == "continuation":
            sampled &= ~loss_mask.bool()  # the student's own prefix; the rest was written by the teacher
        kl = (logps - teacher_logps) * sampled
        per_teacher = []
        for name in self.teacher.names:
            rows = torch.tensor([t == name for t in teachers], device=kl.device)[:, None]
            per_teacher += [(kl * rows).sum(), (sampled & rows).sum().float()]
        sums = torch.stack(
            [
                kl.sum(),
                (-teacher_logps * sampled).sum(),
                sampled.sum().float(),
                (entropies * loss_mask).sum(),
                loss_mask.sum(),
                *per_teacher,
            ]
        )
        totals = self.accelerator.gather(sums[None]).sum(0).tolist()
        kl_sum, nll_sum, count, entropy_sum, supervised = totals[:5]
        for i, name in enumerate(self.teacher.names):
            teacher_kl_sum, teacher_count = totals[5 + 2 * i : 7 + 2 * i]
            if teacher_count > 0:
                self._metrics[mode][f"teacher_kl/sampled/{name}"].append(teacher_kl_sum / teacher_count)
        if count > 0:
            self._metrics[mode]["teacher_kl/sampled"].append(kl_sum / count)
            self._metrics[mode]["teacher_nll"].append(nll_sum / count)
        if supervised > 0:
            self._metrics[mode]["entropy"].append(entropy_sum / supervised)


def _discounted_reverse_cumsum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """`y_t = sum_{s >= t} gamma^(s - t) x_s` along dim 1, as `y_t = x_t + gamma y_{t+1}` from the last position:
    O(B*T) memory, where a `(T, T)` discount matrix takes about 1 GiB at T = 16k. (Scaling by `gamma^-t` to use
    `cumsum` would overflow on long rows.)"""
    out = torch.empty_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in range(x.size(1) - 1, -1, -1):
        running = x[:, t] + gamma * running
        out[:, t] = running
    return out
