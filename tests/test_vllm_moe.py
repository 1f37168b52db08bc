"""A real `vllm serve` (CPU) of a tiny MoE checkpoint follows a bucket whose anchors and deltas
name the checkpoint's per-expert tensors, while transformers trains the fused ones: Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4.5, Qwen3-Next, PhiMoE (biases beside MoE layers)
and gpt-oss (experts vLLM's loader writes past its weight loaders). DeepSeek-V3 adds latent attention (vLLM
derives matrices from `kv_b_proj` after loading); it and GLM-4.5 keep a router bias that
transformers holds as a buffer, and keep their routers in float32: the bucket carries them
so, and the server that follows holds the router bias (float32 in vLLM too) as the saved
checkpoint's float32 bits.

The check needs no tolerance and no agreement between vLLM's MoE kernels and transformers':
the server that followed the bucket and a server started on `save_pretrained` of the trained
model, same flags, give the same greedy tokens and the same prompt logprobs.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from delta_sync import read_file

from vllm_server import PROMPT, TinyTrainer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


#: Attention as vLLM's CPU backend runs it (head_dim 64), shared by every row.
_ATTENTION = {"vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
_LAYERS = {"hidden_size": 128, "num_hidden_layers": 2, "tie_word_embeddings": False}

#: DeepSeek-V3's mixture of experts, as GLM-4.5 has it too: a dense first layer, then four
#: routed experts (two per token, one group) beside a shared one.
_DEEPSEEK_ROUTED = {
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}

#: Model type -> (config class, model class, arguments): four experts, two per token.
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (  # a shared expert, with its gate, beside the routed ones
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "mixtral": (  # `block_sparse_moe.experts.K.w1/w2/w3` in the checkpoint
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Multi-head latent attention (vLLM derives its absorbed matrices from `kv_b_proj` after
    # loading), a router score correction bias (a buffer in transformers), a dense first
    # layer and a shared expert. Sizes as vLLM's CPU MLA kernels take them (kv_lora_rank 512,
    # rope dims 64).
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_DEEPSEEK_ROUTED,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "num_key_value_heads": 2,
        },
    ),
    # GLM-4.5: DeepSeek-V3's router (score correction bias, dense first layer, shared expert)
    # with standard attention, half of each head rotary.
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        _DEEPSEEK_ROUTED,
    ),
    # Linear attention (a gated delta net) in the first layer, gated full attention in the
    # second; every layer a mixture of experts with a gated shared expert.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
        },
    ),
    "olmoe": (  # query and key norms over the whole projection
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    # Experts fused on disk too (gate and up interleaved), with biases; attention sinks; vLLM's
    # loader writes all of these with `param.copy_`, past the weight loaders its reload counts.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "granitemoe": (  # a router without bias, logits and residuals scaled by the config
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Biases on the attention projections, the layer norms and lm_head (vLLM's PhiMoE always
    # builds them), and a sparse-mixer router.
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        {
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "attention_bias": True,
            "lm_head_bias": True,
        },
    ),
}
#: vLLM's name for a family's architecture where it differs from the one transformers saves.
VLLM_ARCHITECTURES = {"phimoe": "PhiMoEForCausalLM"}
#: Server options a row needs: vLLM's CPU kernels for latent attention (MLA) and for the gated
#: delta net take bf16 only.
SERVER_OPTIONS = {
    "deepseek_v3": {"dtype": "bfloat16"},
    "qwen3_next": {"dtype": "bfloat16"},
    "gpt_oss": {"dtype": "bfloat16"},  # vLLM's CPU backend serves gpt-oss's sinks attention in bf16
}
#: The router tensors vLLM holds in float32 (as transformers does) that `/weight_checker` reads
#: back: the score correction bias. GLM-4.5's router weight is float32 in vLLM too, but its CPU
#: backend packs linear layers' weights for its GEMM, which then read back empty (the greedy
#: tokens and logprobs against the fresh server cover it); vLLM 0.32 holds DeepSeek-V3's router
#: weight in the model's dtype, rounding the saved float32 one as it loads it.
SERVED_IN_FLOAT32 = {
    "deepseek_v3": ("mlp.gate.e_score_correction_bias",),
    "glm4_moe": ("mlp.gate.e_score_correction_bias",),
}


def build_checkpoint(family: str, path):
    """A tiny MoE checkpoint of `family` at `path` (what save_pretrained writes: one tensor
    per expert) and its tokenizer."""
    import transformers

    from tiny_model import build_tokenizer

    config_class, model_class, arguments = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**_LAYERS, **_ATTENTION, **arguments})
    getattr(transformers, model_class)(config).to(torch.bfloat16).save_pretrained(path)
    if family in VLLM_ARCHITECTURES:
        saved = json.loads((path / "config.json").read_text())
        saved["architectures"] = [VLLM_ARCHITECTURES[family]]
        (path / "config.json").write_text(json.dumps(saved, indent=2))
    build_tokenizer(512).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_model(request, tmp_path_factory):
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-model"))


#: The rows also run on two tensor-parallel CPU workers: experts sliced on every worker, and
#: latent attention's `kv_b_proj` split by heads.
TENSOR_PARALLEL = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module", params=TENSOR_PARALLEL)
def tensor_parallel_model(request, tmp_path_factory):
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-tp-model"))


def test_a_server_following_per_expert_deltas_serves_the_saved_checkpoint(moe_model, bucket_root, tmp_path):
    family, model = moe_model
    follow_then_compare(
        model,
        bucket_root,
        tmp_path,
        served_in_float32=SERVED_IN_FLOAT32.get(family, ()),
        **SERVER_OPTIONS.get(family, {}),
    )


@pytest.mark.timeout(2400)
def test_a_tensor_parallel_server_following_per_expert_deltas_serves_the_saved_checkpoint(
    tensor_parallel_model, bucket_root, tmp_path
):
    """Two CPU workers, each holding a slice of every expert, both mapping the one node
    snapshot. (Expert parallelism is not run: vLLM 0.32's CPU MoE kernel crashes on the first
    request of a server started with `--enable-expert-parallel`, without this extension.)"""
    family, model = tensor_parallel_model
    follow_then_compare(
        model,
        bucket_root,
        tmp_path,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        extra_args=["--tensor-parallel-size", "2"],
        served_in_float32=SERVED_IN_FLOAT32.get(family, ()),
        **SERVER_OPTIONS.get(family, {}),
    )


def follow_then_compare(model, bucket_root, tmp_path, served_in_float32: tuple[str, ...] = (), **options) -> None:
    """A server on `model` follows a bucket the trainer publishes (anchors, deltas, then a
    delta of one expert); its greedy tokens and prompt logprobs must equal those of a server
    started, with the same `options`, on `save_pretrained` of the trained model, and the
    tensors it holds in float32 of those named `served_in_float32` (name suffixes) the saved
    checkpoint's float32 bits.

    The two servers start while other work goes on (the follower while the trainer trains,
    the fresh one while the follower follows): a start is mostly one process importing
    Python, which leaves the other core free."""
    from transformers import AutoTokenizer

    from vllm_server import VLLMServer, server_in

    def server(checkpoint, name: str) -> VLLMServer:
        (tmp_path / name).mkdir()
        # Prefetch on hints only: every version is in the bucket before the follower takes the
        # first, and a prefetch of the newest would move the node snapshot past the versions
        # posted after it (tensor-parallel workers share it).
        extra_env = {"DELTA_SYNC_PREFETCH": "3600", **options.get("extra_env", {})}
        return server_in(
            tmp_path / name, checkpoint, allowed_buckets=bucket_root.as_uri(), **{**options, "extra_env": extra_env}
        )

    follower, fresh = server(model, "follower").launch(), None
    # Every version is published before the follower takes the first: none may be pruned.
    trainer = TinyTrainer(model, bucket_root / tmp_path.name, lr=1e-3, keep_anchors=10)
    try:
        routers = sorted(trainer.detector.float32)  # DeepSeek-V3's and GLM-4.5's, kept in float32
        balance_routers(trainer.model, routers, seed=1)
        published = []
        for step in range(4):
            if step == 2:  # between two deltas: no optimizer step moves it (a buffer)
                balance_routers(trainer.model, routers, seed=2)
            trainer.step()
            published.append(trainer.publisher.reports[-1])
        # A delta of one expert: the server must rebuild that layer from all its experts.
        fused = next(name for name, _ in trainer.model.named_parameters() if name.endswith("experts.gate_up_proj"))
        with torch.no_grad():
            trainer.model.get_parameter(fused)[0].mul_(-1.5)
        trainer.detector.mark_changed([fused])
        trainer.publish()
        one_expert = trainer.publisher.reports[-1]
        changed = read_file(trainer.publisher.bucket.local_path(one_expert.delta)).changes
        checkpoint = trainer.detector.checkpoint.shapes
        per_expert = any(".experts.0." in name for name in checkpoint)
        if per_expert:  # one tensor per expert in the checkpoint: only expert 0's changed
            assert changed and all(".experts.0." in name for name in changed), sorted(changed)
            assert not any(name.endswith("gate_up_proj") for name in checkpoint)
        else:  # every expert in one checkpoint tensor (GraniteMoE's `input_linear` on disk)
            assert list(changed) == trainer.detector.checkpoint.checkpoint_names(fused), sorted(changed)
        (layer,) = {_experts_of(name) for name in changed}
        saved = tmp_path / "saved"
        trainer.save_published(saved)  # the routers DeepSeek-V3 and GLM-4.5 keep in float32, unrounded
        AutoTokenizer.from_pretrained(model).save_pretrained(saved)
        served_as = json.loads((model / "config.json").read_text())["architectures"]
        config = json.loads((saved / "config.json").read_text())
        (saved / "config.json").write_text(json.dumps({**config, "architectures": served_as}, indent=2))
        fresh = server(saved, "fresh").launch()

        follower.wait_healthy()
        for version, report in enumerate(published, start=1):
            response = follower.update(trainer.bucket, report.delta or report.anchor)
            assert response.status_code == 200, response.text
            for status in follower.rpc("delta_sync_status"):
                assert status["version"] == version and status["model_checksum"] == report.model_checksum
        assert follower.update(trainer.bucket, one_expert.delta).status_code == 200
        for status in follower.rpc("delta_sync_status"):
            assert status["model_checksum"] == one_expert.model_checksum
        followed = follower.greedy(PROMPT), follower.prompt_logprobs(PROMPT)
        # The layer was reloaded with all its experts' tensors (four experts, three
        # projections), not only the changed ones.
        loads = re.findall(r"reloaded (\d+) whole", follower.log_tail(10**9))
        group = [name for name in checkpoint if _experts_of(name) == layer]
        assert loads and loads[-1] == str(len(group)), (loads, group)

        if served_in_float32:
            saved_names = [name for router in routers for name in trainer.detector.checkpoint.checkpoint_names(router)]
            assert_served_unrounded(follower, saved, [name for name in saved_names if name.endswith(served_in_float32)])

        fresh.wait_healthy()
        assert (fresh.greedy(PROMPT), fresh.prompt_logprobs(PROMPT)) == followed
    finally:
        trainer.close()
        for started in (follower, fresh):
            if started is not None:
                started.stop()


def balance_routers(model, routers: list[str], seed: int) -> None:
    """Move the score correction biases among `routers` off zero and off the bf16 grid, by
    hand, as auxiliary-loss-free load balancing does."""
    weights = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name in routers:
            if name.endswith("e_score_correction_bias"):
                shape = weights[name].shape
                weights[name].copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-3)


def assert_served_unrounded(server, saved, names: list[str]) -> None:
    """The server holds the tensors `names` as the saved checkpoint's float32 bits (vLLM's
    `/weight_checker` hashes a parameter's bytes in its own dtype), and they are float32,
    non-zero and off the bf16 grid there (so a bf16 rounding anywhere on the way shows)."""
    from safetensors.torch import load_file

    assert names, "no tensor the server holds in float32 to check"
    checkpoint = load_file(str(saved / "model.safetensors"))
    served = server.weight_checksums()
    for name in names:
        tensor = checkpoint[name]
        assert tensor.dtype == torch.float32, f"{name} is saved as {tensor.dtype}"
        assert tensor.count_nonzero() > 0, f"{name} is zero"
        assert not torch.equal(tensor, tensor.to(torch.bfloat16).float()), f"{name} lies on the bf16 grid"
        digest = hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        assert served[name] == digest, f"{name}: the server holds other bits than the saved float32 tensor"


def _experts_of(name: str) -> str | None:
    """The MoE layer (`...experts`, GraniteMoE's `...block_sparse_moe`) a checkpoint tensor of
    its experts belongs to."""
    match = re.match(r"(.+\.experts)\.|(.+\.block_sparse_moe)\.(?:input|output)_linear\.", name)
    return (match.group(1) or match.group(2)) if match else None
