"""flowrl samplers: transition kernels, schedules and rollouts for rectified-flow models.

Importable on its own (torch only): it never imports ``flowrl``, ``rewards`` or diffusers models.
"""

from .kernels import (
    KERNELS,
    STOCHASTIC_KERNELS,
    StepOutput,
    dance_sde_step,
    flow_sde_step,
    gaussian_log_prob,
    ode_step,
)
from .rollout import (
    Rollout,
    StepPlan,
    VelocityFn,
    group_index,
    initial_noise,
    ode_sample,
    recompute_log_prob,
    sample,
)
from .schedule import flow_sigmas

__all__ = [
    "KERNELS",
    "STOCHASTIC_KERNELS",
    "Rollout",
    "StepOutput",
    "StepPlan",
    "VelocityFn",
    "dance_sde_step",
    "flow_sde_step",
    "flow_sigmas",
    "gaussian_log_prob",
    "group_index",
    "initial_noise",
    "ode_sample",
    "ode_step",
    "recompute_log_prob",
    "sample",
]
