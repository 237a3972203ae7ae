import json
import math
import random
import re
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_statelens.cli import main as statelens
from trl_statelens.lab import (
    LabWorld,
    build_model,
    build_tokenizer,
    check_math_answer,
    format_plain,
    pretrain,
    score_multiple_choice,
)
from trl_statelens.lab.world import EQUATION


# ----- the world ---------------------------------------------------------------------------------------------------
def test_every_math_answer_equals_its_own_worked_steps(world):
    rows = world.math("train", n=500) + world.math("test") + world.math("dev")
    for row in rows:
        final = int(row["answer"].rsplit("#### ", 1)[1])
        assert check_math_answer(row["answer"]) == final
        # independent recomputation from the question's own numbers, step by step
        steps = EQUATION.findall(row["answer"])
        assert steps[0][0] in row["question"].split()[2]  # the starting amount is the question's first number
        assert len(steps) == row["question"].count(".") - 1  # one worked step per action sentence


@pytest.mark.parametrize(
    "corruption",
    [lambda a: a.replace("#### ", "#### 1"), lambda a: a.replace(" = ", " = 1", 1)],
)
def test_check_math_answer_rejects_a_wrong_solution(world, corruption):
    answer = world.math("test")[0]["answer"]
    with pytest.raises(ValueError):
        check_math_answer(corruption(answer))


def test_math_knobs_control_steps_and_ranges():
    world = LabWorld(seed=3, math_steps=(2, 2), max_start=9, max_operand=5)
    for row in world.math("train", n=200):
        steps = EQUATION.findall(row["answer"])
        assert len(steps) == 2
        assert int(steps[0][0]) <= 9
        assert all(int(b) <= 5 for _, op, b, _ in steps if op != "*")


def test_same_seed_same_world_other_seed_other_world():
    a, b, c = LabWorld(seed=7), LabWorld(seed=7), LabWorld(seed=8)
    for split_of in (
        lambda w: w.math("train", n=50),
        lambda w: w.math("test"),
        lambda w: w.kb("test"),
        lambda w: w.truth("test"),
    ):
        assert split_of(a) == split_of(b)
        assert split_of(a) != split_of(c)
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert [a.corpus_document(rng_a) for _ in range(50)] == [b.corpus_document(rng_b) for _ in range(50)]


def test_train_and_test_splits_are_disjoint(world):
    test_q = {r["question"] for r in world.math("test")}
    dev_q = {r["question"] for r in world.math("dev")}
    train_q = {r["question"] for r in world.math("train", n=5000)}
    assert len(test_q) == world.math_test_size and not test_q & dev_q
    assert not train_q & (test_q | dev_q)
    rng = random.Random(0)
    corpus = "\n".join(world.corpus_document(rng) for _ in range(3000))
    assert not any(q in corpus for q in test_q | dev_q)
    for task in (world.kb, world.truth):
        dev = {r["question"] for r in task("dev")}
        test = {r["question"] for r in task("test")}
        assert dev and test and not dev & test


def test_retention_rows_have_hub_layouts(world):
    kb = world.kb("test")[0]
    assert set(kb) == {"question", "subject", "choices", "answer"} and len(kb["choices"]) == 4
    truth = world.truth("test")[0]
    assert sum(truth["mc1_targets"]["labels"]) == 1 and len(truth["mc1_targets"]["choices"]) == 4
    assert sum(truth["mc2_targets"]["labels"]) == 2


def test_a_world_too_small_for_its_tiers_is_refused():
    with pytest.raises(ValueError, match="num_entities >= 16"):
        LabWorld(num_entities=12)


def test_retention_exposure_tiers(world):
    """The corpus states common facts often, rare ones seldom and unstated ones never; it debunks some myths and
    repeats others as fact. Tier sizes are exact shares, the same for every seed."""
    for seed in (0, 1):
        w = LabWorld(seed=seed)
        assert Counter(e["tier"] for e in w.entities) == {"common": 54, "rare": 30, "unstated": 36}
        assert Counter(m["tier"] for m in w.myths) == {"debunked": 36, "contested": 28, "popular": 16}
    rng = random.Random(0)
    corpus = [world.corpus_document(rng) for _ in range(20000)]
    text = "\n".join(corpus)
    words = set(re.findall(r"\w+", text))
    mentions = {tier: 0 for tier in ("common", "rare", "unstated")}
    for e in world.entities:
        mentions[e["tier"]] += text.count(e["name"] + " ") + text.count(e["name"] + "?")
        if e["tier"] == "unstated":  # never a fact about it, nor any of its answers
            name = e["name"]
            for said in (f"of {name} ", f"of {name}?", f"of {name}.", f"the {name} ", f"The {name} "):
                assert said not in text
            assert e["capital"] not in words and re.search(rf"\b{e['inventor']}\b", text) is None
    per_entity = {"common": mentions["common"] / 54, "rare": mentions["rare"] / 30}
    # rare_kb_share of the kb text is about rare entities: per entity, (0.04 / 30) / (0.96 / 54) = 0.075 as often
    assert 0.04 < per_entity["rare"] / per_entity["common"] < 0.15
    # distractors share the truth's tier, so an unstated answer is not told apart by being unfamiliar
    tier_of_answer = {e[key]: e["tier"] for e in world.entities for key in ("capital", "inventor")}
    for row in world.kb("test"):
        if row["subject"] != "biology":
            assert len({tier_of_answer[c] for c in row["choices"]}) == 1
    # how often the corpus answers a myth question with the truth, by tier
    answers = {m["question"]: m for m in world.myths}
    told = {"debunked": Counter(), "contested": Counter(), "popular": Counter()}
    for doc in corpus:
        question = doc.split("\n")[0].removeprefix("Question: ")
        if question in answers:
            m = answers[question]
            told[m["tier"]][doc.endswith(m["myth"])] += 1
    share_of_myth = {tier: c[True] / (c[True] + c[False]) for tier, c in told.items()}
    assert share_of_myth["debunked"] == 0
    assert 0.4 < share_of_myth["contested"] < 0.6 and 0.7 < share_of_myth["popular"] < 0.9


# ----- tokenizer ---------------------------------------------------------------------------------------------------
def test_tokenizer_round_trips_the_worlds_text(world, tokenizer):
    rng = random.Random(5)
    texts = [world.corpus_document(rng) for _ in range(300)]
    texts += [format_plain(r["question"], r["answer"]) for r in world.math("test")[:50]]
    for text in texts:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.tokenize(" 305")[-3:] == ["3", "0", "5"]  # digits are single tokens
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tokenizer_reloads_with_auto_tokenizer(tokenizer_path, tokenizer):
    reloaded = AutoTokenizer.from_pretrained(tokenizer_path)
    text = format_plain("Ava has 3 apples.", "Ava starts with 3 apples.")
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template


def test_chat_template_marks_exactly_the_assistant_tokens(tokenizer):
    messages = [
        {"role": "user", "content": "Ava has 3 apples. How many apples does Ava have now?"},
        {"role": "assistant", "content": "Ava starts with 3 apples.\n#### 3"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "#### 4"},
    ]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    marked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert marked == "Ava starts with 3 apples.\n#### 3<|im_end|>#### 4<|im_end|>"
    # the generation prompt is a prefix of the conversation, as SFT and GRPO need
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, tokenize=False).startswith(prompt)


# ----- models ------------------------------------------------------------------------------------------------------
def test_models_match_the_tokenizer_and_reload(tokenizer, student_path):
    model = AutoModelForCausalLM.from_pretrained(student_path)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tokenizer)
    assert model.config.head_dim == model.config.hidden_size // 4
    lab = build_model("lab", tokenizer)
    assert 1e6 <= sum(p.numel() for p in lab.parameters()) <= 5e6
    with pytest.raises(ValueError, match="unknown model size"):
        build_model("huge", tokenizer)


# ----- pretraining -------------------------------------------------------------------------------------------------
SMALL_WORLD = dict(seed=0, num_entities=16, num_myths=8, math_test_size=8, math_dev_size=8)


@pytest.mark.slow
def test_pretraining_lowers_loss_and_learns_the_retention_facts(tmp_path):
    world = LabWorld(**SMALL_WORLD)
    tokenizer = build_tokenizer(world, num_documents=1000)
    model = build_model("test", tokenizer)
    # what the corpus states often: common knowledge-base facts and debunked myths
    debunked = [row for row, m in zip(world._truth_rows, world.myths) if m["tier"] == "debunked"]
    stated = world._kb_questions_by_tier["common"] + debunked
    before = score_multiple_choice(model, tokenizer, stated)
    result = pretrain(
        model,
        tokenizer,
        world,
        tmp_path,
        max_steps=240,
        batch_size=16,
        block=128,
        lr=5e-3,
        eval_every=40,
        min_steps=0,  # evaluate from the start, and never stop early:
        math_target=2.0,
        log=lambda _: None,
    )
    assert [h["step"] for h in result["history"]] == [40, 80, 120, 160, 200, 240]
    losses = [h["loss"] for h in result["history"]]
    assert losses[0] < 0.6 * math.log(len(tokenizer))  # far below a uniform guess after 40 steps
    assert losses[-1] < 0.8 * losses[0]  # and still falling
    after = score_multiple_choice(model, tokenizer, stated)
    # 4-way choices: chance is 0.25
    assert after > 0.5 and after > before


@pytest.mark.slow
def test_pretraining_resumes_where_it_stopped(tmp_path):
    world = LabWorld(**SMALL_WORLD)
    tokenizer = build_tokenizer(world, num_documents=500)
    kwargs = dict(max_steps=12, batch_size=4, block=64, eval_every=6, min_steps=10**6)

    uninterrupted = build_model("test", tokenizer)
    result = pretrain(uninterrupted, tokenizer, world, tmp_path / "a", log=lambda _: None, **kwargs)
    assert [h["step"] for h in result["history"]] == [12]  # before min_steps only the last step is evaluated

    def crash_after_first_checkpoint(message):
        if message.startswith("step 6"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pretrain(
            build_model("test", tokenizer),
            tokenizer,
            world,
            tmp_path / "b",
            log=crash_after_first_checkpoint,
            **kwargs,
        )
    resumed = build_model("test", tokenizer, seed=123)  # different init: everything must come from the checkpoint
    messages = []
    pretrain(resumed, tokenizer, world, tmp_path / "b", log=messages.append, **kwargs)
    assert messages[0] == "resuming pretraining at step 6"
    for a, b in zip(uninterrupted.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_statelens_lab_build_and_info(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STATELENS_HOME", str(tmp_path))
    assert statelens(["lab", "info"]) == 1
    assert "no lab built" in capsys.readouterr().out
    assert statelens(["lab", "build", "--size", "test", "--max-steps", "20", "--teacher-steps", "3"]) == 0
    assert "lab ready at" in capsys.readouterr().out
    root = tmp_path / "lab" / "v2" / "seed0"
    info = json.loads((root / "info.json").read_text())
    assert set(info["teacher"]["test_scores"]) == {"math", "kb", "truth"}
    assert info["pretrain_steps"] == 20 and set(info["test_scores"]) == {"math", "kb", "truth"}
    assert AutoModelForCausalLM.from_pretrained(root / "base").config.model_type == "qwen3"
    assert info["teacher"]["steps"] == 3 and (root / "teacher" / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(root / "base").eos_token == "<|endoftext|>"
    assert sum(1 for _ in open(root / "data" / "math" / "test.jsonl")) == 300
    assert statelens(["lab", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["test_scores"] == info["test_scores"]


# ----- the lab a clone ships built ---------------------------------------------------------------------------------
def test_a_clone_copies_its_built_lab_instead_of_pretraining(tmp_path, monkeypatch, capsys):
    from trl_statelens.lab.build import shipped_lab

    shipped = shipped_lab(0)
    assert shipped is not None, "the repository ships lab/v2/seed0"
    monkeypatch.setenv("STATELENS_HOME", str(tmp_path))
    assert statelens(["lab", "build"]) == 0  # would pretrain for minutes, and print a progress bar, without the copy
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "copied from the repository's built lab" in out
    assert "pretraining a lab Qwen3" not in out and "fine-tuning lab teacher" not in out
    root = tmp_path / "lab" / "v2" / "seed0"
    for name in ("base/model.safetensors", "teacher/model.safetensors", "tokenizer/tokenizer.json"):
        assert (root / name).read_bytes() == (shipped / name).read_bytes()
    info = json.loads((root / "info.json").read_text())
    assert info["copied_from"] == str(shipped) and info["teacher"]["steps"] == 300
    assert [p.name for p in root.parent.iterdir()] == ["seed0"]  # no staging copy left behind


@pytest.mark.slow
def test_the_shipped_lab_scores_what_its_info_says():
    """The shipped weights are the ones every study ran on: scored now by the lab's own scorers, the base and the
    teacher give the test scores recorded when they were built (a change to the world would break this)."""
    from trl_statelens.lab import evaluate_base
    from trl_statelens.lab.build import shipped_lab

    shipped = shipped_lab(0)
    info = json.loads((shipped / "info.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(shipped / "base")
    world = LabWorld(seed=0)
    for folder, recorded in (("base", info["test_scores"]), ("teacher", info["teacher"]["test_scores"])):
        model = AutoModelForCausalLM.from_pretrained(shipped / folder).eval()
        with torch.no_grad():
            scores = evaluate_base(model, tokenizer, world, split="test")
        assert scores == pytest.approx(recorded, abs=1e-9), folder
