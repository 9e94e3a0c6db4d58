"""The records that travel from the rollout to the training engine: :class:`TrainSample` and the
format of its routed experts (:mod:`~megatron_gspo.samples.routes`)."""

from megatron_gspo.samples.train_sample import TrainSample

__all__ = ["TrainSample"]
