"""A teacher of another tokenizer against a teacher of the student's (issue 45), and against GOLD on the same rollouts.

Two arms of `OnPolicyDistillTrainer` (signal="reverse_kl", the one signal carried across tokenizers), each run in a
fresh forked process, in alternating order within each repeat:

- `same`: the teacher speaks the student's tokenizer (an `InProcessTeacher`);
- `cross`: a teacher of the same size and architecture (same width, depth and embedding rows, same seed) whose
  tokenizer is another lab tokenizer (700 merges of other documents, digit runs kept whole), so the trainer builds a
  `CrossTokenizerTeacher`: the teacher reads its own tokens of each prompt and completion, and its log-probs come back
  on the student's tokens through the alignment (`teachers/alignment.py`).

Equal work: every step trains on rollouts of exactly `completion_tokens` tokens (`min_new_tokens` forbids an early eos)
from the same prompts of exactly PROMPT_TOKENS student tokens (bench_opd's). The difference between the arms is the
tokenizer path only: the teacher's own prompt and completion tokens (its forward runs over its own token count) and
the alignment.

The alignment's own cost is timed apart, in the cross arm's child: the seconds per step in
`CrossTokenizerTeacher.respell` (the completion spelled in the teacher's tokens), `align_token_ids` and the carry
(`inner_prefixes` and `resolved_logprobs`, each row's teacher log-probs carried onto the student's tokens with its
chunks resolved; `student_token_teacher_logprobs` where they are not), and their share of the step. The other parts of the step are timed the same way in both arms: the student's generation, the teacher's
prompts (`teacher.prompts`) and scoring (`teacher.score`, which holds the alignment), the loss (`compute_loss`, the
student's forward) and the backward.

GOLD (TRL's `trl.experimental.gold`, its cross-tokenizer ULD loss with the hybrid split of matched and unmatched
vocabulary) on the very token batches the cross arm trained on, after its training run: the student's and the other
tokenizer's teacher's logits on the same text (GOLD's own teacher inputs: the decoded prompt and completion tokenized
by the teacher's tokenizer, through `build_teacher_inputs_from_texts`; the student's byte offsets from
`GOLDTrainer._maybe_add_completion_byte_offsets`), `ULDLoss` on them, and the backward. Its loss value and its seconds
for (inputs + teacher forward + student forward + loss + backward) are set against the cross step's corresponding part
(teacher prompts + teacher scoring + loss + backward). Its ULD runs with `uld_skip_student_eos=False`: the rollouts end
at the length limit, with no eos for it to skip (the teacher's side gets the eos GOLD appends, and skips it).

    .venv/bin/python bench/bench_cross_tokenizer.py [--repeats 3] [--steps 4] [--out bench/results]
    .venv/bin/python bench/bench_cross_tokenizer.py --quick --out /tmp/r   # tiny models, 1 repeat, 2 steps (the test)
    .venv/bin/python bench/bench_cross_tokenizer.py --pair real [--data ../shared/data]   # the real pair (below)

`--pair real` (after `make install-gemma3`, with real GSM8K at `--data`): the student SmolLM2-135M-Instruct on real
GSM8K test questions in its chat template; `same` is a teacher of its tokenizer, SmolLM2-135M-Instruct itself, `cross`
Gemma 3 270M base (262,144 SentencePiece tokens against 49,152 byte-level BPE ones), so the two teachers differ in
size as well (268M against 135M parameters) and `cross / same` is not the tokenizer path alone: the alignment's
share of the step is. Rollouts of REAL_COMPLETION_TOKENS tokens, REAL_ROLLOUTS a step.
"""

import argparse
import math
import os
import statistics
import time
import traceback
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_opd import PROMPT_TOKENS, fixed_length_prompts
from common import (
    CPU_ARGS,
    RESULTS_DIR,
    backbone,
    count_parameters,
    count_saved_parameters,
    keep_token_batches,
    print_table,
    ratio_row,
    run_forked,
    say,
    scratch_dir,
    train_and_measure,
    write_results,
)
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

import trl_statelens.teachers.cross_tokenizer as cross_tokenizer_module
import trl_statelens.teachers.reads_text as reads_text_module
from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.data import chat_prompt, read_gsm8k_rows
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer
from trl_statelens.teachers import CrossTokenizerTeacher, InProcessTeacher

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # GOLD lives in trl.experimental, which warns on import

STUDENT = dict(hidden=256, layers=4, ffn=1024)
TEACHER = dict(hidden=256, layers=4, ffn=1024)  # both teachers: the same shape and seed, only the tokenizer differs
QUICK_MODEL = dict(hidden=64, layers=2, ffn=128)
STUDENT_VOCAB = dict(vocab_size=1024, num_documents=2000)
OTHER_VOCAB = dict(vocab_size=700, num_documents=500, individual_digits=False)  # the cross-tokenizer test's second
NUM_GENERATIONS = 2
ROLLOUTS_PER_STEP, QUICK_ROLLOUTS = 8, 4
COMPLETION_TOKENS, QUICK_COMPLETION_TOKENS = 32, 8
REAL_ROLLOUTS, REAL_COMPLETION_TOKENS, REAL_PROMPTS = 8, 64, 64
WARMUP_STEPS = 1
ARMS = ("same", "cross")
# the carry: `student_token_teacher_logprobs` where chunks are shared, `inner_prefixes` and `resolved_logprobs` where an
# in-process teacher resolves them (its prefix masses are gathered inside `teacher_score`)
ALIGNMENT_PARTS = (
    "respell",
    "align_token_ids",
    "student_token_teacher_logprobs",
    "inner_prefixes",
    "resolved_logprobs",
)
STEP_PARTS = ("generate", "teacher_prompts", "teacher_score", *ALIGNMENT_PARTS, "compute_loss", "backward")
CORRESPONDING_PARTS = ("teacher_prompts", "teacher_score", "compute_loss", "backward")  # what GOLD's work stands for
GOLD_PARTS = ("inputs", "teacher_forward", "student_forward", "loss", "backward")


class PartTimes(TrainerCallback):
    """Seconds spent in named calls, summed over each optimizer step (`wrap` a callable to time it)."""

    def __init__(self):
        self.current = defaultdict(float)
        self.steps: list[dict] = []
        self.spelled = {"student": 0, "teacher": 0}  # completion tokens, the student's and the teacher's spelling

    def wrap(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start

        return wrapper

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({name: self.current.get(name, 0.0) for name in STEP_PARTS})
        self.current.clear()


def time_step_parts(trainer, parts: PartTimes) -> None:
    """Wrap the calls of a step whose seconds are reported (in this forked child only)."""
    teacher = trainer.teacher
    trainer.model.generate = parts.wrap("generate", trainer.model.generate)
    teacher.prompts = parts.wrap("teacher_prompts", teacher.prompts)
    teacher.score = parts.wrap("teacher_score", teacher.score)
    trainer.compute_loss = parts.wrap("compute_loss", trainer.compute_loss)
    trainer.accelerator.backward = parts.wrap("backward", trainer.accelerator.backward)
    if isinstance(teacher, CrossTokenizerTeacher):
        respell = teacher.respell

        def respell_counted(student_ids):  # the tokens the teacher reads for the student's
            teacher_ids = respell(student_ids)
            parts.spelled["student"] += len(student_ids)
            parts.spelled["teacher"] += len(teacher_ids)
            return teacher_ids

        teacher.respell = parts.wrap("respell", respell_counted)
        for name in ALIGNMENT_PARTS[1:]:  # called by name from the teachers' modules
            for module in (cross_tokenizer_module, reads_text_module):
                if hasattr(module, name):
                    setattr(module, name, parts.wrap(name, getattr(module, name)))
    trainer.add_callback(parts)


def run_arm(arm, paths, tokenizer, dataset, steps, rollouts, completion_tokens, gold_path=None):
    """One training run in a forked child: step times and parts, losses, peak memory; in the cross arm, GOLD on the
    token batches it trained on (`gold_path`: the teacher's, whose tokenizer GOLD loads)."""
    trainer = OnPolicyDistillTrainer(
        model=paths["student"],
        teacher_model=paths[f"{arm}_teacher"],
        args=OnPolicyDistillConfig(
            output_dir=scratch_dir(f"bench-cross-tokenizer-{arm}-"),
            signal="reverse_kl",
            num_generations=NUM_GENERATIONS,
            max_steps=WARMUP_STEPS + steps,
            per_device_train_batch_size=rollouts,
            max_completion_length=completion_tokens,
            temperature=1.0,
            generation_kwargs={"min_new_tokens": completion_tokens},
            **CPU_ARGS,
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    expected = CrossTokenizerTeacher if arm == "cross" else InProcessTeacher
    if type(trainer.teacher) is not expected:
        raise RuntimeError(f"the {arm} arm built a {type(trainer.teacher).__name__}, not a {expected.__name__}")
    parts = PartTimes()
    time_step_parts(trainer, parts)
    batches = keep_token_batches(trainer) if gold_path else []
    teacher = trainer.accelerator.unwrap_model(trainer.teacher.model)
    result = train_and_measure(
        trainer, {"student": backbone(trainer.model), "teacher": backbone(teacher)}, WARMUP_STEPS
    )
    result["parts"] = parts.steps[WARMUP_STEPS:]
    if arm == "cross":
        result["teacher_tokens_per_student_token"] = parts.spelled["teacher"] / parts.spelled["student"]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result["loss"] = [entry["loss"] for entry in logs][WARMUP_STEPS:]
    result["exact_share"] = [entry["alignment/exact"] for entry in logs if "alignment/exact" in entry][WARMUP_STEPS:]
    result["per_decision_exact_share"] = [
        entry["alignment/per_decision_exact"] for entry in logs if "alignment/per_decision_exact" in entry
    ][WARMUP_STEPS:]
    if gold_path:
        result["gold"] = measure_gold(trainer, tokenizer, teacher, gold_path, batches[WARMUP_STEPS:])
    return result


def measure_gold(trainer, tokenizer, teacher, teacher_path, batches) -> dict:
    """GOLD's ULD loss (hybrid) on `batches`, each part timed; or, where it cannot run, the reason."""
    try:
        from trl.experimental.gold import GOLDConfig, GOLDTrainer
        from trl.experimental.gold.gold_trainer import ULDLoss, build_teacher_inputs_from_texts
    except ImportError as error:
        return {"available": False, "reason": f"trl.experimental.gold cannot be imported: {error}"}
    try:
        config = GOLDConfig(
            output_dir=scratch_dir("bench-gold-"),
            use_uld_loss=True,
            use_extended_uld=True,  # GOLD's default: byte-offset groups, split tokens merged
            uld_use_hybrid_loss=True,  # matched vocabulary compared directly (JSD), the rest sorted (ULD)
            uld_skip_student_eos=False,  # fixed-length rollouts end without an eos
            teacher_tokenizer_name_or_path=teacher_path,
            temperature=trainer.temperature,
            **CPU_ARGS,
        )
        # As GOLDTrainer loads the teacher's tokenizer (and gives it a pad token where it has none)
        teacher_tokenizer = AutoTokenizer.from_pretrained(config.teacher_tokenizer_name_or_path)
        if teacher_tokenizer.pad_token is None:
            teacher_tokenizer.pad_token = teacher_tokenizer.eos_token
        uld = ULDLoss(config, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer, device=teacher.device)
        # The attributes GOLDTrainer's byte-offset method reads (it is called unbound, on this namespace)
        offsets_owner = SimpleNamespace(
            use_uld_loss=True, teacher_tokenizer=teacher_tokenizer, uld_loss_fn=uld, _tokenizer=tokenizer
        )
        student = trainer.accelerator.unwrap_model(trainer.model)
        student.train()
        seconds = {part: [] for part in GOLD_PARTS}
        losses, matched, unmatched, groups, garbled = [], [], [], [], []
        for batch in batches:
            prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
            completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]

            start = time.perf_counter()

            def text(ids, mask):
                return tokenizer.decode(
                    ids[mask.bool()].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
                )

            prompt_texts = [text(i, m) for i, m in zip(prompt_ids, prompt_mask)]
            completion_texts = [text(i, m) for i, m in zip(completion_ids, completion_mask)]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            scored = torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool()
            student_inputs = {"input_ids": input_ids, "labels": input_ids.masked_fill(~scored, -100)}
            GOLDTrainer._maybe_add_completion_byte_offsets(offsets_owner, student_inputs)
            teacher_ids, teacher_labels, teacher_mask, teacher_offsets = build_teacher_inputs_from_texts(
                teacher_tokenizer, prompt_texts, completion_texts, use_extended_uld=uld.use_extended_uld
            )
            seconds["inputs"].append(time.perf_counter() - start)

            start = time.perf_counter()
            with torch.no_grad():
                teacher_logits = teacher(input_ids=teacher_ids, attention_mask=teacher_mask).logits
            seconds["teacher_forward"].append(time.perf_counter() - start)

            start = time.perf_counter()
            student_logits = student(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            seconds["student_forward"].append(time.perf_counter() - start)

            start = time.perf_counter()
            loss = uld(
                student_logits=student_logits,
                teacher_logits=teacher_logits,
                student_labels=student_inputs["labels"],
                teacher_labels=teacher_labels,
                student_input_ids=input_ids,
                teacher_input_ids=teacher_ids,
                student_byte_offsets=student_inputs["byte_offsets"],
                teacher_byte_offsets=teacher_offsets,
            )
            seconds["loss"].append(time.perf_counter() - start)

            start = time.perf_counter()
            loss.backward()
            seconds["backward"].append(time.perf_counter() - start)
            trainer.optimizer.zero_grad(set_to_none=True)  # no optimizer step: the corresponding part has none

            losses.append(loss.item())
            matched.append(float(uld.last_matched_loss.detach()))
            unmatched.append(float(uld.last_unmatched_loss.detach()))
            # GOLD's two byte coordinates of a completion: the student's tokens' (their pieces' lengths) and its
            # decoded text's, which the teacher's offsets count. Bytes that are no whole UTF-8 text (a sampled lone
            # byte token) decode to U+FFFD, and from there the two disagree and the groups pair other text.
            student_bytes = student_inputs["byte_offsets"][:, :, 1].amax(dim=1).tolist()
            garbled.append(
                sum(n != len(t.encode("utf-8")) for n, t in zip(student_bytes, completion_texts))
                / len(completion_texts)
            )
            # GOLD's alignment groups of the first row (byte-offset boundaries both tokenizations share)
            first = student_inputs["labels"][0] != -100
            student_groups, _ = ULDLoss._align_by_byte_offsets(
                student_inputs["byte_offsets"][0][first].tolist(),
                teacher_offsets[0][teacher_labels[0] != -100][:-1].tolist(),  # its eos, which ULD skips, left out
            )
            groups.append(len(student_groups) / int(first.sum()))
            del teacher_logits, student_logits, loss
    except Exception as error:  # the reason goes into the results, in place of a number
        return {
            "available": False,
            "reason": f"GOLD's ULD loss failed on these models: {type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
    seconds["total"] = [sum(values) for values in zip(*(seconds[part] for part in GOLD_PARTS))]
    return {
        "available": True,
        "call": {
            "loss": "trl.experimental.gold.gold_trainer.ULDLoss(GOLDConfig(...), student_tokenizer, teacher_tokenizer)",
            "config": {
                name: getattr(config, name)
                for name in (
                    "use_uld_loss",
                    "use_extended_uld",
                    "uld_use_hybrid_loss",
                    "uld_token_merge_strategy",
                    "uld_hybrid_matched_weight",
                    "uld_hybrid_unmatched_weight",
                    "uld_crossentropy_weight",
                    "uld_distillation_weight",
                    "uld_student_temperature",
                    "uld_teacher_temperature",
                    "uld_skip_student_eos",
                    "uld_skip_teacher_eos",
                    "beta",
                )
            },
            "matched_vocabulary": len(uld._vocab_mapping or {}),
        },
        "loss": losses,
        "matched_loss": matched,
        "unmatched_loss": unmatched,
        "groups_per_student_token": groups,
        "rows_text_not_student_bytes": garbled,
        "seconds": seconds,
    }


def save_models(tokenizer, other_tokenizer, directory, student_shape, teacher_shape) -> tuple[dict, dict]:
    """The student (seed 0) and two teachers of one shape and seed (1): one with the student's tokenizer, one with the
    other. All three have the same embedding rows (the larger tokenizer's), so both teachers have the same size."""
    rows = max(len(tokenizer), len(other_tokenizer))
    paths, parameters = {}, {}
    for name, shape, seed, tok in (
        ("student", student_shape, 0, tokenizer),
        ("same_teacher", teacher_shape, 1, tokenizer),
        ("cross_teacher", teacher_shape, 1, other_tokenizer),
    ):
        model = build_qwen3(tok, **shape, vocab_size=rows, seed=seed)
        paths[name] = f"{directory}/{name}"
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
        parameters[name] = count_parameters(model)
    return paths, parameters


def per_step(run: dict, names) -> list[float]:
    """The seconds per measured step spent in `names` together."""
    return [sum(step[name] for name in names) for step in run["parts"]]


def median_step(run: dict) -> float:
    return statistics.median(run["step_seconds"])


def alignment_share(run: dict) -> float:
    return statistics.median(a / s for a, s in zip(per_step(run, ALIGNMENT_PARTS), run["step_seconds"]))


def summarize(runs: dict, same_size: bool = True) -> tuple[list[dict], dict]:
    """The table's rows (each a spread over repeats) and the summary the JSON keeps; the 1.3x target applies where the
    two teachers have one size (`same_size`)."""
    same, cross = runs["same"], runs["cross"]
    pairs = list(zip(cross, same))
    alignment = [statistics.median(per_step(run, ALIGNMENT_PARTS)) for run in cross]
    rows = [
        ratio_row(
            "cross / same: step time",
            [median_step(c) / median_step(s) for c, s in pairs],
            "<= 1.3" if same_size else "",
        ),
        ratio_row(
            "cross without the alignment / same: step time",
            [(median_step(c) - a) / median_step(s) for (c, s), a in zip(pairs, alignment)],
        ),
        ratio_row("cross / same: train memory", [c["train_mem_mb"] / s["train_mem_mb"] for c, s in pairs]),
    ]
    for arm in ARMS:
        rows.append(ratio_row(f"{arm}: step seconds", [median_step(run) for run in runs[arm]]))
        for part in STEP_PARTS if arm == "cross" else [p for p in STEP_PARTS if p not in ALIGNMENT_PARTS]:
            rows.append(
                ratio_row(
                    f"{arm}: {part} seconds per step", [statistics.median(per_step(r, [part])) for r in runs[arm]]
                )
            )
        rows.append(
            ratio_row(f"{arm}: loss (median over steps)", [statistics.median(run["loss"]) for run in runs[arm]])
        )
    rows += [
        ratio_row("cross: alignment seconds per step", alignment),
        ratio_row("cross: alignment share of the step", [alignment_share(run) for run in cross]),
        ratio_row("cross: exact share of student tokens", [statistics.median(run["exact_share"]) for run in cross]),
        ratio_row(
            "cross: exact per decision, share of student tokens",
            [statistics.median(run["per_decision_exact_share"]) for run in cross],
        ),
        ratio_row(
            "cross: teacher tokens per student token", [run["teacher_tokens_per_student_token"] for run in cross]
        ),
    ]
    summary = {
        "step_seconds": {arm: spread_of([median_step(run) for run in runs[arm]]) for arm in ARMS},
        "cross_over_same": spread_of([median_step(c) / median_step(s) for c, s in pairs]),
        "alignment_seconds_per_step": spread_of(alignment),
        "alignment_share": spread_of([alignment_share(run) for run in cross]),
    }
    golds = [run["gold"] for run in cross]
    if all(gold["available"] for gold in golds):
        ours = [statistics.median(per_step(run, CORRESPONDING_PARTS)) for run in cross]
        theirs = [statistics.median(gold["seconds"]["total"]) for gold in golds]
        for part in (*GOLD_PARTS, "total"):
            rows.append(
                ratio_row(f"GOLD: {part} seconds per step", [statistics.median(g["seconds"][part]) for g in golds])
            )
        rows += [
            ratio_row("cross: corresponding part seconds per step", ours),
            ratio_row("GOLD / cross: corresponding part", [t / o for t, o in zip(theirs, ours)]),
            ratio_row("GOLD: ULD loss (median over steps)", [statistics.median(g["loss"]) for g in golds]),
            ratio_row(
                "GOLD: groups per student token", [statistics.median(g["groups_per_student_token"]) for g in golds]
            ),
            ratio_row(
                "GOLD: share of rows whose text is not the student's bytes",
                [statistics.mean(g["rows_text_not_student_bytes"]) for g in golds],
            ),
        ]
        summary["gold"] = {
            "available": True,
            "loss": spread_of([statistics.median(g["loss"]) for g in golds]),
            "seconds_per_step": spread_of(theirs),
            "cross_corresponding_seconds_per_step": spread_of(ours),
            "gold_over_cross_corresponding": spread_of([t / o for t, o in zip(theirs, ours)]),
        }
    else:
        reason = next(gold["reason"] for gold in golds if not gold["available"])
        summary["gold"] = {"available": False, "reason": reason}
    return rows, summary


def spread_of(values) -> dict:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def real_pair(data: Path) -> tuple[dict, dict, object, Dataset, dict]:
    """The real pair's models (converted once), the student's tokenizer, REAL_PROMPTS real GSM8K test questions as
    chat prompts, and what the setup records."""
    from trl_statelens.real_models import build_gemma3, build_smollm2

    if not (data / "gsm8k" / "test.jsonl").exists():
        raise SystemExit(f"--pair real needs real GSM8K at {data / 'gsm8k'} (see ../shared/data/README.md)")
    student, gemma = str(build_smollm2()), str(build_gemma3())  # build_gemma3 names the install step it needs
    paths = {"student": student, "same_teacher": student, "cross_teacher": gemma}
    parameters = {name: count_saved_parameters(path) for name, path in paths.items()}
    tokenizer = AutoTokenizer.from_pretrained(student)
    rows = read_gsm8k_rows(str(data / "gsm8k"), "test")[:REAL_PROMPTS]
    dataset = Dataset.from_dict({"prompt": [chat_prompt(row["question"]) for row in rows]})
    setup = {
        "pair": "real",
        "student": "smollm2-135m",
        "teachers": {"same": "smollm2-135m", "cross": "gemma3-270m"},
        "parameters": parameters,
        "student_tokenizer": {"size": len(tokenizer)},
        "teacher_tokenizer": {"size": len(AutoTokenizer.from_pretrained(gemma))},
        "prompts": f"the first {REAL_PROMPTS} GSM8K test questions, chat template",
    }
    return paths, parameters, tokenizer, dataset, setup


def lab_pair(quick: bool) -> tuple[dict, dict, object, Dataset, dict]:
    """The lab pair: a student and two teachers of one size, one of the student's tokenizer and one of another."""
    shape = QUICK_MODEL if quick else None
    world = LabWorld(seed=0)
    tokenizer = build_tokenizer(world, **STUDENT_VOCAB)
    other_tokenizer = build_tokenizer(world, **OTHER_VOCAB)
    prompts = fixed_length_prompts(tokenizer, world, n=32 if quick else 256)
    dataset = Dataset.from_dict({"prompt": prompts})
    paths, parameters = save_models(
        tokenizer, other_tokenizer, scratch_dir("bench-cross-tokenizer-models-"), shape or STUDENT, shape or TEACHER
    )
    if parameters["same_teacher"] != parameters["cross_teacher"]:
        raise RuntimeError(f"the two teachers differ in size: {parameters}")
    setup = {
        "pair": "lab",
        "student": shape or STUDENT,
        "teacher": shape or TEACHER,
        "parameters": parameters,
        "student_tokenizer": {**STUDENT_VOCAB, "size": len(tokenizer)},
        "teacher_tokenizer": {**OTHER_VOCAB, "size": len(other_tokenizer)},
        "prompt_tokens": PROMPT_TOKENS,
    }
    return paths, parameters, tokenizer, dataset, setup


def main(
    repeats: int = 3,
    steps: int = 4,
    quick: bool = False,
    out: str = str(RESULTS_DIR),
    pair: str = "lab",
    data: Path = Path("../shared/data"),
) -> dict:
    if quick:
        repeats, steps = 1, 2
    if pair == "real":
        rollouts, completion_tokens = (
            (QUICK_ROLLOUTS, QUICK_COMPLETION_TOKENS) if quick else (REAL_ROLLOUTS, REAL_COMPLETION_TOKENS)
        )
        paths, parameters, tokenizer, dataset, setup = real_pair(data)
    else:
        rollouts = QUICK_ROLLOUTS if quick else ROLLOUTS_PER_STEP
        completion_tokens = QUICK_COMPLETION_TOKENS if quick else COMPLETION_TOKENS
        paths, parameters, tokenizer, dataset, setup = lab_pair(quick)

    runs = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
            start = time.perf_counter()
            gold_path = paths["cross_teacher"] if arm == "cross" else None
            run = run_forked(run_arm, arm, paths, tokenizer, dataset, steps, rollouts, completion_tokens, gold_path)
            runs[arm].append(run)
            say(
                f"repeat {repeat + 1}/{repeats} {arm}: median step {median_step(run):.3f}s, loss "
                f"{statistics.median(run['loss']):.4f}, train mem {run['train_mem_mb']:.0f} MB "
                f"({time.perf_counter() - start:.0f}s)"
            )
            if arm == "cross" and not run["gold"]["available"]:
                say(f"GOLD not measured: {run['gold']['reason']}")

    rows, summary = summarize(runs, same_size=pair == "lab")
    teachers = "Gemma 3 270M vs SmolLM2-135M" if pair == "real" else "same size"
    print_table(f"Cross-tokenizer teacher vs same-tokenizer teacher ({teachers}), and GOLD on the same rollouts", rows)
    gold = summary["gold"]
    if gold["available"]:
        call = runs["cross"][0]["gold"]["call"]
        print(
            f"GOLD: {call['loss']} with {call['config']}; {call['matched_vocabulary']} teacher tokens matched by string"
        )
    else:
        print(f"GOLD: not measured: {gold['reason']}")
    results = {
        "quick": quick,
        "setup": {
            **setup,
            "signal": "reverse_kl",
            "rollouts_per_step": rollouts,
            "num_generations": NUM_GENERATIONS,
            "completion_tokens": completion_tokens,
            "warmup_steps": WARMUP_STEPS,
            "measured_steps": steps,
            "repeats": repeats,
        },
        "runs": runs,
        "rows": rows,
        "summary": summary,
        "finite_losses": all(math.isfinite(v) for arm in ARMS for run in runs[arm] for v in run["loss"]),
    }
    name = "cross_tokenizer" + ("_real" if pair == "real" else "") + ("_quick" if quick else "")
    path = write_results(name, results, Path(out))
    say(f"wrote {path}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run, after one warm-up step")
    parser.add_argument(
        "--quick", action="store_true", help="tiny models and rollouts, 1 repeat of 2 steps (the test)"
    )
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder of the results file")
    parser.add_argument("--pair", choices=("lab", "real"), default="lab", help="real: SmolLM2 and Gemma 3 (above)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data"), help="real GSM8K, for --pair real")
    options = parser.parse_args()
    main(options.repeats, options.steps, options.quick, options.out, options.pair, options.data)
