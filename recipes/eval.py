"""Evaluate a model without training (the study's "base" row), in the same run-folder layout as the recipes.

python recipes/eval.py                                                  # the lab base model (configs/lab/eval.yaml)
python recipes/eval.py --config recipes/configs/study/base_eval.yaml
"""

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from trl import ModelConfig, TrlParser

from trl_statelens.provenance import provenance
from trl_statelens.reports.runs import RecipeArguments, evaluate, resolve_model, with_default_config


@dataclass
class EvalScriptArguments(RecipeArguments):
    """output_dir: the run folder to write (`results.json`, `eval/after.json`); seed: seed of the item subsets."""

    output_dir: str = "runs/lab/base"
    seed: int = 0


def main(args: EvalScriptArguments, model_args: ModelConfig):
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    out = Path(args.output_dir)
    after = evaluate(args, model_path, None, out / "eval" / "after.json", args.seed)
    results = {"recipe": "eval", "trainer": None, "baseline": args.baseline, "run_name": out.name, "model": model_path,
               "teacher": None, "seed": args.seed, "before": None, "after": after, "retention": None,
               "final_drift": None, "train_seconds": 0.0, "global_steps": 0, "recipe_arguments": asdict(args)}  # fmt: skip
    # the evaluation's record (the weights as evaluated), else the model folder's files hashed
    results["provenance"] = (after or {}).get("provenance") or provenance({"model": model_path})
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n=== eval of {model_path} -> {out}")
    for task, score in (after or {}).get("scores", {}).items():
        print(f"{task:<12}{score:>8.3f}")


if __name__ == "__main__":
    parser = TrlParser((EvalScriptArguments, ModelConfig))
    main(*parser.parse_args_and_config(args=with_default_config(__file__, sys.argv[1:])))
