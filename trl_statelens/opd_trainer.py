"""`OnPolicyDistillTrainer`: the student's states, the teacher's signal.

Built on [`StateLensGRPOTrainer`]: TRL's GRPO machinery samples the rollouts (plain `generate` or vLLM, PEFT,
gradient accumulation, accelerate/DeepSpeed all keep working), this trainer decides per sample whose states are
supervised (`state_source_mix`) and what the teacher says there (`signal`), and records every supervised state.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils.peft_utils import find_adapter_config_file
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_logprob import _use_triton
from trl.models import prepare_deepspeed, unwrap_model_for_generation
from trl.models.utils import _ForwardRedirection
from trl.trainer.distillation_trainer import _chunked_divergence_loss
from trl.trainer.utils import (
    add_fused_lm_head,
    create_model_from_path,
    maybe_gather_lm_head_ctx,
    pad,
)

from .callback import trainer_generation_config
from .checks import check_train_dataset
from .grpo_trainer import StateLensGRPOTrainer
from .opd_config import MIX_SOURCES, OnPolicyDistillConfig
from .records import source_code

logger = logging.getLogger(__name__)
SOURCE_RNG_FILE = "statelens_source_rng_{rank}.pth"  # in each checkpoint, one per process

LEARNER, DATASET, TEACHER = (source_code(s) for s in ("learner", "dataset", "teacher"))
# Vocabulary columns per projection tile in the completion log-prob path (TRL's fused head uses 32768). On CPU a
# 4096-wide tile is as fast, and at V=32k it cuts the step's peak memory by about a third (BENCHMARKS.md).
VOCAB_CHUNK = 4096


class ServedTeacherRow(NamedTuple):
    """Row `index` of a scoring request sent to the teacher server for a whole batch, whose answer (`rows`, the
    log-probs of each row's completion tokens) may still be on its way. A batch's `teacher_logps` is a list of these,
    one per row: GRPO shuffles and splits lists with the batch's tensors, so each micro-batch keeps its rows' handles.
    [`OnPolicyDistillTrainer._resolve_teacher_logps`] waits for the answer and builds the `(B, T)` tensor."""

    rows: Future
    index: int


def no_reward(completions, **kwargs) -> list[float]:
    """Reward of 0 for every completion: GRPO needs a reward function, pure distillation has none."""
    return [0.0] * len(completions)


class OnPolicyDistillTrainer(StateLensGRPOTrainer):
    """On-policy distillation: the student samples rollouts and a frozen teacher supervises the student's own states.

    Args:
        model (`str` or `PreTrainedModel`): the student, as for [`~trl.GRPOTrainer`].
        teacher_model (`str` or `PreTrainedModel`, *optional*): the teacher, an instance or a path/hub id loaded with
            `args.teacher_model_init_kwargs`. It must share the student's tokenizer (TRL's `GOLDTrainer` handles
            cross-tokenizer distillation); its output layer may be padded past the student's with `reverse_kl` and
            `continuation` (see `_check_same_vocabulary`), not with `divergence`. It is frozen, kept in eval mode
            and prepared for the same device/DeepSpeed setup as the student. With `args.teacher_model_server_url` a
            vLLM server runs the teacher instead: omit it, or give its path/hub id to have its tokenizer checked (no
            weights are loaded).
        args ([`OnPolicyDistillConfig`], *optional*): the configuration; `signal` and `state_source_mix` choose
            the method.
        train_dataset: rows with a `prompt` column (plain text or conversational), plus `args.reference_column`
            when the `dataset` state source is used. Image datasets (an `image` or `images` column, what GRPO reads
            images from) are refused: neither the loss nor the teacher would see the images.
        reward_funcs (*optional*): reward functions as for GRPO, mixed into the `reverse_kl` advantage with
            `args.reward_weight`.
        eval_dataset, processing_class, callbacks, optimizers, peft_config, state_logging: as for
            [`StateLensGRPOTrainer`].
    """

    _tag_names = ["trl", "statelens", "on-policy-distillation"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        teacher_model: str | PreTrainedModel | None = None,
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
        _check_dataset(train_dataset, args)
        _check_no_images(train_dataset, eval_dataset)
        if args.use_vllm and args.state_source_mix.get("learner", 0.0) < 1.0:
            raise ValueError(
                "state_source_mix with dataset or teacher states is not supported with use_vllm=True: the vLLM "
                "importance-sampling correction would see log-probs of tokens the student did not sample"
            )
        if args.teacher_model_server_url is not None:
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
            if args.teacher_model_init_kwargs is not None:
                raise ValueError("teacher_model_init_kwargs only applies when teacher_model is a path or hub id")

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
        self._teacher_requests = None
        self._pending_teacher_logps = None
        if args.teacher_model_server_url is not None:
            self.teacher_model = None
            self.served_teacher = self._connect_teacher_server(teacher_path)
        else:
            self.served_teacher = None
            _check_same_vocabulary(self.model, self._tokenizer, teacher_model, teacher_path, args.signal)
            teacher_model.eval()
            teacher_model.requires_grad_(False)
            add_fused_lm_head(
                teacher_model, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32
            )
            if self.is_deepspeed_enabled:
                self.teacher_model = prepare_deepspeed(teacher_model, self.accelerator)
            else:
                self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
        self._forward_redirection = _ForwardRedirection()
        if self.use_vllm and args.signal != "reverse_kl":
            # Only the reverse_kl policy gradient runs on tokens vLLM sampled; continuation trains on the teacher's
            # tokens and divergence on full distributions (TRL's DistillationTrainer applies no ratio either)
            self.vllm_importance_sampling_correction = False
        self._scoring_rollouts = False
        # Per-sample state sources and cut points are drawn from their own generator, never the training RNG
        self._source_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._source_probs = torch.tensor([args.state_source_mix.get(s, 0.0) for s in MIX_SOURCES])

    def train(self, *args, **kwargs):
        if self.served_teacher is None or not self.args.teacher_server_overlap:
            return super().train(*args, **kwargs)
        from .served_teacher import BackgroundRequests

        # One worker: a rank's scoring requests go out one at a time, in the order the batches were made. Shut down
        # when training ends or fails, so that a crash does not leave the process waiting for a request in flight.
        self._teacher_requests = BackgroundRequests("teacher-server")
        try:
            return super().train(*args, **kwargs)
        finally:
            self._teacher_requests.shutdown()
            self._teacher_requests = None

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

    # ----- checkpoints: the source/cut-point generator travels with the trainer's RNG states -----------------------
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        path = Path(output_dir) / SOURCE_RNG_FILE.format(rank=self.args.process_index)
        # `micro_step`: GRPO's count of micro-batches, to tell at resume whether the checkpoint is inside a generation
        torch.save({"source_generator": self._source_generator.get_state(), "micro_step": self._step}, path)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
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

    def _connect_teacher_server(self, teacher_path: str | None):
        """A [`ServedTeacher`] on `args.teacher_model_server_url`, checked now: reachable, serving a model with the
        student's vocabulary (and, when `teacher_path` names the teacher, the student's tokenizer). Every rank asks
        for its own rows: no collective, and vLLM batches the ranks' concurrent requests itself."""
        from .served_teacher import ServedTeacher

        teacher_tokenizer = None
        if teacher_path is not None:
            try:
                teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
            except (OSError, ValueError):
                pass  # a checkpoint without a tokenizer: the served vocabulary size is checked all the same
        student = self.model.get_base_model() if is_peft_model(self.model) else self.model
        args = self.args
        return ServedTeacher(
            args.teacher_model_server_url,
            self._tokenizer,
            student.config.get_text_config().vocab_size,
            teacher_tokenizer=teacher_tokenizer,
            timeout=args.teacher_server_timeout,
            max_retries=args.teacher_server_max_retries,
            retry_backoff=args.teacher_server_retry_backoff,
            chunk_size=args.teacher_server_chunk_size,
        )

    # ----- rollouts: whose states -----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        draws = torch.multinomial(self._source_probs, len(inputs), replacement=True, generator=self._source_generator)
        self._row_sources = [MIX_SOURCES[i] for i in draws.tolist()]
        self._row_references = [row.get(self.args.reference_column) for row in inputs]
        self._scoring_rollouts = True
        try:
            output = super()._generate_and_score_completions(inputs)  # calls `_generate` below, then the rewards
            served_logps = self._pending_teacher_logps  # requested in `_generate` (served teacher, `reverse_kl`)
        finally:
            self._scoring_rollouts = False
            self._pending_teacher_logps = None
        device = output["completion_ids"].device
        output["row_source"] = torch.tensor([source_code(s) for s in self._row_sources], device=device)
        if self.args.signal == "continuation":
            output = self._continue_with_teacher(output)
        elif self.args.signal == "reverse_kl":
            output["teacher_logps"] = served_logps if served_logps is not None else self._teacher_logps(output)
        return output

    def _generate(self, prompts):
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(
            prompts
        )
        swap = [i for i, s in enumerate(self._row_sources) if s != "learner"]
        teacher_rows = [i for i in swap if self._row_sources[i] == "teacher"]
        replacement = {}
        # Sources are drawn per rank, but teacher generation is collective under ZeRO-3 (parameter gathers, synced
        # decoding steps): when any rank has teacher rows, every rank generates, a rank without any on a stand-in row
        # whose rollout it drops. A served teacher is asked by each rank for its own rows only.
        if self.served_teacher is not None:
            teacher_needed = bool(teacher_rows)
        else:
            teacher_needed = self._any_rank_has(teacher_rows)
        if teacher_needed:
            prefixes = [prompt_ids[i] for i in teacher_rows] or prompt_ids[:1]
            rollouts = self._teacher_generate(prefixes, self.max_completion_length)
            replacement = dict(zip(teacher_rows, rollouts))
        if swap:
            for i in swap:
                ids = replacement[i] if i in replacement else self._reference_ids(self._row_references[i])
                completion_ids[i] = ids
                text = self._tokenizer.decode(ids, skip_special_tokens=True)
                completions[i] = [{"role": "assistant", "content": text}] if isinstance(prompts[i], list) else text
        if self.served_teacher is not None and self.args.signal == "reverse_kl":
            # The tokens to score are final here: ask the server now, so that with `teacher_server_overlap` the
            # round trip runs while GRPO pads the batch, computes rewards (and, under vLLM, the student's old
            # log-probs) and the first micro-batch's forward runs. Rows GRPO masks later (truncated completions)
            # are zeroed when the answer is read.
            self._pending_teacher_logps = self._request_served_logps(prompt_ids, completion_ids)
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    def _any_rank_has(self, rows: list) -> bool:
        if self.accelerator.num_processes == 1:
            return bool(rows)
        return self.accelerator.gather(torch.tensor([len(rows)], device=self.accelerator.device)).sum().item() > 0

    def _reference_ids(self, reference) -> list[int]:
        """The dataset's reference answer as completion tokens, ended by eos like a finished rollout; one that does not
        fit in `max_completion_length` with its eos is cut there without one, like a rollout that hit the limit (so
        `mask_truncated_completions` masks it as GRPO masks those)."""
        text = reference[-1]["content"] if isinstance(reference, list) else reference
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.max_completion_length:
            return ids[: self.max_completion_length]
        return ids + [self.eos_token_ids[0]]

    @torch.no_grad()
    def _teacher_generate(self, prefixes: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Teacher samples up to `max_new_tokens` from each token prefix, with the student's sampling settings (GRPO's
        own, or built from its fields under vLLM, where GRPO keeps no `generation_config`) but not its length floor;
        each continuation ends at (and includes) its first eos."""
        if not prefixes:
            return []
        if self.served_teacher is not None:
            return self.served_teacher.generate(
                prefixes,
                max_new_tokens,
                self.eos_token_ids,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                # A seed per row (vLLM would sample a request's identical prefixes alike), drawn from the run's seed
                seeds=torch.randint(2**31 - 1, (len(prefixes),), generator=self._source_generator).tolist(),
            )
        device = self.accelerator.device
        rows = [torch.tensor(p, dtype=torch.long) for p in prefixes]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        generation_config = trainer_generation_config(self)
        generation_config.max_new_tokens = max_new_tokens
        # A length floor in `generation_kwargs` (`min_new_tokens`) shapes the student's rollouts; the teacher's
        # continuation ends at its own eos, as a served teacher's does
        generation_config.min_new_tokens, generation_config.min_length = None, 0
        # A teacher whose output layer is padded past the student's vocabulary never writes those ids (the student
        # could not read them): its distribution is renormalised over the ids both share
        student_vocab, teacher_vocab = map(_vocab_size, (self.model, self.teacher_model))
        if teacher_vocab > student_vocab:
            generation_config.suppress_tokens = list(range(student_vocab, teacher_vocab))
        with unwrap_model_for_generation(
            self.teacher_model, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
        ) as teacher:
            out = teacher.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
            )
        continuations = []
        for row in out[:, input_ids.size(1) :].tolist():
            ends = [j for j, t in enumerate(row) if t in self.eos_token_ids]
            continuations.append(row[: ends[0] + 1] if ends else row)
        return continuations

    def _continue_with_teacher(self, output: dict) -> dict:
        """Cut each rollout at a uniformly drawn prefix length and append a teacher continuation from there. A rollout
        GRPO masked whole (truncated, with `mask_truncated_completions`) is neither cut nor continued: it supervises
        nothing, as in GRPO, and is left as one masked padding token."""
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        lengths = completion_mask.sum(1).cpu()
        cuts = (torch.rand(len(lengths), generator=self._source_generator) * lengths.clamp(min=1)).long()
        cuts = torch.minimum(cuts, lengths)
        prefixes = [completion_ids[i, : cuts[i]].tolist() for i in range(len(cuts))]
        prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in range(len(cuts))]
        # Every rollout holds at least its first token (or eos) unless GRPO masked it whole
        kept = [i for i in range(len(cuts)) if lengths[i] > 0]
        continuations = [[] for _ in cuts]
        # Teacher generation is collective under ZeRO-3: a rank whose rows are all masked continues a stand-in row
        # while another rank has some, and drops it (a served teacher is asked by each rank for its own rows only)
        teacher_needed = bool(kept) if self.served_teacher is not None else self._any_rank_has(kept)
        if teacher_needed:
            written = self._teacher_generate(
                [prompts[i] + prefixes[i] for i in kept or [0]], self.args.continuation_length
            )
            for i, continuation in zip(kept, written):
                continuations[i] = continuation

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
        output["teacher_logps"] = self._teacher_logps(output)
        return output

    @torch.no_grad()
    def _teacher_logps(self, output: dict) -> torch.Tensor | list[ServedTeacherRow]:
        """Teacher log-prob of every completion token, `(B, T)`, through the teacher's fused LM head, in chunks of
        the per-device batch size (as GRPO scores its reference model); or, from the teacher server's prompt
        log-probs, one [`ServedTeacherRow`] per row (each row sent without its padding)."""
        if self.served_teacher is not None:
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]
            lengths = output["completion_mask"].sum(1).tolist()
            completions = [ids[:n].tolist() for ids, n in zip(output["completion_ids"], lengths)]
            return self._request_served_logps(prompts, completions)
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.teacher_model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size
        )
        return logps

    def _request_served_logps(self, prompts: list[list[int]], completions: list[list[int]]) -> list[ServedTeacherRow]:
        """Ask the teacher server for the log-prob of each completion token after its prompt: one request for the
        batch, from the background worker with `teacher_server_overlap` (its errors are raised where the answer is
        read), else at once."""
        sequences, lengths = [p + c for p, c in zip(prompts, completions)], [len(p) for p in prompts]
        if self._teacher_requests is not None:
            rows = self._teacher_requests.submit(self.served_teacher.logps, sequences, lengths)
        else:
            rows = Future()
            rows.set_result(self.served_teacher.logps(sequences, lengths))
        return [ServedTeacherRow(rows, i) for i in range(len(sequences))]

    def _resolve_teacher_logps(self, inputs: dict) -> torch.Tensor:
        """`inputs["teacher_logps"]` as a `(B, T)` tensor like `completion_ids`, 0 where `completion_mask` is 0: an
        in-process teacher's as it is; a served teacher's once its answer is in (a failed request raises its
        `TeacherServerError` here, in the training thread)."""
        value = inputs["teacher_logps"]
        if isinstance(value, torch.Tensor):
            return value
        completion_ids = inputs["completion_ids"]
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for i, (rows, index) in enumerate(value):
            row = rows.result()[index]
            logps[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        mask = inputs["completion_mask"].bool().cpu()
        return torch.where(mask, logps, torch.zeros_like(logps)).to(completion_ids.device)

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
            self._scoring_rollouts
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

        if self.args.signal == "divergence":
            unwrapped = self.accelerator.unwrap_model(model)
            loss, logps, entropies, teacher_logps, aux_loss = self._forward_redirection(
                model,
                unwrapped,
                self._divergence_loss,
                unwrapped,
                input_ids,
                attention_mask,
                num_completion,
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

        self._log_teacher_metrics(logps.detach(), teacher_logps, entropies, completion_mask, loss_mask, token_source)
        if self.model.training:
            align = lambda x: F.pad(x, (prompt_ids.size(1), 0))  # noqa: E731 (completion -> full sequence)
            self._record_states(
                input_ids=input_ids,
                supervised_mask=align(loss_mask.bool()),
                logps=align(logps),
                entropy=align(entropies),
                source=align(token_source),
                prefix_len=align(torch.arange(num_completion, device=input_ids.device).expand_as(completion_ids)),
                attention_mask=attention_mask,
                # Continuation tokens are the teacher's own samples: the records' teacher_kl (over tokens the
                # learner sampled) has nothing to average there; the trainer's `teacher_kl` covers the prefix.
                teacher_logps=None if self.args.signal == "continuation" else align(teacher_logps),
                weights=weights if isinstance(weights, float) else align(weights),
                rewards=inputs.get("rewards"),
            )
        return loss

    def _reverse_kl_advantages(self, logps, teacher_logps, mask):
        """`A_t = -sum_k gamma^k (log p_S - log p_T)_{t+k}` over the valid tokens of each row."""
        kl = (logps - teacher_logps) * mask
        if self.args.kl_discount > 0:
            kl = _discounted_reverse_cumsum(kl, self.args.kl_discount)
        return -kl * mask

    def _divergence_loss(self, unwrapped, input_ids, attention_mask, num_completion, loss_mask, normalizer):
        """Runs inside the student wrapper's forward (so DDP/DeepSpeed see one forward): generalised JSD over the
        full vocabulary in chunks, plus the per-token log-probs and entropies the records need, and a MoE student's
        router load-balancing loss (`None` unless GRPO's `aux_loss_enabled`)."""
        if self.aux_loss_enabled:
            student_hidden, aux_loss = _completion_hidden_states_and_aux_loss(
                unwrapped, input_ids, attention_mask, num_completion
            )
        else:
            student_hidden = _completion_hidden_states(unwrapped, input_ids, attention_mask, num_completion)
            aux_loss = None
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model,
                unwrapped_teacher,
                _completion_hidden_states,
                unwrapped_teacher,
                input_ids,
                attention_mask,
                num_completion,
            )
        student_head, teacher_head = unwrapped.get_output_embeddings(), unwrapped_teacher.get_output_embeddings()
        (student_scale, student_softcap), (teacher_scale, teacher_softcap) = map(
            _logit_post_processing, (unwrapped, unwrapped_teacher)
        )
        loss, _, _ = _chunked_divergence_loss(  # gathers ZeRO-3-sharded heads itself
            student_hidden,
            teacher_hidden,
            student_head.weight,
            teacher_head.weight,
            loss_mask,
            beta=self.args.jsd_beta,
            num_items_in_batch=normalizer,
            student_lm_head_bias=student_head.bias,
            teacher_lm_head_bias=teacher_head.bias,
            student_logit_scale=student_scale,
            teacher_logit_scale=teacher_scale,
            student_final_logit_softcapping=student_softcap,
            teacher_final_logit_softcapping=teacher_softcap,
            temperature=self.temperature,
        )
        tokens = input_ids[:, -num_completion:]
        with torch.no_grad():
            logps, entropies = _head_logps(unwrapped, student_hidden.detach(), tokens, self.temperature, True)
            teacher_logps, _ = _head_logps(unwrapped_teacher, teacher_hidden, tokens, self.temperature, False)
        return loss, logps, entropies, teacher_logps, aux_loss

    def _log_teacher_metrics(self, logps, teacher_logps, entropies, completion_mask, loss_mask, token_source):
        """`teacher_kl` (mean sampled reverse KL) and `teacher_nll` over the tokens the student sampled itself."""
        mode = "train" if self.model.training else "eval"
        sampled = completion_mask.bool() & (token_source == LEARNER)
        if self.args.signal == "continuation":
            sampled &= ~loss_mask.bool()  # the student's own prefix; the rest was written by the teacher
        sums = torch.stack(
            [
                ((logps - teacher_logps) * sampled).sum(),
                (-teacher_logps * sampled).sum(),
                sampled.sum().float(),
                (entropies * loss_mask).sum(),
                loss_mask.sum(),
            ]
        )
        kl_sum, nll_sum, count, entropy_sum, supervised = self.accelerator.gather(sums[None]).sum(0).tolist()
        if count > 0:
            self._metrics[mode]["teacher_kl"].append(kl_sum / count)
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


def _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion):
    """Final hidden states at the positions that predict the completion tokens, `(B, T, H)`."""
    decoder = unwrapped_model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -num_completion - 1 : -1]


def _completion_hidden_states_and_aux_loss(unwrapped_model, input_ids, attention_mask, num_completion):
    """`_completion_hidden_states` and, from the same forward's router logits, a MoE model's load-balancing loss,
    computed as TRL's fused LM head computes it for GRPO (Mixtral's `load_balancing_loss_func`, padding excluded)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = unwrapped_model.config.get_text_config()
    out = unwrapped_model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_router_logits=True
    )
    aux_loss = load_balancing_loss_func(
        out.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
    )
    return out.last_hidden_state[:, -num_completion - 1 : -1], aux_loss


def _logit_post_processing(unwrapped_model) -> tuple[float, float | None]:
    """The logit scale and final soft-cap the model applies after its LM head, read from its config under the names
    TRL's fused head and `DistillationTrainer` read (`logit_scale`, `output_multiplier`, `lm_head_multiplier`, or
    `logits_scaling`, a divisor except for HyperCLOVA X)."""
    config = unwrapped_model.config.get_text_config()
    names = ("logit_scale", "output_multiplier", "lm_head_multiplier")
    scale = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    return (1.0 if scale is None else scale), getattr(config, "final_logit_softcapping", None)


def _head_logps(unwrapped_model, hidden, tokens, temperature, entropy):
    """Log-prob of `tokens` (and, if `entropy`, the entropy of the next-token distribution) from final hidden states
    `(B, T, H)`, with TRL's chunked kernel: the model's LM-head bias, logit scale and soft-cap applied, a ZeRO-3-sharded
    head gathered, and at most `VOCAB_CHUNK` vocabulary columns projected at a time."""
    head = unwrapped_model.get_output_embeddings()
    scale, softcap = _logit_post_processing(unwrapped_model)
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        logps, entropies, *_ = ChunkedLogProbFunction.apply(
            hidden.reshape(-1, hidden.size(-1)).to(head.weight.device),
            head.weight,
            head.bias,
            tokens.reshape(-1).to(head.weight.device),
            temperature,
            VOCAB_CHUNK,
            softcap,
            scale,
            ("log_probs", "entropy") if entropy else ("log_probs",),
        )
    return logps.view_as(tokens), None if entropies is None else entropies.view_as(tokens)


def _completion_logps_and_entropies(unwrapped_model, input_ids, attention_mask, num_completion, temperature, entropy):
    """Log-prob of each completion token and (if `entropy`) the entropy at its state, `(B, T)`, projecting the
    completion positions only; 0 at padding, as TRL's fused head gives."""
    hidden = _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion)
    logps, entropies = _head_logps(unwrapped_model, hidden, input_ids[:, -num_completion:], temperature, entropy)
    padding = attention_mask[:, -num_completion:] == 0
    return logps.masked_fill(padding, 0.0), None if entropies is None else entropies.masked_fill(padding, 0.0)


def load_teacher(name_or_path: str, args) -> PreTrainedModel:
    """Load a teacher given by path or hub id as TRL's trainers load theirs, for inference.

    `args.teacher_model_init_kwargs` go to `from_pretrained`; the dtype defaults to `"auto"` (a bf16 checkpoint
    stays bf16, as in TRL's `DistillationTrainer`) and, under multi-GPU DDP or DeepSpeed, `device_map` is `None` (as
    TRL's GRPO/Distillation trainers set it: ZeRO-3 rejects a device map and "auto" would put every rank's copy on
    the first GPU). A PEFT adapter folder (`adapter_config.json` plus adapter weights, what a LoRA SFT run saves)
    is loaded as its base model plus the adapter, merged: the teacher only runs inference.

    `args` is an [`OnPolicyDistillConfig`] or TRL's `DistillationConfig` (the recipes' stock arm loads its teacher
    here too, so both arms accept the same teacher folders).
    """
    kwargs = dict(args.teacher_model_init_kwargs or {})
    kwargs.setdefault("dtype", "auto")
    kwargs.setdefault("use_safetensors", True)  # no pickle files: weights only
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if find_adapter_config_file(name_or_path, revision=kwargs.get("revision")) is None:
        return create_model_from_path(name_or_path, **kwargs)
    from peft import PeftConfig, PeftModel

    revision = kwargs.pop("revision", None)  # the adapter's revision; its base model's is in adapter_config.json
    adapter = PeftConfig.from_pretrained(name_or_path, revision=revision)
    if adapter.revision is not None:
        kwargs["revision"] = adapter.revision
    # Under ZeRO-3, from_pretrained would partition the base as it loads, and PEFT would add the adapter's delta to
    # the empty shards: load and merge a whole model on each process; preparing the teacher partitions it after.
    with without_zero3_init():
        base = create_model_from_path(adapter.base_model_name_or_path, **kwargs)
        return PeftModel.from_pretrained(base, name_or_path, revision=revision).merge_and_unload()


@contextmanager
def without_zero3_init():
    """Load whole models, not ZeRO-3 partitions, even inside a ZeRO-3 run.

    Under ZeRO-3, `from_pretrained` partitions the weights across processes as it loads them (`zero.Init`, set up by
    `TrainingArguments` whatever accelerate's `zero3_init_flag` says, so accelerate's
    `zero3_init_context_manager(enable=False)` changes nothing then), a collective call: done by the main process
    alone (evaluation) it would wait forever for the others, and a LoRA adapter cannot be merged into empty shards.
    """
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def _check_dataset(dataset, args: OnPolicyDistillConfig) -> None:
    if dataset is None:
        return
    check_train_dataset(dataset, ("prompt",), "OnPolicyDistillTrainer")  # rows, before the teacher loads
    columns = dataset.column_names or []
    if "prompt" not in columns:
        raise ValueError(
            f"the training dataset has no 'prompt' column (columns: {columns}); OnPolicyDistillTrainer samples "
            "completions from prompts: rename your prompt column to 'prompt'"
        )
    if args.state_source_mix.get("dataset", 0.0) > 0 and args.reference_column not in columns:
        raise ValueError(
            f"state_source_mix uses 'dataset' states, which need reference answers in column "
            f"{args.reference_column!r}, absent from the dataset (columns: {columns}); set reference_column"
        )


def _check_no_images(*datasets) -> None:
    """GRPO would pass an `image`/`images` column to the student's rollouts, but OPD's loss and teacher scoring run
    on token ids alone: the student would be trained, and the teacher would score, without the images."""
    for dataset in datasets:
        for split in dataset.values() if isinstance(dataset, dict) else [dataset]:
            columns = getattr(split, "column_names", None) or []
            found = [c for c in ("image", "images") if c in columns]
            if found:
                raise ValueError(
                    f"the dataset has an image column ({found[0]!r}): OnPolicyDistillTrainer supports text only (its "
                    "loss and the teacher see token ids, never the images). Drop the column "
                    f"(dataset.remove_columns({found[0]!r})) to train on the text alone, or use TRL's GRPOTrainer or "
                    "GOLDTrainer for vision-language data."
                )


def _vocab_size(model) -> int:
    """Rows of the model's output layer, from its config (unwrapped from PEFT/DDP/DeepSpeed; ZeRO-3-safe)."""
    model = getattr(model, "module", model)  # DDP, DeepSpeed engine
    model = model.get_base_model() if is_peft_model(model) else model
    return model.config.get_text_config().vocab_size


def _check_same_vocabulary(student, student_tokenizer, teacher, teacher_path: str | None, signal: str) -> None:
    """The teacher must read the student's token ids as the student does. Its output layer may have more rows than the
    student's, as when a larger model of a family is padded further (Qwen2.5-7B: 152064, Qwen2.5-0.5B: 151936, one
    tokenizer): `reverse_kl` and `continuation` score the student's ids, all below the student's vocab_size, under
    the teacher's softmax over its whole output layer (the teacher as it is: padding rows no tokenizer id reaches
    carry next to no mass in a trained model), and the teacher never writes a padding id. `divergence` compares whole
    next-token distributions, which needs the same width."""
    student_vocab, teacher_vocab = _vocab_size(student), _vocab_size(teacher)
    hint = "Use a teacher with the student's tokenizer, or TRL's GOLDTrainer for cross-tokenizer distillation."
    if teacher_vocab < student_vocab:
        raise ValueError(
            f"the teacher's vocab_size ({teacher_vocab}) is smaller than the student's ({student_vocab}): on-policy "
            f"distillation scores the student's tokens with the teacher, so every student id must be one of the "
            f"teacher's. {hint}"
        )
    if teacher_vocab > student_vocab and signal == "divergence":
        raise ValueError(
            f"signal='divergence' compares the student's and the teacher's full next-token distributions, but the "
            f"teacher's output layer has {teacher_vocab} rows and the student's {student_vocab}. If the extra rows are "
            "padding (the same tokenizer), drop them from the teacher before training, "
            f"`teacher.resize_token_embeddings({student_vocab})` (its distribution renormalised over the shared ids), "
            "or use signal='reverse_kl' or 'continuation', which score the student's ids under the whole teacher"
        )
    teacher_tokenizer = None
    if teacher_path is not None:
        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
        except (OSError, ValueError):
            pass  # a checkpoint without a tokenizer: the vocab_size checks above are all we can do
    if teacher_tokenizer is None:
        if teacher_vocab != student_vocab:
            logger.warning(
                "The teacher's output layer has %d rows, the student's %d, and no teacher tokenizer was read to check "
                "that both map ids alike: the extra rows are taken as padding of the same tokenizer. Pass the "
                "teacher as a path or hub id to have its tokenizer checked.",
                teacher_vocab,
                student_vocab,
            )
        return
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"the teacher's tokenizer ({teacher_path}) maps tokens to ids differently from the student's: the same "
            f"ids would mean different text to each model. {hint}"
        )
    if teacher_tokenizer.chat_template != student_tokenizer.chat_template:
        logger.warning(
            "The teacher's chat template (%s) differs from the student's: prompts are formatted with the student's "
            "template and the teacher scores those tokens, so on conversational data the teacher reads a layout it "
            "was not trained on. Use a teacher fine-tuned with the student's template, or plain-text prompts.",
            teacher_path,
        )
