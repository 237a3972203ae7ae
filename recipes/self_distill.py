"""Self-distillation with privileged context: the student is its own teacher, shown the reference solution it does
not see itself, on the student's own states (issue 28).

accelerate launch recipes/self_distill.py                                   # the lab (configs/lab/self_distill.yaml)
accelerate launch recipes/self_distill.py --baseline stock                  # TRL's experimental SDFTTrainer, same run
accelerate launch recipes/self_distill.py --config recipes/configs/real/self_distill.yaml    # real GSM8K

The data's `privileged_context` column is each problem's reference solution (`trl_statelens.data`); the teacher's
prompt is `teacher_prompt_template` filled with the row's prompt and that context. `--baseline stock` maps this
config onto TRL's `SDFTConfig` (`trl_statelens.opd.stock_sdft`: which modes match, and which settings it refuses).
"""

import os
import sys

from trl import ModelConfig, TrlParser, get_peft_config

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.opd.stock_sdft import to_sdft_config
from trl_statelens.reports.runs import (
    RecipeArguments,
    load_train_data,
    resolve_model,
    run_recipe,
    state_logging_callback,
    with_default_config,
)


def build_trainer(args: RecipeArguments, training_args: OnPolicyDistillConfig, model_args: ModelConfig):
    """The run's trainer and its student's path, as `main` trains it (`statelens preflight` builds it so too, and
    checks it without training)."""
    if training_args.teacher_model_kind is None:
        raise ValueError("self-distillation needs --teacher_model_kind base, live or ema (the student as its teacher)")
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    dataset = load_train_data(args, training_args.seed)  # with `privileged_context`: the reference solution
    callback = state_logging_callback(args)
    if args.baseline == "stock":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.sdft import SDFTTrainer

        trainer = SDFTTrainer(
            model=model_path,
            args=to_sdft_config(training_args),
            train_dataset=dataset.select_columns(["prompt", "privileged_context"]),
            peft_config=get_peft_config(model_args),
            callbacks=[callback],
        )
    else:
        trainer = OnPolicyDistillTrainer(
            model=model_path,
            args=training_args,
            train_dataset=dataset,
            peft_config=get_peft_config(model_args),
            callbacks=[callback],
        )
    callback.trainer = trainer
    return trainer, model_path


def main(args: RecipeArguments, training_args: OnPolicyDistillConfig, model_args: ModelConfig):
    trainer, model_path = build_trainer(args, training_args, model_args)
    run_recipe("self_distill", trainer, args, model_path)


def parse_arguments(argv: list[str]):
    """The run's arguments: its config file (the lab's without `--config`), then the flags that override it."""
    parser = TrlParser((RecipeArguments, OnPolicyDistillConfig, ModelConfig))
    return parser.parse_args_and_config(args=with_default_config(__file__, argv))


if __name__ == "__main__":
    main(*parse_arguments(sys.argv[1:]))
