"""A real `vllm serve` (CPU) of a tiny Qwen3-MoE checkpoint follows a bucket whose anchors and
deltas name the checkpoint's per-expert tensors, while transformers trains the fused ones.

The check needs no tolerance and no agreement between vLLM's MoE kernels and transformers':
the server that followed the bucket and a server started on `save_pretrained` of the trained
model, same flags, give the same greedy tokens and the same prompt logprobs.
"""

from __future__ import annotations

import pytest
import torch

from test_vllm import PROMPT, TinyTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (what save_pretrained writes: one tensor per expert) and
    its tokenizer."""
    from tiny_model import build_tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("moe-model")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    build_tokenizer(512).save_pretrained(path)
    return path


@pytest.mark.xfail(
    strict=True,
    reason="vLLM side of fused MoE experts: the bucket holds the checkpoint bit for bit (tests/test_checkpoint_layout.py), "
    "but vllm_ext reloads the per-expert tensors into vLLM's fused CPU MoE layer inexactly: the follower's prompt "
    "logprobs differ from a server started on the saved checkpoint already after the first anchor",
)
def test_a_server_following_per_expert_deltas_serves_the_saved_checkpoint(moe_model, bucket_root, tmp_path):
    from transformers import AutoTokenizer

    from vllm_server import serving

    trainer = TinyTrainer(moe_model, bucket_root / "moe", lr=1e-3)
    for logs in ("follower", "fresh"):
        (tmp_path / logs).mkdir()
    try:
        with serving(moe_model, tmp_path / "follower", allowed_buckets=bucket_root.as_uri()) as follower:
            for _ in range(4):
                version = trainer.step()
                report = trainer.publisher.reports[-1]
                response = follower.update(trainer.bucket, report.delta or report.anchor)
                assert response.status_code == 200, response.text
                status = follower.status()
                assert status["version"] == version and status["model_checksum"] == report.model_checksum
            followed = follower.greedy(PROMPT), follower.prompt_logprobs(PROMPT)
        assert any(".mlp.experts.0." in name for name in trainer.detector.checkpoint.shapes)
        saved = tmp_path / "saved"
        trainer.model.to(torch.bfloat16).save_pretrained(saved)
        AutoTokenizer.from_pretrained(moe_model).save_pretrained(saved)
        with serving(saved, tmp_path / "fresh", allowed_buckets=bucket_root.as_uri()) as fresh:
            assert (fresh.greedy(PROMPT), fresh.prompt_logprobs(PROMPT)) == followed
    finally:
        trainer.close()
