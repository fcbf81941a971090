"""Seconds per transformer build step on this device for (layers, width, batch), joint text tower."""
import sys, time, torch
from flowrl.tiny.build import tiny_transformer, train_transformer, LATENT_CHANNELS, LATENT_SIZE, MAX_TOKENS
from transformers import CLIPTextModelWithProjection

import os; DEV = os.environ.get("DEV", "cuda")
layers, width, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
te = CLIPTextModelWithProjection.from_pretrained("assets/tiny-sd3/text_encoder", dtype=torch.float32)
ids = torch.randint(0, 1000, (50, MAX_TOKENS))
lat = torch.randn(4096, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)
cap = torch.randint(0, 50, (4096,))
m = tiny_transformer(te.config.hidden_size * 2, te.config.projection_dim * 2, 0, layers, width)
def run(n):
    t0 = time.time(); train_transformer(m, lat, None, None, cap, n, 0, batch=batch, ema_decay=0.999, text_encoder=te,
                                        input_ids=ids, text_lr=1e-4, device=DEV); DEV == "cuda" and torch.cuda.synchronize(); return time.time() - t0
N = int(os.environ.get("N", 60))
run(10); a = run(10); b = run(N)
print(f"PROBE {layers} {width} {batch} {(b - a) / (N - 10):.5f}", flush=True)
