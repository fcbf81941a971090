"""flowrl samplers: transition kernels, schedules and rollouts for rectified-flow models (and, through the change of
variables of :mod:`samplers.ddim`, for variance-preserving DDPM models).

The repository's top-level ``samplers/`` folder, installed as ``flowrl.samplers``: one of the two leaves every other
layer builds on, importable on its own (torch only); it imports nothing else of flowrl (not the rewards) and no
diffusers models.
"""

from .chunked import cat_flat_rollouts, sample_in_chunks
from .ddim import (
    PREDICTION_TYPES,
    ddim_std,
    ddim_step,
    ddpm_step,
    flow_ddim_step,
    flow_ddpm_step,
    flow_sigma,
    flow_velocity,
    start_latents,
    vp_alpha,
    vp_predictions,
    vp_scale,
)
from .gaussian import gaussian_kernel
from .kernels import (
    KERNEL_SPECS,
    KERNELS,
    MULTISTEP_KERNELS,
    STOCHASTIC_KERNELS,
    UNIT_ETA_KERNELS,
    KernelSpec,
    StepOutput,
    cps_step,
    dance_sde_step,
    dpm_solver_2m_step,
    flow_sde_step,
    gaussian_log_prob,
    ode_step,
    register_kernel,
)
from .probes import ProbeRollout, Probes, sample_probes
from .rollout import (
    Rollout,
    StepPlan,
    TransitionBuffer,
    VelocityFn,
    group_index,
    initial_noise,
    ode_sample,
    recompute_log_prob,
    sample,
    velocity_gain,
)
from .schedule import flow_sigmas, respace_tail
from .tree import leaf_incidence, sample_shared_noise, sample_tree
from .windows import WINDOW_SCHEDULES, SlidingWindow, mix_plan

__all__ = [
    "KERNELS",
    "MULTISTEP_KERNELS",
    "PREDICTION_TYPES",
    "STOCHASTIC_KERNELS",
    "KERNEL_SPECS",
    "KernelSpec",
    "register_kernel",
    "UNIT_ETA_KERNELS",
    "WINDOW_SCHEDULES",
    "ProbeRollout",
    "Probes",
    "Rollout",
    "SlidingWindow",
    "StepOutput",
    "StepPlan",
    "TransitionBuffer",
    "VelocityFn",
    "cat_flat_rollouts",
    "cps_step",
    "dance_sde_step",
    "ddim_std",
    "ddim_step",
    "ddpm_step",
    "flow_ddim_step",
    "flow_ddpm_step",
    "flow_sigma",
    "flow_velocity",
    "dpm_solver_2m_step",
    "flow_sde_step",
    "flow_sigmas",
    "gaussian_kernel",
    "gaussian_log_prob",
    "group_index",
    "initial_noise",
    "leaf_incidence",
    "mix_plan",
    "ode_sample",
    "ode_step",
    "recompute_log_prob",
    "respace_tail",
    "sample",
    "sample_in_chunks",
    "sample_probes",
    "sample_shared_noise",
    "sample_tree",
    "start_latents",
    "velocity_gain",
    "vp_alpha",
    "vp_predictions",
    "vp_scale",
]
