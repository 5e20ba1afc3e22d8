"""Thin adapters that put the stepwatch agent into the training loops people already have.

- ``stepwatch.integrations.lightning.StepwatchCallback`` (``pip install 'stepwatch[lightning]'``)
- ``stepwatch.integrations.hf.StepwatchTrainerCallback`` (``pip install 'stepwatch[hf]'``)

Both do the same three things over the same agent: ``stepwatch.init`` when training starts
(rank, world size and the model from the framework), ``sw.step(tokens=...)`` after every
optimizer step (non-padding tokens from the batch's ``attention_mask`` when it has one),
and ``sw.close()`` when training ends. Evaluation and checkpoint steps are tagged so that
baselines and regression detection skip them.
"""
