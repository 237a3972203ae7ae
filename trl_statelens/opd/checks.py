"""What [`OnPolicyDistillTrainer`] reads from its datasets, rows and teacher settings, checked before any model
loads (a map dataset's rows), or per generation batch on every process (an `IterableDataset`'s): each names the
problem and the fix (docs/bad-input.md)."""

from __future__ import annotations

import dataclasses

from transformers import GenerationConfig

from ..checks import check_train_dataset, context_length, named_splits
from ..teachers import check_before_loading
from .config import OnPolicyDistillConfig


def check_datasets(train_dataset, eval_dataset, teacher_model, args: OnPolicyDistillConfig) -> None:
    """What the run reads from its rows, before any model loads: the columns, the teacher ids and (a map dataset's)
    every row's values. The evaluation data too, which runs the same row logic (state sources, teachers, the self
    teacher's prompt) at the first evaluation."""
    check_train_dataset(train_dataset, ("prompt",), "OnPolicyDistillTrainer")
    for what, dataset in named_splits(train_dataset, eval_dataset).items():
        if dataset is None:
            continue
        _check_no_images(dataset, what)
        _check_columns(dataset, args, what)
        _check_teacher_ids(dataset, teacher_model, what)
        if hasattr(dataset, "__len__"):  # an IterableDataset's rows are checked batch by batch, on every process
            check_rows({name: dataset[name] for name in row_columns(args)}, args, what)


def _check_columns(dataset, args: OnPolicyDistillConfig, what: str) -> None:
    columns = dataset.column_names or []
    if "prompt" not in columns:
        raise ValueError(
            f"{what} has no 'prompt' column (columns: {columns}); OnPolicyDistillTrainer samples completions from "
            "prompts: rename your prompt column to 'prompt'"
        )
    if args.teacher_model_kind is not None and "privileged_context" not in columns:
        raise ValueError(
            f"teacher_model_kind={args.teacher_model_kind!r} makes the student its own teacher, reading "
            f"teacher_prompt_template={args.teacher_prompt_template!r}, which needs each row's privileged context in "
            f"a 'privileged_context' column, absent from {what} (columns: {columns})"
        )
    if args.teacher_reads_context and "privileged_context" not in columns:
        raise ValueError(
            f"teacher_reads_context=True: the teacher reads each row's privileged context before its prompt, from a "
            f"'privileged_context' column, absent from {what} (columns: {columns}); add one (recipes: "
            "--context_shots) or leave teacher_reads_context False"
        )
    if args.state_source_mix.get("dataset", 0.0) > 0 and args.reference_column not in columns:
        raise ValueError(
            f"state_source_mix uses 'dataset' states, which need reference answers in column "
            f"{args.reference_column!r}, absent from {what} (columns: {columns}); set reference_column"
        )


def row_columns(args: OnPolicyDistillConfig) -> list[str]:
    """The columns whose values `check_rows` reads."""
    columns = ["prompt"]
    if args.teacher_model_kind is not None or args.teacher_reads_context:
        columns.append("privileged_context")
    if args.state_source_mix.get("dataset", 0.0) > 0:
        columns.append(args.reference_column)
    return columns


def check_rows(columns: dict[str, list], args: OnPolicyDistillConfig, what: str = "this batch") -> None:
    """Each row's values that the run reads (`columns`, from `row_columns`): prompts without images in their messages,
    a self teacher's privileged context and a conversational prompt ending with the user message its template fills,
    a reference answer for `dataset` states."""

    def refuse(rows: list[int], problem: str, fix: str) -> None:
        if rows:
            raise ValueError(f"{what}: {len(rows)} row(s) {problem} (the first: row {rows[0]}); {fix}")

    prompts = columns["prompt"]
    refuse(
        [i for i, prompt in enumerate(prompts) if _has_image_part(prompt)],
        'hold an image in their prompt messages (a {"type": "image"} content part)',
        "OnPolicyDistillTrainer supports text only (its loss and the teacher see token ids, never the images): drop "
        "the image parts to train on the text alone, or use TRL's GRPOTrainer or GOLDTrainer for vision-language data",
    )
    if args.teacher_model_kind is not None or args.teacher_reads_context:
        refuse(
            [i for i, context in enumerate(columns["privileged_context"]) if context is None],
            "have no privileged_context (None)",
            f"the teacher reads it before its prompt ({args.teacher_prompt_template!r} for text): give every row a "
            "privileged_context (an empty string for none)",
        )
        refuse(
            [
                i
                for i, prompt in enumerate(prompts)
                if isinstance(prompt, list) and prompt[-1:] and not _ends_with_user(prompt)
            ],
            "have a conversational prompt that does not end with a user message",
            "the teacher's prompt (teacher_prompt_template) fills the last user message: end each prompt with one",
        )
    if args.state_source_mix.get("dataset", 0.0) > 0:
        refuse(
            [i for i, reference in enumerate(columns[args.reference_column]) if reference is None],
            f"have no reference answer (None in {args.reference_column!r})",
            "the 'dataset' state source teacher-forces each row's reference: give every row one",
        )


def _ends_with_user(prompt: list[dict]) -> bool:
    return prompt[-1].get("role") == "user"


def _has_image_part(prompt) -> bool:
    """A conversational prompt with a `{"type": "image"}` content part, which GRPO would hand to the student's
    rollouts as an image."""
    return isinstance(prompt, list) and any(
        isinstance(message.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") == "image" for part in message["content"])
        for message in prompt
    )


def _check_teacher_ids(dataset, teacher_model, what: str) -> None:
    """Every `teacher_id` in the dataset must name one of the teachers (a single teacher takes none)."""
    columns = getattr(dataset, "column_names", None) or []
    if "teacher_id" not in columns or not hasattr(dataset, "unique"):  # an IterableDataset is checked batch by batch
        return
    given = {teacher_id for teacher_id in dataset.unique("teacher_id") if teacher_id is not None}
    if not isinstance(teacher_model, dict):
        if given:
            raise ValueError(
                f"the teacher_id column of {what} names teachers {sorted(given)}, but teacher_model is a single "
                "teacher: pass a dict name -> teacher with those names, or drop the column"
            )
        return
    unknown = sorted(given - set(teacher_model))
    if unknown:
        raise ValueError(
            f"the teacher_id column of {what} names teachers that are not given: {unknown}; the teachers are "
            f"{list(teacher_model)} (rows without a teacher_id go to the first, {next(iter(teacher_model), None)!r})"
        )


def _check_no_images(dataset, what: str) -> None:
    """GRPO would pass an `image`/`images` column to the student's rollouts, but OPD's loss and teacher scoring run
    on token ids alone: the student would be trained, and the teacher would score, without the images."""
    columns = getattr(dataset, "column_names", None) or []
    found = [c for c in ("image", "images") if c in columns]
    if found:
        raise ValueError(
            f"{what} has an image column ({found[0]!r}): OnPolicyDistillTrainer supports text only (its loss and the "
            f"teacher see token ids, never the images). Drop the column (dataset.remove_columns({found[0]!r})) to "
            "train on the text alone, or use TRL's GRPOTrainer or GOLDTrainer for vision-language data."
        )


def is_url(teacher) -> bool:
    return isinstance(teacher, str) and teacher.startswith(("http://", "https://"))


def check_teacher_settings_are_read(teacher_model, args: OnPolicyDistillConfig) -> None:
    """The config's teacher settings checked against the teachers given (`teacher_model_init_kwargs` is read for a
    teacher loaded from a path, `teacher_top_k` and `teacher_server_*` for a served one)."""
    if args.teacher_model_kind is not None or args.teacher_model_server_url is not None or teacher_model is None:
        return  # checked by the config already (or no teacher: refused below)
    teachers = list(teacher_model.values()) if isinstance(teacher_model, dict) else [teacher_model]
    args.check_settings_are_read(
        served=any(is_url(t) for t in teachers),
        loads_a_path=any(isinstance(t, str) and not is_url(t) for t in teachers),
    )


def teacher_checks(args, tokenizer, model, train_dataset, eval_dataset):
    """`check(path, served=False)`: [`check_before_loading`] of the teacher at `path` against the student `model`:
    its `tokenizer` (`None`: not known yet), its end tokens from its generation config (as GRPO reads them) and
    whether the data holds conversational prompts (a map dataset's first row)."""
    if isinstance(model, str):
        try:
            config = GenerationConfig.from_pretrained(model)
        except OSError:
            config = None
    else:
        config = getattr(model, "generation_config", None)
    ends = getattr(config, "eos_token_id", None)
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    splits = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    conversational = any(
        hasattr(split, "__len__") and len(split) and isinstance(split[0]["prompt"], list)
        for split in [train_dataset, *splits]
        if split is not None
    )

    def check(path: str, served: bool = False) -> bool | None:
        return check_before_loading(args, tokenizer, path, served, end_token_ids=ends, conversational=conversational)

    return check


def refuse_unread_top_k(args, served_crosses: list[bool | None]) -> None:
    """`teacher_top_k` away from its default where no served teacher reads it (`served_crosses`: per served teacher,
    whether it has another tokenizer than the student's; `None`: not known yet): outside `divergence`, only a served
    teacher of another tokenizer reads it (its moved ends)."""
    default = next(f.default for f in dataclasses.fields(args) if f.name == "teacher_top_k")
    if args.signal == "divergence" or args.teacher_top_k == default or any(c is None or c for c in served_crosses):
        return
    raise ValueError(
        f"teacher_top_k={args.teacher_top_k} (default {default}): with signal={args.signal!r} it is read only by a "
        "served teacher of another tokenizer than the student's (the top-k log-probs that move its ends), and this "
        "run's served teacher shares the student's tokenizer, so it would train exactly as with the default. Leave it "
        "at its default"
    )


def refuse_reading_student_text(args, crosses: list[bool | None]) -> None:
    """`teacher_reads_student_text` with teachers all known to have the student's tokenizer (`crosses`: per teacher,
    whether it has another; `None`: not known yet) is refused."""
    if args.teacher_reads_student_text and crosses and not any(c is None or c for c in crosses):
        raise ValueError(
            "teacher_reads_student_text=True, but no teacher has another tokenizer than the student's: a teacher of "
            "the student's tokenizer reads its prompt tokens as they are, so the setting is never read. Leave it "
            "False"
        )


def check_teacher_prompt_lengths(trainer) -> None:
    """Each row's teacher prompt, where it is not the student's (the row's privileged context with
    `teacher_reads_context`; a teacher of another tokenizer's own chat template and tokens), plus the tokens written
    after it (`max_completion_length`, and `continuation_length` for continuations) fits that teacher's context, in
    the training and evaluation data, before training: the prompts are made as the rollouts make them
    (`_teacher_prompts`). A teacher of another tokenizer reads the completion in its own tokens, as many as the
    student's or not: counted as the student's. A self teacher checks its own prompts (`SelfTeacher`); a served
    teacher's context is not known here, nor an `IterableDataset`'s rows."""
    args, teacher = trainer.args, trainer.teacher
    if args.teacher_model_kind is not None or not (args.teacher_reads_context or teacher.crosses_tokenizers):
        return
    routed = getattr(teacher, "teachers", None)  # several teachers: each row's is the one it names
    after = trainer._tokens_after_prompt()
    for what, dataset in named_splits(trainer.train_dataset, trainer.eval_dataset).items():
        if dataset is None or not hasattr(dataset, "__len__"):
            continue
        columns = [c for c in ("prompt", "privileged_context", "teacher_id") if c in dataset.column_names]
        rows = [dict(zip(columns, values)) for values in zip(*(dataset[c] for c in columns))]
        student_prompts = [list(ids) for ids in trainer._tokenize_prompts([row["prompt"] for row in rows])[0]]
        prompts = trainer._teacher_prompts(student_prompts, rows)
        if routed is None:
            contexts = [context_length(teacher.model)] * len(rows)
        else:
            names = teacher.route([row.get("teacher_id") for row in rows])
            contexts = [context_length(routed[name].model) for name in names]
        too_long = [i for i, (p, c) in enumerate(zip(prompts, contexts)) if c is not None and len(p) + after > c]
        if too_long:
            first = too_long[0]
            reads = (
                "the row's prompt with its privileged_context (teacher_reads_context): shorten those contexts or drop "
                "those rows"
                if args.teacher_reads_context
                else "the prompt in its own tokens and chat template (a teacher of another tokenizer): shorten or "
                "drop those prompts"
            )
            raise ValueError(
                f"{what}: {len(too_long)} teacher prompt(s) do not fit the teacher's context of {contexts[first]} "
                f"tokens with {after} tokens after them (max_completion_length, plus continuation_length for "
                f"continuations; the first, row {first}, has {len(prompts[first])} tokens). The teacher reads {reads}, "
                "use a teacher with a longer context, or generate fewer tokens."
            )
