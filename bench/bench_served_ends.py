"""A served teacher of another tokenizer's moved ends from its top-k log-probs, against the same teacher in the process.

The lab pair of docs/cross-tokenizer.md: the student's tokenizer (the lab's, one digit a token) and a teacher of the
second lab tokenizer (700 merges, digit runs kept whole): the untrained `other_teacher_path` model of tests/conftest.py,
whose distribution is nearly flat, and the same model trained on math text as `math_trained_path` is (40 steps). The
completions are 16 lab math reference answers (the first rows of the `math_dataset` fixture, each ending with the
student's eos) after their plain-text prompts. The in-process teacher (`CrossTokenizerTeacher`) moves its "ends here"
with the mass of every longer teacher token; the served one (`ServedCrossTokenizerTeacher`, behind
tests/vllm_test_server.py) with those among its top-k log-probs per position (`teacher_top_k`), for each k asked.
Per k: the max and mean absolute difference of the carried per-token teacher log-probs, and the share of tokens whose
value is exact per decision (`alignment/per_decision_exact`), served and in the process. The student's weights play no
part in these (only its tokenizer does). Under a minute on 2 cores.

    .venv/bin/python bench/bench_served_ends.py [--ks 0 1 2 5 10 20 32 64 700]
"""

import argparse
import sys
from pathlib import Path

import torch
from common import CPU_ARGS, scratch_dir
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _train_on_math  # noqa: E402
from vllm_test_server import TestTeacherServer  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer  # noqa: E402
from trl_statelens.lab import LabWorld, build_model, build_tokenizer, format_plain  # noqa: E402
from trl_statelens.teachers import CrossTokenizerTeacher, ServedCrossTokenizerTeacher  # noqa: E402
from trl_statelens.teachers.decisions import Decision  # noqa: E402

ANSWERS = 16
TEACHERS = ("other_teacher_path (untrained)", "trained on math")


def lab_pair() -> tuple[str, str, str]:
    """The student (`math_trained_path`), the teacher of the second lab tokenizer (`other_teacher_path`) and that
    teacher trained on math text as the student was, made and saved as tests/conftest.py makes them."""
    world = LabWorld(seed=0)
    student_tokenizer = build_tokenizer(world, num_documents=2000)
    student = _train_on_math(
        build_model("test", student_tokenizer, seed=0), student_tokenizer, world, scratch_dir("student"), 40, 1
    )
    tokenizer = build_tokenizer(world, vocab_size=700, num_documents=500, individual_digits=False)
    teacher = scratch_dir("other_teacher")
    build_model("test", tokenizer, seed=3).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    model = build_model("test", tokenizer, seed=3)
    trained = _train_on_math(model, tokenizer, world, scratch_dir("other_teacher_trained"), 40, 1)
    return str(student), teacher, str(trained)


def carried(teacher, prompts, completions):
    """Per row, the teacher's carried values and decisions on the student's tokens, as `score` gives them."""
    rows = [row.scores.result()[row.index] for row in teacher.score(prompts, completions)]
    return torch.cat([row.logps for row in rows]), torch.cat([row.decision for row in rows])


def main(ks: list[int]) -> dict[str, list[dict]]:
    student_path, *teachers = lab_pair()
    world = LabWorld(seed=0)
    rows = [{"prompt": format_plain(r["question"]), **r} for r in world.math("train", n=64)[:ANSWERS]]
    return {name: measured(student_path, path, rows, ks) for name, path in zip(TEACHERS, teachers)}


def measured(student_path: str, teacher_path: str, rows: list[dict], ks: list[int]) -> list[dict]:
    args = OnPolicyDistillConfig(
        output_dir=scratch_dir("served-ends"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=256, temperature=1.0, preflight="off", **CPU_ARGS,
    )  # fmt: skip
    trainer = OnPolicyDistillTrainer(
        model=student_path, teacher_model=teacher_path, args=args, train_dataset=Dataset.from_list(rows)
    )
    in_process = trainer.teacher
    assert isinstance(in_process, CrossTokenizerTeacher)
    tokenizer = trainer.processing_class
    student_prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    prompts = in_process.prompts(student_prompts, rows)
    completions = [
        tokenizer(" " + row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for row in rows
    ]
    reference, reference_decisions = carried(in_process, prompts, completions)
    results = []
    with TestTeacherServer(teacher_path) as server:
        for k in ks:
            trainer.args.teacher_top_k = k
            served = ServedCrossTokenizerTeacher.connect(trainer, in_process.tokenizer, server.url)
            values, decisions = carried(served, prompts, completions)
            error = (values - reference).abs()
            results.append(
                {
                    "k": k,
                    "tokens": len(values),
                    "max_abs": error.max().item(),
                    "mean_abs": error.mean().item(),
                    "per_decision_exact_served": (decisions == Decision.EXACT).float().mean().item(),
                    "per_decision_exact_in_process": (reference_decisions == Decision.EXACT).float().mean().item(),
                }
            )
    return results


def table(results: dict[str, list[dict]]) -> str:
    tokens = next(iter(results.values()))[0]["tokens"]
    lines = [
        f"{ANSWERS} lab math reference answers, {tokens} student tokens: the carried teacher log-probs of a served "
        "teacher (top-k) against the same teacher in the process",
        "",
        "| teacher | k | max abs difference (nats) | mean abs difference (nats) | per decision exact, served | in process |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        for r in rows:
            lines.append(
                f"| {name} | {r['k']} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} | "
                f"{r['per_decision_exact_served']:.3f} | {r['per_decision_exact_in_process']:.3f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 5, 10, 20, 32, 64, 700])
    print(table(main(parser.parse_args().ks)))
