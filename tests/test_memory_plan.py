"""Model FLOPs and MFU (agentrl.benchmarks.measure) and the memory plan (agentrl.benchmarks.memory_plan, issue 44
items 4 and 2): hand computations, PEFT's and transformers' own counts, DeepSpeed's own estimators."""

import dataclasses
import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.benchmarks import memory_plan as mp
from agentrl.benchmarks.measure import flops_per_token, matmul_peak, mfu, model_dims
from agentrl.sizing import matmul_parameters

DIMS = dict(
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
)


def recipe(**changes) -> mp.Recipe:
    """A full fine-tuning bf16 recipe of the DIMS model, no DeepSpeed, one process."""
    phase = mp.Phase(lora_r=None, lora_modules=(), batch=4, sequence=32, checkpointing=False, logits_tokens=32)
    base = mp.Recipe(
        name="tiny",
        dims=DIMS,
        device="gpu",
        precision="bf16",
        zero_stage=0,
        offload_optimizer=False,
        offload_params=False,
        processes=1,
        sft=phase,
        grpo=dataclasses.replace(phase, logits_tokens=16),
        generation_tokens=32,
        reference_model=False,
        vllm_share=0.0,
    )
    return dataclasses.replace(base, **changes)


def test_flops_per_token_of_a_known_config_equals_the_hand_computation():
    # per layer: q,o 2*8*(2*4) + k,v 2*8*(1*4) = 192; SwiGLU 3*8*16 = 384; 2 layers + LM head 100*8 -> N = 1952
    assert matmul_parameters(DIMS) == 1952
    attention = 4 * 2 * 10 * 2 * 4  # layers * context * heads * head_dim, Q.K^T and weights.V
    assert flops_per_token(DIMS, 10, "forward") == 2 * 1952 + attention
    assert flops_per_token(DIMS, 10, "train") == 6 * 1952 + 3 * attention
    assert flops_per_token(DIMS, 10, "train_frozen") == 4 * 1952 + 3 * attention
    with pytest.raises(ValueError, match="mode must be one of"):
        flops_per_token(DIMS, 10, "backward")


def test_matmul_parameters_are_the_linear_weights_of_transformers_qwen3():
    cfg = Qwen3Config(**DIMS, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(model_dims(cfg, "test")) == linear


def test_mfu_is_achieved_flops_over_the_peak():
    assert mfu(tokens_per_second=50.0, flops_per_token_=4e6, peak_flops_per_second=1e9) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="peak must be positive"):
        mfu(1.0, 1.0, 0.0)


def test_matmul_peak_times_a_gemm():
    peak = matmul_peak(size=64, repeats=3)
    assert peak["runs"] == 3 and peak["dtype"] == "float32" and peak["size"] == 64
    assert peak["min"] <= peak["flops_per_second"] <= peak["max"] and peak["flops_per_second"] > 0


def test_activation_bytes_of_a_tiny_batch_equal_the_hand_computation():
    phase = mp.Phase(None, (), batch=1, sequence=2, checkpointing=False, logits_tokens=2)
    # 4h + 4q + 4kv + 4i values per token, and keys and values repeated to both query heads (2q; kv 4 < q 8)
    per_layer = 4 * 8 + 4 * 8 + 4 * 4 + 4 * 16 + 2 * 8
    head = 8.25 * 2 * 100 * 4  # TRL's fused LM head on the CPU: 8.25 fp32 tiles of 2 scored tokens x 100 entries
    assert mp.activation_bytes(DIMS, phase, "bf16", "cpu") == 2 * 2 * per_layer * 2 + head
    checkpointed = dataclasses.replace(phase, checkpointing=True)
    # checkpointed: each layer's input, then the head's tiles or one recomputed layer, whichever is larger
    assert mp.activation_bytes(DIMS, checkpointed, "bf16", "cpu") == 2 * 2 * 8 * 2 + max(head, 2 * per_layer * 2)
    long = dataclasses.replace(checkpointed, sequence=200, logits_tokens=1)  # a layer outweighs 1 token's tiles
    assert mp.activation_bytes(DIMS, long, "bf16", "gpu") == 200 * 2 * 8 * 2 + 200 * per_layer * 2


def test_the_cpu_head_scores_every_position_and_a_gpus_only_the_labelled_ones():
    """TRL's fused head runs every position through the projection off Triton devices (GRPO's prompt too)."""
    phase = mp.Phase(None, (), batch=1, sequence=50, checkpointing=True, logits_tokens=5)
    kept = 50 * 2 * 8 * 2  # each layer's input
    assert mp.activation_bytes(DIMS, phase, "bf16", "cpu") == kept + mp.fused_head_bytes(DIMS, 50, "cpu")
    assert mp.activation_bytes(DIMS, phase, "bf16", "gpu") == kept + max(
        mp.fused_head_bytes(DIMS, 5, "gpu"), 50 * mp.layer_values_per_token(DIMS, phase) * 2
    )


def test_lora_dropout_keeps_each_adapters_copy_of_its_input():
    phase = mp.Phase(4, ("q_proj", "o_proj", "down_proj"), batch=1, sequence=2, checkpointing=False, logits_tokens=2)
    without = mp.layer_values_per_token(DIMS, phase)
    with_dropout = mp.layer_values_per_token(DIMS, dataclasses.replace(phase, lora_dropout=0.05))
    assert with_dropout - without == 8 + 8 + 16  # q_proj's input h, o_proj's q, down_proj's i


def test_recipe_reads_lora_dropout_from_params():
    tree = mp.load_tree(None)
    tree["sft"]["use_lora"] = True
    tree["sft"]["lora"]["lora_dropout"] = 0.125
    assert mp.recipe_from_params(tree, "t").sft.lora_dropout == 0.125


def test_fused_head_tiles_are_trls():
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    big = dict(DIMS, vocab_size=10 * _CHUNKED_LOGPROB_CHUNK_SIZE)
    tile = TOKEN_CHUNK_SIZE * _CHUNKED_LOGPROB_CHUNK_SIZE * 4
    assert mp.fused_head_bytes(big, 10 * TOKEN_CHUNK_SIZE, "gpu") == mp.FUSED_HEAD_TILES["gpu"] * tile


def test_zero2_plan_is_deepspeeds_estimate_plus_its_reduce_bucket_plus_the_activations():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    r = recipe(zero_stage=2, processes=2)
    deepspeed_gpu_bytes = estimate_zero2_model_states_mem_needs(1952, num_gpus_per_node=2, cpu_offload=False)[1]
    p = mp.plan(r)
    assert p["sft"]["model_states"] == deepspeed_gpu_bytes
    bucket = 500_000_000 * 2  # DeepSpeed's default reduce_bucket_size in bf16, reserved whole on a GPU
    assert p["sft"]["reduce_bucket"] == bucket
    assert p["sft"]["total"] == deepspeed_gpu_bytes + bucket + mp.activation_bytes(DIMS, r.sft, "bf16", "gpu")
    # on the CPU only the pages the gradients are written to count: the 1,952 trainable parameters' fp32 bytes
    assert mp.reduce_bucket_bytes(recipe(zero_stage=3, processes=2, device="cpu", precision="fp32"), r.sft) == 1952 * 4
    assert mp.reduce_bucket_bytes(recipe(), r.sft) == 0  # no DeepSpeed, no bucket


def test_zero3_lora_plan_is_deepspeeds_estimate_for_the_adapters_plus_the_frozen_share():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    lora = dataclasses.replace(recipe().sft, lora_r=2, lora_modules=("q_proj", "v_proj"))
    r = recipe(zero_stage=3, processes=2, sft=lora)
    adapters = 2 * 2 * ((8 + 8) + (8 + 4))  # layers * r * (in + out) of q_proj and v_proj
    estimate = estimate_zero3_model_states_mem_needs(adapters, 100 * 8, num_gpus_per_node=2, cpu_offload=False)[1]
    assert mp.model_state_bytes(r, lora) == 1952 * 2 // 2 + estimate


def test_lora_parameters_equal_peft_count():
    from peft import LoraConfig, get_peft_model

    model = Qwen3ForCausalLM(Qwen3Config(**DIMS, tie_word_embeddings=True))
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=modules))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert mp.lora_parameters(DIMS, 4, modules) == trainable
    with pytest.raises(ValueError, match="unknown module 'lm_head'"):
        mp.lora_parameters(DIMS, 4, ["lm_head"])


def test_zero3_shards_the_model_states_but_a_small_model_stays_gathered():
    """fp32: both sides hold 16 bytes per parameter, ZeRO-3 splits them. bf16 differs in kind: the plain trainer keeps
    weights, gradients and AdamW's moments in bf16 (8 bytes), DeepSpeed adds fp32 master weights and moments (18
    bytes, split): two processes are not enough to win, and the plan says so. What ZeRO-3 saves in states it gives
    back in training at DeepSpeed's defaults: a model under 1B parameters stays gathered from the second step."""
    alone, sharded = mp.plan(recipe(precision="fp32")), mp.plan(recipe(precision="fp32", zero_stage=3, processes=2))
    assert sharded["sft"]["model_states"] < alone["sft"]["model_states"]
    for phase in ("sft", "grpo"):  # less, but for DeepSpeed's reduce bucket and the gathered weights
        extra = sharded[phase]["reduce_bucket"] + sharded[phase]["gathered_weights"]
        assert sharded[phase]["total"] - extra < alone[phase]["total"]
    bf16_alone, bf16_zero3 = mp.plan(recipe()), mp.plan(recipe(zero_stage=3, processes=2))
    assert bf16_zero3["sft"]["model_states"] > bf16_alone["sft"]["model_states"]
    zero2 = mp.plan(recipe(zero_stage=2, processes=2))["sft"]
    assert bf16_zero3["sft"]["model_states"] < zero2["model_states"]
    assert (
        bf16_zero3["sft"]["total"]
        == zero2["total"]
        - zero2["model_states"]
        + bf16_zero3["sft"]["model_states"]
        + (bf16_zero3["sft"]["gathered_weights"])
    )


def test_a_missing_dim_names_it(tmp_path):
    tiny = {k: v for k, v in DIMS.items() if k != "head_dim"}
    with pytest.raises(ValueError, match="params model.tiny: model config has no 'head_dim'"):
        mp.dims_for({"base_model": "tiny", "tiny": tiny})
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in DIMS.items() if k != "num_key_value_heads"}))
    with pytest.raises(ValueError, match=r"config.json: model config has no 'num_key_value_heads'"):
        mp.dims_for({"base_model": str(tmp_path)})
    with pytest.raises(ValueError, match="'org/unknown-1B': no local config.json and not in KNOWN_ARCHITECTURES"):
        mp.dims_for({"base_model": "org/unknown-1B"})


def test_relative_error_against_measured_peaks():
    p = mp.plan(recipe())
    measured = {"sft": p["sft"]["total"] / 2, "grpo": p["grpo"]["total"] * 2}
    assert mp.relative_error(p, measured) == pytest.approx({"sft": 1.0, "grpo": -0.5})
    with pytest.raises(ValueError, match="measured phase 'eval' is not planned"):
        mp.relative_error(p, {"eval": 1.0})


def test_committed_recipe_reads_its_dims_zero_stage_and_vllm_share():
    r = mp.recipe_from_params(mp.load_tree(mp.ROOT / "configs/recipes/qwen3-0.6b-gsm8k.yaml"), "qwen3")
    assert r.dims == model_dims(mp.KNOWN_ARCHITECTURES["Qwen/Qwen3-0.6B"], "table")
    assert (r.precision, r.zero_stage, r.processes, r.vllm_share) == ("bf16", 2, 4, 0.3)
    assert r.sft.lora_r == 32 and r.sft.sequence == 1024 and r.grpo.logits_tokens == 512
    default = mp.recipe_from_params(mp.load_tree(None), "default", device="cpu")
    assert (default.precision, default.zero_stage, default.sft.lora_r) == ("fp32", 0, None)


def test_memory_plan_prints_every_recipe(capsys):
    mp.main([])
    out = capsys.readouterr().out
    assert "params.yaml:" in out and "configs/recipes/qwen3-0.6b-gsm8k.yaml:" in out
    assert "<- the recipe" in out and "GB GPU" in out


def test_zero3_gathers_whole_parameters_beside_each_shard():
    r = recipe(zero_stage=3, processes=4)
    weights = matmul_parameters(DIMS) * 2  # bf16, full size: the gathered tensor sits beside the shard
    assert mp.gathered_weights(r, training=False) == weights  # sampling: unwrap_model_for_generation gathers all
    assert mp.gathered_weights(r, training=True) == weights  # training: under DeepSpeed's 1e9 reuse distance
    p = mp.plan(r)["grpo"]
    states = p["model_states"] + p["reduce_bucket"]
    assert p["total"] == states + max(p["kv_cache"] + weights, p["activations"] + weights)
    assert mp.gathered_weights(dataclasses.replace(r, gather_for_generation=False), training=False) == 0
    assert mp.gathered_weights(recipe(zero_stage=2, processes=4), training=True) == 0
    tree = mp.load_tree(None)
    tree["grpo"]["trainer"]["ds3_gather_for_generation"] = False
    assert mp.recipe_from_params(tree, "t").gather_for_generation is False
    # DeepSpeed keeps at most max_live_parameters gathered: a model past it holds that many, not all
    big = dict(DIMS, vocab_size=1_000_000, hidden_size=2048)  # 2.05e9 embedding parameters
    assert mp.gathered_weights(recipe(zero_stage=3, processes=4, dims=big), training=True) == 1_000_000_000 * 2


def test_saving_under_deepspeed_copies_the_state_dict_into_host_memory():
    """accelerate's get_state_dict clones every tensor, the tied embedding once per key; on the CPU that copy is in
    the same memory as training, on a GPU it is host memory and not part of the GPU's peak."""
    copy = (matmul_parameters(DIMS) + 100 * 8) * 4  # fp32 state dict, embedding twice (embed_tokens and lm_head)
    cpu = recipe(
        zero_stage=2, processes=2, device="cpu", precision="fp32", sft=dataclasses.replace(recipe().sft, batch=1)
    )
    p = mp.plan(cpu)["sft"]
    assert p["saved_copy"] == copy
    assert p["total"] == p["model_states"] + p["reduce_bucket"] + max(p["activations"], copy)
    gpu = mp.plan(dataclasses.replace(cpu, device="gpu"))["sft"]
    assert gpu["total"] == gpu["model_states"] + gpu["reduce_bucket"] + gpu["activations"]
    assert mp.saved_copy_bytes(recipe()) == 0  # no DeepSpeed: the Trainer saves the adapter from the model


def test_the_plan_is_within_20_percent_of_every_training_row_of_the_rehearsal_on_file(capsys):
    """docs/rehearsal/gpu_check.json: `make rehearse`'s measured peaks (the 0.6B-sized stand-in on the CPU, single,
    ZeRO-2 and ZeRO-3 with 2 processes); the issue's bar for trusting the plan is +-20%."""
    on_file = mp.ROOT / "docs/rehearsal/gpu_check.json"
    rows = mp.against_run(on_file)
    assert {r["path"] for r in rows} == {
        "recipe: sft LoRA (single)",
        "recipe: grpo LoRA (single)",
        "zero2: sft LoRA",
        "zero2: grpo LoRA",
        "zero3: sft LoRA",
        "zero3: grpo LoRA",
    }
    assert all(abs(r["error"]) <= 0.2 for r in rows), [(r["path"], round(r["error"], 3)) for r in rows]
    assert mp.main(["--against", str(on_file)]) == 0
    assert mp.main(["--against", str(on_file), "--tolerance", "0.001"]) == 1  # the exit code follows the errors
    assert "largest error" in capsys.readouterr().out


def test_against_a_file_without_plan_inputs_names_it(tmp_path):
    bare = tmp_path / "gpu_check.json"
    bare.write_text(json.dumps({"header": [], "rows": [{"path": "x", "peak_rss_bytes": 1}]}))
    with pytest.raises(ValueError, match="no row has plan_inputs"):
        mp.against_run(bare)
