"""recipes/opd.py (either arm) as launched, saving the teacher's weights as the trainer holds them, gathered from
their ZeRO-3 partitions: tests/test_recipes.py compares them with a one-process `load_teacher` of the same folder.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_recipe_teacher_weights.py OUT_DIR RECIPE_ARGS...

Each rank writes `OUT_DIR/teacher_rank<i>.pt`: the gathered weights by name, whether they were partitioned and the
teacher's wrapper class.
"""

import runpy
import sys
from pathlib import Path

import deepspeed
import torch

out = Path(sys.argv[1])
recipe_file = Path(__file__).resolve().parents[2] / "recipes" / "opd.py"
recipe = runpy.run_path(str(recipe_file), run_name="opd_recipe")
main = recipe["main"]
run_recipe = main.__globals__["run_recipe"]


def save_teacher_then_run(name, trainer, *args, **kwargs):
    teacher = trainer.teacher_model
    module = getattr(teacher, "module", teacher)  # a DeepSpeedEngine's model
    params = dict(module.named_parameters())
    partitioned = [hasattr(p, "ds_id") and p.numel() == 0 for p in params.values()]  # ZeRO-3 leaves 0 locally
    with deepspeed.zero.GatheredParameters(list(params.values())):
        weights = {key: p.detach().clone() for key, p in params.items()}
    rank = trainer.accelerator.process_index
    saved = {"weights": weights, "partitioned": partitioned, "engine": type(teacher).__name__}
    torch.save(saved, out / f"teacher_rank{rank}.pt")
    return run_recipe(name, trainer, *args, **kwargs)


main.__globals__["run_recipe"] = save_teacher_then_run
parser = recipe["TrlParser"]((recipe["OPDScriptArguments"], recipe["OnPolicyDistillConfig"], recipe["ModelConfig"]))
main(*parser.parse_args_and_config(args=recipe["with_default_config"](str(recipe_file), sys.argv[2:])))
