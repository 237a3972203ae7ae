"""The ``lm-eval`` protocol against lm-evaluation-harness 0.4.13 itself, item by item.

lm-eval runs its own task definitions (the official ``gsm8k``, ``truthfulqa_mc1``, ``truthfulqa_mc2`` and
``mmlu_abstract_algebra`` yamls, included from a task folder that only points them at local json files and loaded
through ``TaskManager(include_path=...)``) on a tiny math-trained model wrapped in its ``HFLM``; our tasks run with
``protocol="lm-eval"`` on the same model and data. Every prompt must be identical, every GSM8K completion,
extracted answer and verdict identical, every log-likelihood within 1e-4 and every MC1/MC2/MMLU score within 1e-4.

Real GSM8K and TruthfulQA rows come from ``../shared/data`` (those tests skip when it is absent). On real GSM8K the
tiny model, which only saw lab math, writes no answers, and its 5-shot prompts (~2000 lab-tokenizer tokens) are
cut to their last 256 tokens by both sides; so GSM8K also runs on lab math problems in the GSM8K layout, where the
model writes varied ``#### N`` lines and both filters find right, wrong and no answers. The MMLU-format rows are
written here. The one known difference, MC2 when every log-likelihood underflows ``exp``, is pinned below.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from trl_statelens.answers import LM_EVAL_FILTERS, LM_EVAL_IGNORED, lm_eval_exact_match, lm_eval_extract
from trl_statelens.evaluation import GSM8KTask, MMLUTask, TruthfulQATask, read_truthfulqa_rows, true_mass

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency (pip install 'trl-statelens[dev]')")
yaml = pytest.importorskip("yaml")

# ../shared/data from the project root; STATELENS_SHARED_DATA points elsewhere (a git worktree, a CI cache).
SHARED_DATA = Path(os.environ.get("STATELENS_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
TASKS_DIR = Path(lm_eval.__file__).parent / "tasks"
N_ITEMS = 24  # per task; lm-eval's --limit takes the first rows, and so does the lm-eval protocol
TOLERANCE = 1e-4  # on scores; lm-eval batches log-likelihoods differently: float32 sums differ in the last digits
LL_TOLERANCE = {"rel": 1e-6, "abs": 1e-4}  # sums of hundreds of float32 log-probs (TruthfulQA: about -500)

TRICKY_OUTPUTS = [
    "She pays 6 * 3 = $18 every day.\n#### 18",
    "#### 18.00",
    "####18",
    "#### $18",
    "####  18",
    "#### -18",
    "#### 1,800",
    "#### 18.",
    "#### 18\n#### 19",
    "The answer is $1,234.50.",
    "18 apples and 3 oranges",
    "x = 5, so 5.",
    "it is -.5 or -7",
    "1.2.3",
    "no digits",
    "",
]
GOLDS = ["The total is 6 * 3 = <<6*3=18>>18.\n#### 18", "#### 1,234.5", "#### 5", "#### -18", "#### 1800"]


def official_yaml(relative: str) -> dict:
    return yaml.safe_load((TASKS_DIR / relative).read_text())


# ----- the gsm8k filters and exact_match, on strings chosen to break them -----------------------------------------
def test_our_gsm8k_filters_are_the_official_yaml_ones():
    config = official_yaml("gsm8k/gsm8k.yaml")
    filters = {f["name"]: f["filter"][0] for f in config["filter_list"]}
    assert LM_EVAL_FILTERS["strict"][0].pattern == filters["strict-match"]["regex_pattern"]
    assert LM_EVAL_FILTERS["strict"][1] == filters["strict-match"].get("group_select", 0)
    assert LM_EVAL_FILTERS["flexible"][0].pattern == filters["flexible-extract"]["regex_pattern"]
    assert LM_EVAL_FILTERS["flexible"][1] == filters["flexible-extract"]["group_select"]
    (metric,) = config["metric_list"]
    assert list(LM_EVAL_IGNORED) == metric["regexes_to_ignore"] and metric["ignore_case"] is True
    assert metric["ignore_punctuation"] is False


@pytest.mark.parametrize("output", TRICKY_OUTPUTS)
def test_gsm8k_filters_and_exact_match_agree_with_lm_eval_on_tricky_outputs(output):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    config = official_yaml("gsm8k/gsm8k.yaml")
    for name, mode in (("strict-match", "strict"), ("flexible-extract", "flexible")):
        spec = next(f["filter"][0] for f in config["filter_list"] if f["name"] == name)
        regex = RegexFilter(regex_pattern=spec["regex_pattern"], group_select=spec.get("group_select", 0))
        (theirs,) = list(regex.apply([[output]], [{}]))[0]
        assert lm_eval_extract(output, mode) == theirs
        for gold in GOLDS:
            kwargs = {k: v for k, v in config["metric_list"][0].items() if k not in ("metric", "aggregation")}
            kwargs.pop("higher_is_better")
            expected = exact_match_hf_evaluate(predictions=[theirs], references=[gold], **kwargs)["exact_match"]
            assert lm_eval_exact_match(theirs, gold) == bool(expected)


def test_lm_eval_strict_match_rejects_what_the_statelens_filter_accepts():
    """The documented difference between the protocols' strict filters."""
    from trl_statelens.answers import extract_answer

    for output in ("#### 18.00", "####18", "#### $18", "####  18"):
        assert extract_answer(output, "strict") == "18"
        assert not lm_eval_exact_match(lm_eval_extract(output, "strict"), "#### 18")
    assert lm_eval_exact_match(lm_eval_extract("#### 18", "strict"), "#### 18")


def test_mc2_differs_from_lm_eval_only_where_exp_underflows():
    """lm-eval's ``process_results_mc2`` exponentiates raw log-likelihoods: below about -745 all of them are 0 and
    it returns NaN. Ours normalises in log space (a float64 softmax) and stays finite. Pinned, not copied."""
    from lm_eval.tasks.truthfulqa.utils import process_results_mc2

    doc = {"mc2_targets": {"choices": ["a", "b", "c"], "labels": [1, 0, 0]}}
    ordinary = [-12.5, -11.0, -14.25]
    expected = process_results_mc2(doc, [(ll, False) for ll in ordinary])["acc"]
    assert true_mass(ordinary, [1, 0, 0]) == pytest.approx(expected, abs=1e-12)
    underflow = [-800.0, -760.0, -790.0]
    with pytest.warns(RuntimeWarning):
        assert math.isnan(process_results_mc2(doc, [(ll, False) for ll in underflow])["acc"])
    assert true_mass(underflow, [1, 0, 0]) == pytest.approx(math.exp(-40) / (1 + math.exp(-40) + math.exp(-30)))


# ----- whole tasks on a tiny model --------------------------------------------------------------------------------
MMLU_ROWS = {
    "dev": [
        ("Find the order of the group Z_4.", ["1", "2", "3", "4"], 3),
        ("Which element is the identity of Z_5 under addition?", ["0", "1", "2", "5"], 0),
        ("How many elements does S_3 have?", ["3", "6", "9", "12"], 1),
    ],
    "test": [
        ("Find the order of the element 3 in Z_6 under addition.", ["1", "2", "3", "6"], 1),
        ("Is Z_7 a field?", ["Yes", "No", "Only for odd elements", "It is not a ring"], 0),
        ("What is 2 + 5 in Z_6?", ["0", "1", "5", "7"], 1),
        ("The number of subgroups of Z_12 is", ["4", "5", "6", "12"], 2),
        ("Statement: every group of prime order is cyclic.", ["True", "False", "Only abelian ones", "Unknown"], 0),
        ("How many generators does Z_8 have?", ["1", "2", "4", "8"], 2),
        ("What is the inverse of 3 in Z_7 under multiplication?", ["2", "3", "5", "6"], 2),
        ("  Leading and trailing spaces are stripped from the question.  ", ["a", "b", "c", "d"], 3),
    ],
}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def local_task(folder: Path, name: str, official: str, data_files: dict, cache: Path) -> None:
    """A task yaml that includes the official one and only points it at local json files."""
    config = {
        "include": str(TASKS_DIR / official),
        "task": name,
        "tag": None,  # else it joins the official groups (mmlu_stem_tasks, truthfulqa)
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {k: str(v) for k, v in data_files.items()}, "cache_dir": str(cache)},
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def model_and_tokenizer(math_teacher_path):
    """The conftest's 100-step math model: it writes ``#### N`` lines, right and wrong, on lab problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(math_teacher_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(math_teacher_path)


@pytest.fixture(scope="module")
def data(tmp_path_factory, world):
    """Local data: real GSM8K and TruthfulQA (None when ../shared/data is absent) and the MMLU-format rows."""
    root = tmp_path_factory.mktemp("lm_eval_data")
    mmlu = {
        split: write_jsonl(
            root / "mmlu" / f"{split}.jsonl",
            [
                {"question": q, "subject": "abstract_algebra", "choices": c, "answer": a}
                for q, c, a in MMLU_ROWS[split]
            ],
        )
        for split in ("dev", "test")
    }
    lab_gsm8k = root / "lab_gsm8k"
    for split, rows in (("train", world.math("train", n=200)), ("test", world.math("test")[:N_ITEMS])):
        write_jsonl(lab_gsm8k / f"{split}.jsonl", [{"question": r["question"], "answer": r["answer"]} for r in rows])
    gsm8k = SHARED_DATA / "gsm8k"
    truthfulqa_csv = SHARED_DATA / "truthfulqa" / "TruthfulQA.csv"
    truthfulqa = None
    if truthfulqa_csv.is_file():  # the hub's multiple_choice layout, rebuilt from the CSV by our reader
        rows = read_truthfulqa_rows(str(truthfulqa_csv), "validation")
        rows = [{k: r[k] for k in ("question", "mc1_targets", "mc2_targets")} for r in rows]
        truthfulqa = write_jsonl(root / "truthfulqa" / "validation.jsonl", rows)
    return {
        "root": root,
        "mmlu": mmlu,
        "lab_gsm8k": lab_gsm8k,
        "gsm8k": gsm8k if (gsm8k / "test.jsonl").is_file() and (gsm8k / "train.jsonl").is_file() else None,
        "truthfulqa": truthfulqa,
    }


def run_lm_eval(model, tokenizer, folder: Path, tasks: list[str], limit: int, num_fewshot=None) -> dict:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, num_fewshot=num_fewshot, limit=limit, bootstrap_iters=0
    )
    return out["samples"]


def by_doc(samples: list[dict], filter_name: str = "none") -> list[dict]:
    chosen = sorted((s for s in samples if s["filter"] == filter_name), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in chosen] == list(range(len(chosen)))
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("source, n_items", [("gsm8k", 8), ("lab_gsm8k", N_ITEMS)])
def test_gsm8k_matches_lm_eval_item_by_item(tmp_path, data, model_and_tokenizer, source, n_items):
    if data[source] is None:
        pytest.skip("GSM8K not present in ../shared/data/gsm8k")
    model, tokenizer = model_and_tokenizer
    files = {"train": data[source] / "train.jsonl", "test": data[source] / "test.jsonl"}
    local_task(tmp_path, "gsm8k_local", "gsm8k/gsm8k.yaml", files, tmp_path / "cache")
    samples = run_lm_eval(model, tokenizer, tmp_path, ["gsm8k_local"], n_items)["gsm8k_local"]
    strict, flexible = by_doc(samples, "strict-match"), by_doc(samples, "flexible-extract")

    task = GSM8KTask(data[source], protocol="lm-eval", limit=n_items, batch_size=8)
    assert task.num_shots == 5
    ours = task.evaluate(model, tokenizer, progress=False)["records"]
    assert len(ours) == len(strict) == n_items
    for example, record, s, f in zip(task.examples(), ours, strict, flexible):
        context, gen_kwargs = s["arguments"][0]
        assert example["prompt"] == context  # shots drawn per question from Random(1234), the same layout
        assert record["output"] == s["resps"][0][0]  # the same greedy text, cut at the same stops
        assert record["strict"] == s["filtered_resps"][0] and record["flexible"] == f["filtered_resps"][0]
        assert record["correct_strict"] == bool(s["exact_match"])
        assert record["correct_flexible"] == bool(f["exact_match"])
    if source == "lab_gsm8k":  # the model exercised extraction: right and wrong answers under the flexible filter
        # On lab v2's problems this small model's 5-shot answers stop before any '#### N' line, so every strict
        # answer is '[invalid]' here; strict answers that are found are compared with lm-eval's filters on fixed
        # strings in tests/test_evaluation.py (test_lm_eval_filters_on_tricky_outputs).
        assert {r["correct_flexible"] for r in ours} == {True, False}


@pytest.mark.slow
def test_truthfulqa_mc1_mc2_match_lm_eval_item_by_item(tmp_path, data, model_and_tokenizer):
    if data["truthfulqa"] is None:
        pytest.skip("TruthfulQA.csv not present in ../shared/data/truthfulqa")
    model, tokenizer = model_and_tokenizer
    files = {"validation": data["truthfulqa"]}
    for name in ("mc1", "mc2"):
        local_task(tmp_path, f"truthfulqa_{name}_local", f"truthfulqa/truthfulqa_{name}.yaml", files, tmp_path / "c")
    samples = run_lm_eval(model, tokenizer, tmp_path, ["truthfulqa_mc1_local", "truthfulqa_mc2_local"], 16)

    task = TruthfulQATask(data["truthfulqa"], protocol="lm-eval", limit=16, batch_size=8)
    ours = task.evaluate(model, tokenizer, progress=False)["records"]
    for name in ("mc1", "mc2"):
        theirs = by_doc(samples[f"truthfulqa_{name}_local"])
        assert len(theirs) == len(ours) == 16
        for row, record, sample in zip(task.rows(), ours, theirs):
            logprob = dict(zip(record["choices"], record["logprobs"]))
            choices = row[f"{name}_targets"]["choices"]
            assert [a[0] for a in sample["arguments"]] == [task.context(row)] * len(choices)
            assert [a[1] for a in sample["arguments"]] == [" " + c for c in choices]
            their_lls = [ll for ll, _ in sample["filtered_resps"]]
            assert [logprob[c] for c in choices] == pytest.approx(their_lls, **LL_TOLERANCE)
            assert record[name] == pytest.approx(sample["acc"], abs=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("num_shots", [0, 2])
def test_mmlu_matches_lm_eval_item_by_item(tmp_path, data, model_and_tokenizer, num_shots):
    model, tokenizer = model_and_tokenizer
    files = {"dev": data["mmlu"]["dev"], "test": data["mmlu"]["test"]}
    local_task(tmp_path, "mmlu_local", "mmlu/default/mmlu_abstract_algebra.yaml", files, tmp_path / "cache")
    samples = run_lm_eval(model, tokenizer, tmp_path, ["mmlu_local"], None, num_fewshot=num_shots)
    theirs = by_doc(samples["mmlu_local"])

    task = MMLUTask(data["mmlu"]["test"].parent, protocol="lm-eval", num_shots=num_shots, batch_size=8)
    result = task.evaluate(model, tokenizer, progress=False)
    assert len(theirs) == len(result["records"]) == len(MMLU_ROWS["test"])
    for row, record, sample in zip(task.rows(), result["records"], theirs):
        assert [tuple(a) for a in sample["arguments"]] == [(task.context(row), f" {x}") for x in "ABCD"]
        assert record["logprobs"] == pytest.approx([ll for ll, _ in sample["filtered_resps"]], **LL_TOLERANCE)
        assert record["correct"] == sample["acc"]
    assert result["metrics"]["accuracy"] == pytest.approx(sum(s["acc"] for s in theirs) / len(theirs))
