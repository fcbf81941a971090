"""Advantages, PPO loss, KL, config and checkpoint: numeric checks against hand-computed values."""

import pytest
import torch

from flowrl.advantages import group_advantages
from flowrl.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from flowrl.config import ConfigError, load_config
from flowrl.losses import kl_to_reference, ppo_loss


def test_group_advantages_group_std():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 1, 1])
    adv, zero = group_advantages(r, g, std="group", clip=5.0, eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]))
    assert zero.tolist() == [False, False, True, True]


def test_group_advantages_global_std_and_clip():
    r = torch.tensor([0.0, 2.0, 10.0, 10.0])
    g = torch.tensor([0, 0, 1, 1])
    adv, _ = group_advantages(r, g, std="global", clip=5.0, eps=1e-4)
    std = r.std(unbiased=False)
    assert torch.allclose(adv[:2], torch.tensor([-1.0, 1.0]) / (std + 1e-4))
    adv, _ = group_advantages(torch.tensor([0.0, 100.0]), torch.tensor([0, 0]), std="global", clip=0.5)
    assert adv.tolist() == [-0.5, 0.5]


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="'group' or 'global'"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std="batch")


def test_ppo_loss_on_policy_is_minus_mean_advantage():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = ppo_loss(lp, lp.detach(), adv, clip_range=1e-4)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats["policy/ratio_max_dev"].item() == 0.0 and stats["policy/clipfrac"].item() == 0.0
    loss.backward()
    assert torch.allclose(lp.grad, -adv / 3)


def test_ppo_loss_clips_beyond_range():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 and 0.5
    adv = torch.tensor([1.0, -1.0])
    loss, stats = ppo_loss(new, old, adv, clip_range=0.2)
    # max(-A r, -A clip(r)): A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2; A=-1, r=0.5 -> max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["policy/clipfrac"].item() == 1.0


def test_kl_to_reference_closed_form():
    mean = torch.zeros(2, 1, 2, 2)
    ref = torch.ones(2, 1, 2, 2) * torch.tensor([1.0, 2.0]).view(2, 1, 1, 1)
    std = torch.tensor([1.0, 2.0])
    # per transition: d^2 / (2 s^2) = 1/2 and 4/8 -> mean 0.5
    assert kl_to_reference(mean, ref, std).item() == pytest.approx(0.5)


def test_config_rejects_unknown_and_bad_keys(tmp_path):
    with pytest.raises(ConfigError, match="train.lerning_rate"):
        load_config(None, ["train.lerning_rate=1e-3"])
    with pytest.raises(ConfigError, match="sampling.group_size"):
        load_config(None, ["sampling.group_size=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["sampling.group_size"])
    with pytest.raises(ConfigError, match="sampling.probe.granularities.*tp_grpo"):  # its returns would overwrite
        load_config(None, ["sampling.shape=tp_grpo", "sampling.probe.granularities=[1,2]"])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.max_grad_norm=-1", "train.max_grad_norm"),
        ("train.inner_epochs=0", "train.inner_epochs"),
        ("train.kl_beta=-0.1", "train.kl_beta"),
        ("train.adv_clip_max=0", "train.adv_clip_max"),
        ("train.weight_decay=-1", "train.weight_decay"),
        ("train.adam_betas=[2,3]", "train.adam_betas"),
        ("model.lora_alpha=0", "model.lora_alpha"),
        ("eval.every=-1", "eval.every"),
        ("eval.num_steps=0", "eval.num_steps"),
        ("run.save_every=0", "run.save_every"),
        ("run.device=gpu", "run.device"),
        ("run.mixed_precision=fp16", "run.mixed_precision"),
        ("sampling.batch_size=0", "sampling.batch_size"),
        ("sampling.prompts_per_iteration=0", "sampling.prompts_per_iteration"),
        ("sampling.shift=0", "sampling.shift"),
        ("sampling.window.stride=-1", "sampling.window.stride"),
        ("sampling.window.min_interval=0", "sampling.window.min_interval"),
        ("sampling.tree.flash_ratio=1.5", "sampling.tree.flash_ratio"),
    ],
)
def test_config_range_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/tiny_geneval.yaml", [override])


def test_config_cross_field_errors_name_the_key():
    with pytest.raises(ConfigError, match="sampling.train_last_step"):
        load_config(None, ["sampling.kernel=cps", "sampling.train_last_step=true"])
    with pytest.raises(ConfigError, match="sampling.tree.sde_steps"):  # not blamed on split_steps
        load_config(None, ["sampling.shape=tree", "sampling.tree.split_steps=[0,2,4]", "sampling.tree.sde_steps=[99]"])
    with pytest.raises(ConfigError, match="sampling.tree.depth_prune"):
        load_config(
            None, ["sampling.shape=tree", "sampling.tree.split_steps=[0,2,4]", "sampling.tree.depth_prune=[99]"]
        )
    tree = ["sampling.shape=tree", "sampling.tree.split_steps=[0,2,4]", "sampling.tree.flash_ratio=0.4"]
    with pytest.raises(ConfigError, match="sampling.tree.split_steps.*unless sampling.shape is 'tree'"):
        load_config(None, ["sampling.tree.split_steps=[0,2,4]"])  # a tree's settings without the tree shape
    with pytest.raises(ConfigError, match="sampling.shape"):
        load_config(None, ["sampling.shape=spiral"])
    with pytest.raises(
        ConfigError, match="sampling.tree.flash_ratio.*every step is SDE"
    ):  # all SDE: no tail to re-space
        load_config(None, tree)
    with pytest.raises(ConfigError, match="sampling.tree.flash_ratio.*last SDE step is 9, the last step 9"):
        load_config(None, [*tree, "sampling.tree.sde_steps=[0,9]"])
    assert load_config(None, [*tree, "sampling.tree.sde_steps=[0,1,2,3]"]).sampling.tree.flash_ratio == 0.4


def test_config_rewards_of_a_preset_replace_the_default(tmp_path):
    (tmp_path / "c.yaml").write_text("rewards:\n  clipscore:\n    weight: 0.5\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert list(cfg.rewards) == ["clipscore"] and cfg.rewards["clipscore"].weight == 0.5
    assert list(load_config(None).rewards) == ["geneval"]


def test_config_presets_load():
    for name in ("tiny_geneval", "recipes/sd35m_pickscore"):
        load_config(f"configs/{name}.yaml")


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.sum().backward()
    opt.step()
    ema = {"w": w.detach().clone() * 2}
    save_checkpoint(tmp_path, 7, {"w": w}, opt, ema, extra={"elapsed_s": 1.5})
    expected_rand = torch.rand(3)
    saved_w, saved_state = w.detach().clone(), opt.state_dict()["state"][0]["exp_avg"].clone()

    w2 = torch.nn.Parameter(torch.zeros(3, 2))
    opt2 = torch.optim.AdamW([w2], lr=0.1)
    ema2 = {"w": torch.zeros(3, 2)}
    path = latest_checkpoint(tmp_path)
    assert path.name == "checkpoint-000007"
    state = load_checkpoint(path, {"w": w2}, opt2, ema2)
    assert state["iteration"] == 7 and state["extra"]["elapsed_s"] == 1.5
    assert torch.equal(w2.detach(), saved_w) and torch.equal(ema2["w"], saved_w * 2)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved_state)
    assert torch.equal(torch.rand(3), expected_rand)  # the torch RNG continues where it was saved


def test_latest_checkpoint_skips_an_incomplete_newest_one(tmp_path):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w])
    save_checkpoint(tmp_path, 1, {"w": w}, opt)
    torn = save_checkpoint(tmp_path, 2, {"w": w}, opt)
    (torn / "state.json").write_text('{"iteration": 2, "opt')  # damaged, e.g. by a crash without fsync
    assert latest_checkpoint(tmp_path).name == "checkpoint-000001"
    (torn / "state.json").unlink()
    assert latest_checkpoint(tmp_path).name == "checkpoint-000001"
    (tmp_path / ".tmp-checkpoint-000003").mkdir()  # a save interrupted before its rename
    assert latest_checkpoint(tmp_path).name == "checkpoint-000001"


def test_checkpoint_resave_and_extra_files(tmp_path):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w])
    save_checkpoint(tmp_path, 1, {"w": w}, opt)
    with torch.no_grad():
        w.mul_(3)
    path = save_checkpoint(tmp_path, 1, {"w": w}, opt, write_extra_files=lambda d: (d / "lora").mkdir())
    assert (path / "lora").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]
    w2 = torch.nn.Parameter(torch.zeros(2))
    ema = {"w": torch.zeros(2)}
    load_checkpoint(path, {"w": w2}, torch.optim.AdamW([w2]), ema)  # EMA switched on at resume: no saved EMA
    assert torch.equal(w2.detach(), torch.full((2,), 3.0)) and torch.equal(ema["w"], torch.full((2,), 3.0))


def test_prune_checkpoints_keeps_the_newest_complete_ones(tmp_path):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w])
    for it in (1, 2, 3):
        save_checkpoint(tmp_path, it, {"w": w}, opt)
    assert prune_checkpoints(tmp_path, 5) == []
    (tmp_path / "checkpoint-000004").mkdir()  # incomplete: does not count, and is not deleted
    (tmp_path / "checkpoint-000000.tar").write_text("")  # a stray file that only looks like a checkpoint
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["checkpoint-000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-000000.tar",
        "checkpoint-000002",
        "checkpoint-000003",
        "checkpoint-000004",
    ]
    assert latest_checkpoint(tmp_path).name == "checkpoint-000003"
    torn = save_checkpoint(tmp_path, 5, {"w": w}, opt)
    (torn / "state.json").write_text('{"iter')  # damaged: not complete, so keep=1 keeps checkpoint 3 ...
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["checkpoint-000002"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-000003"
    save_checkpoint(tmp_path, 1000000, {"w": w}, opt)  # ... and iterations sort as numbers, not names
    prune_checkpoints(tmp_path, 1, just_saved=tmp_path / "checkpoint-1000000")
    assert latest_checkpoint(tmp_path).name == "checkpoint-1000000"
    assert not (tmp_path / "checkpoint-000003").exists()
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, 0)
    with pytest.raises(ConfigError, match="run.keep_checkpoints"):
        load_config(None, ["run.keep_checkpoints=0"])


def test_checkpoint_names_missing_tensor(tmp_path):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w])
    path = save_checkpoint(tmp_path, 1, {"w": w}, opt)
    with pytest.raises(ValueError, match="no trainable tensor 'v'"):  # a CheckpointError
        load_checkpoint(path, {"v": torch.nn.Parameter(torch.zeros(2))}, opt)


def test_timestep_fraction_trains_that_share_of_each_samples_steps():
    from flowrl.methods.shapes import step_subset
    from flowrl.samplers import StepPlan, flow_sigmas, sample

    plan = StepPlan.sde(6)  # 5 trained steps per sample
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    ro = sample(
        lambda x, t, c: torch.tanh(x), x, torch.zeros(4, dtype=torch.long), torch.arange(4), flow_sigmas(6), plan
    )
    keep = step_subset(ro, 0.6, torch.Generator().manual_seed(1))
    per_leaf = torch.bincount(ro.leaf[keep], minlength=4)
    assert per_leaf.tolist() == [3, 3, 3, 3]  # ceil(0.6 * 5)
    assert not bool((keep & ~ro.trained).any())
    other = step_subset(ro, 0.6, torch.Generator().manual_seed(2))
    assert not torch.equal(keep, other)  # a different random subset each iteration


def test_one_policy_update_favours_positive_advantages(tmp_path, random_pipeline, prompt_files):
    """After one optimizer step the log-probs of the rollout's transitions move with their advantages."""
    import importlib.util
    from pathlib import Path

    from conftest import tiny_overrides

    spec = importlib.util.spec_from_file_location(
        "psc", Path(__file__).parent.parent / "benchmarks" / "policy_step_check.py"
    )
    psc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(psc)
    train, test = prompt_files
    over = tiny_overrides(
        random_pipeline,
        train,
        test,
        tmp_path / "run",
        **{
            "run.mixed_precision": "no",
            "train.minibatch_size": 1000,
            "train.learning_rate": 1e-2,
            "sampling.group_size": 4,
            "sampling.prompts_per_iteration": 2,
        },
    )
    result = psc.main([o for o in over if not o.startswith("run.output_dir")] + [f"run.output_dir={tmp_path}/run"])
    assert (
        result["optimizer_steps"] == 1 and result["corr_change_advantage"] > 0.05
    )  # 0.15 here; a flipped loss sign gives < 0


def test_tag_means_averages_each_tag_and_names_length_mismatch():
    from flowrl.diagnostics import tag_means

    out = tag_means(torch.tensor([1.0, 0.0, 0.5, 0.25]), ["colors", "position", "colors", "position"])
    assert out == {"reward/tag/colors/mean": 0.75, "reward/tag/position/mean": 0.125}
    with pytest.raises(ValueError, match="3 tags for 4 rewards"):
        tag_means(torch.zeros(4), ["a", "b", "c"])


def _processes(others: list[torch.Tensor] = ()):
    """A fake accelerator on the CPU, process 0 of ``1 + len(others)``: gather puts the `others`' rows after its own."""
    from types import SimpleNamespace

    def gather(t):
        return torch.cat([t, *(o.to(t.dtype).view(t.shape) for o in others)])

    return SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1 + len(others), gather=gather)


def test_peak_memory_is_the_largest_over_the_processes():
    from flowrl.diagnostics import peak_memory

    one = peak_memory(_processes())
    assert set(one) == {"memory/host_peak_gib"} and 0 < one["memory/host_peak_gib"] < 1024  # no GPU here
    two = peak_memory(_processes([torch.tensor([[4096.0]])]))
    assert two == {"memory/host_peak_gib": 4096.0}  # the other process's, the larger


def test_diversity_metrics_average_every_process_groups():
    from flowrl.diagnostics import diversity_metrics

    def probe(images, group):
        return torch.tensor([0.2, 0.4], dtype=torch.float64)  # two groups' diversity

    images, group = torch.rand(4, 3, 2, 2), torch.tensor([0, 0, 1, 1])
    one = diversity_metrics(probe, images, group, _processes())
    assert one["diversity/clip"] == pytest.approx(0.3) and one["diversity/clip_min"] == pytest.approx(0.2)
    other = torch.tensor([1.0, 2.0, 0.1])  # another process's sum, groups and least diverse group: 0.1 and 0.9
    two = diversity_metrics(probe, images, group, _processes([other]))
    assert two["diversity/clip"] == pytest.approx(0.4) and two["diversity/clip_min"] == pytest.approx(0.1)
    assert "time/diversity_s" in two
    assert diversity_metrics(None, images, group, _processes()) == {}
    assert diversity_metrics(probe, images[:0], group[:0], _processes()) == {}


def test_the_diversity_probe_is_off_or_named_when_its_folder_is_bad(tmp_path):
    from flowrl.diagnostics import diversity_probe

    assert diversity_probe("", "cpu") is None and diversity_probe(None, "cpu") is None
    with pytest.raises(ConfigError, match="config key 'run.diversity_model'"):
        diversity_probe(str(tmp_path), "cpu")


def test_precisions_are_resolved_on_a_copy_and_summarised():
    from flowrl.diagnostics import precision_summary, resolve_precisions

    cfg = load_config(None, ["run.mixed_precision=auto", "sampling.decode_precision=no", "sampling.ode_precision=no"])
    resolved = resolve_precisions(cfg, torch.device("cpu"))
    assert cfg.run.mixed_precision == "auto" and resolved.run.mixed_precision in ("bf16", "no")
    mixed = load_config(None, ["sampling.decode_precision=no", "sampling.ode_precision=no"])
    mixed.run.mixed_precision = "bf16"
    summary = precision_summary(mixed, torch.device("cpu"))
    assert summary.startswith(
        "precision bf16 autocast (run.mixed_precision); float32 (sampling.decode_precision, sampling.ode_precision) on "
    )
    assert summary.endswith(", log-probs float32")


def test_prompts_are_drawn_per_seed_iteration_and_process_and_balanced_over_tags(tmp_path):
    from flowrl.prompt_sampler import PromptSampler, read_prompt_records

    metas = [{"prompt": f"a{i}", "tag": "a"} for i in range(9)] + [{"prompt": "b", "tag": "b"}]
    cfg = load_config(None, ["sampling.prompts_per_iteration=400"])
    draw = PromptSampler(metas, cfg)
    assert draw(3) == PromptSampler(metas, cfg)(3) and draw(3) != draw(4)
    assert draw(3) != PromptSampler(metas, cfg, process_index=1)(3)
    assert 150 < sum(m["tag"] == "b" for m in draw(0)) < 250  # a tag, then a prompt of it: b half the time
    cfg.tag_balanced = False
    assert sum(m["tag"] == "b" for m in draw(0)) < 80  # a prompt uniformly: b a tenth of the time
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="config key 'train_prompts'"):
        read_prompt_records("train_prompts", str(tmp_path / "bad.jsonl"))


def test_velocity_of_a_sample_does_not_depend_on_its_batch():
    """The PPO ratio is exactly 1 before the first optimizer step only if a sample's velocity has the same
    bits whatever the forward call it shares (rollout batches, tree depths and minibatches differ)."""
    from conftest import ASSETS

    from flowrl.models import SD3Model, make_batch_invariant

    model = SD3Model(ASSETS / "tiny-sd3", max_sequence_length=0)
    model.add_lora(4, 8)
    for p in model.transformer.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))  # a non-zero adapter
    table = model.encode(["", "a photo of a star", "a photo of two red circles"])
    velocity = model.velocity_fn(table, guidance_scale=4.5)
    gen = torch.Generator().manual_seed(0)
    n = 40
    x = torch.randn(n, *model.latent_shape, generator=gen)
    t, cond = torch.rand(n, generator=gen), torch.randint(1, 3, (n,), generator=gen)
    with torch.no_grad():
        full = velocity(x, t, cond)
        for rows in ([0], [1, 2], [3, 4, 5, 6, 7], list(range(8, 27))):
            idx = torch.tensor(rows)
            assert torch.equal(velocity(x[idx], t[idx], cond[idx]), full[idx]), rows
    assert make_batch_invariant(model.transformer, model._probe) == 0  # every layer already done, none hooked twice


def test_a_padded_convolution_keeps_a_channels_last_input_channels_last():
    """SANA's feed-forward convolutions get their tokens permuted into a channels-last image batch; oneDNN runs a
    contiguous batch with other kernels (on an Intel Xeon: other bits), so :func:`make_batch_invariant`'s zero
    padding must keep the input's memory format: a sample's output is then the same in a padded and a large batch."""
    from flowrl.models import make_batch_invariant

    conv = torch.nn.Conv2d(8, 40, 1)
    tokens = torch.randn(48, 64, 8, generator=torch.Generator().manual_seed(0))  # (N, H * W, C)
    image = lambda n: tokens[:n].unflatten(1, (8, 8)).permute(0, 3, 1, 2)  # noqa: E731 (n, C, H, W), channels-last
    seen = []
    conv.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    assert make_batch_invariant(conv, None) == 1
    with torch.no_grad():
        full = conv(image(48))
        for n in (1, 3, 20):
            assert torch.equal(conv(image(n)), full[:n]), n
    assert all(seen)  # the padded batches too (the flag is read after the padding hook)


def test_minibatch_sizes_give_every_process_the_same_number_of_steps():
    from flowrl.policy import minibatch_sizes

    sizes = minibatch_sizes(torch.tensor([5, 0, 3]), 2)
    assert sizes.tolist() == [[2, 2, 1], [0, 0, 0], [2, 1, 0]]
    assert sizes.sum(1).tolist() == [5, 0, 3]  # every kept transition in exactly one step
    assert minibatch_sizes(torch.tensor([0, 0]), 4).shape == (2, 0)
    assert minibatch_sizes(torch.tensor([7]), 64).tolist() == [[7]]


@pytest.mark.parametrize("value", [22.3, 31.7, 1000.1])
def test_equal_rewards_at_clip_scale_are_zero_variance(value):
    """A group (or tree depth) of equal rewards gets A = 0 and is dropped, also at CLIP-score magnitudes,
    where float32 means left a spread of ~1e-6 that neither threshold caught (A up to -1 per node)."""
    from flowrl.advantages import depthwise_advantages, process_advantages

    r = torch.cat([torch.full((8,), value), torch.tensor([value, value + 1.0])])
    g = torch.tensor([0] * 8 + [1, 1])
    for std in ("group", "global"):
        adv, zero = group_advantages(r, g, std=std)
        assert zero.tolist() == [True] * 8 + [False, False] and (adv[:8] == 0).all() and (adv[8:] != 0).all()
    step = torch.zeros(10, dtype=torch.long)
    assert (depthwise_advantages(r, g, step, 5.0)[:8] == 0).all()
    assert (process_advantages(r, g, step, torch.ones_like(step), 5.0)[:8] == 0).all()


def test_resume_takes_the_configs_optimizer_settings_not_the_checkpoints(tmp_path):
    """A restored AdamW state carries the checkpoint's learning rate; a resumed run must use (and say it uses)
    the resumed config's."""
    import warnings
    from types import SimpleNamespace

    from flowrl.policy import Policy

    cfg = load_config("configs/tiny_geneval.yaml", ["train.learning_rate=1e-4"])
    w = torch.nn.Parameter(torch.zeros(2))
    t = cfg.train
    opt = torch.optim.AdamW([w], lr=3e-4, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)  # as saved
    fake = SimpleNamespace(cfg=cfg.train, optimizer=opt, accelerator=SimpleNamespace(is_main_process=True))
    with pytest.warns(UserWarning, match=r"config's lr \(learning rate 0.0001"):
        Policy.apply_optimizer_config(fake, tmp_path)
    assert opt.param_groups[0]["lr"] == 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unchanged settings: no warning
        Policy.apply_optimizer_config(fake, tmp_path)
