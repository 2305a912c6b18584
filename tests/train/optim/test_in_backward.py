"""optimizer.step_in_backward: each parameter updated by its own optimizer as backward finishes its gradient.

The hooks' arithmetic is proven against one ordinary optimizer step on a real tiny Llama (same weights after
several steps with a changing learning rate, and after a save and load); the whole memtrain path, DeepSpeed
included, against an ordinary run of the same recipe (same losses), and its resume against a straight run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.commands.run import run_command
from memtrain.recipe.load import load_recipe
from memtrain.train.optim.in_backward import StepInBackward
from memtrain.train.resolve import RunOptions
from tests.conftest import read_records, train_losses
from tests.model.test_support import shakespeare_batches, tiny_llama

SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def _loss(model, ids) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _in_backward(model) -> StepInBackward:
    return StepInBackward(list(model.parameters()), SETTINGS, make=lambda group: torch.optim.AdamW(group, **SETTINGS))


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def test_updates_in_backward_equal_one_optimizer_step_after_backward():
    batches = shakespeare_batches(4)
    plain_model, fused_model = tiny_llama(), tiny_llama()
    plain = torch.optim.AdamW(plain_model.parameters(), **SETTINGS)
    fused = _in_backward(fused_model)
    schedules = _schedule(plain), _schedule(fused)
    for ids in batches:
        _loss(plain_model, ids).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        loss = _loss(fused_model, ids)
        fused.arm(loss)
        loss.backward()
        assert all(p.grad is None for p in fused_model.parameters())  # freed as soon as used
        fused.step()
        for schedule in schedules:
            schedule.step()
    start = tiny_llama()
    moved = 0
    for (name, a), b, s in zip(plain_model.named_parameters(), fused_model.parameters(), start.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
        moved += not torch.equal(a, s)
    assert moved == len(list(start.parameters()))  # every parameter trained, with the schedule's rates


def test_a_non_finite_loss_changes_nothing_and_leaves_no_gradient():
    model = tiny_llama()
    optimizer = _in_backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, shakespeare_batches(1)[0]) * float("nan")
    optimizer.arm(loss)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_saved_and_loaded_state_continues_exactly():
    batches = shakespeare_batches(4)

    def steps(model, optimizer, schedule, these):
        for ids in these:
            loss = _loss(model, ids)
            optimizer.arm(loss)
            loss.backward()
            optimizer.step()
            schedule.step()

    straight_model = tiny_llama()
    straight = _in_backward(straight_model)
    steps(straight_model, straight, _schedule(straight), batches)

    first_model = tiny_llama()
    first = _in_backward(first_model)
    first_schedule = _schedule(first)
    steps(first_model, first, first_schedule, batches[:2])
    saved = first.state_dict(), first_schedule.state_dict(), first_model.state_dict()
    second_model = tiny_llama(seed=5)  # other weights: everything must come from the saved state
    second_model.load_state_dict(saved[2])
    second = _in_backward(second_model)
    second_schedule = _schedule(second)
    second.load_state_dict(saved[0])
    second_schedule.load_state_dict(saved[1])
    steps(second_model, second, second_schedule, batches[2:])
    for a, b in zip(straight_model.parameters(), second_model.parameters()):
        assert torch.equal(a, b)


def test_a_state_of_another_model_is_refused():
    optimizer = _in_backward(tiny_llama())
    other = _in_backward(tiny_llama(layers=2))
    with pytest.raises(ValueError, match="per-parameter optimizers"):
        optimizer.load_state_dict(other.state_dict())


# --- the recipe path, DeepSpeed included ------------------------------------------------------------

IN_BACKWARD = {
    "optimizer": {"lr": 3.0e-3, "grad_clip": 0.0, "step_in_backward": True},
    "batch": {"global_batch": 8, "micro_batch": 8},
    "offload": {"zero_stage": 0},
    "train": {"steps": 8, "save_every": 4, "eval_every": 100},
}


def _run(path: Path, **options) -> int:
    return run_command(path, [], RunOptions(**options))


def _run_dir(path: Path) -> Path:
    return Path(load_recipe(path).recipe.train.output_dir)


def test_no_gradient_outlives_the_backward_in_deepspeeds_engine(process_group, write_recipe):
    """DeepSpeed's ZeRO-0 all-reduce gives every parameter without a gradient a zero one after backward: the whole
    model's gradients again (a 7B run held 22.6 GiB where 16.8 were planned). memtrain turns it off."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.train.setup import build_engine, build_policy_model

    recipe = load_recipe(write_recipe("engine", IN_BACKWARD)).recipe
    config = ds_config(recipe, micro_batch=8)
    assert config["zero_optimization"] == {"stage": 0} and "bf16" not in config and "optimizer" not in config
    engine, _ = build_engine(recipe, build_policy_model(recipe, process_group, config), config, total_steps=8)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    ids = shakespeare_batches(1)[0]
    loss_sum, targets = engine(input_ids=ids, labels=ids)
    loss = loss_sum / targets
    engine.optimizer.arm(loss)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(loss, scale_wrt_gas=False)
    assert [name for name, p in engine.module.named_parameters() if p.grad is not None] == []
    changed = [name for name, p in engine.module.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before)  # every parameter updated inside backward
    after_backward = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    engine.step()  # the schedule moves on; the weights do not
    assert all(torch.equal(p, after_backward[name]) for name, p in engine.module.named_parameters())


def test_a_checkpoint_of_this_mode_loads_on_the_host(process_group, write_recipe, tmp_path, monkeypatch):
    """DeepSpeed would load stage 0's saved weights back onto the device they came from, beside the model's own (a
    7B resume ran out of memory so on a 24 GiB card): memtrain loads them on the host, memory-mapped (read whole,
    the 7B resume took 40.2 GiB of host memory), and copies them in."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.train.setup import build_engine, build_policy_model
    from memtrain.train.state.checkpoint import LoopState, load_checkpoint, save_checkpoint

    recipe = load_recipe(write_recipe("host-load", IN_BACKWARD)).recipe
    config = ds_config(recipe, micro_batch=8)

    def engine():
        return build_engine(recipe, build_policy_model(recipe, process_group, config), config, total_steps=8)[0]

    saved = engine()
    ids = shakespeare_batches(1)[0]
    loss_sum, targets = saved(input_ids=ids, labels=ids)
    saved.optimizer.arm(loss_sum)
    saved.set_gradient_accumulation_boundary(True)
    saved.backward(loss_sum / targets, scale_wrt_gas=False)
    path = save_checkpoint(saved, tmp_path, LoopState(step=1), rank=0, keep_last=1)
    loaded, loads = engine(), []
    torch_load = torch.load
    monkeypatch.setattr(torch, "load", lambda file, **options: loads.append(options) or torch_load(file, **options))
    assert load_checkpoint(loaded, path, rank=0).step == 1
    deepspeed_files = [options for options in loads if "mmap" in options]  # not memtrain's own RNG file
    assert len(deepspeed_files) == 2  # the model's states and the optimizer's
    assert all(o["map_location"] == torch.device("cpu") and o["mmap"] for o in deepspeed_files)
    assert all(torch.equal(a, b) for a, b in zip(saved.module.parameters(), loaded.module.parameters()))
    assert all(p.device == loaded.device for p in loaded.module.parameters())


@pytest.mark.slow
def test_a_run_stepping_in_backward_matches_an_ordinary_run(write_recipe):
    """fp32 weights are their own master copy, as bf16 ones are in this mode: same losses as torch's AdamW
    stepped by DeepSpeed after each backward."""
    ordinary = write_recipe("ordinary", {**IN_BACKWARD, "optimizer": {"lr": 3.0e-3, "grad_clip": 0.0}})
    fused = write_recipe("fused", IN_BACKWARD)
    assert _run(ordinary, save=False) == 0 and _run(fused, save=False) == 0
    a, b = train_losses(_run_dir(ordinary)), train_losses(_run_dir(fused))
    assert sorted(b) == list(range(1, 9))
    assert b[8] < b[1] - 0.3, b
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "paged_adamw_8bit"])
def test_bf16_stepping_in_backward_trains_and_resumes_exactly(write_recipe, name):
    """bf16 weights updated in place (bitsandbytes runs the paged optimizer unpaged on the CPU); a run
    stopped half-way and resumed gives the straight run's losses."""
    recipe = {
        **IN_BACKWARD,
        "precision": {"compute": "bf16", "master": "bf16"},
        "optimizer": {**IN_BACKWARD["optimizer"], "name": name},
    }
    straight, halves = write_recipe(f"straight-{name}", recipe), write_recipe(f"halves-{name}", recipe)
    assert _run(straight) == 0
    assert _run(halves, max_steps=4) == 0 and _run(halves) == 0
    a, b = train_losses(_run_dir(straight)), train_losses(_run_dir(halves))
    assert sorted(b) == list(range(1, 9)) and a[8] < a[1] - 0.3, a
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    assert [r for r in read_records(_run_dir(halves), "run") if r.get("event") == "resume"]
    assert (_run_dir(straight) / "final" / "config.json").exists()
