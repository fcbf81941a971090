"""Tiny random pipelines of every model family's real diffusers classes, built offline in seconds, and each family's
stock-pipeline reference.

One module per family (``sd3``, ``flux``, ``flux_kontext``, ``sd15``, ``sdxl``, ``qwen_image``, ``qwen_image_edit``,
``z_image``, ``sana``, ``flux2``, ``wan``, ``wan_i2v``, ``hunyuan_video``, ``hunyuan_video15``,
``hunyuan_video15_i2v``, ``ltx``, ``ltx2``), each with

- ``build_random_<family>_pipeline(folder, ...) -> folder``: saves a seeded random-weight pipeline of the family's
  real classes there (the same weights on every call);
- ``stock_<family>(folder, model, metas, noise, num_steps, guidance_scale, **kwargs)``: the stock diffusers
  pipeline's images ``(B, 3, H, W)`` (videos ``(B, F, 3, H, W)``) float32 in [0, 1], the reference flowrl's adapter
  must equal: the pipeline loaded from ``folder`` (a ``Path``) samples the prompt records ``metas`` (dicts with
  ``prompt``, and ``image`` / ``images`` for the edit families) in ``num_steps`` steps at ``guidance_scale`` (flowrl's
  convention) from the noise ``noise`` (``(B, *model.latent_shape)`` float32, as
  :func:`tiny_pipelines.common.noise` draws it), at the size of flowrl's loaded ``model`` (its resolution, prompt
  length, frames); ``kwargs``: the family's own (``lora``: a LoRA folder loaded first; ``negative_prompt``).

``text`` holds the offline tokenizers and small text-encoder settings several families share, ``clip`` the tiny CLIP
models of the reward tests, ``common`` the noise, the stock pipeline loader and the VAE settings. The modules import
diffusers and transformers inside their functions: importing one is cheap. ``tests/families.py`` lists the families
for the conformance suite; each family's test module imports what it needs from here.
"""
