"""`OnPolicyDistillTrainer`: the student's states, the teacher's signal.

Built on [`StateLensGRPOTrainer`]: TRL's GRPO machinery samples the rollouts (plain `generate` or vLLM, PEFT,
gradient accumulation, accelerate/DeepSpeed all keep working), this trainer decides per sample whose states are
supervised (`state_source_mix`) and what the teacher says there (`signal`), and records every supervised state.
"""

from __future__ import annotations

import copy

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

from .grpo_trainer import StateLensGRPOTrainer
from .opd_config import MIX_SOURCES, OnPolicyDistillConfig
from .records import source_code

LEARNER, DATASET, TEACHER = (source_code(s) for s in ("learner", "dataset", "teacher"))
# Vocabulary columns per projection tile in the completion log-prob path (TRL's fused head uses 32768). On CPU a
# 4096-wide tile is as fast, and at V=32k it cuts the step's peak memory by about a third (BENCHMARKS.md).
VOCAB_CHUNK = 4096


def no_reward(completions, **kwargs) -> list[float]:
    """Reward of 0 for every completion: GRPO needs a reward function, pure distillation has none."""
    return [0.0] * len(completions)


class OnPolicyDistillTrainer(StateLensGRPOTrainer):
    """On-policy distillation: the student samples rollouts and a frozen teacher supervises the student's own states.

    Args:
        model (`str` or `PreTrainedModel`): the student, as for [`~trl.GRPOTrainer`].
        teacher_model (`str` or `PreTrainedModel`): the teacher, an instance or a path/hub id loaded with
            `args.teacher_model_init_kwargs`. It must share the student's vocabulary (TRL's `GOLDTrainer` handles
            cross-tokenizer distillation). It is frozen, kept in eval mode and prepared for the same
            device/DeepSpeed setup as the student.
        args ([`OnPolicyDistillConfig`], *optional*): the configuration; `signal` and `state_source_mix` choose
            the method.
        train_dataset: rows with a `prompt` column (plain text or conversational), plus `args.reference_column`
            when the `dataset` state source is used.
        reward_funcs (*optional*): reward functions as for GRPO, mixed into the `reverse_kl` advantage with
            `args.reward_weight`.
        eval_dataset, processing_class, callbacks, optimizers, peft_config, state_logging: as for
            [`StateLensGRPOTrainer`].
    """

    _tag_names = ["trl", "statelens", "on-policy-distillation"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        teacher_model: str | PreTrainedModel,
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
        if args.use_vllm and args.state_source_mix.get("learner", 0.0) < 1.0:
            raise ValueError(
                "state_source_mix with dataset or teacher states is not supported with use_vllm=True: the vLLM "
                "importance-sampling correction would see log-probs of tokens the student did not sample"
            )
        if teacher_model is None:
            raise ValueError("OnPolicyDistillTrainer needs a teacher_model (an instance, a path or a hub id)")
        if isinstance(teacher_model, str):
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
        _check_same_vocabulary(self.model, self._tokenizer, teacher_model, teacher_path)

        teacher_model.eval()
        teacher_model.requires_grad_(False)
        add_fused_lm_head(teacher_model, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            self.teacher_model = prepare_deepspeed(teacher_model, self.accelerator)
        else:
            self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
        self._forward_redirection = _ForwardRedirection()
        # Per-sample state sources and cut points are drawn from their own generator, never the training RNG
        self._source_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._source_probs = torch.tensor([args.state_source_mix.get(s, 0.0) for s in MIX_SOURCES])

    # ----- rollouts: whose states -----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        draws = torch.multinomial(self._source_probs, len(inputs), replacement=True, generator=self._source_generator)
        self._row_sources = [MIX_SOURCES[i] for i in draws.tolist()]
        self._row_references = [row.get(self.args.reference_column) for row in inputs]
        output = super()._generate_and_score_completions(inputs)  # calls `_generate` below, then the rewards
        device = output["completion_ids"].device
        output["row_source"] = torch.tensor([source_code(s) for s in self._row_sources], device=device)
        if self.args.signal == "continuation":
            output = self._continue_with_teacher(output)
        elif self.args.signal == "reverse_kl":
            output["teacher_logps"] = self._teacher_logps(output)
        return output

    def _generate(self, prompts):
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(
            prompts
        )
        swap = [i for i, s in enumerate(self._row_sources) if s != "learner"]
        if swap:
            teacher_rows = [i for i in swap if self._row_sources[i] == "teacher"]
            teacher_rollouts = self._teacher_generate(
                [prompt_ids[i] for i in teacher_rows], self.max_completion_length
            )
            replacement = dict(zip(teacher_rows, teacher_rollouts))
            for i in swap:
                ids = replacement[i] if i in replacement else self._reference_ids(self._row_references[i])
                completion_ids[i] = ids
                text = self._tokenizer.decode(ids, skip_special_tokens=True)
                completions[i] = [{"role": "assistant", "content": text}] if isinstance(prompts[i], list) else text
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    def _reference_ids(self, reference) -> list[int]:
        """The dataset's reference answer as completion tokens, ended by eos like a finished rollout."""
        text = reference[-1]["content"] if isinstance(reference, list) else reference
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_completion_length - 1]
        return ids + [self.eos_token_ids[0]]

    @torch.no_grad()
    def _teacher_generate(self, prefixes: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Teacher samples `max_new_tokens` from each token prefix, with the student's sampling settings; each
        continuation ends at (and includes) its first eos."""
        if not prefixes:
            return []
        device = self.accelerator.device
        rows = [torch.tensor(p, dtype=torch.long) for p in prefixes]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        generation_config = copy.deepcopy(self.generation_config)
        generation_config.max_new_tokens = max_new_tokens
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
        """Cut each rollout at a uniformly drawn prefix length and append a teacher continuation from there."""
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        lengths = completion_mask.sum(1).cpu()
        cuts = (torch.rand(len(lengths), generator=self._source_generator) * lengths.clamp(min=1)).long()
        cuts = torch.minimum(cuts, lengths)
        prefixes = [completion_ids[i, : cuts[i]].tolist() for i in range(len(cuts))]
        prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in range(len(cuts))]
        continuations = self._teacher_generate(
            [p + c for p, c in zip(prompts, prefixes)], self.args.continuation_length
        )

        device = completion_ids.device
        rows = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prefixes, continuations)]
        output["completion_ids"] = pad(rows, padding_value=self._tokenizer.pad_token_id).to(device)
        output["completion_mask"] = pad([torch.ones_like(r) for r in rows], padding_value=0).to(device)
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
    def _teacher_logps(self, output: dict) -> torch.Tensor:
        """Teacher log-prob of every completion token, `(B, T)`, through the teacher's fused LM head."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.teacher_model, input_ids, attention_mask, output["completion_ids"].size(1)
        )
        return logps

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """Log-probs (and entropies) of the completion tokens, `(B, T)`, projecting only the completion positions
        onto the vocabulary.

        On devices without Triton (CPU) TRL's fused LM head projects every position, the prompt's too, though only
        the completion is scored; at a large vocabulary that projection and its recomputation in the backward are
        most of the step (see BENCHMARKS.md). Same kernel, same values. Triton devices (where TRL's head already
        skips unscored positions), multimodal or MoE calls, and heads that scale, soft-cap or upcast their logits
        keep TRL's path."""
        unwrapped = self.accelerator.unwrap_model(model)
        if (
            kwargs.get("compute_aux_loss")
            or any(value is not None for key, value in kwargs.items() if key != "compute_aux_loss")
            or self.args.cast_lm_head_to_fp32
            or _use_triton(input_ids.device)  # there TRL's head already projects the scored positions only
            or not _plain_lm_head(unwrapped)
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
        token_source = inputs.get("token_source", inputs["row_source"][:, None].expand_as(completion_ids))
        # Token-mean over the whole generation batch (all processes and accumulation steps), as GRPO's DAPO loss
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes

        if self.args.signal == "divergence":
            unwrapped = self.accelerator.unwrap_model(model)
            loss, logps, entropies, teacher_logps = self._forward_redirection(
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
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, num_completion, compute_entropy=True
            )
            self._loss_logps_and_entropies = None  # recorded below, with per-token sources and teacher log-probs
            teacher_logps = inputs["teacher_logps"]
            if self.args.signal == "reverse_kl":
                weights = self._reverse_kl_advantages(logps.detach(), teacher_logps, loss_mask)
                if self.args.reward_weight:
                    weights = weights + self.args.reward_weight * inputs["advantages"][:, None] * loss_mask
                loss = -(weights * logps * loss_mask).sum() / normalizer
            else:  # continuation: cross-entropy on the teacher's tokens
                weights = 1.0
                loss = -(logps * loss_mask).sum() / normalizer

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
        gamma = self.args.kl_discount
        if gamma > 0:
            steps = torch.arange(kl.size(1), device=kl.device)
            lag = (steps[None, :] - steps[:, None]).float()  # [t, s] = s - t
            discount = torch.where(lag >= 0, gamma ** lag.clamp(min=0), torch.zeros_like(lag))
            kl = kl @ discount.T
        return -kl * mask

    def _divergence_loss(self, unwrapped, input_ids, attention_mask, num_completion, loss_mask, normalizer):
        """Runs inside the student wrapper's forward (so DDP/DeepSpeed see one forward): generalised JSD over the
        full vocabulary in chunks, plus the per-token log-probs and entropies the records need."""
        student_hidden = _completion_hidden_states(unwrapped, input_ids, attention_mask, num_completion)
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
        student_head = unwrapped.get_output_embeddings().weight
        teacher_head = unwrapped_teacher.get_output_embeddings().weight
        loss, _, _ = _chunked_divergence_loss(
            student_hidden,
            teacher_hidden,
            student_head,
            teacher_head,
            loss_mask,
            beta=self.args.jsd_beta,
            num_items_in_batch=normalizer,
            temperature=self.temperature,
        )
        tokens = input_ids[:, -num_completion:]
        logps, entropies = _token_logps_and_entropy(student_hidden.detach(), student_head, tokens, self.temperature)
        teacher_logps, _ = _token_logps_and_entropy(teacher_hidden, teacher_head, tokens, self.temperature)
        return loss, logps, entropies, teacher_logps

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


def _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion):
    """Final hidden states at the positions that predict the completion tokens, `(B, T, H)`."""
    decoder = unwrapped_model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, -num_completion - 1 : -1]


def _plain_lm_head(unwrapped_model) -> bool:
    """Whether the model's logits are just `hidden @ head.T` (plus bias): no scale, no soft-cap, no sharded head."""
    config = unwrapped_model.config.get_text_config()
    scales = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in scales):
        return False
    if getattr(config, "final_logit_softcapping", None) is not None:
        return False
    return not isinstance(unwrapped_model.get_output_embeddings().weight, DTensor)


def _completion_logps_and_entropies(unwrapped_model, input_ids, attention_mask, num_completion, temperature, entropy):
    """Log-prob of each completion token and (if `entropy`) the entropy at its state, `(B, T)`, with TRL's chunked
    kernel on the completion positions only; 0 at padding, as TRL's fused head gives."""
    hidden = _completion_hidden_states(unwrapped_model, input_ids, attention_mask, num_completion)
    tokens = input_ids[:, -num_completion:]
    head = unwrapped_model.get_output_embeddings()
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        logps, entropies, *_ = ChunkedLogProbFunction.apply(
            hidden.reshape(-1, hidden.size(-1)).to(head.weight.device),
            head.weight,
            head.bias,
            tokens.reshape(-1).to(head.weight.device),
            temperature,
            VOCAB_CHUNK,
            None,
            1.0,
            ("log_probs", "entropy") if entropy else ("log_probs",),
        )
    padding = attention_mask[:, -num_completion:] == 0
    logps = logps.view_as(tokens).masked_fill(padding, 0.0)
    return logps, None if entropies is None else entropies.view_as(tokens).masked_fill(padding, 0.0)


@torch.no_grad()
def _token_logps_and_entropy(hidden, head_weight, tokens, temperature, chunk_size: int = 1024):
    """Log-prob of `tokens` and entropy of the next-token distribution from hidden states, projecting at most
    `chunk_size` positions onto the vocabulary at a time."""
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.size(-1)), tokens.reshape(-1)
    logps, entropies = [], []
    for start in range(0, flat_hidden.size(0), chunk_size):
        logits = (flat_hidden[start : start + chunk_size] @ head_weight.T).float() / temperature
        log_probs = logits.log_softmax(-1)
        logps.append(log_probs.gather(-1, flat_tokens[start : start + chunk_size, None]).squeeze(-1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    return torch.cat(logps).view_as(tokens), torch.cat(entropies).view_as(tokens)


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
    base = create_model_from_path(adapter.base_model_name_or_path, **kwargs)
    return PeftModel.from_pretrained(base, name_or_path, revision=revision).merge_and_unload()


def _check_dataset(dataset, args: OnPolicyDistillConfig) -> None:
    if dataset is None:
        return
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


def _check_same_vocabulary(student, student_tokenizer, teacher, teacher_path: str | None) -> None:
    student = student.get_base_model() if is_peft_model(student) else student
    student_vocab = student.config.get_text_config().vocab_size
    teacher_vocab = teacher.config.get_text_config().vocab_size
    hint = "Use a teacher with the student's tokenizer, or TRL's GOLDTrainer for cross-tokenizer distillation."
    if student_vocab != teacher_vocab:
        raise ValueError(
            f"the teacher's vocab_size ({teacher_vocab}) differs from the student's ({student_vocab}): on-policy "
            f"distillation scores the student's tokens with the teacher, so both must share a vocabulary. {hint}"
        )
    if teacher_path is None:
        return
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError):
        return  # a checkpoint without a tokenizer: the vocab_size check above is all we can do
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"the teacher's tokenizer ({teacher_path}) maps tokens to ids differently from the student's: the same "
            f"ids would mean different text to each model. {hint}"
        )
