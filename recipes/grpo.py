"""GRPO with state records: the learner's own states, a verifiable reward (exact final answer).

accelerate launch recipes/grpo.py                                       # the lab (configs/lab/grpo.yaml)
accelerate launch recipes/grpo.py --config recipes/configs/study/grpo.yaml
accelerate launch recipes/grpo.py --baseline stock                      # TRL's GRPOTrainer, same run
"""

import sys
from dataclasses import dataclass

from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config

from trl_statelens import StateLensGRPOTrainer, gsm8k_accuracy_reward
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
    pass


def main(args: GRPOScriptArguments, training_args: GRPOConfig, model_args: ModelConfig):
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    callback = state_logging_callback(args)
    trainer_class = GRPOTrainer if args.baseline == "stock" else StateLensGRPOTrainer
    trainer = trainer_class(
        model=model_path,
        reward_funcs=gsm8k_accuracy_reward,
        args=training_args,
        train_dataset=load_train_data(args, training_args.seed),
        peft_config=get_peft_config(model_args),
        callbacks=[callback],
    )
    callback.trainer = trainer
    run_recipe("grpo", trainer, args, model_path)


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config(args=with_default_config(__file__, sys.argv[1:])))
