"""DeltaSyncCallback's events without a trainer, and the TRL patch's version gate."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from delta_sync import DeltaSyncCallback, DeltaSyncConfig
from delta_sync.changes import Encoding
from delta_sync.control.client import PauseMode, ReplicaOptions
from delta_sync.trainer import trl_vllm
from delta_sync.trainer.publisher import PublisherOptions

from two_tower import TwoTower, train_step

VLLM_SERVER_ARGS = SimpleNamespace(use_vllm=True, vllm_mode="server")


class Owner:
    def __init__(self) -> None:
        self.generation = None
        self.syncs = 0

    def attach_vllm_generation(self, generation) -> None:
        self.generation = generation

    def sync_vllm_weights(self) -> None:
        self.syncs += 1


def test_on_log_adds_metrics_to_training_logs_only(tmp_path):
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = DeltaSyncCallback(bucket=str(tmp_path / "bucket"), background=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    sync.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    try:
        train_step(model, optimizer, seed=1)
        state.global_step = 1
        sync.on_step_end(args, state, control)

        evaluation = {"eval_loss": 1.0}
        sync.on_log(args, state, control, logs=evaluation)
        assert evaluation == {"eval_loss": 1.0}

        training = {"loss": 1.0}
        sync.on_log(args, state, control, logs=training)
        assert training["delta/version"] == 1 and 0.0 <= training["delta/sparsity"] <= 1.0
        assert training["delta/bytes"] == sync.reports[0].bytes_written

        # Nothing published since: the next log carries no delta metrics.
        later = {"loss": 0.5}
        sync.on_log(args, state, control, logs=later)
        assert later == {"loss": 0.5}
    finally:
        sync.on_train_end(args, state, control)


def test_trl_is_left_alone_unless_it_generates_through_a_vllm_server(monkeypatch, tmp_path):
    import trl

    monkeypatch.setattr(trl, "__version__", "0.1.0")
    sync = DeltaSyncCallback(bucket=str(tmp_path / "bucket"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    sync.on_init_end(args, TrainerState(), TrainerControl(), model=torch.nn.Linear(2, 2))
    with pytest.raises(ImportError, match="trl 0.1.0 is installed"):
        sync.on_init_end(VLLM_SERVER_ARGS, TrainerState(), TrainerControl(), model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0", "not-a-version"])
def test_the_trl_patch_refuses_other_releases(monkeypatch, version):
    import trl

    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(ImportError, match=re.escape(f"trl {version} is installed")) as error:
        trl_vllm.claim(torch.nn.Linear(2, 2), Owner())
    message = str(error.value)
    assert f"trl {version} is installed" in message
    assert trl_vllm.SUPPORTED_TRL in message and "pip install" in message


def test_a_claimed_generator_connects_without_nccl_and_syncs_through_its_owner(monkeypatch):
    import trl
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(trl, "__version__", "1.16.3")
    model, owner = torch.nn.Linear(2, 2), Owner()
    trl_vllm.claim(model, owner)
    # TRL's VLLMGeneration.__init__ calls _init_vllm on itself; a stand-in with the attributes it reads.
    generation = SimpleNamespace(model=model, mode="server", accelerator=SimpleNamespace(is_main_process=False))
    VLLMGeneration._init_vllm(generation)
    assert owner.generation is generation
    generation.sync_weights()
    assert owner.syncs == 1


def test_the_config_keeps_its_defaults_and_hands_on_typed_options():
    config = DeltaSyncConfig()
    assert (config.encoding, config.vllm_pause_mode) == ("raw", "keep")  # the documented defaults
    assert config.publisher_options == PublisherOptions()
    assert config.replica_options == ReplicaOptions()
    config = DeltaSyncConfig(
        anchor_every=5, encoding="compact", vllm_pause_mode="abort", vllm_request_timeout=9.0, vllm_token="t"
    )
    assert config.encoding is Encoding.COMPACT and config.vllm_pause_mode is PauseMode.ABORT
    assert config.publisher_options == PublisherOptions(anchor_every=5, encoding=Encoding.COMPACT)
    assert config.replica_options == ReplicaOptions(timeout=9.0, pause_mode=PauseMode.ABORT, token="t")
    assert DeltaSyncConfig(vllm_pause_mode=None).replica_options.pause_mode is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"anchor_every": 0}, "anchor_every must be >= 1, got 0"),
        ({"anchor_bytes_ratio": -1.0}, "anchor_bytes_ratio must be > 0 or None"),
        ({"encoding": "zip"}, "encoding must be 'raw' or 'compact', got 'zip'"),
        ({"vllm_pause_mode": "later"}, "pause_mode must be 'keep', 'wait', 'abort' or None, got 'later'"),
        ({"vllm_retry_seconds": -1.0}, "retry_seconds must be >= 0, got -1.0"),
        ({"vllm_request_timeout": 0.0}, "timeout must be > 0, got 0.0"),
    ],
)
def test_the_config_checks_every_option_when_made(options, match):
    with pytest.raises(ValueError, match=match):
        DeltaSyncConfig(**options)
    with pytest.raises(ValueError, match=match):
        DeltaSyncCallback(**options)
