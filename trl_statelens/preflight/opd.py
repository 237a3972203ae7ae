"""Preflight checks of an `OnPolicyDistillTrainer`'s teacher, through the teacher interface every kind answers
(`teachers.base.Teacher`: in the process, served, a self teacher, another tokenizer, a router): its prompt as it
renders it, its own sampled answers (how they end, whether they hold the answer line, whether it wants to end right
after it), the student-teacher KL on the student's samples by position, the teacher's context, and for a teacher of
another tokenizer how much of the alignment is exact."""

from __future__ import annotations

import math

from ..answers import STRICT_PATTERN, clean_format
from ..checks import context_length
from ..lens.endings import answer_end_position
from ..teachers.alignment import TeacherSignal
from .grpo import rollout_checks
from .verdicts import Check, graded, skipped

POSITION_BUCKETS = 4  # quarters of max_completion_length


def scored_logps(trainer, teacher_prompts, completions, teachers) -> list:
    """The teacher's answers for each completion after its prompt ([`RowScores`] per row)."""
    rows = trainer.teacher.score(teacher_prompts, completions, False, teachers=teachers)
    return [row.scores.result()[row.index] for row in rows]


def assistant_opener(tokenizer) -> str:
    """What the tokenizer's chat template writes to open an assistant turn ("" without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    message = [{"role": "user", "content": "Q"}]
    opened = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    closed = tokenizer.apply_chat_template(message, tokenize=False)
    return opened[len(closed) :] if opened.startswith(closed) else ""


def prompt_frame(trainer, teacher_prompts, student_prompts) -> Check:
    """Whether the teacher reads its prompt in the frame the student reads its own: both end by opening an assistant
    turn of their own chat template, or neither does (plain text); with both prompts' rendering of the first row."""
    tokenizer = getattr(trainer.teacher, "tokenizer", None) or trainer._tokenizer
    teacher_text = tokenizer.decode(teacher_prompts[0])
    student_text = trainer._tokenizer.decode(student_prompts[0])
    teacher_opener, student_opener = assistant_opener(tokenizer), assistant_opener(trainer._tokenizer)
    teacher_in_turn = bool(teacher_opener) and teacher_text.endswith(teacher_opener)
    student_in_turn = bool(student_opener) and student_text.endswith(student_opener)
    details = {
        "teacher_prompt": teacher_text[-400:],
        "student_prompt": student_text[-400:],
        "same_prompt": teacher_text == student_text,
        "teacher_in_chat_turn": teacher_in_turn,
        "student_in_chat_turn": student_in_turn,
    }
    frames = {True: "an assistant turn of its chat template", False: "plain text"}
    fix = (
        f"the student answers in {frames[student_in_turn]}, the teacher in {frames[teacher_in_turn]}: its signal is "
        "about another task's continuation. Render the teacher's prompt as the student's (its own chat template for "
        "a conversational prompt)"
    )
    same = float(teacher_in_turn == student_in_turn)
    return graded("teacher/same_frame", same, 0.5, None, fix, higher_is_worse=False, details=details)


def end_after_answer(trainer, teacher_prompts, answers, teachers) -> tuple[float | None, int]:
    """The teacher's mean probability of the end token right after the `#### N` line of its own answers (those that
    hold one, cut there), and how many did."""
    tokenizer, end_id = trainer._tokenizer, trainer._tokenizer.eos_token_id
    kept, cut = [], []
    for i, row in enumerate(answers):
        position = answer_end_position(tokenizer.batch_decode([[t] for t in row])) if row else None
        if position is not None:
            kept.append(i)
            cut.append(row[:position] + [end_id])
    if not kept:
        return None, 0
    scores = scored_logps(trainer, [teacher_prompts[i] for i in kept], cut, [teachers[i] for i in kept])
    return sum(math.exp(s.logps[-1].item()) for s in scores) / len(scores), len(kept)


def teacher_checks(trainer, rows, student_prompts, student_answers, student_texts) -> list[Check]:
    teacher = trainer.teacher
    tokenizer = trainer._tokenizer
    teachers = teacher.route([row.get("teacher_id") for row in rows])
    teacher_prompts = trainer._teacher_prompts(student_prompts, rows)
    checks = [prompt_frame(trainer, teacher_prompts, student_prompts)]
    checks += context_checks(trainer, teacher_prompts)

    # The teacher's own answers, sampled as the `teacher` state source samples them
    answers = teacher.generate(teacher_prompts, trainer.max_completion_length, teachers=teachers)
    texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
    checks += rollout_checks(trainer, "teacher", answers, texts, repeats_warn=0.25, repeats_fail=0.5)
    references = [str(row.get(trainer.args.reference_column) or "") for row in rows]
    expects_answer_line = any(STRICT_PATTERN.search(r) for r in references) or any(map(STRICT_PATTERN.search, texts))
    if not expects_answer_line:
        why = f"neither the data's {trainer.args.reference_column!r} answers nor the teacher's hold a `#### N` line"
        checks += [skipped("teacher/format_share", why), skipped("teacher/end_after_answer", why)]
    else:
        found = sum(bool(STRICT_PATTERN.search(t)) for t in texts) / len(texts)
        clean = sum(map(clean_format, texts)) / len(texts)
        checks.append(
            graded(
                "teacher/format_share",
                found,
                0.5,
                0.1,
                "the teacher's own answers rarely hold the `#### N` answer line the data's answers end with: it "
                "cannot teach the format. Show it solved examples (teacher_reads_context) or choose another teacher",
                higher_is_worse=False,
                details={"clean_format_share": clean},
            )
        )
        probability, counted = end_after_answer(trainer, teacher_prompts, answers, teachers)
        checks.append(
            graded(
                "teacher/end_after_answer",
                probability,
                0.5,
                0.3,  # the text-frame self teacher whose student looped measured 0.271 (STUDY.md)
                "the teacher does not want to end right after its `#### N` line (it expects more text: the next "
                "question of a text frame?); the student then learns to go on after its answer. Give the teacher its "
                "context as chat turns, each answer closed by the end token (context_format='chat')",
                higher_is_worse=False,
                details={"answers_with_line": counted, "end_token": tokenizer.eos_token},
                unmeasured="none of the teacher's answers holds a `#### N` line",
            )
        )
    checks += kl_checks(trainer, teacher_prompts, student_prompts, student_answers, teachers)
    return checks


def context_checks(trainer, teacher_prompts) -> list[Check]:
    """The share of sampled rows whose teacher prompt and `max_completion_length` overflow the teacher's context."""
    if trainer.teacher.model is None:
        return [skipped("teacher/over_context_share", "the teacher runs elsewhere (served): its context is not known")]
    context = context_length(trainer.teacher.model)
    if context is None:
        return [skipped("teacher/over_context_share", "the teacher's config states no context length")]
    over = sum(len(p) + trainer.max_completion_length > context for p in teacher_prompts) / len(teacher_prompts)
    fix = f"teacher prompts plus max_completion_length exceed the teacher's {context} tokens: shorten the context"
    verdict = "fail" if over > 0 else "pass"
    return [Check("teacher/over_context_share", over, "fail > 0", verdict, fix if over else "", {"context": context})]


def kl_checks(trainer, teacher_prompts, student_prompts, student_answers, teachers) -> list[Check]:
    """The sampled reverse KL (student log-prob less the teacher's) on the student's own answers, overall and by
    quarter of `max_completion_length`; for a teacher of another tokenizer, the share of tokens carried exactly."""
    from .sampling import student_log_probs

    kept = [i for i, answer in enumerate(student_answers) if answer]
    if not kept:
        return [skipped("teacher/kl_sampled", "the student's answers are all empty")]
    prompts = [student_prompts[i] for i in kept]
    answers = [student_answers[i] for i in kept]
    scores = scored_logps(trainer, [teacher_prompts[i] for i in kept], answers, [teachers[i] for i in kept])
    student = student_log_probs(trainer, prompts, answers)
    width = max(trainer.max_completion_length // POSITION_BUCKETS, 1)
    sums, counts = [0.0] * POSITION_BUCKETS, [0] * POSITION_BUCKETS
    exact, tokens = 0, 0
    for own, teacher in zip(student, scores):
        kl = own - teacher.logps.float().cpu()[: own.size(0)]
        for position, value in enumerate(kl.tolist()):
            if math.isfinite(value):
                bucket = min(position // width, POSITION_BUCKETS - 1)
                sums[bucket] += value
                counts[bucket] += 1
        if teacher.signal is not None:
            exact += int((teacher.signal == TeacherSignal.EXACT).sum())
            tokens += teacher.signal.numel()
    by_position = [s / c if c else None for s, c in zip(sums, counts)]
    overall = sum(sums) / max(sum(counts), 1)
    checks = [
        graded(
            "teacher/kl_sampled",
            overall,
            1.5,
            None,
            "the teacher finds the student's own answers very unlikely: check that it reads the student's task in "
            "its own template (teacher/same_frame) and that it is the intended model",
            details={"by_position_quarter": by_position, "tokens": sum(counts)},
        )
    ]
    checks += alignment_checks(trainer, exact / tokens if tokens else None)
    return checks


def alignment_checks(trainer, exact_share: float | None) -> list[Check]:
    teacher = trainer.teacher
    if not teacher.crosses_tokenizers:
        return []
    vocabularies = [getattr(teacher, "tokenizer", None), trainer._tokenizer]
    same = vocabularies[0] is not None and vocabularies[0].get_vocab() == vocabularies[1].get_vocab()
    return [
        graded(
            "teacher/tokenizers_differ",
            float(not same),
            0.5,
            None,
            "the teacher's tokenizer holds the student's vocabulary: load it as a teacher of the student's tokenizer "
            "(no alignment, exact log-probs)",
            higher_is_worse=False,
        ),
        graded(
            "teacher/alignment_exact_share",
            exact_share,
            0.9,
            0.5,
            "few student tokens get the teacher's exact log-prob: the two tokenizers cut the text differently there "
            "(docs/cross-tokenizer.md); a teacher of a closer tokenizer gives a sharper signal",
            higher_is_worse=False,
        ),
    ]
