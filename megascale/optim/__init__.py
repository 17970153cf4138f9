"""Optimizer math shared by the replicated and ZeRO-1 paths: AdamW, LAMB, schedules, clipping, loss scaling."""

from megascale.optim.adamw import adam_direction, adamw_step
from megascale.optim.clip import clip_coefficient, global_norm, sum_of_squares
from megascale.optim.lamb import lamb_apply, lamb_direction, piece_sq_norms, trust_ratios
from megascale.optim.loss_scale import LossScaler
from megascale.optim.schedules import decay_length, lr_at

__all__ = [
           "LossScaler",
           "adam_direction",
           "adamw_step",
           "clip_coefficient",
           "decay_length",
           "global_norm",
           "lamb_apply",
           "lamb_direction",
           "lr_at",
           "piece_sq_norms",
           "sum_of_squares",
           "trust_ratios",
]
