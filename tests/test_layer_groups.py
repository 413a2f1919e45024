"""The streamed gather's grouping of a state dict (train.distributed.layer_groups): a decoder layer's tensors
travel together (the conversion back to checkpoint names is per layer), everything else alone, order kept."""

from qarl_cli.train.distributed import layer_groups


def test_a_layer_is_one_group_and_the_rest_stand_alone():
    names = ["model.embed_tokens.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
             "model.layers.1.input_layernorm.weight", "model.layers.10.self_attn.k_proj.weight",
             "model.layers.1.mlp.down_proj.weight",  # out of order: still layer 1's group, not layer 10's
             "model.norm.weight", "lm_head.weight"]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"],
        ["model.layers.1.input_layernorm.weight", "model.layers.1.mlp.down_proj.weight"],
        ["model.layers.10.self_attn.k_proj.weight"],
        ["model.norm.weight"], ["lm_head.weight"]]


def test_every_name_is_in_exactly_one_group():
    names = [f"model.layers.{i}.w{j}" for i in range(12) for j in range(3)] + ["model.norm.weight"]
    flat = [n for g in layer_groups(names) for n in g]
    assert sorted(flat) == sorted(names) and len(layer_groups(names)) == 13
