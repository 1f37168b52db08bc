"""DeltaSyncCallback's events without a trainer, and the TRL patch's version gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from delta_sync import DeltaSyncCallback
from delta_sync.trainer import trl_vllm

from conftest import TwoTower, train_step

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
    with pytest.raises(ImportError) as error:
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
