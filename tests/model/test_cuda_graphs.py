"""train.cuda_graphs: which runs replay their compiled layers as CUDA graphs, what is refused, and that the gradient
buffers a replay needs leave the accumulated gradients as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.errors import RecipeError
from memtrain.model.compiled import ready_for_replay, resolve_compile, resolve_cuda_graphs
from memtrain.recipe.load import load_recipe
from memtrain.train.resolve import with_train

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "recipes/llama2-7b-lora-24gb.yaml"
NONE = "checkpointing.strategy=none"


def graphs(*overrides: str, cuda: bool = True) -> bool:
    """train.cuda_graphs as the run resolves it: train.compile first, then the graphs (checkpointing is explicit in
    every case here, so nothing else is left to resolve)."""
    recipe = load_recipe(LORA, list(overrides)).recipe
    return resolve_cuda_graphs(with_train(recipe, compile=resolve_compile(recipe, cuda)), cuda)


def test_auto_replays_compiled_layers_that_recompute_nothing_on_text():
    assert graphs(NONE, "batch.micro_batch=1")
    assert graphs("checkpointing.strategy=first_n_layers", "checkpointing.first_n_layers=0")  # what auto may resolve to
    assert not graphs(NONE, cuda=False)  # no CUDA, no graphs, and the run goes on


@pytest.mark.parametrize(
    "overrides, why",
    [
        ((), "the recipe as shipped recomputes every layer in backward"),
        (("checkpointing.strategy=first_n_layers", "checkpointing.first_n_layers=4"), "some layers recomputed"),
        ((NONE, "train.compile=false"), "no compiled layers to replay"),
        ((NONE, "model.lora.lean_dropout=true"), "auto leaves lean dropout's layers eager, so nothing to replay"),
        ((NONE, "data.packing=false"), "text cut per document: micro-batches cut to their longest row"),
        (
            (NONE, 'data.train=[{path: "builtin:chat", type: chat}]', "model.tokenizer=builtin:shakespeare-chat"),
            "chat rows change width",
        ),
        ((NONE, "train.cuda_graphs=false"), "false stands"),
        ((NONE, "model.lora=null", "train.compile=true"), "a full fine-tune: a gradient buffer for every weight"),
    ],
)
def test_auto_leaves_the_rest_without_graphs(overrides, why):
    assert not graphs(*overrides), why


@pytest.mark.parametrize(
    "overrides, said",
    [
        (("checkpointing.strategy=every_layer",), "checkpointing.strategy=none"),
        (("checkpointing.strategy=memory_budget",), "ran out of memory on the GPU"),
        ((NONE, "train.compile=false"), "train.compile=auto"),
        ((NONE, "data.packing=false"), "one width"),
        ((NONE, "model.lora=null"), "LoRA adapters"),
    ],
)
def test_true_where_graphs_cannot_replay_is_refused_with_what_to_change(overrides, said):
    with pytest.raises(RecipeError) as caught:
        load_recipe(LORA, ["train.cuda_graphs=true", *overrides])
    text = str(caught.value)
    assert "train.cuda_graphs" in text and said in text


def test_true_stands_where_graphs_can_replay():
    assert graphs(NONE, "train.cuda_graphs=true")


def test_prepared_gradient_buffers_accumulate_what_autograd_would():
    """A replay's gradient must be added into a buffer that outlives it: ready_for_replay gives every trainable
    parameter without a gradient a zero one, keeps the buffers already there, and two accumulated micro-batches
    then leave the same gradients as autograd's own buffers do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)  # a frozen weight gets no buffer
    trainable = [p for p in model.parameters() if p.requires_grad]
    inputs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def accumulate(prepare: bool) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        for x in inputs:
            if prepare:
                ready_for_replay(trainable)
            model(x).square().sum().backward()
        return [p.grad.clone() for p in trainable]

    expected = accumulate(prepare=False)
    for p in model.parameters():
        p.grad = None
    ready_for_replay(trainable)
    buffers = [p.grad for p in trainable]
    assert model[0].weight.grad is None
    assert all(b is not None and not b.any() for b in buffers)
    ready_for_replay(trainable)
    assert all(p.grad is b for p, b in zip(trainable, buffers))  # kept, not replaced
    got = accumulate(prepare=True)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
