"""The lens: what a trainer supervised, step by step, and how far the policy moved.

:mod:`.records` holds a step's state records and their metrics, :mod:`.recorder` the trainer mixin that records
them from the loss path. :mod:`.callback` is `StateLoggingCallback` (per-step metrics, the on-disk ledger, compute
accounting), with :mod:`.probes` (probe sampling, the step-0 reference, `base_kl` and the teacher's disagreement) and
:mod:`.drift` (distances between sets of prefix states). :mod:`.compute` counts training FLOPs;
:mod:`.forecast` is `ForgettingForecast`, with its lab calibration (`forgetting_calibration.json`).
"""
