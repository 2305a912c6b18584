"""OOM helpers: recognising real OOM errors, freeing memory, snapshots on CPU, the test injector."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from memtrain.errors import UserError
from memtrain.train.runtime.oom import (
    INJECT_ENV,
    OomInjector,
    dump_memory_snapshot,
    is_oom,
    release_memory,
    start_memory_history,
)


def real_cpu_allocation_failure() -> RuntimeError:
    try:
        torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: refused by the allocator, nothing is touched
    except RuntimeError as error:
        return error
    pytest.fail("allocating 1 EiB succeeded")


def real_shape_error() -> RuntimeError:
    try:
        torch.ones(2, 3) @ torch.ones(2, 3)
    except RuntimeError as error:
        return error
    pytest.fail("a shape mismatch did not raise")


# Messages as CUDA, cuBLAS, cuDNN and DeepSpeed print them.
OOM_MESSAGES = [
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
    "Last error:\nCuda failure 'out of memory'",
]
NOT_OOM_MESSAGES = [
    "CUDA error: device-side assert triggered",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "NCCL communicator was aborted on rank 0: Watchdog caught collective operation timeout",
]


def test_torch_out_of_memory_error_is_oom():
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which "
        "1.06 GiB is free. Of the allocated memory 20.1 GiB is allocated by PyTorch"
    )
    assert is_oom(error)
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError  # one class to catch for both names


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_runtime_errors_that_say_out_of_memory_are_oom(message):
    assert is_oom(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_OOM_MESSAGES)
def test_other_runtime_errors_are_not_oom(message):
    assert not is_oom(RuntimeError(message))


def test_real_cpu_allocator_failure_is_oom_and_a_real_shape_error_is_not():
    assert is_oom(real_cpu_allocation_failure())
    assert not is_oom(real_shape_error())


def test_non_runtime_errors_are_not_oom_even_if_they_mention_memory():
    assert not is_oom(ValueError("out of memory"))
    assert not is_oom(KeyboardInterrupt())
    assert is_oom(MemoryError())


def test_oom_wrapped_in_another_error_is_found_through_the_chain():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backward failed in layer 3") from inner
    except RuntimeError as outer:
        assert is_oom(outer)
    try:
        try:
            raise real_shape_error()
        except RuntimeError:
            raise ValueError("while handling")  # noqa: B904 (the implicit __context__ under test, not an OOM)
    except ValueError as outer:
        assert not is_oom(outer)


def test_release_memory_collects_cycles_that_hold_tensors():
    class Holder:
        pass

    gc.disable()  # so only release_memory can break the cycle
    try:
        holder = Holder()
        holder.self = holder
        holder.activations = torch.ones(1024)
        alive = weakref.ref(holder.activations)
        del holder
        assert alive() is not None
        release_memory(torch.device("cpu"))
        assert alive() is None
    finally:
        gc.enable()


def test_snapshot_and_history_do_nothing_on_cpu(tmp_path):
    start_memory_history("cpu")
    assert dump_memory_snapshot(tmp_path, 7) is None
    assert list(tmp_path.iterdir()) == []


# -- the injector ---------------------------------------------------------------------------------


def drive(injector, attempts):
    """Run (step, micro_index, micro_batch) attempts; return which of them raised."""
    raised = []
    for attempt in attempts:
        try:
            injector.maybe_raise(*attempt)
        except torch.OutOfMemoryError as error:
            assert is_oom(error) and INJECT_ENV in str(error)
            raised.append(attempt)
    return raised


def test_each_point_fires_once_and_the_retry_passes():
    injector = OomInjector.parse("3:0,7:1")
    attempts = [(s, i, 4) for s in range(10) for i in range(3)]
    assert drive(injector, attempts + attempts) == [(3, 0, 4), (7, 1, 4)]


def test_repeat_count_fires_on_consecutive_attempts():
    injector = OomInjector.parse("2:0*3")
    assert drive(injector, [(2, 0, 1)] * 5) == [(2, 0, 1)] * 3


def test_micro_batch_condition_waits_for_a_matching_size():
    injector = OomInjector.parse("5:0:mb>=4, 6:1:mb<2")
    attempts = [(5, 0, 2), (5, 0, 3), (5, 0, 4), (5, 0, 8), (6, 1, 2), (6, 1, 1), (6, 1, 1)]
    assert drive(injector, attempts) == [(5, 0, 4), (6, 1, 1)]


def test_hooks_read_the_environment_once_and_default_to_nothing():
    from memtrain.train.step.hooks import Hooks

    injector = Hooks.from_env({INJECT_ENV: "1:2*2:mb==8"}).oom
    assert injector and drive(injector, [(1, 2, 4), (1, 2, 8), (1, 2, 8), (1, 2, 8)]) == [(1, 2, 8)] * 2
    for quiet in (Hooks().oom, Hooks.from_env({}).oom, Hooks.from_env({}).oom_backward):
        assert not quiet and drive(quiet, [(s, 0, 1) for s in range(20)]) == []
    backward = Hooks.from_env({"MEMTRAIN_INJECT_OOM_BACKWARD": "3:0"}).oom_backward
    assert drive(backward, [(3, 0, 1), (3, 0, 1)]) == [(3, 0, 1)]


def test_only_the_named_rank_injects():
    from memtrain.train.step.hooks import Hooks

    spec = {INJECT_ENV: "0:0", "MEMTRAIN_INJECT_RANK": "1"}
    assert not Hooks.from_env({**spec, "RANK": "0"}).oom
    assert Hooks.from_env({**spec, "RANK": "1"}).oom


@pytest.mark.parametrize("spec", ["3", "3:x", "a:0", "3:0:mb=>4", "3:0*0", "-1:0", "3:0:batch>=2"])
def test_malformed_spec_is_a_user_error_naming_the_point(spec):
    with pytest.raises(UserError) as caught:
        OomInjector.parse(f"1:0,{spec}")
    assert repr(spec) in str(caught.value)
    assert INJECT_ENV in str(caught.value)


def test_a_layer_point_arms_and_raises_from_inside_that_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    entered = []
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, index=index: entered.append(index))
    injector = OomInjector.parse("1:0@layer1")
    injector.attach(model)
    ids = torch.tensor([[1, 2, 3]])
    injector.maybe_raise(1, 0, 4)  # arms instead of raising before the forward
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        model(input_ids=ids)
    assert entered == [0, 1]  # raised after layer 1's attention ran, before layer 2
    entered.clear()
    model(input_ids=ids)  # fired once: the retry passes every layer
    assert entered == [0, 1, 2]


def _checkpoint_as_torch_2_11_did(function, x):
    """torch.utils.checkpoint (non-reentrant) before 2.13: its saved-tensor hooks live in a generator
    that is only closed on success; when `function` raises, they stay installed until the frame dies."""

    def hooks_around_forward():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t), lambda p: p[1]):
            yield

    gen = hooks_around_forward()
    next(gen)
    out = function(x)
    next(gen, None)
    return out


def _saved_tensor_hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_an_oom_inside_a_checkpointed_region_leaves_no_saved_tensor_hooks_behind():
    from memtrain.train.step.micro_batches import OomDuringStep, _as_oom

    def forward_that_runs_out(x):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    try:
        _checkpoint_as_torch_2_11_did(forward_that_runs_out, torch.ones(2, requires_grad=True))
    except torch.OutOfMemoryError as error:
        assert _saved_tensor_hooks_installed()  # what the retry's forward would have saved into
        oom = _as_oom(error, in_backward=False, done=0)
    assert isinstance(oom, OomDuringStep)
    assert not _saved_tensor_hooks_installed()


def test_a_layer_point_beyond_the_model_is_a_user_error_naming_the_range():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(UserError) as caught:
        OomInjector.parse("1:0@layer3").attach(model)
    assert "3 decoder layers" in str(caught.value) and "@layer0 to @layer2" in str(caught.value)
