"""Worker of tests/test_distributed.py, launched by torchrun: ``python distributed_worker.py CONFIG OUT [key=value ...]``.

Trains with the given config, then writes this process's trainable parameters and evaluation results to
``OUT/rank{r}.safetensors`` and ``OUT/rank{r}.json``.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file


def rank_reward(images, prompts, metadata):
    """Brightness on process 0, a constant on the others: their groups have no reward variance, so they
    keep no transitions and must still take every optimizer step."""
    if int(os.environ.get("RANK", "0")) == 0:
        return images.float().mean(dim=(1, 2, 3))
    return torch.zeros(len(prompts))


def main() -> None:
    from flowrl.config import load_config
    from flowrl.evaluate import sharded
    from flowrl.trainer import Trainer

    config, out, *overrides = sys.argv[1:]
    trainer = Trainer(load_config(config, overrides))
    result = trainer.train()
    rank = trainer.accelerator.process_index
    save_file({n: p.detach().contiguous() for n, p in trainer.params.items()}, f"{out}/rank{rank}.safetensors")
    calls = []  # items 0..6 over 2 processes: 4 and 3 items, gathered back in item order
    order = sharded(lambda idx: calls.append(idx) or torch.tensor(idx, dtype=torch.float32)[:, None] * 10, 7,
                    trainer.accelerator)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"before": result["before"], "after": result["after"], "sharded": order.squeeze(1).tolist(),
                   "sharded_calls": calls, "num_processes": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
