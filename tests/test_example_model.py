"""The main example trains a checkpoint given with `--model` (here a local directory) instead of
its built-in model: a matrix of tiny random-init checkpoints of several families, written by
`save_pretrained` (nothing downloaded). On transformers 5 a mixture of experts keeps its experts
fused at run time where its checkpoint has one tensor per expert; the bucket holds the
checkpoint's tensors, and the example compares them with `save_pretrained` of the trained model."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import raw_bits

#: Tiny and fast: two layers of width 128, two attention heads of 64 sharing one KV head,
#: four experts (two per token) in a mixture of experts.
_WIDTH = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
_EXPERTS = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}


def _qwen3(transformers, **common):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=256, **common))


def _llama(transformers, **common):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=256, **common))


def _gemma3_text(transformers, **common):
    """Its input and output embeddings are tied, as Gemma3's are by default."""
    config = transformers.Gemma3TextConfig(intermediate_size=256, **common | {"tie_word_embeddings": True})
    return transformers.Gemma3ForCausalLM(config)


def _qwen3_moe(transformers, **common):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(intermediate_size=256, **_EXPERTS, **common))


def _qwen2_moe(transformers, **common):
    """With a shared expert beside the routed ones."""
    config = transformers.Qwen2MoeConfig(
        intermediate_size=256, shared_expert_intermediate_size=128, **_EXPERTS, **common
    )
    return transformers.Qwen2MoeForCausalLM(config)


def _mixtral(transformers, **common):
    """Its checkpoint names the experts' block otherwise (`block_sparse_moe.experts.{e}.w1`)."""
    config = transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common)
    return transformers.MixtralForCausalLM(config)


def _olmoe(transformers, **common):
    return transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2, **common)
    )


def _deepseek_v3(transformers, **common):
    """Latent attention, a dense first layer, a shared expert, and a router score correction
    bias that transformers keeps as a buffer (the checkpoint holds it)."""
    config = transformers.DeepseekV3Config(
        intermediate_size=256, moe_intermediate_size=64, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=128,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, **common | {"num_key_value_heads": 2},
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


def _glm4_moe(transformers, **common):
    """GLM-4.5: DeepSeek-V3's router and shared expert with standard attention."""
    config = transformers.Glm4MoeConfig(
        intermediate_size=256, moe_intermediate_size=64, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, **common,
    )  # fmt: skip
    return transformers.Glm4MoeForCausalLM(config)


def _qwen3_next(transformers, **common):
    """Linear attention (a gated delta net) in the first layer, gated full attention in the second."""
    config = transformers.Qwen3NextConfig(
        intermediate_size=256, shared_expert_intermediate_size=128, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=64, linear_value_head_dim=64,
        **_EXPERTS, **common,
    )  # fmt: skip
    return transformers.Qwen3NextForCausalLM(config)


def _gpt_oss(transformers, **common):
    """Experts fused, gate and up interleaved, at run time and in the checkpoint alike (no
    conversion); attention sinks; sliding and full attention layers."""
    config = transformers.GptOssConfig(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], **common,
    )  # fmt: skip
    return transformers.GptOssForCausalLM(config)


#: family -> (builder, a tensor of its checkpoint that the run-time model does not have by that name, if any)
FAMILIES: dict[str, tuple[Callable, str | None]] = {
    "qwen3": (_qwen3, None),
    "llama": (_llama, None),
    "gemma3_text": (_gemma3_text, None),
    "qwen3_moe": (_qwen3_moe, "model.layers.1.mlp.experts.3.down_proj.weight"),
    "qwen2_moe": (_qwen2_moe, "model.layers.1.mlp.experts.3.down_proj.weight"),
    "mixtral": (_mixtral, "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    "olmoe": (_olmoe, "model.layers.1.mlp.experts.3.down_proj.weight"),
    "deepseek_v3": (_deepseek_v3, "model.layers.1.mlp.gate.e_score_correction_bias"),
    "glm4_moe": (_glm4_moe, "model.layers.1.mlp.experts.3.down_proj.weight"),
    "qwen3_next": (_qwen3_next, "model.layers.1.mlp.experts.3.down_proj.weight"),
    "gpt_oss": (_gpt_oss, None),
}
ROWS = [
    pytest.param(family, encoding, id=f"{family}-{encoding}") for family in FAMILIES for encoding in ("raw", "compact")
]


class Checkpoints:
    """Each family's tiny checkpoint, written by `save_pretrained` on first use (fp32, with the
    tokenizer), shared by the rows that train it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tokenizer = None
        self._paths: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self._paths:
            transformers = pytest.importorskip("transformers")
            from tiny_model import build_tokenizer

            if self._tokenizer is None:
                self._tokenizer = build_tokenizer()
            tokenizer = self._tokenizer
            build, per_expert = FAMILIES[family]
            torch.manual_seed(3)
            model = build(
                transformers,
                **_WIDTH,
                head_dim=64,
                vocab_size=len(tokenizer),
                tie_word_embeddings=False,
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            path = self.root / family
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            if per_expert is not None:
                # One tensor per expert in the checkpoint, fused into one per layer at run time
                # by transformers 5 (transformers 4 keeps the checkpoint's tensors).
                assert per_expert in load_file(str(path / "model.safetensors"))
                if int(transformers.__version__.split(".")[0]) >= 5:
                    assert per_expert not in dict(model.named_parameters())
            self._paths[family] = path
        return self._paths[family]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


def test_model_and_base_model_dir_exclude_each_other(capsys):
    from grpo_delta_sync import parse_args

    assert parse_args(["--model", "./checkpoint"]).model == "./checkpoint"
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
        parse_args(["--model", "./checkpoint", "--base-model-dir", "./base-model"])
    assert "not allowed with argument" in capsys.readouterr().err


def run_example(checkpoint: Path, bucket: Path, cwd: Path, capsys, encoding: str = "raw") -> str:
    """Runs the example's `main` on `checkpoint` for three steps (anchors at v1 and v3); what it
    printed. In this process: the rows share its imports (the example as a script is run by
    tests/test_readme.py and tests/test_fleet.py)."""
    from grpo_delta_sync import main

    args = ["--model", str(checkpoint), "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2"]
    args += ["--encoding", encoding, "--output-dir", str(cwd / "trainer")]
    capsys.readouterr()
    status = main(args)
    output = capsys.readouterr().out
    assert status == 0, output[-6000:]
    assert re.search(r"replica checks\s+3\n", output), output[-3000:]
    assert re.search(r"replica bit-exact\s+yes", output), output[-3000:]
    return output


def assert_bucket_verifies(bucket: Path) -> None:
    from delta_sync import verify_bucket

    report = verify_bucket(str(bucket))
    assert report.ok, report
    assert (report.latest_version, report.replayed_version) == (3, 3), report


def replay(bucket: Path, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket's last version, as a replica that joins now replays it (the checkpoint's names
    and shapes expected)."""
    from delta_sync import Receiver

    joiner = Receiver(load_weights=lambda weights: None, expected_shapes={name: t.shape for name, t in saved.items()})
    joiner.update(bucket)
    assert joiner.version == 3
    return {name: tensor.clone() for name, tensor in joiner.weights.items()}


def assert_loads_as_its_checkpoint(replayed: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """The replayed tensors are a checkpoint transformers loads with nothing missing, unexpected
    or mismatched, and saves back unchanged, name for name and bit for bit."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="replayed-") as directory:
        (Path(directory) / "config.json").write_text((checkpoint / "config.json").read_text())
        save_file(replayed, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        model.save_pretrained(Path(directory) / "again")
        again = load_file(str(Path(directory) / "again" / "model.safetensors"))
    assert sorted(again) == sorted(replayed)
    for name, tensor in replayed.items():
        # transformers keeps some tensors in float32 whatever it loads (DeepSeek-V3's router),
        # as the bucket carries them.
        assert again[name].dtype == tensor.dtype, name
        assert torch.equal(raw_bits(again[name]), raw_bits(tensor)), f"{name} differs"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "encoding"), ROWS)
def test_the_example_trains_a_checkpoint_and_its_bucket_is_save_pretrained(
    family, encoding, checkpoints, tmp_path, capsys
):
    checkpoint = checkpoints[family]
    saved = load_file(str(checkpoint / "model.safetensors"))
    bucket = tmp_path / "deltas"
    output = run_example(checkpoint, bucket, tmp_path, capsys, encoding)
    # The checkpoint's size, not the built-in model's: the table shows which model was trained.
    parameters = sum(tensor.numel() for tensor in saved.values())
    assert re.search(rf"full bf16 model\s+{2 * parameters:,} bytes", output), output[-3000:]
    assert re.search(
        rf"bucket = save_pretrained\s+yes \({len(saved)} tensors: names, shapes and bf16 bits"
        rf"(, float32 for the \d+ the model keeps in float32)?\)",
        output,
    ), output[-3000:]
    assert_bucket_verifies(bucket)

    # The deltas are in the encoding asked for, and name the checkpoint's tensors.
    for path in sorted((bucket / "deltas").glob("*.safetensors")):
        with safe_open(str(path), "pt") as delta:
            metadata = delta.metadata()
        assert metadata["encoding"] == encoding, path.name
        assert set(json.loads(metadata["changed_params"])) <= set(saved), path.name

    # A replica that joins now replays the checkpoint's own names and shapes, in bf16.
    replayed = replay(bucket, saved)
    assert {name: tuple(t.shape) for name, t in replayed.items()} == {name: tuple(t.shape) for name, t in saved.items()}
    # bf16, but what the model keeps in float32 (DeepSeek-V3's and GLM-4.5's routers), unrounded.
    float32 = {name for name, tensor in replayed.items() if tensor.dtype == torch.float32}
    assert all(tensor.dtype in (torch.bfloat16, torch.float32) for tensor in replayed.values())
    routers = {name for name in saved if name.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    assert float32 == (routers if family in ("deepseek_v3", "glm4_moe") else set()), float32
    # Training moved weights away from the checkpoint (its rounding, as published).
    moved = [
        name
        for name, tensor in saved.items()
        if not torch.equal(raw_bits(tensor.to(replayed[name].dtype)), raw_bits(replayed[name]))
    ]
    assert moved, "no tensor changed in three steps"
    assert_loads_as_its_checkpoint(replayed, checkpoint)
