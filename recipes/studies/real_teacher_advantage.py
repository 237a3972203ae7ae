"""What a teacher knows beyond the student on real GSM8K, before any training: SmolLM2-135M-Instruct's greedy answers
to dev problems behind the student's prompt and behind each teacher view (the self teacher's privileged prompts).

    python recipes/studies/real_teacher_advantage.py [--data ../shared/data] [--n 32] [--out runs/real-study]
        [--model smollm2-135m]

`--model gemma3-270m` (after `make install-gemma3`) measures Gemma 3 270M behind the same views, in its own chat
template, the end of its turn (`<end_of_turn>`, what SmolLM2's `<|im_end|>` maps to) as the end token: what a teacher
of another family would read and want. `--chat_template FILE` reads the views through another template (a text
layout for a base model, `recipes/configs/real/text_frame.jinja`); a template whose turns end with no special token
of their own ends them with the tokenizer's eos.

Views, all in the model's chat template:
- `student`: the question alone (what the student sees);
- `shots`: 4 solved train problems, then the question, in one user message (a few-shot self teacher; the text
  frame the 2026-12-03 run's teacher read, where `#### N` is followed by the next `Question:`);
- `chat_shots`: the same 4 problems as user/assistant exchanges, each answer closed by the template's end token, then
  the question as the last user turn (`load_gsm8k(..., context_format="chat")`: what the teacher reads as turns);
- `solution`: the question with its own reference solution and "now solve it yourself" (the self-distillation
  recipe's teacher, `recipes/configs/real/self_distill.yaml`).
Each teacher view is what a self teacher with that `TEMPLATES` entry as its `teacher_prompt_template` reads.

Dev problems: GSM8K train rows held out from training (`real_splits`); the test split is not read. Prints and writes
`teacher_advantage.json`: per view, strict (`#### N`) and flexible (last number) accuracy, the share of answers with
a `#### N` line (what lm-eval's strict-match reads), the clean-format and loop shares
(`trl_statelens.answers`), the mean answer length in tokens, and what the view wants after a final
answer: the probability of the end-of-turn token right after `N` of the view's own `#### N` answers
(`end_prob_own`, mean over those answers) and after `N` of each problem's reference solution (`end_prob_reference`).
"""

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.answers import STRICT_PATTERN, clean_format, extract_answer, repeats_itself
from trl_statelens.data import chat_prompt, pick_shots, read_gsm8k_rows
from trl_statelens.data import shots_context as format_shots
from trl_statelens.evaluation.gsm8k import GSM8KTask
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model
from trl_statelens.teachers.byte_vocab import chat_turn_tokens

DEV_SIZE, NUM_SHOTS, SPLIT_SEED = 200, 4, 2026
VIEWS = ("student", "shots", "chat_shots", "solution")
# Self-teacher templates (`teacher_prompt_template`): {prompt} is the student's user message, {privileged_context}
# the row's reference solution (`solution`) or NUM_SHOTS solved train problems (`shots`, `shots_context`)
TEMPLATES = {
    "solution": "{prompt}\n\nHere is a worked solution to this problem:\n{privileged_context}\n\n"
    "Now solve the problem yourself, step by step.",
    "shots": "Here are solved examples:\n\n{privileged_context}\n\nSolve this problem the same way, ending with "
    "the line #### followed by the answer.\nQuestion: {prompt}",
}


def real_splits(data: Path) -> tuple[list[dict], list[dict]]:
    """GSM8K's train rows split once, by a fixed seed, into a dev set of DEV_SIZE rows and the training pool."""
    rows = read_gsm8k_rows(str(data / "gsm8k"), "train")
    order = random.Random(SPLIT_SEED).sample(range(len(rows)), len(rows))
    return [rows[i] for i in order[:DEV_SIZE]], [rows[i] for i in order[DEV_SIZE:]]


def shots_context(pool: list[dict], seed: int = 0, context_format: str = "text") -> str | list[dict]:
    """The NUM_SHOTS solved problems a recipe run with `--context_shots` (and `--context_format`) and training seed
    `seed` shows its teacher, its training data being `pool` (`load_gsm8k` draws them so)."""
    return format_shots(pick_shots(pool, NUM_SHOTS, seed + 1)[:NUM_SHOTS], context_format)


def view_prompts(view: str, rows: list[dict], pool: list[dict]) -> list[list[dict]]:
    """Each row's conversation as the student (`student`) or a self teacher with that template sees it."""
    if view == "student":
        return [chat_prompt(r["question"]) for r in rows]
    if view == "chat_shots":
        return [[*shots_context(pool, context_format="chat"), *chat_prompt(r["question"])] for r in rows]
    contexts = [r["answer"] if view == "solution" else shots_context(pool) for r in rows]
    return [
        [{"role": "user", "content": TEMPLATES[view].format(prompt=r["question"], privileged_context=c)}]
        for r, c in zip(rows, contexts)
    ]


def mean_or_none(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


@torch.no_grad()
def end_probability(model, tokenizer, prompts: list[str], answers: list[str]) -> list[float]:
    """For each answer holding a `#### N` line, the model's probability of the end-of-turn token (the tokenizer's
    eos, `<|im_end|>` for SmolLM2's chat) right after `N`, behind its prompt: what this view wants once the answer
    is given. Answers without a final-answer line are left out."""
    probabilities = []
    for prompt, answer in zip(prompts, answers):
        found = STRICT_PATTERN.search(answer)
        if found is None:
            continue
        ids = tokenizer(prompt + answer[: found.end()], add_special_tokens=False, return_tensors="pt")["input_ids"]
        logits = model(ids).logits[0, -1].float()
        probabilities.append(torch.softmax(logits, -1)[tokenizer.eos_token_id].item())
    return probabilities


def end_turn_with_its_token(model, tokenizer) -> None:
    """Make the token that ends an assistant turn in the chat template the one generation stops at and
    `end_probability` reads (Gemma ends a turn with `<end_of_turn>`, not its `<eos>`; SmolLM2's is its eos)."""
    end = chat_turn_tokens(tokenizer, set(tokenizer.all_special_ids)).get("end_of_turn", tokenizer.eos_token_id)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end)
    model.generation_config.eos_token_id = end


def main(
    data: Path,
    n: int,
    out: Path,
    max_new_tokens: int,
    views=VIEWS,
    model_name: str = SMOLLM2,
    chat_template: Path | None = None,
) -> dict:
    if not (data / "gsm8k").is_dir():
        sys.exit(f"needs real GSM8K at {data / 'gsm8k'} (see ../shared/data/README.md)")
    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if chat_template is not None:  # the layout a teacher folder saved with this template would read
        tokenizer.chat_template = chat_template.read_text()
    end_turn_with_its_token(model, tokenizer)
    dev, pool = real_splits(data)
    rows = dev[:n]
    task = GSM8KTask(str(data / "gsm8k"), "train", prompt_format="chat", max_new_tokens=max_new_tokens)
    saved = out / "teacher_advantage.json"
    results = json.loads(saved.read_text())["views"] if saved.exists() else {}  # the views not measured again
    for view in views:
        prompts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in view_prompts(view, rows, pool)
        ]
        outputs = task.generate(model, tokenizer, prompts, progress=False)
        scores = [
            task.score(o, {"ground_truth": extract_answer(r["answer"], "strict")}) for o, r in zip(outputs, rows)
        ]
        results[view] = {
            "accuracy_strict": statistics.mean(s["correct_strict"] for s in scores),
            "accuracy_flexible": statistics.mean(s["correct_flexible"] for s in scores),
            "answer_found": statistics.mean(s["answer_found"] for s in scores),
            "clean_format": statistics.mean(clean_format(o) for o in outputs),
            "repeats": statistics.mean(repeats_itself(o) for o in outputs),
            "mean_tokens": statistics.mean(len(tokenizer(o)["input_ids"]) for o in outputs),
            "end_prob_own": mean_or_none(end_probability(model, tokenizer, prompts, outputs)),
            "end_prob_reference": mean_or_none(
                end_probability(model, tokenizer, prompts, [r["answer"] for r in rows])
            ),
            "example": outputs[0],
        }
        print(view, {k: v for k, v in results[view].items() if k != "example"}, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(
            json.dumps({"model": model_name, "n": n, "max_new_tokens": max_new_tokens, "views": results}, indent=2)
        )
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(
        json.dumps({"model": model_name, "n": n, "max_new_tokens": max_new_tokens, "views": results}, indent=2)
    )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("runs/real-study"))
    parser.add_argument("--views", nargs="+", default=list(VIEWS), choices=VIEWS, help="measure these again")
    parser.add_argument("--model", default=SMOLLM2, help="the model behind the views (smollm2-135m, gemma3-270m)")
    parser.add_argument("--chat_template", type=Path, help="a Jinja chat template file read instead of the model's")
    args = parser.parse_args()
    main(args.data, args.n, args.out, args.max_new_tokens, args.views, args.model, args.chat_template)
