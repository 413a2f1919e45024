"""The streamed gather's grouping of a state dict (train.distributed.layer_groups): a decoder layer's tensors
travel together (the conversion back to checkpoint names is per layer), everything else alone, order kept."""

from qarl_cli.update.distributed import layer_groups


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


def test_converting_layer_by_layer_gives_the_whole_models_checkpoint_tensors(tmp_path):
    """The stream converts each layer group back to checkpoint names on its own (revert_weight_conversion per
    group): on the MoE model, whose experts transformers fuses per layer, that gives the same tensors under the same
    names as converting the whole state dict at once (select.checkpoint_state)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from qarl_cli.config.model import TinyMoEModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.quant.select import checkpoint_state

    path = ensure_tiny_model(TinyMoEModelConfig(cache_dir=str(tmp_path), warm_start_steps=0), log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    whole = checkpoint_state(model)
    state = model.state_dict()
    streamed = {}
    for names in layer_groups(list(state)):
        streamed.update(revert_weight_conversion(model, {n: state[n] for n in names}))
    assert any(".experts.0." in n for n in whole)  # the fused experts were split per expert
    assert streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[n], whole[n]) for n in whole)
