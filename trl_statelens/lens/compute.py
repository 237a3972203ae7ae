"""Training compute counted from model sizes and tokens (DESIGN.md): 2 FLOPs per parameter per token for a forward
pass and 6 for a forward and backward, attention's length-squared term left out (lab sequences are short).

One count, [`ComputeCounter.split`] ([`ComputeCounter.of_ledger`]), serves the run's total in `results.json` ([`~trl_statelens.reports.runs.compute_counts`])
and the per-step and cumulative `statelens/flops/*` of the state records ([`StateLoggingCallback`]).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOPS_PARTS = ("student_generation", "student_training", "teacher_scoring", "teacher_writing")
LEDGER_COUNTS = (
    "supervised_tokens",
    "teacher_tokens",
    "teacher_context_tokens",
    "teacher_skipped_tokens",
    "cache_reused_tokens",
    "cache_reused_completion_tokens",
    "cache_checked_tokens",
    "teacher_generation_prompt_tokens",
    "teacher_written_tokens",
    "teacher_prefix_shared_tokens",
    "teacher_prefix_run_tokens",
    "teacher_writing_prefix_saved",
    "cache_reused_teacher_tokens",
)  # per-step counts the run sums


def matmul_parameters(model) -> int:
    """Parameters a token's forward pass multiplies by: all of them but an untied input embedding (a lookup)."""
    if model is None:
        return 0
    model = getattr(model, "module", model)  # DDP / DeepSpeed engine
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    sizes = {id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}  # ZeRO-3: the full size
    if head is not None and embedding.weight is not head.weight:
        sizes.pop(id(embedding.weight), None)
    return sum(sizes.values())


def teacher_sizes(trainer, student: int) -> dict[str, int | None] | None:
    """Each teacher's matmul parameters by name (`""` for a single teacher), `None` for one on a server; `None` when
    the trainer has no teacher."""
    teacher = getattr(trainer, "teacher", None)  # OnPolicyDistillTrainer's; stock trainers have a teacher_model
    if teacher is None:
        if getattr(trainer.args, "teacher_model_server_url", None):  # TRL's ServerDistillationTrainer
            return {"": None}
        model = getattr(trainer, "teacher_model", None)  # TRL's SDFTTrainer: the student itself or its copy
        return None if model is None else {"": matmul_parameters(model)}
    if teacher.reads_own_prompts:  # the student as its own teacher
        return {"": student}
    teachers = getattr(teacher, "teachers", None) or {"": teacher}
    # A served teacher has no model in this process
    return {name: None if t.model is None else matmul_parameters(t.model) for name, t in teachers.items()}


def weighted_teacher_size(by_name: dict[str, int | None] | None, ledger: list[dict] | None) -> float | None:
    """The teacher parameters a rollout token meets on average: 0 without a teacher, `None` if a teacher's size (a
    served one's) or, for teachers of different sizes, each one's share of the supervised tokens is unknown."""
    if not by_name:
        return 0
    sizes = set(by_name.values())
    if None in sizes:
        return None
    if len(sizes) == 1:
        return sizes.pop()
    tokens = {name: sum(line.get(f"supervised_tokens/{name}", 0.0) for line in ledger or []) for name in by_name}
    total = sum(tokens.values())
    if not total:
        return None
    return sum(by_name[name] * tokens[name] for name in by_name) / total


def tokens_seen(trainer) -> float:
    """The tokens the trainer logs as `num_tokens`, so far (SFT: the tokens trained on; GRPO and distillation: the
    rollouts' prompt and completion tokens, all ranks)."""
    tokens = float(trainer.state.num_input_tokens_seen or getattr(trainer, "_total_train_tokens", 0) or 0)
    if not tokens:
        tokens = float(next((e["num_tokens"] for e in reversed(trainer.state.log_history) if "num_tokens" in e), 0))
    return tokens


def untrained_share(trainer) -> tuple[float, int]:
    """At an optimizer step's end: the share of the last generation batch's micro-batches the student has not
    trained on yet, and how many generation batches the step began. GRPO samples a batch for `steps_per_generation`
    x `num_iterations` micro-batches (counted from the start or resume of training, at a batch's start), which can
    span optimizer steps; `(0.0, 0)` for a trainer that does not sample."""
    args, micro_steps = trainer.args, getattr(trainer, "_step", None)
    if not hasattr(args, "steps_per_generation") or micro_steps is None:
        return 0.0, 0
    period = args.steps_per_generation * getattr(args, "num_iterations", 1)
    start = micro_steps - args.gradient_accumulation_steps
    began = (micro_steps - 1) // period - (start - 1) // period  # batch starts among the step's micro-batches
    return (-micro_steps) % period / period, began


@dataclass
class ComputeCounter:
    """What a trainer's FLOPs are counted from: the student's matmul parameters, each teacher's (`teacher_sizes`,
    `None` without a teacher), and which passes run per token.

    Per rollout token: the student samples it (2 N_S, `student_generation`), is trained on it (6 N_S) and, in GRPO
    with `beta` > 0, the reference scores it (2 N_S; both `student_training`); a teacher scores it (2 N_T,
    `teacher_scoring`). What the teacher writes is `teacher_writing`: a rollout of a `teacher` state
    (`state_source_mix`) is the teacher's to write before it scores it: its forward over the rollout's prompt (the
    teacher's own prompt: a self teacher's holds the privileged context) and one forward per token it writes, 2 N_T per
    token each (`teacher_generation_prompt_tokens` and `teacher_written_tokens`, the ledger's counts,
    [`teacher_generation`]). (The student's generation is counted at the rollouts' lengths: for a row whose state the
    teacher or the dataset gives, at the length of what replaced the student's sample, not of the sample it threw
    away.) The `continuation` signal is counted as if the whole rollout stayed (an upper bound: the cut drops part of
    it): the teacher reads each cut state and writes the supervised tokens (2 N_T per rollout token and per supervised
    token, `teacher_writing`), scores them (the same again, `teacher_scoring`) and the student trains on them (6 N_S).
    A trainer that does not sample (SFT) is trained on its tokens only (6 N_S). The parts sum to `total`.

    A self teacher reads its own prompt, longer than the student's by its privileged context: those extra tokens
    (`teacher_context_tokens`, the ledger's count) are counted as teacher tokens too, in every pass it makes. Where its
    scoring runs a prompt start shared by every row once (`SelfTeacher`: few-shot examples as the context), the rows'
    positions that forward stood in for (`teacher_prefix_shared_tokens`) come off its scoring and the shared start is
    counted each time its forward ran (`teacher_prefix_run_tokens`: once per scoring call, once per run for a frozen
    `base` teacher while the start stays the same). A teacher of another tokenizer reads the prompt and the completion
    in its own tokens: `teacher_context_tokens` then holds the difference from the student's, signed (fewer where its
    vocabulary writes the text in fewer tokens). A rollout the teacher did not score (state selection,
    `skip_correct_rollouts`) is not counted as teacher work: its prompt and completion tokens
    (`teacher_skipped_tokens`, the ledger's count) come off the teacher's reads.

    The offline teacher cache (`teacher_cache_steps`): a step trained on a reused batch samples nothing and asks the
    teacher nothing (GRPO counts no `num_tokens` then), but trains the student on the batch's prompt and completion
    tokens (`cache_reused_tokens`, 6 N_S each), and the staleness check runs the student forward on them
    (`cache_checked_tokens`, 2 N_S each); with an in-process teacher's `divergence`, the teacher's output layer
    (`teacher_head` parameters) projects its cached hidden states again at each reused completion token
    (`cache_reused_completion_tokens`, 2 each), and a teacher of another tokenizer, which keeps nothing of its forward,
    runs it again over its own tokens of the reused rows (`cache_reused_teacher_tokens`, 2 N_T each).

    A generation batch can span optimizer steps (`steps_per_generation` x `num_iterations` micro-batches above
    `gradient_accumulation_steps`): its sampling counts at the step that samples it, but the student's training on
    its tokens, and with the `divergence` signal the teacher's scoring (in the loss), count at the steps that train on
    it, by their share of its micro-batches ([`untrained_share`]: `untrained_tokens` and `untrained_teacher_reads`
    are the sampled tokens not trained on yet).

    N_T is the teacher's size: the student's for a self teacher;
    with several teachers, their sizes weighted by the tokens each supervised (`supervised_tokens/<name>`). A teacher
    on a server has a size this process cannot know: its FLOPs are then `None`, and so is the total.
    """

    student: int
    teacher_sizes: dict[str, int | None] | None
    samples: bool
    reference: bool
    continuation: bool
    teacher_head: int = 0  # the teacher's output layer, run again on a reused batch (an in-process `divergence`)
    teacher_scores_in_loss: bool = (
        False  # `divergence`: the teacher's forward runs with the student's, per micro-batch
    )

    @classmethod
    def of(cls, trainer) -> ComputeCounter:
        student = matmul_parameters(trainer.model)
        args = trainer.args
        samples = hasattr(args, "num_generations") or hasattr(trainer, "teacher_model")  # the learner samples
        return cls(
            student=student,
            teacher_sizes=teacher_sizes(trainer, student),
            samples=samples,
            reference=samples and bool(getattr(args, "beta", 0.0)) and getattr(trainer, "ref_model", None) is not None,
            continuation=getattr(args, "signal", None) == "continuation",
            teacher_head=_cached_teacher_head(trainer),
            teacher_scores_in_loss=getattr(args, "signal", None) == "divergence",
        )

    def teacher(self, totals: dict | None = None) -> float | None:
        """N_T, weighted by the ledger's `totals` (`supervised_tokens/<name>`) for teachers of several sizes."""
        if not self.samples:
            return 0
        return weighted_teacher_size(self.teacher_sizes, [totals or {}])

    def split(
        self,
        tokens: float,
        supervised: float,
        totals: dict | None = None,
        teacher_context: float = 0.0,
        teacher_skipped: float = 0.0,
        cache: dict | None = None,
        teacher_generation: float = 0.0,
        teacher_prefix_saved: float = 0.0,
        untrained_tokens: float = 0.0,
        untrained_teacher_reads: float = 0.0,
        writing_prefix_saved: float = 0.0,
    ) -> dict:
        """FLOPs by part (`FLOPS_PARTS`, `None` where unknown) and their `total` for `tokens` (as `num_tokens`
        counts them), `supervised` tokens, `teacher_context` tokens (`teacher_context_tokens`: a self teacher's extra
        prompt tokens, a teacher of another tokenizer's difference in tokens) and `teacher_skipped` tokens (of the
        rollouts the teacher did not score, `teacher_skipped_tokens`); `totals`, the ledger's summed counts, weigh
        teachers of several sizes; `cache`, the teacher cache's counts (`cache_reused_tokens`,
        `cache_reused_completion_tokens`, `cache_reused_teacher_tokens`, `cache_checked_tokens`: [`cache_counts`]);
        `teacher_generation`, the tokens of the teacher's forwards writing `teacher` states ([`teacher_generation`],
        2 N_T each); `teacher_prefix_saved`, the prompt positions a shared-prefix forward stood in for less that
        forward's own tokens each time it ran ([`teacher_prefix_saved`]), off the teacher's scoring;
        `untrained_tokens` and `untrained_teacher_reads`, of the last generation batch, not trained on yet (left out
        of the parts that run at training); `writing_prefix_saved`, the prompt positions a shared-prefix forward stood
        in for while the teacher wrote, less its own tokens each time it ran (`teacher_writing_prefix_saved`), off
        the teacher's writing."""
        student, teacher, cache = self.student, self.teacher(totals), cache or {}
        teacher_reads = tokens + teacher_context - teacher_skipped
        if self.teacher_scores_in_loss:
            teacher_reads -= untrained_teacher_reads
        reused, checked = cache.get("cache_reused_tokens", 0.0), cache.get("cache_checked_tokens", 0.0)
        parts = {
            "student_generation": 2 * student * tokens if self.samples else 0.0,
            "student_training": (6 + 2 * self.reference) * student * (tokens - untrained_tokens)
            + student * (6 * reused + 2 * checked),
            "teacher_scoring": None,
            "teacher_writing": None,
        }
        if teacher is not None:
            parts["teacher_scoring"] = (
                2 * teacher * (teacher_reads - teacher_prefix_saved)
                + 2 * self.teacher_head * cache.get("cache_reused_completion_tokens", 0.0)
                + 2 * teacher * cache.get("cache_reused_teacher_tokens", 0.0)
            )
            parts["teacher_writing"] = 2 * teacher * (teacher_generation - writing_prefix_saved)
        if self.continuation:
            parts["student_training"] += 6 * student * supervised
            if teacher is not None:  # it writes from each cut state, then scores what it wrote
                parts["teacher_writing"] += 2 * teacher * (teacher_reads + supervised)
                parts["teacher_scoring"] += 2 * teacher * supervised
        known = [value for value in parts.values() if value is not None]
        return {**parts, "total": sum(known) if len(known) == len(parts) else None}

    def of_ledger(
        self, tokens: float, totals: dict, untrained_tokens: float = 0.0, untrained_teacher_reads: float = 0.0
    ) -> dict:
        """[`split`] of `tokens` with every count read from the ledger's summed `totals` ([`ledger_totals`]): the run's
        FLOPs so far, as the ledger's `flops_total/*` and `results.json`'s `compute` count them (less the last
        generation batch's `untrained_*` share, for the per-step records)."""
        return self.split(
            tokens,
            totals.get("supervised_tokens", 0.0),
            totals,
            totals.get("teacher_context_tokens", 0.0),
            totals.get("teacher_skipped_tokens", 0.0),
            cache_counts(totals),
            teacher_generation(totals),
            teacher_prefix_saved(totals),
            untrained_tokens,
            untrained_teacher_reads,
            totals.get("teacher_writing_prefix_saved", 0.0),
        )


def _cached_teacher_head(trainer) -> int:
    """The parameters of the teacher's output layer when a reused batch runs it again (an in-process teacher's
    `divergence` with `teacher_cache_steps > 1`, which projects the cached hidden states), else 0."""
    args, teacher = trainer.args, getattr(trainer, "teacher", None)
    if getattr(args, "teacher_cache_steps", 1) <= 1 or args.signal != "divergence" or teacher is None:
        return 0
    if teacher.model is None or teacher.reads_own_prompts or teacher.crosses_tokenizers:
        return 0  # (one of another tokenizer keeps no hidden states: it runs its forward again, counted in full)
    weight = getattr(teacher.model, "module", teacher.model).get_output_embeddings().weight
    return getattr(weight, "ds_numel", weight.numel())


def cache_counts(totals: dict) -> dict[str, float]:
    """The teacher cache's counts among the ledger's `totals`, for [`ComputeCounter.split`]'s `cache`."""
    return {key: value for key, value in totals.items() if key.startswith("cache_")}


def teacher_generation(totals: dict) -> float:
    """The tokens of the teacher's forwards writing `teacher` states among the ledger's `totals` (the rollouts'
    prompts and the tokens written), for [`ComputeCounter.split`]'s `teacher_generation`."""
    return totals.get("teacher_generation_prompt_tokens", 0.0) + totals.get("teacher_written_tokens", 0.0)


def teacher_prefix_saved(totals: dict) -> float:
    """The teacher's scoring positions a shared-prefix forward saved among the ledger's `totals`: the rows' prompt
    positions it stood in for (`teacher_prefix_shared_tokens`) less its own tokens each time it ran
    (`teacher_prefix_run_tokens`), for [`ComputeCounter.split`]'s `teacher_prefix_saved`."""
    return totals.get("teacher_prefix_shared_tokens", 0.0) - totals.get("teacher_prefix_run_tokens", 0.0)


def ledger_totals(lines: list[dict]) -> dict[str, float]:
    """The per-step counts of ledger lines (`steps.jsonl`) summed (`LEDGER_COUNTS`: `supervised_tokens`,
    `supervised_tokens/<name>`, `teacher_tokens`, `teacher_context_tokens`, ...), those the lines hold."""
    totals = {}
    for line in lines:
        for key, value in line.items():
            if key.split("/")[0] in LEDGER_COUNTS and value is not None:
                totals[key] = totals.get(key, 0.0) + value
    return totals
