"""Few-step generators and distillation: a student sampled in a few deterministic steps, the teacher's score (the
real score) and a fake score trained on the student's samples, shared by TDM (arXiv 2503.06674), DMD (DMD2, arXiv
2405.14867) and DMDR (arXiv 2511.13649).

Notation (code name -> paper): on flowrl's rectified-flow path ``x_t = (1 - t) x0 + t eps`` (``alpha_t = 1 - t``,
``sigma_t = t``), a velocity ``v`` at ``(x, t)`` predicts ``x0 = x - t v`` and ``eps = x + (1 - t) v``
(:func:`flow_predictions`); ``sigmas`` -> the student's times ``s_0 = 1 > s_1 > ... > s_K = 0``; ``states[:, k]`` ->
the student's deterministic trajectory point ``x_{s_k}``; ``t_mid`` -> TDM's ``timesteps_mid`` (the next trajectory
point), ``t`` -> the time the real and fake scores are queried at; ``real``/``fake`` -> their clean predictions
``x0_real(x_t)`` (with CFG) and ``x0_fake(x_t)``.

- :func:`student_trajectory`: the student's ``K``-step deterministic sampler (Euler, which on this path is DDIM: TDM's
  ``generate_new``), every trajectory point kept;
- :func:`teacher_trajectory`, :func:`regression_loss`: DMD's regression on the teacher's paired trajectory
  (``train.distill.regression_weight``);
- :func:`renoise`, :func:`mixed_noise`, :func:`importance_weights`: TDM's diffusion from the student's next trajectory
  point ``x_{t_mid}`` to ``x_t`` and the fake score's importance weight;
- :func:`tdm_loss`, :func:`dmd_loss`: the generator's distribution-matching losses (TDM's, DMD2's);
- :func:`renoise_shape`, :func:`beta_quantiles`: DMDR's dynamic renoise sampling (the query times' Beta, decayed to
  uniform);
- :func:`tdm_fake_loss`: TDM's fake-score loss (DMD's is the flow-matching loss,
  :func:`flowrl.methods.forward.flow_matching_error`);
- :class:`HeldScore`: a score network held as a second copy of the trainable tensors (a LoRA, or every weight) with
  its own AdamW, trained through the policy's forward by swapping its weights in (:meth:`flowrl.policy.Policy.holding`);
- :class:`Distillation`: the method base (rollout, the fake-score phase, the generator phase, checkpoints); ``tdm``
  (:class:`TDM`), ``dmd`` (:class:`DMD`) and ``dmdr`` (:class:`DMDR`) register on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import ConfigError, check, config_section, setting
from ..losses import nft_loss, optimality_weights
from .base import FinalSamples, Rewards, register_method
from .forward import ForwardProcess, flow_matching_error


# ------------------------------------------------------------------------------------------------ the equations
def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row values `(N,)` viewed as `(N, 1, ...)` against `like` `(N, *latent_shape)`."""
    return t.view((-1,) + (1,) * (like.ndim - 1)).to(like.dtype)


def flow_predictions(x: torch.Tensor, t: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean sample and the noise a velocity predicts on the path ``x_t = (1 - t) x0 + t eps``:
    ``x0 = x - t v``, ``eps = x + (1 - t) v`` (TDM's ``predicted_origin`` and the model's noise, in flow terms).

    Args:
        x, v (`torch.Tensor` of shape `(N, *latent_shape)`): the state and the velocity at it.
        t (`torch.Tensor` of shape `(N,)`, in [0, 1]): the state's time (1 = noise).

    Returns:
        ``(x0, eps)``, each `(N, *latent_shape)`, in `v`'s dtype (with `v`'s gradient).
    """
    t = _rows(t, v)
    return x - t * v, x + (1 - t) * v


def student_trajectory(velocity, noise: torch.Tensor, cond: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The student's deterministic ``K``-step trajectory from `noise`: ``x_{k+1} = x_k + (s_{k+1} - s_k) v(x_k, s_k)``,
    Euler, which on the rectified-flow path is DDIM (``x_{k+1} = (1 - s_{k+1}) x0 + s_{k+1} eps`` of the step's
    predictions), as TDM's ``generate_new`` (train_tdm_demo.py lines 59-101).

    Args:
        velocity: a :class:`flowrl.samplers.VelocityFn` ``(x (N, ...), t (N,), cond (N,)) -> v``.
        noise (`torch.Tensor` of shape `(N, *latent_shape)`): ``x_{s_0}``. cond (`(N,)` long): prompt rows.
        sigmas (`torch.Tensor` of shape `(K + 1,)`, from 1 to 0): the student's times.

    Returns:
        `torch.Tensor` of shape `(N, K + 1, *latent_shape)`, float32: every trajectory point, the last the sample.
    """
    x, states = noise.float(), [noise.float()]
    for k in range(len(sigmas) - 1):
        t = sigmas[k].expand(len(x)).to(x.device)
        x = x + (sigmas[k + 1] - sigmas[k]).item() * velocity(x, t, cond).float()
        states.append(x)
    return torch.stack(states, dim=1)  # (N, K + 1, *latent_shape)


def teacher_trajectory(
    velocity, noise: torch.Tensor, cond: torch.Tensor, sigmas: torch.Tensor, substeps: int
) -> torch.Tensor:
    """The teacher's Euler trajectory from `noise` over the student's times, each of the student's steps split into
    `substeps` equal Euler steps, kept at the student's times only: the paired targets of :func:`regression_loss`
    (DMD's regression pairs, arXiv 2311.18828 Sec. 3.3, taken per student step).

    Args:
        velocity: a :class:`flowrl.samplers.VelocityFn` (the teacher's, with its CFG). noise, cond: as
            :func:`student_trajectory`. sigmas (`(K + 1,)`, from 1 to 0): the student's times.
        substeps (`int`, >= 1): Euler steps per student step.

    Returns:
        `torch.Tensor` of shape `(N, K + 1, *latent_shape)`, float32: the teacher's states at ``sigmas``.
    """
    sigmas = sigmas.float()
    fine = [torch.linspace(sigmas[k].item(), sigmas[k + 1].item(), substeps + 1)[:-1] for k in range(len(sigmas) - 1)]
    fine = torch.cat([*fine, sigmas[-1:].cpu()]).to(sigmas.device)  # (K substeps + 1,)
    return student_trajectory(velocity, noise, cond, fine)[:, ::substeps]


def regression_loss(
    v: torch.Tensor, x: torch.Tensor, x_next: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor
) -> torch.Tensor:
    """DMD's regression loss (arXiv 2311.18828 Eq. 7, with the squared error for LPIPS) per student step: the
    student's one Euler step from the teacher's trajectory point ``x`` at ``s`` should land on the teacher's next
    point ``x_next`` at ``s_next``: ``mean((v - (x_next - x) / (s_next - s))^2)`` (the error of the step's velocity).

    Args:
        v (`torch.Tensor` of shape `(N, *latent_shape)`): the student's velocity at ``(x, s)`` (with its gradient).
        x, x_next (same shape): the teacher's points (:func:`teacher_trajectory`). s, s_next (`(N,)`, ``s > s_next``).

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs).
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    target = (x_next.to(dtype) - x.to(dtype)) / _rows(s_next - s, x).to(dtype)
    return (v.to(dtype) - target.detach()).pow(2).mean()


def renoise(x_mid: torch.Tensor, t_mid: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The forward diffusion from time `t_mid` to a later time `t >= t_mid`:
    ``x_t = (alpha_t / alpha_mid) x_mid + sqrt(sigma_t^2 - (alpha_t sigma_mid / alpha_mid)^2) z`` with ``alpha = 1 -
    t``, ``sigma = t`` (TDM's ``Predictor.add_noise``, train_tdm_demo.py lines 1036-1045; with ``t_mid = 0`` it is the
    plain ``(1 - t) x0 + t z``).

    Args:
        x_mid, z (`torch.Tensor` of shape `(N, *latent_shape)`): the state at `t_mid` and fresh standard noise.
        t_mid, t (`torch.Tensor` of shape `(N,)`): times in [0, 1), ``t >= t_mid``.

    Returns:
        `torch.Tensor` of shape `(N, *latent_shape)`.
    """
    a_mid, s_mid, a_t, s_t = _rows(1 - t_mid, x_mid), _rows(t_mid, x_mid), _rows(1 - t, x_mid), _rows(t, x_mid)
    beta = (s_t**2 - (a_t / a_mid * s_mid) ** 2).clamp_min(0).sqrt()
    return x_mid * (a_t / a_mid) + beta * z


def mixed_noise(eps: torch.Tensor, z: torch.Tensor, t_mid: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The total noise of :func:`renoise`'s ``x_t`` around the student's ``x0`` in units of ``sigma_t``, when ``x_mid``
    is the student's DDIM point ``alpha_mid x0 + sigma_mid eps``: ``(eps alpha_t sigma_mid / alpha_mid + beta z) /
    sigma_t`` (TDM's ``obtain_mixed_noise``, train_tdm_demo.py lines 1047-1057).

    Args:
        eps, z (`torch.Tensor` of shape `(N, *latent_shape)`): the student's predicted noise and the fresh noise.
        t_mid, t (`torch.Tensor` of shape `(N,)`): as :func:`renoise`, ``t > 0``.

    Returns:
        `torch.Tensor` of shape `(N, *latent_shape)`.
    """
    a_mid, s_mid, a_t, s_t = _rows(1 - t_mid, eps), _rows(t_mid, eps), _rows(1 - t, eps), _rows(t, eps)
    beta = (s_t**2 - (a_t / a_mid * s_mid) ** 2).clamp_min(0).sqrt()
    return (eps * (a_t / a_mid) * s_mid + beta * z) / s_t


def importance_weights(mixed: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """TDM's importance weight of each row for the fake-score loss, ``exp(-mean(mixed^2) / 2) / exp(-mean(z^2) / 2)``
    (means over the latent's elements; train_tdm_demo.py line 1129).

    Args:
        mixed, z (`torch.Tensor` of shape `(N, *latent_shape)`): :func:`mixed_noise` and the fresh noise.

    Returns:
        `torch.Tensor` of shape `(N,)`, positive.
    """
    return torch.exp(-0.5 * mixed.pow(2).flatten(1).mean(1)) / torch.exp(-0.5 * z.pow(2).flatten(1).mean(1))


def min_snr_weights(t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Min-SNR weights ``min(SNR(t), gamma)`` with ``SNR = (alpha_t / sigma_t)^2 = ((1 - t) / t)^2`` (Hang et al.,
    arXiv 2303.09556; TDM's fake loss with gamma 5, train_tdm_demo.py lines 1131-1133).

    Args:
        t (`torch.Tensor` of shape `(N,)`, in (0, 1]). gamma (`float`): the cap, > 0.

    Returns:
        `torch.Tensor` of shape `(N,)`, in [0, gamma].
    """
    return (((1 - t) / t) ** 2).clamp(max=gamma)


def tdm_fake_loss(
    x0_fake: torch.Tensor, x0_student: torch.Tensor, t: torch.Tensor, weights: torch.Tensor, gamma: float
) -> torch.Tensor:
    """TDM's fake-score loss: the fake score denoises the diffused student trajectory towards the student's clean
    prediction, ``mean_rows(mean_d (x0_fake - x0_student)^2 * min(SNR(t), gamma) * w)`` (train_tdm_demo.py lines
    1127-1134; ``w``: :func:`importance_weights`, or ones).

    Args:
        x0_fake (`torch.Tensor` of shape `(N, *latent_shape)`): the fake score's clean prediction at ``x_t`` (with
            the gradient); x0_student (same shape): the student's (detached).
        t (`(N,)`): the query times; weights (`(N,)`): importance weights. gamma: the Min-SNR cap.

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs).
    """
    dtype = torch.promote_types(x0_fake.dtype, torch.float32)
    err = (x0_fake.to(dtype) - x0_student.detach().to(dtype)).pow(2).flatten(1).mean(1)  # (N,)
    return (err * min_snr_weights(t.to(dtype), gamma) * weights.to(dtype)).mean()


def revised_x0_loss(x0: torch.Tensor, correction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The student's clean prediction pulled along a detached `correction`, normalised per row by its distance to a
    `reference`: ``mean((x0 - sg(x0 + correction))^2 / sg(mean_d |x0 - reference|))``, the shape of TDM's generator
    loss (train_tdm_demo.py lines 1174-1187) and of each of TDM-R1's reward terms.

    Args:
        x0 (`torch.Tensor` of shape `(N, *latent_shape)`): the student's clean prediction (with its gradient).
        correction, reference (same shape): the direction and the normaliser's reference (both detached here).

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs); its gradient in ``x0`` is ``-2 correction / (D w)``.
    """
    dtype = torch.promote_types(x0.dtype, torch.float32)
    x0, correction, reference = x0.to(dtype), correction.detach().to(dtype), reference.detach().to(dtype)
    target = (x0 + correction).detach()
    w = (x0.detach() - reference).abs().flatten(1).mean(1)  # (N,)
    return ((x0 - target).pow(2) / _rows(w, x0)).mean()


def tdm_loss(x0: torch.Tensor, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """TDM's generator loss (arXiv 2503.06674, Eq. 9's gradient; train_tdm_demo.py lines 1165-1187): the student's
    clean prediction pulled along ``real - fake`` and normalised per row by ``mean_d |x0 - real|``:
    ``mean(( x0 - sg(x0 + real - fake) )^2 / sg(mean_d |x0 - real|))``, whose gradient in ``x0`` is ``2 (fake - real)
    / (D w)``.

    Args:
        x0 (`torch.Tensor` of shape `(N, *latent_shape)`): the student's clean prediction (with its gradient).
        real, fake (same shape): the real score's clean prediction at ``x_t`` with CFG, the fake score's.

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs).
    """
    return revised_x0_loss(x0, real.detach() - fake.detach(), real)


def dmd_loss(x0: torch.Tensor, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """DMD2's distribution-matching loss (arXiv 2405.14867, Eq. 2 with DMD's normalisation, arXiv 2311.18828 Eq. 8;
    DMD2 main/sd_guidance.py lines 235-241): ``grad = (fake - real) / mean_d |x0 - real|``,
    ``loss = mean((x0 - sg(x0 - grad))^2) / 2``, whose gradient in ``x0`` is ``grad / D``.

    Args:
        x0 (`torch.Tensor` of shape `(N, *latent_shape)`): the generator's sample (with its gradient).
        real, fake (same shape): the real score's clean prediction at ``x_t`` (with CFG), the fake score's.

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs).
    """
    dtype = torch.promote_types(x0.dtype, torch.float32)
    x0, real, fake = x0.to(dtype), real.detach().to(dtype), fake.detach().to(dtype)
    grad = torch.nan_to_num((fake - real) / _rows((x0.detach() - real).abs().flatten(1).mean(1), x0))
    return 0.5 * (x0 - (x0 - grad).detach()).pow(2).mean()


def cosine_decay(step: int, steps: int) -> float:
    """DMDR's half-cosine decay (vvvvvjdy/dmdr at 061dc29: the dynamic guidance's scale, training script lines
    517-521, and the renoise Beta's shape, utils.py lines 74-78): ``c = (1 + cos(pi min(n / steps, 1))) / 2`` after
    ``n = step`` student optimizer steps, 1 at the start and 0 from `steps` on; 1 throughout when ``steps <= 0``."""
    import math

    return 1.0 if steps <= 0 else 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0)))


def renoise_shape(start: tuple[float, float], step: int, steps: int) -> tuple[float, float]:
    """DMDR's dynamic renoise sampling schedule (arXiv 2511.13649; vvvvvjdy/dmdr train_cc/sit/utils.py lines 74-78 at
    061dc29): the Beta shape ``(a0, b0)`` decays to ``(1, 1)`` (uniform) by a half cosine over `steps` student
    optimizer steps, ``a = 1 + (a0 - 1) c``, ``b = 1 + (b0 - 1) c``, ``c = (1 + cos(pi min(n / steps, 1))) / 2``.

    Args:
        start (`tuple[float, float]`): ``(a0, b0)``, both > 0. step (`int`): the student's optimizer steps ``n``,
            >= 0. steps (`int`): the decay's length; 0: no decay (the shape stays `start`, as the official code's
            ``dynamic_step`` 0).

    Returns:
        ``(a, b)``, both > 0; ``(1, 1)`` once ``step >= steps > 0``.
    """
    a0, b0 = (float(v) for v in start)
    c = cosine_decay(step, steps)
    return 1 + (a0 - 1) * c, 1 + (b0 - 1) * c


def beta_quantiles(u: torch.Tensor, shape: tuple[float, float]) -> torch.Tensor:
    """Uniform draws `u` mapped through the inverse CDF of ``Beta(a, b)`` (``scipy.special.betaincinv``): Beta draws
    taken from the caller's generator, the same uniforms as a uniform draw (``(1, 1)`` returns `u` itself).

    Args:
        u (`torch.Tensor` of shape `(N,)`, in [0, 1]): uniform draws. shape (`tuple[float, float]`): ``(a, b)``, > 0.

    Returns:
        `torch.Tensor` of shape `(N,)`, `u`'s dtype and device, in [0, 1], distributed as ``Beta(a, b)``.
    """
    if tuple(shape) == (1.0, 1.0):
        return u
    from scipy.special import betaincinv

    q = betaincinv(shape[0], shape[1], u.detach().cpu().double().numpy())
    return torch.from_numpy(q).to(dtype=u.dtype, device=u.device)


# ------------------------------------------------------------------------------------------------ the fake score
class HeldScore:
    """A score network held as a second copy of the policy's trainable tensors (a LoRA, or every weight) with its own
    AdamW: DMD's and TDM's fake score. Its forwards run the policy's network with these weights swapped in
    (:meth:`flowrl.policy.Policy.holding`), its backwards through the policy's (summed over processes as the policy's),
    and :meth:`step` moves the gradients the backwards left on the live parameters onto the copy and steps it.

    Under FSDP2 full shard the copy, its gradients and its AdamW moments are this process's shards (``DTensor``, as
    :meth:`flowrl.policy.Policy.copy` makes them; the gradient norm is over every shard); under FSDP2 keeping the
    weights gathered the copy is whole and each gradient is gathered from its shards (an all-gather per tensor).

    Args:
        policy (:class:`flowrl.policy.Policy`): whose trainable tensors the copy mirrors (not under DeepSpeed, whose
            gradients live in its own partitioned buffers).
        weights (`dict[str, torch.Tensor]`): the initial copy, by the policy's parameter names (float32), shaped as
            :meth:`flowrl.policy.Policy.copy` makes them.
        lr (`float`), betas (`tuple[float, float]`): its AdamW's; max_grad_norm (`float`): its gradient clip.
    """

    def __init__(self, policy, weights: dict[str, torch.Tensor], lr: float, betas, max_grad_norm: float):
        self.policy, self.weights, self.max_grad_norm = policy, weights, max_grad_norm
        params = list(weights.values())
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=0.0)
        for p in params:  # eager state, so that checkpoints hold it from the start
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    def holding(self):
        """Context in which the policy's forwards are this score's."""
        return self.policy.holding(self.weights)

    def step(self) -> float:
        """Move the live parameters' gradients onto the copy (clearing them), clip at `max_grad_norm` and step AdamW.

        Returns:
            The gradient norm before clipping.
        """
        from torch.distributed.tensor import DTensor

        from ..sharding import full

        for n, p in self.policy.params.items():
            grad, held = p.grad, self.weights[n]
            if isinstance(grad, DTensor) and not isinstance(held, DTensor):  # FSDP2 keeping the weights gathered
                grad = full(grad)
            held.grad, p.grad = grad, None
        norm = full(torch.nn.utils.clip_grad_norm_(list(self.weights.values()), self.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    def moments(self, which: str) -> dict[str, torch.Tensor]:
        """AdamW's ``exp_avg`` or ``exp_avg_sq`` by parameter name (the tensors themselves: loading writes them)."""
        return {n: self.optimizer.state[p][which] for n, p in self.weights.items()}

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return int(self.optimizer.state[next(iter(self.weights.values()))]["step"].item())

    @steps.setter
    def steps(self, count: int) -> None:
        for p in self.weights.values():
            self.optimizer.state[p]["step"].fill_(float(count))

    def files(self, stem: str) -> dict[str, dict[str, torch.Tensor]]:
        """Its weights and AdamW moments as checkpoint files ``STEM.safetensors``, ``STEM_exp_avg.safetensors``,
        ``STEM_exp_avg_sq.safetensors`` (:meth:`flowrl.methods.base.Method.snapshots`)."""
        return {
            f"{stem}.safetensors": self.weights,
            f"{stem}_exp_avg.safetensors": self.moments("exp_avg"),
            f"{stem}_exp_avg_sq.safetensors": self.moments("exp_avg_sq"),
        }


# ------------------------------------------------------------------------------------------------ the settings
@config_section("train", "distill", "few-step distillation's settings (train.method tdm, dmd, dmdr)")
@dataclass
class DistillConfig:
    """``train.distill.*``: the student, the real and the fake scores of ``tdm`` (arXiv 2503.06674), ``dmd`` (arXiv
    2405.14867) and ``dmdr`` (arXiv 2511.13649). The student samples ``sampling.num_steps`` deterministic steps at
    ``sampling.guidance_scale`` (1: no CFG, TDM's and DMD's generator)."""

    teacher_guidance: float = setting(
        4.5, "CFG of the real score (the teacher: the LoRA-disabled base) in the matching gradient (TDM's cfg)"
    )
    fake_learning_rate: float = setting(3.0e-4, "AdamW learning rate of the fake score (TDM's: 5x the student's)")
    fake_betas: tuple[float, float] = setting((0.0, 0.95), "AdamW betas of the fake score (TDM's (0, 0.95))")
    fake_updates: int = setting(
        1, "fake-score passes (each of train.inner_epochs) over the iteration's rows before the student's steps (TTUR)"
    )
    fake_init: str = setting(
        "teacher", "the fake score starts as: teacher (the LoRA's B zeroed, or the base weights) | student"
    )
    min_time: float = setting(0.02, "lowest time the scores are queried at (TDM 20/1000, DMD2 min_step_percent)")
    max_time: float = setting(0.98, "highest time the scores are queried at (DMD2's max_step_percent)")
    random_mid: bool = setting(False, "TDM's use_randmid: the next trajectory point at a random time within the step")
    separate: bool = setting(False, "TDM's use_separate: query times capped at the trajectory point's own time")
    min_snr: float = setting(5.0, "Min-SNR cap of TDM's fake-score loss weight")
    importance_weight: bool = setting(True, "TDM's importance weight of the fake-score loss")
    student_lora: str = setting(
        "", "a LoRA folder (pytorch_lora_weights.safetensors) to start the student from (a tdm run's export)"
    )
    dynamic_guidance: float = setting(
        0.0,
        "DMDR's dynamic distribution guidance: the real score is the teacher plus the fake score's LoRA at this scale, "
        "decayed by a half cosine to 0 over dynamic_steps optimizer steps (0: off; the official lora_scale_r)",
    )
    dynamic_steps: int = setting(
        0,
        "optimizer steps over which dynamic_guidance and renoise_beta decay (DMDR's dynamic_step; 0: renoise_beta "
        "stays as set)",
    )
    renoise_beta: tuple[float, float] = setting(
        (1.0, 1.0),
        "dmd, dmdr: DMDR's dynamic renoise sampling: the scores' query times drawn from this Beta(a, b) on [min_time, "
        "max_time], its shape decayed to (1, 1) (uniform) by a half cosine over dynamic_steps (the official gui_a, "
        "gui_b; its cold start (4, 1.5); (1, 1): uniform, DMD2's)",
    )
    regression_weight: float = setting(
        0.0,
        "weight of DMD's regression loss (arXiv 2311.18828 Eq. 7) per student step: the student's step from the "
        "teacher's ODE trajectory point (same noise, teacher_guidance) to the next (0: off, TDM's and DMD2's)",
    )
    regression_substeps: int = setting(3, "the teacher's Euler steps per student step in the regression pairs")
    dmd_weight: float = setting(1.0, "dmdr: weight of the DMD regulariser beside the RL loss")
    nft_beta: float = setting(1.0, "dmdr: DiffusionNFT's beta of the RL loss (arXiv 2509.16117)")

    def __post_init__(self):
        check(self.teacher_guidance >= 1, "train.distill.teacher_guidance", ">= 1", self.teacher_guidance)
        check(self.fake_learning_rate > 0, "train.distill.fake_learning_rate", "> 0", self.fake_learning_rate)
        betas = list(self.fake_betas)
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "train.distill.fake_betas", "two in [0, 1)", betas)
        check(self.fake_updates >= 1, "train.distill.fake_updates", ">= 1", self.fake_updates)
        check(self.fake_init in ("teacher", "student"), "train.distill.fake_init", "teacher|student", self.fake_init)
        check(0 < self.min_time < self.max_time < 1, "train.distill.min_time", "0 < min_time < max_time < 1",
              (self.min_time, self.max_time))  # fmt: skip
        check(self.min_snr > 0, "train.distill.min_snr", "> 0", self.min_snr)
        check(self.dynamic_guidance >= 0, "train.distill.dynamic_guidance", ">= 0", self.dynamic_guidance)
        check(
            self.dynamic_guidance == 0 or self.dynamic_steps > 0,
            "train.distill.dynamic_steps",
            "> 0 with train.distill.dynamic_guidance > 0",
            self.dynamic_steps,
        )
        check(self.dynamic_steps >= 0, "train.distill.dynamic_steps", ">= 0", self.dynamic_steps)
        shape = list(self.renoise_beta)
        check(len(shape) == 2 and all(v > 0 for v in shape), "train.distill.renoise_beta", "two > 0 (a, b)", shape)
        check(self.regression_weight >= 0, "train.distill.regression_weight", ">= 0", self.regression_weight)
        check(self.regression_substeps >= 1, "train.distill.regression_substeps", ">= 1", self.regression_substeps)
        check(self.dmd_weight >= 0, "train.distill.dmd_weight", ">= 0", self.dmd_weight)
        check(self.nft_beta > 0, "train.distill.nft_beta", "> 0", self.nft_beta)


@dataclass
class TrajectorySamples(FinalSamples):
    """A few-step student's rollout: its final samples (``x0``) and every trajectory point.

    Attributes:
        states (`torch.Tensor` of shape `(B, K + 1, *latent_shape)`, float32): ``x_{s_0}`` (noise) to ``x_{s_K}``
            (``x0``), on the device.
        teacher_states (`torch.Tensor` of the same shape, or None): the teacher's trajectory from the same noise
            (:func:`teacher_trajectory`), with ``train.distill.regression_weight`` > 0.
    """

    states: torch.Tensor
    teacher_states: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ the methods
class Distillation(ForwardProcess):
    """Base of the few-step methods (module docstring): the student is the policy, the real score the teacher (the
    LoRA-disabled base; with full fine-tuning a held copy of the starting weights), the fake score a
    :class:`HeldScore`. Each iteration: the student's trajectories (:meth:`rollout`), ``train.distill.fake_updates``
    passes of the fake score over the rows (:meth:`fake_phase`), then the student's optimizer steps
    (:meth:`generator_loss`). A subclass says where the scores are queried (:meth:`query`) and the two losses.

    Args: as :class:`flowrl.methods.base.Method`.

    Raises:
        ConfigError: as :class:`flowrl.methods.base.Method` (DeepSpeed: :meth:`engine_blockers`), or a
            ``train.distill.student_lora`` folder without the trained LoRA's tensors.
    """

    lockstep = True  # every process distils every row it samples (as many as the others): equal forwards

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        d = cfg.train.distill
        if d.student_lora:
            self.load_student(d.student_lora)
        self.teacher = None if cfg.model.lora_rank > 0 else policy.copy()  # full fine-tuning: the start is the teacher
        start = policy.copy()
        if d.fake_init == "teacher" and cfg.model.lora_rank > 0:
            start = {n: torch.zeros_like(w) if "lora_B" in n else w for n, w in start.items()}
        if d.fake_init == "teacher" and self.teacher is not None:
            start = {n: w.clone() for n, w in self.teacher.items()}
        self.fake = HeldScore(policy, start, d.fake_learning_rate, d.fake_betas, cfg.train.max_grad_norm)

    @classmethod
    def engine_blockers(cls, cfg) -> dict[str, str]:
        """DeepSpeed: the fake score (and TDM-R1's surrogate) is trained by its own AdamW from the gradients the
        transformer's backward leaves on the parameters, which DeepSpeed keeps in its own partitioned buffers."""
        return {"DeepSpeed": f"{cls.name} steps its fake score with its own AdamW from the parameters' gradients"}

    @classmethod
    def check_config(cls, cfg) -> None:
        """Plain groups of deterministic student samples: no rollout shape but ``flat``, no window, no KL; dynamic
        distribution guidance only with a LoRA (it scales the fake score's)."""
        cls.check_final_samples(cfg, "it trains a few-step student")
        check(
            cfg.train.distill.dynamic_guidance == 0 or cfg.model.lora_rank > 0,
            "train.distill.dynamic_guidance",
            "0 unless model.lora_rank > 0 (it adds the fake score's LoRA to the teacher)",
            cfg.train.distill.dynamic_guidance,
        )

    def load_student(self, folder: str) -> None:
        """Start the student's LoRA from the LoRA folder (or run) `folder` (:func:`flowrl.merge.lora_as_params`: its
        weight deltas the file's).

        Raises:
            ConfigError: naming ``train.distill.student_lora``, for full fine-tuning, a missing or unreadable file, or
                a LoRA of other modules or rank.
        """
        from ..merge import lora_as_params, lora_folder

        key = "config key 'train.distill.student_lora'"
        if self.cfg.model.lora_rank == 0:
            raise ConfigError(f"{key}: a LoRA student needs model.lora_rank > 0, got {folder} with model.lora_rank 0")
        m = self.cfg.model
        try:
            self.policy.assign(lora_as_params(lora_folder(folder, key), self.policy.params, m.lora_alpha, m.lora_rank))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"{key}: {e}") from None

    # ------------------------------------------------------------------------------ the contract
    def rollout(self, metas: list[dict], generator: torch.Generator) -> TrajectorySamples:
        """``sampling.group_size`` student trajectories per prompt (:func:`student_trajectory`, at
        ``sampling.guidance_scale``), decoded for the rewards; with ``train.distill.regression_weight`` > 0 the
        teacher's from the same noise (:func:`teacher_trajectory`, not decoded)."""
        cfg, model = self.cfg, self.model
        table = model.prompt_table(metas)
        prompt_index = torch.arange(len(metas), device=self.device).repeat_interleave(cfg.sampling.group_size)  # (B,)
        cond = table.rows(prompt_index)  # (B,)
        noise = torch.randn((len(cond), *model.latent_shape), generator=generator).to(self.device)
        velocity = self.chunked(model.velocity_fn(table, cfg.sampling.guidance_scale))
        with torch.no_grad(), self.policy.autocast():
            states = student_trajectory(velocity, noise, cond, self.sigmas.to(self.device))  # (B, K + 1, ...)
        nfe = len(cond) * cfg.sampling.num_steps * model.cfg_rows(cfg.sampling.guidance_scale)
        d, teacher_states = cfg.train.distill, None
        if d.regression_weight > 0:
            teacher = self.chunked(model.velocity_fn(table, d.teacher_guidance))
            with torch.no_grad(), self.policy.autocast(), self.teacher_context():
                teacher_states = teacher_trajectory(
                    teacher, noise, cond, self.sigmas.to(self.device), d.regression_substeps
                )
            nfe += len(cond) * cfg.sampling.num_steps * d.regression_substeps * model.cfg_rows(d.teacher_guidance)
        x0 = states[:, -1]
        return TrajectorySamples(self.decode(x0), prompt_index.cpu(), nfe, x0, cond, table, states, teacher_states)

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """Data-free methods: zeros, every row kept (the rewards are only logged); :class:`DMDR` overrides."""
        n = len(samples.x0)
        return torch.zeros(n), torch.ones(n, dtype=torch.bool), {}

    def update(self, samples: TrajectorySamples, adv: torch.Tensor, keep: torch.Tensor, generator) -> dict:
        """The fake score's passes (:meth:`fake_phase`), then the student's optimizer steps on the kept rows.

        Returns:
            ``policy/loss``, ``policy/grad_norm``, ``policy/optimizer_steps``, ``fake/loss``, ``fake/grad_norm``,
            ``cost/trained_transitions`` (rows x epochs) and ``cost/nfe`` (the loss's forwards, CFG rows counted).
        """
        rows = keep.nonzero().squeeze(1).to(self.device)  # (N,)
        k = self.boundaries(samples, rows, generator)
        fake = self.fake_phase(samples, rows, k, generator)
        fake.update(self.between_phases(samples, rows, k, adv, generator))
        gen = self.generator_phase(samples, rows, k, generator)
        guided = self.model.cfg_rows(self.cfg.train.distill.teacher_guidance)
        d = self.cfg.train.distill
        per_row = d.fake_updates * 2 + self.cfg.train.inner_epochs * (3 + guided + int(d.regression_weight > 0))
        return {**gen, **fake, "cost/nfe": len(rows) * per_row, "cost/trained_transitions": len(rows)}

    # ------------------------------------------------------------------------------ the parts
    def boundaries(self, samples: TrajectorySamples, rows: torch.Tensor, generator) -> torch.Tensor:
        """The trajectory step ``k`` `(N,)` long in ``[0, K)`` each of `rows` trains at: uniform per row."""
        return torch.randint(0, self.cfg.sampling.num_steps, (len(rows),), generator=generator).to(self.device)

    def between_phases(self, samples, rows, k, adv, generator) -> dict:
        """Work between the fake score's passes and the student's steps (:class:`TDMR1`'s surrogate); returns its
        metrics. Nothing here."""
        return {}

    def teacher_context(self):
        """Context in which the forwards are the teacher's (the LoRA disabled, or the held starting weights)."""
        return self.model.reference() if self.teacher is None else self.policy.holding(self.teacher)

    def student_point(self, samples: TrajectorySamples, idx: torch.Tensor, k: torch.Tensor):
        """The trajectory points ``x_{s_k}`` `(n, *latent_shape)`, their times `(n,)` and prompt rows of rows `idx`."""
        x = samples.states[idx, k]  # (n, *latent_shape)
        return x, self.sigmas.to(self.device)[k], samples.cond[idx]

    def query(self, x0, eps, k: torch.Tensor, generator: torch.Generator):
        """Where the real and fake scores are queried: ``(x_t (n, ...), t (n,), fake-loss weights (n,), z)`` from the
        student's predictions `x0`, `eps` at the trajectory points of steps `k` (detached); ``z`` the fresh noise."""
        raise NotImplementedError

    def fake_loss(self, v_fake, x_t, t, x0, weights, z) -> torch.Tensor:
        """The fake score's loss from its velocity at ``x_t``, the student's `x0` (detached) and :meth:`query`'s
        weights and noise."""
        raise NotImplementedError

    def matching_loss(self, x0, real, fake) -> torch.Tensor:
        """The generator's distribution-matching loss (:func:`tdm_loss` or :func:`dmd_loss`)."""
        raise NotImplementedError

    def fake_phase(self, samples, rows, k, generator) -> dict:
        """``train.distill.fake_updates`` passes of minibatches of `rows` (the policy's sizes), one fake-score AdamW
        step each: the student's predictions (no gradient) at its trajectory points, :meth:`query`, the fake score's
        velocity at ``x_t`` with its weights swapped in, :meth:`fake_loss`."""
        policy, model, d = self.policy, self.model, self.cfg.train.distill
        velocity = model.velocity_fn(samples.table, 1.0)
        losses, norms = [], []
        for _ in range(d.fake_updates):
            for _, _, mb, total in policy.minibatches(len(rows), generator):
                share, parts = len(mb) / max(total, 1), []
                for _, idx, frac in policy.micro_batches(mb):
                    x, s, c = self.student_point(samples, rows[idx], k[idx])
                    with torch.no_grad(), policy.autocast():
                        x0, eps = flow_predictions(x, s, velocity(x, s, c))
                    x_t, t, w, z = self.query(x0, eps, k[idx], generator)
                    with self.fake.holding():
                        with policy.autocast():
                            loss = self.fake_loss(velocity(x_t, t, c), x_t, t, x0, w, z)
                        policy.backward(loss, frac * share)
                    parts.append(loss.item() * frac)
                norms.append(self.fake.step())
                losses.append(sum(parts))
        return {"fake/loss": sum(losses) / max(len(losses), 1), "fake/grad_norm": sum(norms) / max(len(norms), 1)}

    def guidance_scale_now(self) -> float:
        """DMDR's dynamic distribution guidance (arXiv 2511.13649, Sec. 3.3; vvvvvjdy/dmdr train_sitxl_refl_deepspeed.py
        lines 517-521): ``lambda = dynamic_guidance (1 + cos(pi min(n / dynamic_steps, 1))) / 2`` after ``n`` student
        optimizer steps (0 once they are done or when off; :func:`cosine_decay`)."""
        d = self.cfg.train.distill
        if d.dynamic_guidance == 0:
            return 0.0
        return d.dynamic_guidance * cosine_decay(self.policy.steps_taken(), d.dynamic_steps)

    def renoise_shape_now(self) -> tuple[float, float]:
        """DMDR's dynamic renoise sampling: the Beta shape the query times are drawn from after ``n`` student
        optimizer steps, :func:`renoise_shape` of ``train.distill.renoise_beta`` over ``dynamic_steps`` (``(1, 1)``,
        uniform, when off)."""
        d = self.cfg.train.distill
        return renoise_shape(d.renoise_beta, self.policy.steps_taken(), d.dynamic_steps)

    def real_context(self):
        """The teacher (:meth:`teacher_context`), or under dynamic distribution guidance the teacher plus the fake
        score's LoRA at :meth:`guidance_scale_now` (its B matrices scaled)."""
        scale = self.guidance_scale_now()
        if scale == 0:
            return self.teacher_context()
        return self.policy.holding({n: w * scale if "lora_B" in n else w for n, w in self.fake.weights.items()})

    def scores(self, x_t, t, c, table):
        """The real score's clean prediction with CFG ``train.distill.teacher_guidance`` (:meth:`real_context`) and
        the fake score's, at ``x_t`` (no gradient)."""
        with torch.no_grad(), self.policy.autocast():
            with self.real_context():
                v_real = self.model.velocity_fn(table, self.cfg.train.distill.teacher_guidance)(x_t, t, c)
            with self.fake.holding():
                v_fake = self.model.velocity_fn(table, 1.0)(x_t, t, c)
        return flow_predictions(x_t, t, v_real)[0], flow_predictions(x_t, t, v_fake)[0]

    def generator_phase(self, samples, rows, k, generator) -> dict:
        """The student's optimizer steps (:meth:`flowrl.methods.base.Method.optimizer_steps`) on `rows`: per
        micro-batch the student's predictions without gradient, the scores at :meth:`query`'s ``x_t`` (weights are
        swapped in, so before any graph exists), then the student's prediction with gradient and :meth:`step_loss`, plus
        ``train.distill.regression_weight`` times :meth:`regression` when the rollout holds the teacher's
        trajectory."""
        velocity = self.model.velocity_fn(samples.table, self.cfg.sampling.guidance_scale)

        def micro_loss(idx, stats, at):
            x, s, c = self.student_point(samples, rows[idx], k[idx])
            with torch.no_grad(), self.policy.autocast():
                x0, eps = flow_predictions(x, s, velocity(x, s, c))
            x_t, t, _, _ = self.query(x0, eps, k[idx], generator)
            real, fake = self.scores(x_t, t, c, samples.table)
            extra = self.extra_scores(x_t, t, c, samples.table)
            with self.policy.autocast():
                x0 = flow_predictions(x, s, velocity(x, s, c))[0]
            loss, stats = self.step_loss(x0, real, fake, idx, extra)
            if samples.teacher_states is not None:
                reg = self.regression(samples, rows[idx], k[idx], velocity)
                loss = loss + self.cfg.train.distill.regression_weight * reg
                stats = {**stats, "policy/regression_loss": reg.item()}
            return loss, stats

        stats, steps = self.optimizer_steps(len(rows), generator, micro_loss)
        return self.update_metrics(stats, steps)

    def regression(self, samples: TrajectorySamples, rows: torch.Tensor, k: torch.Tensor, velocity) -> torch.Tensor:
        """:func:`regression_loss` of the student's step ``k`` `(n,)` from the teacher's trajectory point of `rows`
        `(n,)` (with the student's gradient)."""
        sigmas = self.sigmas.to(self.device)
        x, x_next = samples.teacher_states[rows, k], samples.teacher_states[rows, k + 1]
        s, c = sigmas[k], samples.cond[rows]
        with self.policy.autocast():
            v = velocity(x, s, c)
        return regression_loss(v, x, x_next, s, sigmas[k + 1])

    def extra_scores(self, x_t, t, c, table):
        """What else the student's loss reads at ``x_t`` besides the real and fake scores (no gradient): None here,
        the surrogate's and the teacher's conditional predictions for :class:`TDMR1`."""
        return None

    def step_loss(self, x0, real, fake, idx, extra):
        """The student's loss of the micro-batch `idx` (positions in the update's rows): :meth:`matching_loss`
        (:class:`DMDR` adds its RL loss, :class:`TDMR1` its reward terms)."""
        loss = self.matching_loss(x0, real, fake)
        return loss, {"policy/matching_loss": loss.item()}

    # ------------------------------------------------------------------------------ checkpoints
    snapshot_origin = "by a few-step distillation method (train.method tdm, dmd or dmdr)"

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The fake score and its two AdamW moments, and with full fine-tuning the teacher."""
        return 3 + int(cfg.model.lora_rank == 0)

    def snapshots(self) -> dict:
        """The fake score and its AdamW moments, and with full fine-tuning the teacher."""
        files = self.fake.files("fake_score")
        if self.teacher is not None:
            files["teacher.safetensors"] = self.teacher
        return files

    def state_dict(self) -> dict:
        return {"fake_score_steps": self.fake.steps}

    def load_state_dict(self, state: dict) -> None:
        self.fake.steps = state.get("fake_score_steps", 0)


@register_method("tdm", "few-step student, Trajectory Distribution Matching")
class TDM(Distillation):
    """``train.method: tdm`` (Luo et al., arXiv 2503.06674; Luo-Yihong/TDM train_tdm_demo.py): data-free distillation
    of the teacher into a ``sampling.num_steps``-step student that matches the teacher's distribution at every point
    of its own deterministic trajectory.

    For a row at trajectory point ``x_{s_k}``, the student's step predicts ``x0, eps``; its next point ``x_mid =
    (1 - t_mid) x0 + t_mid eps`` at ``t_mid = s_{k+1}`` (with ``train.distill.random_mid`` uniform in ``[s_{k+1},
    s_k)``) is diffused to ``x_t`` (:func:`renoise`) at ``t`` uniform in ``[max(min_time, t_mid), max_time]`` (with
    ``separate``, ``[.., s_k]``). The fake score learns to denoise ``x_t`` to the student's ``x0``
    (:func:`tdm_fake_loss`, Min-SNR and importance weighted) and the student follows ``real - fake``
    (:func:`tdm_loss`).
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """As :meth:`Distillation.check_config`; DMDR's renoise sampling is refused (TDM's query times are bounded by
        the trajectory point's)."""
        super().check_config(cfg)
        shape = tuple(cfg.train.distill.renoise_beta)
        check(
            shape == (1, 1),
            "train.distill.renoise_beta",
            f"[1, 1] with train.method {cls.name} (the Beta query times are dmd's and dmdr's)",
            shape,
        )

    def query(self, x0, eps, k, generator):
        d, sigmas = self.cfg.train.distill, self.sigmas.to(self.device)
        s_k, t_mid = sigmas[k], sigmas[k + 1]  # (n,)
        if d.random_mid:
            u = torch.rand(len(k), generator=generator).to(self.device)
            t_mid = t_mid + u * (s_k - t_mid)
        low = t_mid.clamp(min=d.min_time)
        high = (s_k if d.separate else torch.full_like(s_k, d.max_time)).clamp(min=low)
        t = low + torch.rand(len(k), generator=generator).to(self.device) * (high - low)  # (n,)
        z = torch.randn(x0.shape, generator=generator).to(x0.device)
        x_mid = (1 - _rows(t_mid, x0)) * x0 + _rows(t_mid, x0) * eps
        x_t = renoise(x_mid, t_mid, t, z)
        w = importance_weights(mixed_noise(eps, z, t_mid, t), z) if d.importance_weight else torch.ones_like(t)
        return x_t, t, w, z

    def fake_loss(self, v_fake, x_t, t, x0, weights, z):
        return tdm_fake_loss(flow_predictions(x_t, t, v_fake)[0], x0, t, weights, self.cfg.train.distill.min_snr)

    def matching_loss(self, x0, real, fake):
        return tdm_loss(x0, real, fake)


@register_method("dmd", "few-step student, Distribution Matching Distillation (DMD2)")
class DMD(Distillation):
    """``train.method: dmd`` (DMD2, Yin et al., arXiv 2405.14867; tianweiy/DMD2 main/sd_guidance.py): the student's
    clean prediction at a random point of its trajectory (DMD2's backward simulation for a multi-step generator) is
    noised afresh, ``x_t = (1 - t) x0 + t z`` with ``t`` uniform in ``[min_time, max_time]``; the fake score learns
    the flow-matching loss on it (:func:`flowrl.methods.forward.flow_matching_error`, DMD2's denoising loss) and the
    student follows ``real - fake`` normalised (:func:`dmd_loss`). With ``train.distill.renoise_beta`` (DMDR's
    dynamic renoise sampling) ``t = min_time + (max_time - min_time) u``, ``u ~ Beta(a, b)`` of
    :meth:`renoise_shape_now`, for the fake score's loss and the student's alike (the official code's ``ts_gui`` and
    ``ts_dmd``)."""

    def query(self, x0, eps, k, generator):
        """``t = min_time + (max_time - min_time) u`` `(n,)` with ``u ~ Beta(renoise_shape_now())`` (uniform by
        default) drawn as the Beta quantile of a uniform from `generator`; ``x_t = (1 - t) x0 + t z``."""
        d = self.cfg.train.distill
        u = beta_quantiles(torch.rand(len(k), generator=generator), self.renoise_shape_now())  # (n,) in [0, 1]
        t = d.min_time + u.to(self.device) * (d.max_time - d.min_time)
        z = torch.randn(x0.shape, generator=generator).to(x0.device)
        return (1 - _rows(t, x0)) * x0 + _rows(t, x0) * z, t, torch.ones_like(t), z

    def fake_loss(self, v_fake, x_t, t, x0, weights, z):
        return flow_matching_error(v_fake, x0, z).mean()

    def matching_loss(self, x0, real, fake):
        return dmd_loss(x0, real, fake)


@register_method("dmdr", "few-step student, DiffusionNFT's RL loss with the DMD loss as regulariser")
class DMDR(DMD):
    """``train.method: dmdr`` (DMDR, arXiv 2511.13649): RL on a few-step student with the DMD loss (real and fake
    scores, :class:`DMD`) as its regulariser: the student's loss is DiffusionNFT's (arXiv 2509.16117,
    :func:`flowrl.losses.nft_loss`) on its final samples noised at the sampler's grid times, with the group-relative
    advantages of the rewards as optimality weights, plus ``train.distill.dmd_weight`` times :func:`dmd_loss`. The
    old velocity of the NFT loss is the student's at the iteration's start (no soft-updated copy). DMDR's two dynamic
    strategies, distribution guidance (:meth:`guidance_scale_now`) and renoise sampling (:meth:`renoise_shape_now`),
    decay over ``train.distill.dynamic_steps``: the official recipe runs them in its cold start (a ``dmd`` run here)
    and resumes its RL stage past their decay (vvvvvjdy/dmdr scripts/dmdr_sitxl_refl.sh at 061dc29), so the preset
    leaves them off."""

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """Group z-scores over every process's images (:meth:`ForwardProcess.advantages`); every row is kept for
        the DMD term (a flat group's rows have ``r = 1/2``)."""
        adv, keep, stats = ForwardProcess.advantages(self, samples, rewards, generator)
        return adv, torch.ones_like(keep), stats

    def update(self, samples: TrajectorySamples, adv: torch.Tensor, keep: torch.Tensor, generator) -> dict:
        """As :meth:`Distillation.update`, the RL loss's rows prepared first: each final sample noised once at a
        grid time, its optimality weight, and the student's velocity there before the update (DiffusionNFT's old
        policy)."""
        rows = keep.nonzero().squeeze(1).to(self.device)  # (N,)
        x_0, c = samples.x0[rows], samples.cond[rows]
        t = self.grid_times(len(rows), generator)
        x_t, _ = self.noised(x_0, t, generator)
        velocity = self.chunked(self.model.velocity_fn(samples.table, self.cfg.sampling.guidance_scale))
        with torch.no_grad(), self.policy.autocast():
            v_old = velocity(x_t, t, c) if len(rows) else x_t
        r = optimality_weights(adv[rows.cpu()], self.cfg.train.adv_clip_max).to(self.device)
        self._rl = (x_0, c, t, x_t, v_old, r, samples.table)
        try:
            return super().update(samples, adv, keep, generator)
        finally:
            self._rl = None

    def step_loss(self, x0, real, fake, idx, extra):
        d, train = self.cfg.train.distill, self.cfg.train
        x_0, c, t, x_t, v_old, r, table = self._rl
        with self.policy.autocast():
            v = self.model.velocity_fn(table, self.cfg.sampling.guidance_scale)(x_t[idx], t[idx], c[idx])
        rl = nft_loss(v, v_old[idx], x_t[idx], x_0[idx], t[idx], r[idx], d.nft_beta, train.adv_clip_max)
        dmd = dmd_loss(x0, real, fake)
        return rl + d.dmd_weight * dmd, {"policy/rl_loss": rl.item(), "policy/matching_loss": dmd.item()}
