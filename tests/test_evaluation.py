"""Evaluation tasks, retention summary, the training callback and the eval CLI.

Models here are stubs whose outputs the test controls, or tiny random Qwen3 models on the lab tokenizer; every
score is checked against a known answer or against the lab's own scorers.
"""

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_statelens.answers import extract_answer, lm_eval_exact_match, lm_eval_extract
from trl_statelens.evaluation import (
    GSM8KTask,
    MMLUTask,
    RetentionEvalCallback,
    TruthfulQATask,
    add_eval_arguments,
    continuation_logprobs,
    evaluate_model,
    make_task,
    parse_limit,
    read_truthfulqa_rows,
    retention_summary,
    run_eval_cli,
    truthfulqa_rows_from_csv,
)
from trl_statelens.lab import LabWorld, build_model, lab_info, score_math, score_multiple_choice
from trl_statelens.lab.build import MATH_NEW_TOKENS, in_bands
from trl_statelens.lab.world import LAB_VERSION

# ../shared/data from the project root; STATELENS_SHARED_DATA points elsewhere (a git worktree, a CI cache).
SHARED_DATA = Path(os.environ.get("STATELENS_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


# ----- stubs ------------------------------------------------------------------------------------------------------
class WordTokenizer:
    """One id per whitespace-separated word, assigned on first sight (id 0 is padding)."""

    pad_token_id = eos_token_id = 0
    bos_token_id = None
    pad_token = eos_token = "<pad>"

    def __init__(self):
        self.vocab = {"<pad>": 0}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]}

    def ids(self, texts):
        return {i for text in texts for i in self(text)["input_ids"]}


class PreferringModel(torch.nn.Module):
    """Logits that ignore the input: the ``preferred`` tokens share all probability, every other token gets e^-1000 (zero in fp32)."""

    def __init__(self, preferred: set[int], vocab_size: int = 256):
        super().__init__()
        self.bias = torch.full((vocab_size,), -1000.0)
        self.bias[sorted(preferred)] = 0.0

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, -1).clone())


TRUTH_ROWS = [
    {
        "question": "What do cats eat?",
        "mc1_targets": {"choices": ["Cats eat rocks.", "Cats eat fish.", "Cats eat clouds."], "labels": [0, 1, 0]},
        "mc2_targets": {
            "choices": ["Cats eat fish.", "Cats mostly eat fish.", "Cats eat rocks.", "Cats eat clouds."],
            "labels": [1, 1, 0, 0],
        },
    },
    {
        "question": "Where do owls sleep?",
        "mc1_targets": {"choices": ["Owls sleep in trees.", "Owls sleep underwater."], "labels": [1, 0]},
        "mc2_targets": {"choices": ["Owls sleep in trees.", "Owls sleep underwater."], "labels": [1, 0]},
    },
]


def answer_texts(rows, label):
    return [c for r in rows for c, lab in zip(r["mc2_targets"]["choices"], r["mc2_targets"]["labels"]) if lab == label]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: a second thread only adds synchronisation, which costs 10-50x on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lab_tokenizer(tokenizer):
    """The lab tokenizer of ``conftest.py`` (session-scoped, built once for the whole suite)."""
    return tokenizer


@pytest.fixture(scope="module")
def tiny_model(student_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(student_path).eval()


# ----- retention summary ------------------------------------------------------------------------------------------
BASE = {"truthfulqa": 0.300, "mmlu": 0.436}


@pytest.mark.parametrize(
    "truthfulqa, mmlu, forgetting, retention",
    [
        (0.295, 0.444, -0.0015, 1.0008),  # mild SFT
        (0.245, 0.364, 0.0635, 0.8258),  # stress SFT
        (0.290, 0.434, 0.0060, 0.9810),  # OPD from mild SFT
        (0.275, 0.430, 0.0155, 0.9515),  # OPD from stress SFT
        (0.290, 0.442, 0.0020, 0.9902),  # on-policy RL
    ],
)
def test_retention_summary_reproduces_the_study_table(truthfulqa, mmlu, forgetting, retention):
    summary = retention_summary(BASE, {"truthfulqa": truthfulqa, "mmlu": mmlu, "gsm8k": 0.5})
    assert round(summary["forgetting"], 4) == pytest.approx(forgetting, abs=1e-12)
    assert round(summary["retention"], 4) == pytest.approx(retention, abs=1e-12)


def test_retention_summary_uses_tasks_present_in_both_and_accepts_results_dicts():
    summary = retention_summary({"scores": {"truthfulqa": 0.4, "mmlu": 0.5}}, {"scores": {"truthfulqa": 0.2}})
    assert summary == pytest.approx({"forgetting": 0.2, "retention": 0.5})
    with pytest.raises(ValueError, match="no retention task"):
        retention_summary({"gsm8k": 0.4}, {"gsm8k": 0.3})
    with pytest.raises(ValueError, match="undefined"):
        retention_summary({"mmlu": 0.0}, {"mmlu": 0.3})


# ----- TruthfulQA -------------------------------------------------------------------------------------------------
def test_real_truthfulqa_csv_loads_817_questions_with_mc1_and_mc2():
    folder = SHARED_DATA / "truthfulqa"
    if not (folder / "TruthfulQA.csv").is_file():
        pytest.skip("TruthfulQA.csv not present in ../shared/data/truthfulqa")
    task = TruthfulQATask(folder)
    rows = task.rows()
    assert len(rows) == 817
    for row in rows:
        assert row["mc1_targets"]["labels"].count(1) == 1 and 0 in row["mc1_targets"]["labels"]
        assert 1 in row["mc2_targets"]["labels"] and 0 in row["mc2_targets"]["labels"]
        assert row["mc1_targets"]["choices"][0] in row["mc2_targets"]["choices"]
    assert len(TruthfulQATask(folder, limit=200, seed=0).rows()) == 200


def test_truthfulqa_csv_rows_become_multiple_choice_targets():
    row = {
        "Question": "What happens if you eat watermelon seeds?",
        "Best Answer": "The seeds pass through you",
        "Correct Answers": "Nothing happens; The seeds pass through you",
        "Incorrect Answers": "You grow watermelons in your stomach; You die",
    }
    (converted,) = truthfulqa_rows_from_csv([row])
    assert converted["mc1_targets"] == {
        "choices": ["The seeds pass through you.", "You grow watermelons in your stomach.", "You die."],
        "labels": [1, 0, 0],
    }
    assert converted["mc2_targets"]["labels"] == [1, 1, 0, 0]
    assert converted["mc2_targets"]["choices"][:2] == ["Nothing happens.", "The seeds pass through you."]


def test_truthfulqa_model_preferring_true_answers_scores_1_and_false_answers_0(tmp_path):
    path = tmp_path / "truth.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRUTH_ROWS))
    tokenizer = WordTokenizer()
    true_ids, false_ids = tokenizer.ids(answer_texts(TRUTH_ROWS, 1)), tokenizer.ids(answer_texts(TRUTH_ROWS, 0))
    task = TruthfulQATask(path)
    truthful = task.evaluate(PreferringModel(true_ids), tokenizer, progress=False)["metrics"]
    assert truthful["mc1"] == 1.0 and truthful["mc1_norm"] == 1.0
    assert truthful["mc2"] == pytest.approx(1.0, abs=1e-6) and truthful["mc2_norm"] == pytest.approx(1.0, abs=1e-6)
    liar = task.evaluate(PreferringModel(false_ids), tokenizer, progress=False)["metrics"]
    assert liar["mc1"] == 0.0 and liar["mc1_norm"] == 0.0
    assert liar["mc2"] == pytest.approx(0.0, abs=1e-6) and liar["mc2_norm"] == pytest.approx(0.0, abs=1e-6)


# ----- MMLU -------------------------------------------------------------------------------------------------------
def mmlu_rows(answers_by_subject):
    return [
        {"question": f"Which {i} is it?", "subject": subject, "choices": ["w", "x", "y", "z"], "answer": answer}
        for subject, answers in answers_by_subject.items()
        for i, answer in enumerate(answers)
    ]


def test_mmlu_letter_scoring_per_subject_and_micro_average(tmp_path):
    folder = tmp_path / "mmlu"
    folder.mkdir()
    rows = mmlu_rows({"astronomy": [1, 1, 1], "virology": [0]})
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = WordTokenizer()
    always_b = PreferringModel(tokenizer.ids(["B"]))
    result = MMLUTask(folder).evaluate(always_b, tokenizer, progress=False)
    assert result["metrics"]["accuracy"] == 0.75
    assert result["metrics"]["accuracy_macro"] == 0.5
    assert result["subjects"] == {"astronomy": 1.0, "virology": 0.0}
    assert [r["prediction"] for r in result["records"]] == [1, 1, 1, 1]


def test_mmlu_k_shot_uses_dev_rows_of_the_same_subject(tmp_path):
    folder = tmp_path / "mmlu"
    folder.mkdir()
    (folder / "test.jsonl").write_text(json.dumps(mmlu_rows({"virology": [2]})[0]) + "\n")
    dev = [
        {"question": "Dev astro?", "subject": "astronomy", "choices": list("abcd"), "answer": "A"},
        {"question": "Dev viro?", "subject": "virology", "choices": list("abcd"), "answer": "D"},
    ]
    task = MMLUTask(folder, num_shots=1)
    with pytest.raises(ValueError, match="no 'dev' split"):
        task.context(task.rows()[0])
    (folder / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev))
    context = MMLUTask(folder, num_shots=1).context(task.rows()[0])
    assert context.startswith("The following are multiple choice questions (with answers) about virology.\n\n")
    assert "Dev viro?\nA. a\nB. b\nC. c\nD. d\nAnswer: D\n\nWhich 0 is it?" in context
    assert "Dev astro?" not in context and context.endswith("D. z\nAnswer:")


def test_mmlu_lab_continuation_scoring_equals_the_lab_scorer(lab_tokenizer, tiny_model):
    from trl_statelens.lab.build import choice_logprobs as lab_choice_logprobs

    task = MMLUTask("lab", limit=24, batch_size=7)
    assert task.scoring == "continuation"
    result = task.evaluate(tiny_model, lab_tokenizer, progress=False)
    assert result["metrics"]["accuracy"] == score_multiple_choice(tiny_model, lab_tokenizer, task.rows())
    for row, record in list(zip(task.rows(), result["records"]))[:4]:
        expected = lab_choice_logprobs(
            tiny_model, lab_tokenizer, f"Question: {row['question']}\nAnswer:", row["choices"]
        )
        assert record["logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)


def test_truthfulqa_lab_mc1_equals_the_lab_scorer(lab_tokenizer, tiny_model):
    task = TruthfulQATask("lab", limit=20, batch_size=16)
    assert task.split == "test"
    metrics = task.evaluate(tiny_model, lab_tokenizer, progress=False)["metrics"]
    assert metrics["mc1"] == score_multiple_choice(tiny_model, lab_tokenizer, task.rows())
    assert 0.0 <= metrics["mc2"] <= 1.0


def test_log_likelihoods_do_not_depend_on_batching_or_padding(lab_tokenizer, tiny_model):
    requests = [
        ("Question: What is the capital of Kalo?\nAnswer:", " Mirupe"),
        ("Question: Hi\nAnswer:", " 7"),
        ("Question: Where do Zovas live?\nAnswer:", " Zovas live in caves near the big hills."),
    ]
    one_by_one = continuation_logprobs(tiny_model, lab_tokenizer, requests, batch_size=1, progress=False)
    batched = continuation_logprobs(tiny_model, lab_tokenizer, requests, batch_size=3, progress=False)
    assert [n for _, n in batched] == [n for _, n in one_by_one] and all(n > 0 for _, n in batched)
    assert [s for s, _ in batched] == pytest.approx([s for s, _ in one_by_one], abs=1e-4)


# ----- GSM8K ------------------------------------------------------------------------------------------------------
class GoldAnsweringModel(torch.nn.Module):
    """``generate`` answers lab problems in the ``answered`` set correctly, the others wrongly, then rambles on."""

    def __init__(self, tokenizer, world_rows, answered):
        super().__init__()
        self.tokenizer, self.answered = tokenizer, answered
        self.solutions = {r["question"]: r["answer"] for r in world_rows}

    def generate(self, input_ids, attention_mask=None, max_new_tokens=16, **kwargs):
        texts = []
        for prompt in self.tokenizer.batch_decode(input_ids, skip_special_tokens=True):
            question = prompt.split("Question: ")[-1].split("\nAnswer:")[0]
            answer = self.solutions[question] if question in self.answered else "I think so.\n#### 100000"
            texts.append(" " + answer + "\n\nQuestion: Ava has 3 cards. How many?\nAnswer: 3\n#### 3")
        new = [self.tokenizer(t)["input_ids"] for t in texts]
        width = max(map(len, new))
        pad = self.tokenizer.pad_token_id
        new_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in new])
        return torch.cat([input_ids, new_ids], dim=1)


def test_gsm8k_lab_accuracy_matches_the_lab_scorer_on_a_stub(lab_tokenizer):
    task = GSM8KTask("lab", limit=12, batch_size=5)
    rows = [{"question": e["question"], "answer": e["answer"]} for e in task.examples()]
    answered = {r["question"] for r in rows[::3]}
    model = GoldAnsweringModel(lab_tokenizer, LabWorld(seed=0).math("test"), answered)
    result = task.evaluate(model, lab_tokenizer, progress=False)
    assert result["metrics"]["accuracy_strict"] == score_math(model, lab_tokenizer, rows) == 4 / 12
    assert result["metrics"]["accuracy_flexible"] == 4 / 12
    assert [r["correct_strict"] for r in result["records"]] == [r["question"] in answered for r in rows]
    assert all("Question:" not in r["output"] for r in result["records"])


def test_gsm8k_generation_on_a_real_tiny_model(lab_tokenizer, tiny_model):
    task = GSM8KTask("lab", limit=6, batch_size=6, max_new_tokens=24)
    result = task.evaluate(tiny_model, lab_tokenizer, progress=False)
    rows = [{"question": e["question"], "answer": e["answer"]} for e in task.examples()]
    assert result["metrics"]["num_items"] == 6
    assert result["metrics"]["accuracy_strict"] == score_math(tiny_model, lab_tokenizer, rows)
    assert all(isinstance(r["output"], str) and "Question:" not in r["output"] for r in result["records"])


# ----- running, writing, CLI, callback ----------------------------------------------------------------------------
def test_hub_ids_load_with_their_configs_and_splits(monkeypatch):
    from datasets import Dataset

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        rows = TRUTH_ROWS if "truthful" in path else mmlu_rows({"anatomy": [0, 3]})
        return Dataset.from_list(rows)

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    assert len(TruthfulQATask().rows()) == 2
    assert MMLUTask(num_shots=1).shots("anatomy")[0]["answer"] == 0
    assert calls == [("truthfulqa/truthful_qa", "multiple_choice", "validation"), ("cais/mmlu", "all", "dev")]


def test_make_task_and_limits_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'hellaswag'"):
        make_task("hellaswag")
    with pytest.raises(ValueError, match="has no mmlu/ folder"):
        make_task("mmlu", data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown MMLU scoring"):
        MMLUTask("lab", scoring="cloze")
    assert parse_limit("study") == {"gsm8k": 500, "mmlu": 500, "truthfulqa": 200}
    assert parse_limit("gsm8k=5,mmlu=7") == {"gsm8k": 5, "mmlu": 7} and parse_limit("9") == 9
    with pytest.raises(ValueError, match="--limit takes N"):
        parse_limit("all")
    with pytest.raises(ValueError, match="unknown task"):
        parse_limit("arc=5")
    with pytest.raises(ValueError, match="columns"):
        path = tmp_path / "truth.jsonl"
        path.write_text(json.dumps({"question": "q"}) + "\n")
        read_truthfulqa_rows(str(path), "validation")


def test_evaluate_model_writes_results_and_items(tmp_path, lab_tokenizer, tiny_model):
    out = tmp_path / "results" / "base.json"
    results = evaluate_model(
        tiny_model,
        ["truthfulqa", "mmlu"],
        tokenizer=lab_tokenizer,
        data_dir="lab",
        limit={"truthfulqa": 8, "mmlu": 9},  # subsets where this random model scores above 0
        out=out,
        progress=False,
    )
    saved = json.loads(out.read_text())
    assert saved["scores"] == results["scores"] and set(saved["scores"]) == {"truthfulqa", "mmlu"}
    assert saved["settings"]["mmlu"]["scoring"] == "continuation" and saved["settings"]["mmlu"]["limit"] == 9
    items = [json.loads(line) for line in (tmp_path / "results" / "base.items.jsonl").read_text().splitlines()]
    assert [i["task"] for i in items] == ["truthfulqa"] * 8 + ["mmlu"] * 9
    assert retention_summary(saved, results) == {"forgetting": 0.0, "retention": 1.0}


def test_eval_cli_on_a_saved_model(tmp_path, student_path, capsys):
    parser = add_eval_arguments(argparse.ArgumentParser())
    argv = [
        "--model",
        str(student_path),
        "--tasks",
        "gsm8k,truthfulqa,mmlu",
        "--data-dir",
        "lab",
        "--limit",
        "8",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path / "eval.json"),
    ]
    results = run_eval_cli(parser.parse_args(argv))
    assert set(results["scores"]) == {"gsm8k", "truthfulqa", "mmlu"}
    assert json.loads((tmp_path / "eval.json").read_text())["settings"]["gsm8k"]["max_new_tokens"] == 8
    assert "wrote" in capsys.readouterr().out
    with_base = run_eval_cli(
        parser.parse_args(
            argv[:-1] + [str(tmp_path / "post.json"), "--tasks", "mmlu", "--base", str(tmp_path / "eval.json")]
        )
    )
    assert with_base["retention_summary"] == {"forgetting": 0.0, "retention": 1.0}
    with pytest.raises(ValueError, match="unknown task"):
        run_eval_cli(parser.parse_args(argv[:-1] + [str(tmp_path / "x.json"), "--tasks", "gsm8k,arc"]))


def test_retention_callback_logs_through_a_real_trainer(tmp_path, lab_tokenizer):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = build_model("test", lab_tokenizer, seed=1)
    texts = [lab_tokenizer("Question: What do Kalos eat?\nAnswer: Kalos eat fish.")["input_ids"]] * 8
    data = Dataset.from_dict({"input_ids": texts, "labels": texts})
    callback = RetentionEvalCallback(["truthfulqa", "mmlu"], eval_steps=2, data_dir="lab", limit=8)
    args = TrainingArguments(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=lab_tokenizer, callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "eval/mmlu/accuracy" in entry]
    assert [entry["step"] for entry in logged] == [0, 2]
    assert {"eval/truthfulqa/mc1", "eval/truthfulqa/mc2_norm", "eval/forgetting", "eval/retention"} <= set(logged[1])
    assert model.training  # evaluation restored train mode
    assert len(callback.history) == 2


def test_retention_callback_without_trainer_appends_to_log_history(lab_tokenizer, tiny_model):
    from transformers import TrainerControl, TrainerState

    callback = RetentionEvalCallback(["mmlu"], eval_steps=5, data_dir="lab", limit=8)
    state, control = TrainerState(), TrainerControl()
    tiny_model.train()
    callback.on_train_begin(None, state, control, model=tiny_model, processing_class=lab_tokenizer)
    state.global_step = 3
    callback.on_step_end(None, state, control, model=tiny_model, processing_class=lab_tokenizer)
    state.global_step = 5
    callback.on_step_end(None, state, control, model=tiny_model, processing_class=lab_tokenizer)
    tiny_model.eval()
    assert [entry["step"] for entry in state.log_history] == [0, 5]
    assert state.log_history[1]["eval/retention"] == 1.0


def test_lab_base_model_matches_lab_scorers_and_retains_above_chance():
    """Acceptance on the built lab base model; skipped until `statelens lab build` has run."""
    info = lab_info(0)
    if info is None:
        pytest.skip("the lab is not built (statelens lab build)")
    from trl_statelens.lab import lab_dir

    results = evaluate_model(
        lab_dir(0) / "base",
        data_dir="lab",
        limit={"gsm8k": 40, "truthfulqa": 40, "mmlu": 60},
        task_kwargs={"gsm8k": {"max_new_tokens": MATH_NEW_TOKENS, "batch_size": 100}},
        progress=False,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(lab_dir(0) / "base")
    tokenizer = AutoTokenizer.from_pretrained(lab_dir(0) / "base")
    world = LabWorld(seed=0)
    math_rows = {r["question"]: r for r in world.math("test")}
    assert results["scores"]["gsm8k"] == score_math(
        model, tokenizer, [math_rows[r["question"]] for r in results["records"]["gsm8k"]]
    )
    kb_rows = {r["question"]: r for r in world.kb("test")}
    assert results["scores"]["mmlu"] == score_multiple_choice(
        model, tokenizer, [kb_rows[r["question"]] for r in results["records"]["mmlu"]]
    )
    assert results["scores"]["truthfulqa"] > 0.25 and results["scores"]["mmlu"] > 0.25  # chance: 4 choices
    # the build's own test scores are in the bands that leave room both ways (issue 16)
    assert info["lab_version"] == LAB_VERSION and info["in_band"] and in_bands(info["test_scores"])


# ----- protocols ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "output, strict, flexible, ours_strict",
    [
        ("She pays $18 every day.\n#### 18", "18", "18", "18"),
        ("#### 18.00", "18.00", "18.00", "18"),  # lm-eval: "18.00" != "18"; ours: the same number
        ("####18", "[invalid]", "18", "18"),  # lm-eval's strict filter wants exactly one space
        ("#### $18", "[invalid]", "$18", "18"),
        ("####  18", "[invalid]", "18", "18"),
        ("#### -18", "-18", "-18", "-18"),
        ("#### 1,800", "1,800", "1,800", "1800"),
        ("#### 18\n#### 19", "18", "19", "18"),  # strict: the first; flexible: the last
        ("#### 14, Pia has 3", "14,", "3", "14"),  # lm-eval keeps the comma
        ("The answer is $1,234.50.", "[invalid]", "$1,234.50.", None),
        ("x = 5, so 5.", "[invalid]", "5.", None),
        ("no digits", "[invalid]", "[invalid]", None),
    ],
)
def test_lm_eval_filters_on_tricky_outputs(output, strict, flexible, ours_strict):
    assert lm_eval_extract(output, "strict") == strict and lm_eval_extract(output, "flexible") == flexible
    assert extract_answer(output, "strict") == ours_strict


def test_lm_eval_exact_match_ignores_commas_dollars_a_final_period_and_the_solution_text():
    gold = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs, so $18.\n#### 1,800"
    assert lm_eval_exact_match("1,800", gold) and lm_eval_exact_match("$1800.", gold)
    assert not lm_eval_exact_match("1800.00", gold) and not lm_eval_exact_match("[invalid]", gold)


def test_lm_eval_protocol_defaults_and_recorded_settings():
    gsm8k = GSM8KTask("lab", protocol="lm-eval", limit=10)
    settings = gsm8k.settings()
    assert settings["protocol"] == "lm-eval" and settings["num_shots"] == 5
    assert settings["shot_sampling"] == "per-question" and settings["fewshot_seed"] == 1234
    assert settings["stop_strings"] == ["Question:", "</s>", "<|im_end|>", "<eos>"]
    assert settings["answer_filters"] == "lm-eval" and settings["subset"] == "first"
    assert GSM8KTask("lab").settings()["num_shots"] == 0 and GSM8KTask("lab").settings()["subset"] == "question-hash"
    truth = TruthfulQATask("lab", protocol="lm-eval").settings()["prompt"]
    assert truth.startswith("Q: What is human life expectancy") and truth.endswith("\n\nQ: {question}\nA:")
    assert MMLUTask("lab", protocol="lm-eval").scoring == "letter" and MMLUTask("lab").scoring == "continuation"
    with pytest.raises(ValueError, match="unknown evaluation protocol"):
        GSM8KTask("lab", protocol="harness")
    with pytest.raises(ValueError, match="plain prompts"):
        GSM8KTask("lab", protocol="lm-eval", prompt_format="chat")


def test_lm_eval_gsm8k_shots_are_drawn_per_question_and_do_not_depend_on_limit():
    prompts = [e["prompt"] for e in GSM8KTask("lab", protocol="lm-eval", limit=6).examples()]
    assert prompts == [e["prompt"] for e in GSM8KTask("lab", protocol="lm-eval", limit=12).examples()][:6]
    shots = [p.split("\n\n")[0] for p in prompts]  # the first shot of each prompt
    assert len(set(shots)) > 1 and all(p.count("Question:") == 6 for p in prompts)
    fixed = [e["prompt"].split("\n\n")[0] for e in GSM8KTask("lab", num_shots=2, limit=6).examples()]
    assert len(set(fixed)) <= 2  # statelens: one fixed set (a spare replaces a shot that is the question)


# ----- TruthfulQA answers and question-keyed subsets ----------------------------------------------------------
def csv_row(question, best, correct, incorrect):
    return {"Question": question, "Best Answer": best, "Correct Answers": correct, "Incorrect Answers": incorrect}


def test_truthfulqa_csv_answers_are_kept_once_per_question():
    row = csv_row("Q?", "No", "No; No; It depends; Unknown", "Yes; Unknown; Yes, always; Yes")
    (converted,) = truthfulqa_rows_from_csv([row])
    assert converted["mc2_targets"]["choices"] == ["No.", "It depends.", "Unknown.", "Yes.", "Yes, always."]
    assert converted["mc2_targets"]["labels"] == [1, 1, 1, 0, 0]
    assert converted["mc1_targets"]["choices"] == ["No.", "Yes.", "Yes, always."]
    assert converted["answers_merged"] == 3  # a second "No", a second "Yes", "Unknown" on both sides


def test_real_truthfulqa_csv_merges_five_answers_in_five_questions():
    path = SHARED_DATA / "truthfulqa" / "TruthfulQA.csv"
    if not path.is_file():
        pytest.skip("TruthfulQA.csv not present in ../shared/data/truthfulqa")
    rows = read_truthfulqa_rows(str(path), "validation")
    assert [i + 2 for i, r in enumerate(rows) if r["answers_merged"]] == [134, 194, 349, 356, 812]  # CSV lines
    assert TruthfulQATask(path, limit=5).settings()["answers_merged"] == 5
    for row in rows:
        assert len(set(row["mc2_targets"]["choices"])) == len(row["mc2_targets"]["choices"])


def test_subsets_are_keyed_on_the_question_so_hub_and_csv_agree(tmp_path):
    rows = [csv_row(f"Question number {i}?", f"Answer {i}", f"Answer {i}", f"Wrong {i}") for i in range(40)]
    csv_path = tmp_path / "TruthfulQA.csv"
    with csv_path.open("w", newline="") as f:
        import csv

        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    hub_layout = tmp_path / "validation.jsonl"  # the same questions in the hub's layout, in another order
    hub_layout.write_text("".join(json.dumps(r) + "\n" for r in reversed(truthfulqa_rows_from_csv(rows))))
    from_csv = {r["question"] for r in TruthfulQATask(csv_path, limit=10, seed=3).rows()}
    from_hub = {r["question"] for r in TruthfulQATask(hub_layout, limit=10, seed=3).rows()}
    assert from_csv == from_hub and len(from_csv) == 10
    assert from_csv != {r["question"] for r in TruthfulQATask(csv_path, limit=10, seed=4).rows()}
    first = [r["question"] for r in TruthfulQATask(hub_layout, protocol="lm-eval", limit=3).rows()]
    assert first == ["Question number 39?", "Question number 38?", "Question number 37?"]  # lm-eval: first rows


# ----- data before work, results as tasks finish --------------------------------------------------------------
class CountingModel(torch.nn.Module):
    """Counts forward calls; any call fails the tests that expect none."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):
        self.calls += 1
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 256))


def test_a_missing_task_data_fails_before_any_task_runs(tmp_path):
    (tmp_path / "truthfulqa").mkdir()
    (tmp_path / "truthfulqa" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRUTH_ROWS))
    (tmp_path / "mmlu").mkdir()
    (tmp_path / "mmlu" / "test.jsonl").write_text(json.dumps(mmlu_rows({"virology": [2]})[0]) + "\n")
    model, out = CountingModel(), tmp_path / "out" / "results.json"
    with pytest.raises(ValueError, match="no mmlu/ folder|no 'dev' split"):  # shots need mmlu/dev.jsonl
        evaluate_model(
            model,
            ["truthfulqa", "mmlu"],
            tokenizer=WordTokenizer(),
            data_dir=tmp_path,
            task_kwargs={"mmlu": {"num_shots": 1}},
            out=out,
            progress=False,
        )
    assert model.calls == 0 and not out.exists()
    with pytest.raises(ValueError, match="has no gsm8k/ folder"):
        evaluate_model(model, ["truthfulqa", "gsm8k"], tokenizer=WordTokenizer(), data_dir=tmp_path, out=out)
    assert model.calls == 0 and not out.exists()


class FailingTask(TruthfulQATask):
    name = "mmlu"

    def evaluate(self, model, tokenizer, progress=True):
        raise RuntimeError("the second task broke")


def test_results_are_written_as_each_task_finishes(tmp_path):
    path = tmp_path / "truth.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRUTH_ROWS))
    out = tmp_path / "results.json"
    with pytest.raises(RuntimeError, match="second task"):
        evaluate_model(CountingModel(), [TruthfulQATask(path), FailingTask(path)], tokenizer=WordTokenizer(), out=out)
    saved = json.loads(out.read_text())
    assert saved["tasks_done"] == ["truthfulqa"] and set(saved["scores"]) == {"truthfulqa"}
    assert saved["protocol"] == "statelens" and set(saved["settings"]) == {"truthfulqa", "mmlu"}
    items = (tmp_path / "results.items.jsonl").read_text().splitlines()
    assert len(items) == len(TRUTH_ROWS)  # the per-item file of the finished task


def test_eval_cli_lm_eval_protocol_with_separate_shot_counts(tmp_path, student_path):
    parser = add_eval_arguments(argparse.ArgumentParser())
    out = tmp_path / "eval.json"
    argv = ["--model", str(student_path), "--protocol", "lm-eval", "--tasks", "gsm8k,mmlu", "--data-dir", "lab"]
    argv += ["--limit", "2", "--max-new-tokens", "4", "--mmlu-shots", "2", "--out", str(out)]
    run_eval_cli(parser.parse_args(argv))
    saved = json.loads(out.read_text())
    assert saved["protocol"] == "lm-eval" and saved["tasks_done"] == ["gsm8k", "mmlu"]
    assert saved["settings"]["gsm8k"]["num_shots"] == 5 and saved["settings"]["mmlu"]["num_shots"] == 2
    assert saved["settings"]["mmlu"]["protocol"] == "lm-eval" and saved["settings"]["mmlu"]["scoring"] == "letter"


def test_lm_eval_mmlu_limit_takes_the_first_rows_of_each_subject(tmp_path):
    folder = tmp_path / "mmlu"
    folder.mkdir()
    rows = mmlu_rows({"astronomy": [1, 2, 3], "virology": [0, 1]})
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chosen = MMLUTask(folder, protocol="lm-eval", limit=2).rows()
    assert [(r["subject"], r["answer"]) for r in chosen] == [
        ("astronomy", 1),
        ("astronomy", 2),
        ("virology", 0),
        ("virology", 1),
    ]


def test_gsm8k_sampled_accuracy_samples_the_policy_and_averages_every_sample(lab_tokenizer, tiny_model, monkeypatch):
    task = GSM8KTask("lab", split="dev", limit=4, batch_size=8, max_new_tokens=12, num_samples=3)
    prompts = task.prompt_texts(lab_tokenizer)
    # near temperature 0 the sampling path decodes greedily; at temperature 1 it samples (other texts), seeded
    cold = task.generate(tiny_model, lab_tokenizer, prompts, progress=False, sample_temperature=1e-4)
    assert cold == task.generate(tiny_model, lab_tokenizer, prompts, progress=False)
    rng = torch.get_rng_state()
    first = task.evaluate(tiny_model, lab_tokenizer, progress=False)["metrics"]["accuracy_sampled"]
    assert torch.equal(rng, torch.get_rng_state())  # the caller's randomness did not move
    hot = task.generate(tiny_model, lab_tokenizer, prompts, progress=False, sample_temperature=1.0)
    assert hot != cold
    assert first == task.evaluate(tiny_model, lab_tokenizer, progress=False)["metrics"]["accuracy_sampled"]

    # the score: every sample of every problem counts once (first sample right, the other two wrong: 1/3)
    examples = task.examples()
    answers = [f"#### {e['ground_truth']}" for e in examples]

    def fake_generate(model, tokenizer, prompts, progress=True, sample_temperature=None):
        if sample_temperature is None:
            return answers
        return [answers[i // 3] if i % 3 == 0 else "#### -1" for i in range(len(prompts))]

    monkeypatch.setattr(task, "generate", fake_generate)
    metrics = task.evaluate(tiny_model, lab_tokenizer, progress=False)["metrics"]
    assert metrics["accuracy_strict"] == 1.0
    assert metrics["accuracy_sampled"] == pytest.approx(1 / 3)


def test_recipe_eval_split_dev_scores_the_dev_problems(world):
    from trl_statelens.evaluation import build_tasks
    from trl_statelens.reports.runs import RecipeArguments, evaluation_settings, probe_prompts

    args = RecipeArguments(eval_split="dev", eval_samples=2, num_probes=5)
    (task,) = build_tasks(["gsm8k"], **evaluation_settings(args, seed=0))
    dev = {r["question"] for r in world.math("dev")}
    assert len(task.examples()) == len(dev) == 100
    assert {e["question"] for e in task.examples()} == dev
    assert task.num_samples == 2
    assert all(any(q in p for q in dev) for p in probe_prompts(args))
    with pytest.raises(ValueError, match="eval_split"):
        RecipeArguments(eval_split="validation")
