"""The compact encoding end to end: published, replayed bit-exactly, checked, and refused when damaged."""

from __future__ import annotations

import pytest
import torch

from delta_sync import BF16ChangeDetector, Publisher, Receiver, read_file, verify_bucket
from delta_sync.errors import FormatError
from delta_sync.layout import anchor_path, delta_path

from helpers import bf16_bits
from two_tower import TwoTower, bf16_state, train_step


def publish(root, encoding: str, versions: int = 5):
    torch.manual_seed(0)
    model = TwoTower(torch.float32)  # fp32 masters, bf16 published
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(root, BF16ChangeDetector(model, optimizer), anchor_every=3, encoding=encoding)
    states = {}
    for version in range(1, versions + 1):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
        publisher.flush()
        states[version] = bf16_state(model)
    publisher.close()
    return states, publisher.reports


def test_compact_deltas_replay_bit_exactly_and_are_smaller(tmp_path):
    states, compact = publish(tmp_path / "compact", "compact")
    _, raw = publish(tmp_path / "raw", "raw")
    for version in range(2, 6):
        with read_file(tmp_path / "compact" / delta_path(version)) as delta:
            assert delta.header.encoding == "compact" and delta.encoded
    assert sum(r.delta_bytes for r in compact) * 2 < sum(r.delta_bytes for r in raw)
    receiver = Receiver()
    receiver.update(tmp_path / "compact", anchor_path(1))
    for version in range(2, 6):
        assert receiver.update(tmp_path / "compact", delta_path(version)).version == version
        for name, tensor in states[version].items():
            assert torch.equal(bf16_bits(tensor), bf16_bits(receiver.weights[name])), (version, name)
    assert verify_bucket(str(tmp_path / "compact")).ok


def test_a_damaged_compact_delta_changes_nothing(tmp_path):
    publish(tmp_path, "compact")
    receiver = Receiver()
    receiver.update(tmp_path, anchor_path(1))
    receiver.update(tmp_path, delta_path(2))
    before = {name: bf16_bits(t).clone() for name, t in receiver.weights.items()}
    path = tmp_path / delta_path(3)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"deltas/step_00000003\.safetensors: payload digest .* does not match"):
        receiver.update(tmp_path, delta_path(3))
    assert receiver.version == 2
    for name, tensor in before.items():
        assert torch.equal(tensor, bf16_bits(receiver.weights[name]))


@pytest.mark.slow
def test_the_example_trains_with_the_compact_encoding(tmp_path):
    import re
    import subprocess
    import sys

    from helpers import REPO

    example = REPO / "examples" / "grpo_delta_sync.py"
    bucket = tmp_path / "deltas"
    result = subprocess.run(
        [sys.executable, str(example), "--bucket", str(bucket), "--steps", "4", "--encoding", "compact"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert re.search(r"replica bit-exact\s+yes", result.stdout)
    with read_file(bucket / delta_path(2)) as delta:
        assert delta.header.encoding == "compact"
    assert verify_bucket(str(bucket)).ok


def test_inspect_decodes_a_compact_delta_as_a_raw_one(tmp_path):
    import json

    from helpers import cli

    publish(tmp_path / "compact", "compact")
    publish(tmp_path / "raw", "raw")

    def decoded(root):
        result = cli("inspect", str(root / delta_path(3)), "--decode")
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    compact, raw = decoded(tmp_path / "compact"), decoded(tmp_path / "raw")
    assert compact and [c["name"] for c in compact] == [r["name"] for r in raw]
    for c, r in zip(compact, raw):
        assert c["indices"] == r["indices"]
        assert torch.equal(torch.tensor(c["values"]).to(torch.bfloat16), torch.tensor(r["values"]).to(torch.bfloat16))
