"""On-policy distillation: the student samples, a teacher (``trl_statelens.teachers``) supervises its states.

:mod:`.config` is `OnPolicyDistillConfig` (the options, documented; :mod:`.config_checks` checks their values) and
:mod:`.checks` what the trainer reads from datasets and rows. :mod:`.trainer` is `OnPolicyDistillTrainer`, built on
`StateLensGRPOTrainer`, with :mod:`.rollouts` (whose states, the teacher's prompts and continuations) and :mod:`.loss`
(each signal's loss) mixed in. The teacher-budget levers: :mod:`.selection` (`skip_correct_rollouts`) and
:mod:`.cache` (`teacher_cache_steps`); the rollout horizon lives in the rollouts. :mod:`.stock_sdft` maps a self
teacher's config onto TRL's stock `SDFTConfig`.
"""
