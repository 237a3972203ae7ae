"""GRPO with state records: the learner's own states, a verifiable reward (exact final answer).

accelerate launch recipes/grpo.py                                       # the lab (configs/lab/grpo.yaml)
accelerate launch recipes/grpo.py --config recipes/configs/study/grpo.yaml
accelerate launch recipes/grpo.py --baseline stock                      # TRL's GRPOTrainer, same run
"""

import sys
from dataclasses import dataclass

from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config

from trl_statelens import StateLensGRPOTrainer, gsm8k_accuracy_reward
from trl_statelens.guards import check_mode
from trl_statelens.preflight import check_preflight_settings
from trl_statelens.reports.runs import (
    RecipeArguments,
    load_train_data,
    resolve_model,
    run_recipe,
    state_logging_callback,
    with_default_config,
)


@dataclass
class GRPOScriptArguments(RecipeArguments):
    """The arguments every recipe shares ([`RecipeArguments`]) and the StateLens trainer's own keywords, which are
    not `GRPOConfig` fields (a `--baseline stock` run, TRL's GRPOTrainer, runs neither).

    Args:
        guards: the run guards' mode: `"warn"`, `"stop"` or `"off"` (docs/guards.md).
        preflight: the preflight's mode: `"warn"`, `"strict"` or `"off"` (docs/preflight.md).
        preflight_prompts: training prompts the preflight samples.
    """

    guards: str = "warn"
    preflight: str = "warn"
    preflight_prompts: int = 16

    def __post_init__(self):
        super().__post_init__()
        check_mode(self.guards)
        check_preflight_settings(self.preflight, self.preflight_prompts)


def build_trainer(args: GRPOScriptArguments, training_args: GRPOConfig, model_args: ModelConfig):
    """The run's trainer and its student's path, as `main` trains it (`statelens preflight` builds it so too, and
    checks it without training)."""
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    callback = state_logging_callback(args)
    trainer_class = GRPOTrainer if args.baseline == "stock" else StateLensGRPOTrainer
    keywords = {}  # the StateLens trainer's own
    if args.baseline != "stock":
        keywords = dict(guards=args.guards, preflight=args.preflight, preflight_prompts=args.preflight_prompts)
    trainer = trainer_class(
        model=model_path,
        reward_funcs=gsm8k_accuracy_reward,
        args=training_args,
        train_dataset=load_train_data(args, training_args.seed),
        peft_config=get_peft_config(model_args),
        callbacks=[callback],
        **keywords,
    )
    callback.trainer = trainer
    return trainer, model_path


def main(args: GRPOScriptArguments, training_args: GRPOConfig, model_args: ModelConfig):
    trainer, model_path = build_trainer(args, training_args, model_args)
    run_recipe("grpo", trainer, args, model_path)


def parse_arguments(argv: list[str]):
    """The run's arguments: its config file (the lab's without `--config`), then the flags that override it."""
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    return parser.parse_args_and_config(args=with_default_config(__file__, argv))


if __name__ == "__main__":
    main(*parse_arguments(sys.argv[1:]))
