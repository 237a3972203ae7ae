"""`OnPolicyDistillTrainer`: the student's states, the teacher's signal.

Built on [`StateLensGRPOTrainer`]: TRL's GRPO machinery samples the rollouts (plain `generate` or vLLM, PEFT,
gradient accumulation, accelerate/DeepSpeed all keep working), this trainer decides per sample whose states are
supervised (`state_source_mix`) and what the teacher says there (`signal`), and records every supervised state.

The rollouts (`rollouts.py`: whose states, the teacher's prompts, rollouts and continuations) and the loss (`loss.py`:
each signal's loss, the records and teacher metrics) are mixed in; this module builds the trainer and its teacher,
and holds what travels with checkpoints; the per-step counts of the teacher and its budget levers are its
`step_counts` ([`StepCounts`]).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import PreTrainedModel
from trl.models.utils import _ForwardRedirection

from .. import collective
from ..guards import check_mode
from ..lens.step_counts import StepCounts
from ..teachers import (
    SelfTeacher,
    TeacherRouter,
    load_teacher,
    load_teachers,
    read_tokenizer,
    served_teacher,
    teacher_in_process,
)
from ..teachers.in_process import InProcessTeacher
from ..teachers.self_teacher import SHARED_PREFIX_COUNTS
from ..trainers.grpo import StateLensGRPOTrainer
from .cache import TeacherCache
from .checks import (
    check_datasets,
    check_teacher_prompt_lengths,
    check_teacher_settings_are_read,
    is_url,
    refuse_reading_student_text,
    refuse_unread_top_k,
    teacher_checks,
)
from .config import MIX_SOURCES, OnPolicyDistillConfig
from .loss import LossMixin
from .rollouts import LEARNER, RolloutBatch, RolloutsMixin, no_reward
from .selection import SELECTION_COUNTS

logger = logging.getLogger(__name__)
SOURCE_RNG_FILE = "statelens_source_rng_{rank}.pth"  # in each checkpoint, one per process
# The teacher's writing of `teacher` states, per step: its prompts' tokens and the tokens it wrote (`ComputeCounter`)
TEACHER_GENERATION_COUNTS = ("teacher_generation_prompt_tokens", "teacher_written_tokens")


def _student_tokenizer(model, processing_class):
    """The student's tokenizer before anything loads: the one given (a processor holds one), else the one saved at the
    student's path; `None` if neither is known yet."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return read_tokenizer(model) if tokenizer is None and isinstance(model, str) else tokenizer


class OnPolicyDistillTrainer(RolloutsMixin, LossMixin, StateLensGRPOTrainer):
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
        check_mode(args.guards)
        check_datasets(train_dataset, eval_dataset, teacher_model, args)
        check_teacher_settings_are_read(teacher_model, args)
        if args.skip_correct_rollouts and not reward_funcs:
            raise ValueError(
                "skip_correct_rollouts=True skips the rollouts whose reward reaches correct_reward, but no reward_funcs "
                "were given: without them every rollout is rewarded 0 by `no_reward` and nothing would ever be "
                "skipped. Pass reward_funcs (the lab's: trl_statelens.evaluation.rewards.gsm8k_accuracy_reward), or leave "
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
            check = teacher_checks(
                args, _student_tokenizer(model, processing_class), model, train_dataset, eval_dataset
            )
            crosses = []
            for name, teacher in teacher_model.items():
                if isinstance(teacher, str) and not teacher.startswith(("http://", "https://")):
                    try:
                        crosses.append(check(teacher))
                    except ValueError as error:
                        raise ValueError(f"teacher {name!r}: {error}") from error
                else:
                    crosses.append(None)  # an instance or a server: known once it is reached
            refuse_reading_student_text(args, crosses)
            # a served one, given by URL alone, shares the student's tokenizer
            refuse_unread_top_k(args, [False for t in teacher_model.values() if is_url(t)])
            loaded_teachers = load_teachers(teacher_model, args)
        elif args.teacher_model_server_url is not None:
            if not (teacher_model is None or isinstance(teacher_model, str)):
                raise ValueError(
                    "teacher_model_server_url serves the teacher, so teacher_model must not be a model instance: "
                    "omit it, or give the teacher's path or hub id to check its tokenizer against the student's "
                    "(its weights are not loaded)"
                )
            teacher_path, teacher_model = teacher_model, None
            crosses = False  # given by URL alone, it shares the student's tokenizer
            if teacher_path is not None:
                check = teacher_checks(
                    args, _student_tokenizer(model, processing_class), model, train_dataset, eval_dataset
                )
                crosses = check(teacher_path, served=True)
                refuse_reading_student_text(args, [crosses])
            refuse_unread_top_k(args, [crosses])
        elif teacher_model is None:
            raise ValueError(
                "OnPolicyDistillTrainer needs a teacher_model (an instance, a path or a hub id), or the address of a "
                "vLLM server running it in args.teacher_model_server_url"
            )
        elif isinstance(teacher_model, str):
            teacher_path = teacher_model
            check = teacher_checks(
                args, _student_tokenizer(model, processing_class), model, train_dataset, eval_dataset
            )
            refuse_reading_student_text(args, [check(teacher_path)])
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
            guards=args.guards,
            preflight=args.preflight,
            preflight_prompts=args.preflight_prompts,
        )
        self._has_rewards = reward_funcs is not None
        # Per-sample state sources and cut points are drawn from their own generator, never the training RNG (so are
        # a served teacher's sampling seeds)
        self._source_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._source_probs = torch.tensor([args.state_source_mix.get(s, 0.0) for s in MIX_SOURCES])
        self._rollout_batch: RolloutBatch | None = None  # while a generation batch is made (see `RolloutBatch`)
        # This rank's counts of the optimizer step in progress, reset at each step's first count whether or not a
        # StateLoggingCallback reads them: the records' `teacher_tokens` (`_count_teacher_tokens`), state selection's
        # (`selection.py`) and the teacher cache's (`cache.py`)
        self.step_counts = StepCounts(self)
        self._rollout_length = self.max_completion_length  # this generation batch's (`_set_rollout_length`)
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
            self.teacher = served_teacher(self, teacher_path)
        else:
            self.teacher = teacher_in_process(self, teacher_model, teacher_path)
        if not self.teacher.crosses_tokenizers:
            refuse_reading_student_text(args, [False])
        if args.teacher_row_shift and type(self.teacher) is not InProcessTeacher:
            raise ValueError(
                f"teacher_row_shift={args.teacher_row_shift} needs one in-process teacher of the student's tokenizer, "
                f"got a {type(self.teacher).__name__}: give one such teacher, or leave teacher_row_shift=0"
            )
        self._suppress_unreadable_ids()
        check_teacher_prompt_lengths(self)  # a self teacher checked its own before its copy was made
        # TRL's name (as `DistillationTrainer`'s): the prepared teacher model in this process, None when none is (a
        # served teacher, several teachers)
        self.teacher_model = self.teacher.model
        # The teacher the probe's disagreement scores on the probe prompts (StateLoggingCallback): none for a teacher
        # that reads prompts of its own or a privileged context, which the probe prompts do not hold
        reads_probes = (
            self.teacher.reads_student_ids
            and not self.teacher.reads_own_prompts
            and not self.args.teacher_reads_context
        )
        self.probe_teacher_model = self.teacher.model if reads_probes else None
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
        GRPO samples and scores a new one; each micro-batch carries its cache slot (`TeacherCache.attach`)."""
        if self.teacher_cache is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        first = self._step % self.args.steps_per_generation == 0
        if first and self.teacher_cache.advance_or_refresh(self._buffered_inputs):
            inputs = self._buffered_inputs[0]
        else:  # a refresh, or a later micro-batch of this step
            if first:  # without a buffered batch GRPO samples and scores a new one
                self._buffered_inputs = None
            inputs = super()._prepare_inputs(generation_batch)
        self.teacher_cache.attach(inputs)
        return inputs

    def _collect_state_records(self, sample_rate: float, seed: int = 0):
        """The step's records; with the teacher cache, each sampled sequence says whether it was trained from the
        cache (`from_cache`) and the cached batch's age (`cache_age`: 0 on a refresh)."""
        records = super()._collect_state_records(sample_rate, seed=seed)
        if self.teacher_cache is not None:
            for sample in records.samples or []:
                sample.update(from_cache=self.teacher_cache.refreshed is None, cache_age=self.teacher_cache.age)
        return records

    def _step_trace(self) -> dict[str, float]:
        """The lever settings the optimizer step ran with, for its ledger line: the rollout `horizon` when one is set;
        with state selection, the rollouts the teacher skipped as correct and rechecked since the last line, and the
        prompt and completion tokens it did not read (`teacher_skipped_tokens`, all ranks: called on every rank); with
        the teacher cache, whether the step refreshed it and its staleness (`TeacherCache.step_trace`); with `teacher`
        states, the tokens of the teacher's forwards writing them (`TEACHER_GENERATION_COUNTS`, all ranks); with a self
        teacher, the prompt positions of its scoring that a shared prompt start's one forward stood in for and that
        forward's tokens each time it ran, and what it saved the teacher's writing (`SHARED_PREFIX_COUNTS`, all
        ranks)."""
        trace = {} if self.args.horizon is None else {"horizon": float(self._rollout_length)}
        if self.args.state_source_mix.get("teacher", 0.0) > 0:
            counts = torch.tensor(self.step_counts.take(*TEACHER_GENERATION_COUNTS))
            counts = collective.sum_over_ranks(self.accelerator, counts)  # its forwards writing `teacher` states
            trace.update(zip(TEACHER_GENERATION_COUNTS, map(float, counts)))
        if self.teacher_cache is not None:
            trace.update(self.teacher_cache.step_trace())
        if self.teacher.reads_own_prompts:  # a self teacher's scoring and writing may run a shared prompt start once
            counts = torch.tensor(self.step_counts.take(*SHARED_PREFIX_COUNTS), dtype=torch.float32)
            counts = collective.sum_over_ranks(self.accelerator, counts)
            trace.update(zip(SHARED_PREFIX_COUNTS, map(float, counts)))
        if self.args.skip_correct_rollouts:
            counts = torch.tensor(self.step_counts.take(*SELECTION_COUNTS))
            skipped, rechecked, tokens = collective.sum_over_ranks(self.accelerator, counts)
            trace.update(
                {
                    "selection/skipped": float(skipped),
                    "selection/rechecked": float(rechecked),
                    "selection/correct": float(skipped + rechecked),
                    "teacher_skipped_tokens": float(tokens),
                }
            )
        return trace

    def _teachers_by_name(self) -> dict:
        """Each teacher by the name `Teacher.route` gives its rows (`None` for a single teacher)."""
        return getattr(self.teacher, "teachers", None) or {None: self.teacher}

    def _own_tokens_written(self) -> int:
        """The tokens the teachers of another tokenizer have written so far, in their own tokens
        (`ReadsText.own_tokens_written`)."""
        return sum(getattr(teacher, "own_tokens_written", 0) for teacher in self._teachers_by_name().values())

    def _count_teacher_generation(
        self, prompts: list[list[int]], rollouts: list[list[int]], teachers: list, own_written: int
    ) -> None:
        """Count the teacher's writing of this rank's `teacher` states (its own rows: a stand-in generation that only
        joins the other ranks' is never passed) for the step's FLOPs: its forward over each rollout's prompt (its own
        tokens) and the tokens it wrote (`TEACHER_GENERATION_COUNTS`), in its own tokens too: a teacher of another
        tokenizer's are `own_written` (what its forwards ran over), not the student's tokens it gave them back as;
        the others' are the rollouts'. `teachers`: each rollout's teacher's name. Training only."""
        if self.model.training:
            by_name = self._teachers_by_name()
            written = own_written + sum(
                len(r) for r, name in zip(rollouts, teachers) if not by_name[name].crosses_tokenizers
            )
            self.step_counts.add(
                teacher_generation_prompt_tokens=sum(len(p) for p in prompts), teacher_written_tokens=written
            )
