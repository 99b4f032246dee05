"""The seams into other libraries' trainers, each built on the tiers' public parts.

- :mod:`mixprec.integrations.transformers_engine`: the switch (:func:`~mixprec.patch_transformers`)
  that makes mixprec's Accelerator the engine under transformers' own Trainer, and the log callback.
- :mod:`mixprec.integrations.engine_checkpoints`: under the switch, transformers' checkpoints
  committed atomically and verified, the resume that never takes a broken one, and preemption.
"""
