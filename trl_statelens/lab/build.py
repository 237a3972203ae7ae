"""Build the lab: data files, tokenizer and a pretrained base model, cached under ``$STATELENS_HOME/lab``.

The base model is pretrained on raw text of the world (no chat format) until its math accuracy on a held-out dev
split enters a band that leaves room for post-training. Its retention tasks land far from chance and from ceiling by
construction of the world (facts stated often, seldom or never; myths debunked, contested or popular).

A clone of the repository ships seed 0 ready-built (`lab/v2/seed0/`, the lab every study in STUDY.md ran on): the
first use copies it instead of pretraining for four and a half minutes, and every machine starts from the same
weights (a rebuild on another CPU can differ in the last bits, and so in every score). `--force` rebuilds it.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .model import build_model
from .paths import lab_dir
from .tokenizer import build_tokenizer
from .world import LAB_VERSION, LabWorld, format_plain

# Base-model scores that leave room for post-training in both directions (4-way retention choices: chance 0.25)
MATH_BAND = (0.15, 0.35)
RETENTION_BAND = (0.45, 0.85)
MATH_NEW_TOKENS = 96  # lab answers are at most ~80 tokens
_FINAL = re.compile(r"#### (-?\d+)")


def _say(message: str) -> None:
    tqdm.write(message)  # keeps progress bars intact
    sys.stdout.flush()  # and reaches a redirected log at once


def in_bands(scores: dict) -> bool:
    return MATH_BAND[0] <= scores["math"] <= MATH_BAND[1] and all(
        RETENTION_BAND[0] <= scores[task] <= RETENTION_BAND[1] for task in ("kb", "truth")
    )


# ----- the lab's own scorers (the evaluation module checks itself against these) -------------------------------
@torch.no_grad()
def score_math(model, tokenizer, rows: list[dict], batch_size: int = 100) -> float:
    """Greedy accuracy: the number after ``####`` in the generation equals the gold one."""
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        enc = tokenizer(
            [format_plain(r["question"]) for r in batch], return_tensors="pt", padding=True, padding_side="left"
        )
        out = model.generate(**enc, max_new_tokens=MATH_NEW_TOKENS, do_sample=False)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for row, text in zip(batch, texts):
            found = _FINAL.search(text.split("Question:")[0])
            correct += found is not None and found.group(1) == _FINAL.search(row["answer"]).group(1)
    return correct / len(rows)


@torch.no_grad()
def choice_logprobs(model, tokenizer, prompt: str, choices: list[str]) -> torch.Tensor:
    """Summed log-probability of each ``" " + choice`` after ``prompt``, one forward pass for all choices."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    seqs = [tokenizer(prompt + " " + c)["input_ids"] for c in choices]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
        mask[j, : len(s)] = 1
    logps = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
    token_logps = logps.gather(-1, ids[:, 1:, None]).squeeze(-1)
    scored = torch.zeros_like(token_logps)
    for j, s in enumerate(seqs):
        scored[j, len(prompt_ids) - 1 : len(s) - 1] = 1
    return (token_logps * scored).sum(-1)


@torch.no_grad()
def score_multiple_choice(model, tokenizer, rows: list[dict]) -> float:
    """Accuracy of picking the true choice by log-likelihood, for kb rows and truth rows (MC1)."""
    model.eval()
    correct = 0
    for row in rows:
        if "mc1_targets" in row:
            choices, labels = row["mc1_targets"]["choices"], row["mc1_targets"]["labels"]
            gold = labels.index(1)
        else:
            choices, gold = row["choices"], row["answer"]
        correct += int(choice_logprobs(model, tokenizer, format_plain(row["question"]), choices).argmax()) == gold
    return correct / len(rows)


def evaluate_base(model, tokenizer, world: LabWorld, split: str = "test") -> dict:
    return {
        "math": score_math(model, tokenizer, world.math(split)),
        "kb": score_multiple_choice(model, tokenizer, world.kb("test")),
        "truth": score_multiple_choice(model, tokenizer, world.truth("test")),
    }


# ----- pretraining -------------------------------------------------------------------------------------------
def _token_stream(world: LabWorld, tokenizer, rng: random.Random, block: int, buffer: list[int]):
    """Packed blocks of ``block + 1`` tokens from an endless stream of corpus documents separated by eos."""
    while True:
        while len(buffer) < block + 1:
            buffer.extend(tokenizer(world.corpus_document(rng))["input_ids"] + [tokenizer.eos_token_id])
        chunk = buffer[: block + 1]
        del buffer[:block]  # before yielding, so a checkpoint taken between batches never replays a block
        yield chunk


def pretrain(
    model,
    tokenizer,
    world: LabWorld,
    out_dir: Path,
    max_steps: int = 500,
    batch_size: int = 16,
    block: int = 256,
    lr: float = 4e-3,
    eval_every: int = 25,
    min_steps: int = 300,
    math_target: float = 0.2,
    seed: int = 0,
    log=_say,
) -> dict:
    """Pretrain on the world's raw text; stop at the first dev evaluation whose math accuracy reaches
    ``math_target``.

    Dev evaluations run every ``eval_every`` steps from ``min_steps`` on (earlier ones could not stop the run and
    cost about 5 s each at lab size). Resumable: a checkpoint (weights, optimizer, data stream and RNG state) is
    written to ``out_dir/ckpt.pt`` every ``eval_every`` steps, and a restart continues from it. Returns the history
    of dev evaluations.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "ckpt.pt"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 30

    def lr_at(step):  # linear warmup, then cosine to 10% over max_steps
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - warmup))))

    rng, buffer, step, history = random.Random(f"{world.seed}-pretrain-{seed}"), [], 0, []
    torch.manual_seed(seed)
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True)  # tensors and plain data only, never code
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        buffer, step, history = state["buffer"], state["step"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        log(f"resuming pretraining at step {step}")
    stream = _token_stream(world, tokenizer, rng, block, buffer)
    bar = tqdm(total=max_steps, initial=step, desc="pretraining lab base", unit="step")
    tokens_seen, started = 0, time.perf_counter()
    while step < max_steps:
        model.train()
        batch = torch.tensor([next(stream) for _ in range(batch_size)])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # HF shifts labels internally, so feed the block without its last token and let it predict within it.
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch[:, :-1].numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - started):.0f}")
        if step % eval_every == 0 or step == max_steps:
            scores = {"step": step, "loss": loss.item()}
            evaluated = step >= min_steps or step == max_steps
            if evaluated:
                scores.update(evaluate_base(model, tokenizer, world, split="dev"))
                history.append(scores)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "rng": rng.getstate(),
                    "buffer": buffer,
                    "step": step,
                    "history": history,
                    "torch_rng": torch.get_rng_state(),
                },
                ckpt_path,
            )
            log(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if k != "step"))
            if evaluated and scores["math"] >= math_target:
                break
    bar.close()
    return {"steps": step, "history": history}


# ----- the whole build -----------------------------------------------------------------------------------------
def shipped_lab(seed: int) -> Path | None:
    """The lab of this version and ``seed`` that the repository ships built (`lab/` beside the package: a clone has
    seed 0, an installed wheel none), or ``None``."""
    path = Path(__file__).resolve().parents[2] / "lab" / f"v{LAB_VERSION}" / f"seed{seed}"
    return path if (path / "info.json").exists() else None


def build_lab(seed: int = 0, size: str = "lab", force: bool = False, log=_say, **pretrain_kwargs) -> Path:
    """Build (or reuse) the lab under ``lab_dir(seed)``: ``data/``, ``tokenizer/``, ``base/`` and ``info.json``.

    Without ``force``, size ``"lab"`` and default pretraining settings, the repository's shipped copy of the lab (the
    base model and the math teacher, [`shipped_lab`]) is copied in when there is one."""
    root = lab_dir(seed)
    info_path = root / "info.json"
    if info_path.exists() and not force:
        log(f"lab already built at {root} (use --force to rebuild)")
        return root
    shipped = shipped_lab(seed)
    if shipped is not None and not force and size == "lab" and not pretrain_kwargs:
        # Copied beside it and renamed: a copy cut short is never taken for a lab, and processes starting together
        # (the ranks of a run) each copy their own and keep the first in place
        staging = root.with_name(f"{root.name}.copying-{os.getpid()}")
        shutil.copytree(shipped, staging)
        info = json.loads((staging / "info.json").read_text())
        info["copied_from"] = str(shipped)
        (staging / "info.json").write_text(json.dumps(info, indent=2))
        if not info_path.exists():
            shutil.rmtree(root, ignore_errors=True)  # an earlier build cut short
        try:
            staging.rename(root)
        except OSError:  # another process put its copy there first
            shutil.rmtree(staging)
        log(
            f"lab seed {seed}: copied the repository's built lab from {shipped} (`statelens lab build --force` rebuilds it)"
        )
        return root
    started = time.perf_counter()
    world = LabWorld(seed=seed)
    log(f"writing data to {root / 'data'}")
    write_data(world, root / "data")
    log("training tokenizer")
    tokenizer = build_tokenizer(world)
    tokenizer.save_pretrained(root / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    model = build_model(size, tokenizer, seed=seed)
    log(f"pretraining a {size} Qwen3 with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    result = pretrain(model, tokenizer, world, root / "pretrain", seed=seed, log=log, **pretrain_kwargs)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    # score exactly what downstream code will load
    model = AutoModelForCausalLM.from_pretrained(root / "base", use_safetensors=True)
    scores = evaluate_base(model, tokenizer, world, split="test")
    info = {
        "seed": seed,
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "pretrain_steps": result["steps"],
        "test_scores": scores,
        "dev_history": result["history"],
        "build_seconds": round(time.perf_counter() - started, 1),
        "lab_version": LAB_VERSION,
        "math_band": MATH_BAND,
        "retention_band": RETENTION_BAND,
        "in_band": in_bands(scores),
    }
    info_path.write_text(json.dumps(info, indent=2))
    if not info["in_band"]:
        log(
            f"WARNING: base scores {scores} are outside the intended bands (math in {MATH_BAND}, retention tasks in "
            f"{RETENTION_BAND}); post-training results on this lab may say little. Rebuild with another --seed."
        )
    return root


def fine_tune_on_answers(
    model,
    tokenizer,
    rows: list[dict],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    desc: str = "fine-tuning",
) -> None:
    """Supervised fine-tuning in place on ``{"question", "answer"}`` rows in the plain format, the answer tokens only
    (as SFT on prompt-completion data), ``batch_size`` rows a step in order: ``rows`` holds ``steps * batch_size``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    model.train()
    for step in tqdm(range(steps), desc=desc, unit="step"):
        batch = rows[step * batch_size : (step + 1) * batch_size]
        prompts = [format_plain(r["question"]) for r in batch]
        enc = tokenizer(
            [format_plain(r["question"], r["answer"]) + tokenizer.eos_token for r in batch],
            return_tensors="pt",
            padding=True,
            padding_side="right",
        )
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        for i, prompt in enumerate(prompts):  # supervise the answer only, as SFT on prompt-completion data does
            labels[i, : len(tokenizer(prompt)["input_ids"])] = -100
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def build_teacher(
    seed: int = 0, steps: int = 300, batch_size: int = 16, lr: float = 5e-4, force: bool = False, log=_say
) -> Path:
    """The lab teacher: the base model fine-tuned on lab math (answer tokens only), cached in ``lab_dir(seed)/teacher``.

    The embedded OPD recipe distils it into the base model. Its test scores go to ``info.json`` under ``teacher``.
    """
    root = lab_dir(seed)
    if (root / "teacher" / "config.json").exists() and not force:
        return root / "teacher"
    if not (root / "info.json").exists():
        raise FileNotFoundError(f"no lab base model at {root}: run `statelens lab build --seed {seed}` first")
    started = time.perf_counter()
    world = LabWorld(seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    model = AutoModelForCausalLM.from_pretrained(root / "base", use_safetensors=True)
    rows = world.math("train", n=steps * batch_size, seed=1)
    fine_tune_on_answers(model, tokenizer, rows, steps, batch_size, lr, seed, desc="fine-tuning lab teacher on math")
    model.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    scores = evaluate_base(model, tokenizer, world, split="test")
    info = json.loads((root / "info.json").read_text())
    info["teacher"] = {
        "steps": steps,
        "lr": lr,
        "test_scores": scores,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (root / "info.json").write_text(json.dumps(info, indent=2))
    log("lab teacher: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    return root / "teacher"


def write_data(world: LabWorld, out: Path, math_train_size: int = 2000) -> None:
    """The world's splits as JSONL files, loadable like any local data set (``load_dataset("json", ...)``)."""
    splits = {
        "math/train.jsonl": world.math("train", n=math_train_size),
        "math/test.jsonl": world.math("test"),
        "math/dev.jsonl": world.math("dev"),
        "kb/dev.jsonl": world.kb("dev"),
        "kb/test.jsonl": world.kb("test"),
        "truth/dev.jsonl": world.truth("dev"),
        "truth/test.jsonl": world.truth("test"),
    }
    for name, rows in splits.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
