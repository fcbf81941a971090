"""Train a preset with the pipeline's CLIP text encoders trained too (an experiment, not a flowrl option).

TextCraftor (arXiv 2403.18978) fine-tunes a text-to-image model's text encoder with reward signals. Here
both CLIP text towers of an SD3-family pipeline (the tiny model's ``text_encoder`` and ``text_encoder_2``)
are trained in full, at their own learning rate, beside whatever the config trains (the transformer's
LoRA in the presets). Every prompt table flowrl builds is re-encoded at each use, so gradients reach the
text towers in the training forwards, and the weights held at that moment encode it (DiffusionNFT's
soft-updated sampling policy, the EMA in evaluation). Written for the DiffusionNFT presets: a GRPO
preset's rollout table would be encoded under the rollout's autocast and its training table under the
update's, which need not give the same bits (the PPO ratio before the first step would not be exactly 1).

    python benchmarks/nft_text_encoders.py CONFIG --text-lr 1e-4 [key=value ...]

Writes the run folder as ``flowrl train`` does (the LoRA saved there holds the transformer's layers only;
the run's own ``eval.json`` is the evaluation with the trained text towers).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from flowrl.models import PromptEmbeds
    from flowrl.trainer import Trainer

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


class ReencodedTable:
    """A prompt table that encodes its prompts again at every indexing (in the caller's grad, autocast and
    weights), standing in for :class:`flowrl.models.PromptEmbeds` (its ``NEGATIVE_ROW`` and ``rows``)."""

    def __init__(self, encode, prompts: list[str]):
        from flowrl.models import PromptEmbeds

        self.encode, self.prompts = encode, prompts
        self.NEGATIVE_ROW, self.rows = PromptEmbeds.NEGATIVE_ROW, PromptEmbeds.rows

    def __getitem__(self, index: torch.Tensor) -> PromptEmbeds:
        return self.encode(self.prompts)[index]


def text_encoder_trainer(config, text_lr: float) -> Trainer:
    """A :class:`flowrl.trainer.Trainer` of `config` that also trains the CLIP text towers in full at ``text_lr``."""
    from flowrl.trainer import Trainer

    trainer = Trainer(config)
    text = {}
    for name in TEXT_ENCODERS:
        encoder = getattr(trainer.model.pipe, name).float().requires_grad_(True)
        text.update({f"{name}.{n}": p for n, p in encoder.named_parameters()})
    trainer.policy.params.update(
        text
    )  # clipped, checkpointed, EMA'd and soft-updated with the rest (one process only:
    # the towers are outside the DDP-wrapped transformer, so several processes would not sum their gradients)
    trainer.policy.optimizer.add_param_group({"params": list(text.values()), "lr": text_lr})
    for store in (trainer.policy.ema, trainer.method.sampling_weights()):
        if store is not None:
            store.update({n: p.detach().clone() for n, p in text.items()})
    encode = type(trainer.model).encode.__wrapped__  # FlowModel.encode without its torch.no_grad
    model = trainer.model
    model.encode = lambda prompts: ReencodedTable(lambda p: encode(model, p), list(prompts))
    return trainer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="configs/*.yaml, e.g. configs/diffusion_nft_off_policy.yaml")
    parser.add_argument("--text-lr", type=float, required=True, help="AdamW learning rate of the text towers")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.seed=1")
    args = parser.parse_intermixed_args(argv)
    from flowrl.config import load_config  # after the arguments: --help answers at once, before torch

    config = load_config(args.config, args.overrides)
    result = text_encoder_trainer(config, args.text_lr).train()
    print(
        f"GenEval strict accuracy: {result['before']['overall']:.3f} -> {result['after']['overall']:.3f} in "
        f"{result['wall_time_s'] / 60:.1f} min; run folder {config.run.output_dir}"
    )
    return result


if __name__ == "__main__":
    main()
