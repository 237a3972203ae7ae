"""Drop-in TRL trainers that record the states they supervise: :mod:`.sft` (`StateLensSFTTrainer`) and :mod:`.grpo`
(`StateLensGRPOTrainer`, which `OnPolicyDistillTrainer` builds on). Each mixes in the lens's `StateRecorderMixin` and
attaches a `StateLoggingCallback`; the public names are ``trl_statelens``'s."""
