"""RayDistributedTrainer (seed 003) for every registered family, without a cluster:
model_type / model_task / model_class, config scaling of a MoE and a GPT-2,
create_trainer (the Trainer the job would run), extract_column_names, and the output rules
of a Ray run (only process 0 prints, no colour codes outside a terminal)."""

from __future__ import annotations

import os

import datasets
import numpy as np
import pytest
from flax import nnx
from test_ray_trainer import BASE, VOCAB, arguments, dataset

from jaxtrain.arguments import ArgumentError
from jaxtrain.distributed import RayDistributedTrainer
from jaxtrain.models import GPT2LMHeadModel, LlamaForCausalLM
from jaxtrain.models.classes import classes_for
from jaxtrain.models.gemma import GemmaForCausalLM
from jaxtrain.models.moe import MoeForCausalLM
from jaxtrain.models.vit import ViTForImageClassification
from jaxtrain.trainers.classification import ImageClassificationTrainer
from jaxtrain.training.trainer import Trainer

GPT2 = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=32, model_type="gpt2")  # fmt: skip
MOE = dict(BASE, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=8,
           shared_expert_intermediate_size=16)  # fmt: skip
GEMMA = dict(BASE, model_type="gemma2", head_dim=8, query_pre_attn_scalar=8, sliding_window=4)
VIT = dict(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
           num_attention_heads=2, intermediate_size=32, num_labels=3, model_type="vit")  # fmt: skip


@pytest.mark.parametrize(
    "base,model_class",
    [
        (dict(BASE, model_type="llama"), LlamaForCausalLM),
        (dict(BASE, model_type="qwen2"), LlamaForCausalLM),
        (dict(BASE, model_type="qwen3"), LlamaForCausalLM),
        (dict(BASE, model_type="mistral"), LlamaForCausalLM),
        (GEMMA, GemmaForCausalLM),
        (GPT2, GPT2LMHeadModel),
        (MOE, MoeForCausalLM),
    ],
)
def test_every_family_scales_and_builds_its_own_class(base, model_class):
    rt = RayDistributedTrainer(
        base,
        config_scaling_variables={"hidden_size": 16, "num_attention_heads": 2},
        config_variables={"num_hidden_layers": 1},
    )
    assert rt.model_type == base["model_type"] and rt.model_task == "causal-lm"
    assert rt.model_class is model_class is classes_for(base["model_type"])[1]
    config = rt.create_config(2)
    assert type(config) is classes_for(base["model_type"])[0]
    assert (config.hidden_size, config.num_attention_heads) == (32, 4)
    model = rt.create_model_from_config(2)
    assert type(model) is model_class and model.config == config
    logits = model(np.ones((1, 4), np.int32))
    assert logits.shape == (1, 4, VOCAB)


def test_moe_scaling_moves_the_experts_size_and_a_gpt2_ignores_it():
    rt = RayDistributedTrainer(MOE)  # the default recipe (seed 003) scales moe sizes
    assert rt.CONFIG_SCALING_VARIABLES["moe_intermediate_size"] == 512
    rt = RayDistributedTrainer(
        MOE,
        config_scaling_variables={"moe_intermediate_size": 8, "intermediate_size": 24},
        config_variables={"num_experts": 2},
    )
    config = rt.create_config(3)
    assert (config.moe_intermediate_size, config.intermediate_size) == (24, 72)
    assert config.num_experts == 2
    model = rt.create_model_from_config(3)
    experts = model.model.layers[0].mlp.gate_up  # [E, D, 2, F]
    assert experts.shape[0] == 2 and 24 in experts.shape
    gpt2 = RayDistributedTrainer(GPT2, config_scaling_variables={
        "hidden_size": 8, "intermediate_size": 32, "moe_intermediate_size": 8,
        "num_key_value_heads": 1})  # fmt: skip
    config = gpt2.create_config(2)
    assert (config.hidden_size, config.intermediate_size) == (16, 64)
    assert not hasattr(config, "moe_intermediate_size")
    with pytest.raises(ArgumentError, match=r"config_scaling_variables\['experts'\]"):
        RayDistributedTrainer(MOE, config_scaling_variables={"experts": 2})


def test_model_task_and_model_class(tmp_path):
    with pytest.raises(ArgumentError, match="model_task='image-classification'.*causal-lm"):
        RayDistributedTrainer(BASE, model_task="image-classification").create_config(1)
    vit = RayDistributedTrainer(VIT, model_task="image-classification",
                                config_scaling_variables={"hidden_size": 16})  # fmt: skip
    assert vit.model_class is ViTForImageClassification
    assert type(vit.create_model_from_config(1)) is ViTForImageClassification
    rows = [{"pixel_values": np.zeros((1, 8, 8), np.float32), "labels": i % 3} for i in range(8)]
    trainer = vit.create_trainer(arguments(tmp_path / "vit", max_sequence_length=8), rows)
    assert isinstance(trainer, ImageClassificationTrainer)

    class Tagged(LlamaForCausalLM):
        pass

    rt = RayDistributedTrainer(BASE, model_class=Tagged)
    assert type(rt.create_model_from_config(1)) is Tagged


def test_create_trainer_is_the_trainer_the_job_runs(tmp_path):
    rt = RayDistributedTrainer(
        MOE,
        config_scaling_variables={"hidden_size": 16, "num_attention_heads": 2},
        config_variables={"sharding_axis_dims": (1, -1, 1, 1, 1), "seed": 3},
    )
    args = arguments(tmp_path / "run")
    trainer = rt.create_trainer(args, dataset(), scaling_index=2)
    assert type(trainer) is Trainer
    assert trainer.arguments.sharding_axis_dims == (1, -1, 1, 1, 1)
    assert trainer.dataset_train is not None
    state = trainer.create_state()
    model = trainer.model_from_state(state)
    assert type(model) is MoeForCausalLM and model.config == rt.create_config(2)
    same = rt.create_model_from_config(2)  # the recipe's seed: the same weights (the
    # trainer initialises under jit: the last float32 bit may differ)
    ours, theirs = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (model, same))
    for (path, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-6, err_msg=path)
    # a given state is where that trainer starts
    again = rt.create_trainer(args, dataset(), state=state, scaling_index=2)
    assert isinstance(again, Trainer) and type(again).__name__ == "Trainer"
    assert again.train().state.step == 1


def test_extract_column_names():
    names = RayDistributedTrainer.extract_column_names
    table = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    assert names(table) == ["text", "label"]
    assert names(datasets.DatasetDict(train=table)) == ["text", "label"]
    assert names(table.to_iterable_dataset()) == ["text", "label"]
    assert names({"input_ids": [[1, 2]], "labels": [[1, 2]]}) == ["input_ids", "labels"]
    assert names([{"prompt": "x", "chosen": "y"}]) == ["prompt", "chosen"]
    assert names([[1, 2, 3]]) is None and names([]) is None and names(None) is None


class Speaker:
    """A job that prints, as a Trainer's progress lines would."""

    def run(self, context):
        print(f"process {context.process_id} speaks")
        return context.process_id


def test_only_process_0_prints_and_no_colour_outside_a_terminal(capfd, monkeypatch):
    from ray import cloudpickle

    from jaxtrain.distributed.cluster import plain_output
    from jaxtrain.distributed.worker import ProcessActor

    payload = cloudpickle.dumps(Speaker())
    for process_id in (0, 1):  # one-process "clusters": nothing to join
        assert ProcessActor(process_id, 1, 0).run(payload, None, 1.0) == process_id
    out = capfd.readouterr().out
    assert "process 0 speaks" in out and "process 1 speaks" not in out
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    plain_output()  # pytest's captured stdout is no terminal
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
