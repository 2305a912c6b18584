"""ZeRO-3's partial optimizer offload (`offload.ratio` < 1) resumes exactly through memtrain's checkpoints.

DeepSpeed 0.19.8 updates the sub-groups it keeps on the GPU with a second optimizer (torch's AdamW) whose
moments its checkpoints leave out; memtrain saves and restores them beside DeepSpeed's files. DeepSpeed's
CPU accelerator keeps every sub-group in host memory, so the test routes the first sub-group to that second
optimizer after start-up (what `subgroup_to_device` says on a GPU): the same code paths, in host memory.
"""

from __future__ import annotations

import pytest
import torch

from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Precision
from memtrain.train.state.checkpoint import LoopState, device_sub_group_states, load_checkpoint, save_checkpoint
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401
from tests.train.test_deepspeed_engine import single_process_group, step  # noqa: F401

deepspeed = pytest.importorskip("deepspeed")

FP32 = Precision(compute="fp32", loss_chunk_tokens=16)
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 20_000,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu", "pin_memory": False, "ratio": 0.5},
    },
}


def hybrid_engine():
    eng, *_ = deepspeed.initialize(model=TrainableLM(tiny_llama(), FP32), config=CONFIG)
    zero = eng.optimizer
    assert len(zero.fp32_partitioned_groups_flat) >= 2 and zero.backup_optimizer is not None
    zero.subgroup_to_device[0] = "device"  # updated by the backup optimizer from now on, as on a GPU
    return eng


def master_weights(eng) -> torch.Tensor:
    return torch.cat([g.detach().flatten().clone() for g in eng.optimizer.fp32_partitioned_groups_flat])


@pytest.mark.slow  # builds DeepSpeed's CPU Adam on first use
def test_a_resumed_partial_offload_continues_exactly(tmp_path):
    batches = shakespeare_batches(6)
    straight = hybrid_engine()
    losses = [step(straight, ids) for ids in batches]
    assert losses[-1] < losses[0]

    first = hybrid_engine()
    for ids in batches[:3]:
        step(first, ids)
    assert device_sub_group_states(first), "the backup optimizer holds the GPU sub-group's moments"
    checkpoint = save_checkpoint(first, tmp_path, LoopState(step=3), rank=0, keep_last=1)
    assert (checkpoint / "device-optimizer-rank0.pt").is_file()

    resumed = hybrid_engine()
    assert load_checkpoint(resumed, checkpoint, rank=0).step == 3
    resumed_losses = [step(resumed, ids) for ids in batches[3:]]
    assert resumed_losses == pytest.approx(losses[3:], abs=1e-6)
    assert torch.allclose(master_weights(resumed), master_weights(straight), rtol=0, atol=1e-6)

    # Without the saved moments (what DeepSpeed's checkpoint alone restores) the run drifts: the test can fail.
    (checkpoint / "device-optimizer-rank0.pt").unlink()
    lossy = hybrid_engine()
    load_checkpoint(lossy, checkpoint, rank=0)
    for ids in batches[3:]:
        step(lossy, ids)
    assert not torch.allclose(master_weights(lossy), master_weights(straight), rtol=0, atol=1e-6)
