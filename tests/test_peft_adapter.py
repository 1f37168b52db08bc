"""Adapter mode: a PEFT LoRA model is published as its adapter, in peft's own format, one
whole signed version at a time; a real CPU `vllm serve --enable-lora` on the base
checkpoint loads each version in place under one name and generates through it."""

from __future__ import annotations

import copy
import json
import shutil

import peft
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback

from delta_sync import DeltaSyncCallback, DeltaSyncConfig, Receiver
from delta_sync.control import AdapterStatus
from delta_sync.control.client import Replica, ReplicaOptions
from delta_sync.errors import FormatError, ReplicaError, SignatureError, UnservableModelError
from delta_sync.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LATEST, Latest, adapter_dir
from delta_sync.replica.adapter import AdapterFetcher
from delta_sync.replica.follow import Follower
from delta_sync.replica.verify import verify_bucket
from delta_sync.signing import BUCKET_ID_ENV, SIGNATURE_SUFFIX, SigningKey
from delta_sync.storage.cache import DownloadCache
from delta_sync.trainer.adapter import AdapterPublisher, PeftPublish
from delta_sync.trainer.publisher import PublisherOptions

from helpers import raw_bits
from tiny_model import build_tiny_model
from trainers import grpo_trainer

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
ADAPTER_NAME = "policy"


def assert_same_adapter(expected: nn.Module, actual: nn.Module) -> None:
    """Same LoRA weights under the same names, in the same dtype, bit for bit."""
    ours, theirs = get_peft_model_state_dict(expected), get_peft_model_state_dict(actual)
    assert sorted(ours) == sorted(theirs) and ours
    assert {name: t.dtype for name, t in ours.items()} == {name: t.dtype for name, t in theirs.items()}
    differing = [name for name in ours if not torch.equal(raw_bits(ours[name]), raw_bits(theirs[name]))]
    assert not differing, f"differ from the trainer's adapter: {differing}"


#: The name signed statements give the buckets of the fetcher tests, so that a copy of
#: one (tampered with) is the same bucket to the replica.
BUCKET_ID = "adapter-run"


def fetcher(tmp_path, key: SigningKey | None, bucket_id: str | None = None) -> AdapterFetcher:
    """What a replica fetches adapters with: a receiver's trust settings, a verify key."""
    verify_key = None if key is None else key.verify_key
    return AdapterFetcher(
        Receiver(cache=DownloadCache(tmp_path / "replica-cache"), verify_key=verify_key, bucket_id=bucket_id)
    )


def lora_model(base: nn.Module | None = None, **options) -> nn.Module:
    if base is None:
        base, _ = build_tiny_model(dtype=torch.float32)
    return peft.get_peft_model(base, peft.LoraConfig(**LORA), **options)


def train_steps(model: nn.Module, optimizer, steps: int, seed: int) -> None:
    for step in range(steps):
        tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(seed + step))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# -- (a) publishing from a real training loop ---------------------------------------------------


class AdapterReplica(TrainerCallback):
    """After every version: fetches it as a replica would (signatures checked), loads it
    with peft onto a fresh base model, and compares it with the trainer's adapter."""

    def __init__(self, sync: DeltaSyncCallback, bucket, fetch: AdapterFetcher) -> None:
        self.sync, self.bucket, self.fetch = sync, bucket, fetch
        self.checked: list[int] = []

    def check(self, model: nn.Module, version: int) -> None:
        self.sync.publisher.flush()
        fetched = self.fetch.fetch(self.bucket)
        assert fetched.version == version
        base, _ = build_tiny_model(dtype=torch.float32, seed=99)  # other base weights: only the adapter is read
        assert_same_adapter(model, peft.PeftModel.from_pretrained(base, fetched.path))
        self.checked.append(version)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check(model, 0)  # the adapter as training starts: what the first generation uses

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.check(model, state.global_step)


@pytest.mark.slow
def test_grpo_with_lora_publishes_each_version_as_the_trainers_adapter(tmp_path):
    key = SigningKey.generate()
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), peft_publish="adapter", signing_key=key_file(tmp_path, key))
    replica = AdapterReplica(sync, bucket, fetcher(tmp_path, key))
    trainer = grpo_trainer(tmp_path, [sync, replica], steps=3, learning_rate=1e-2, peft_config=peft.LoraConfig(**LORA))
    trainer.train()
    assert replica.checked == [0, 1, 2, 3]
    assert [report.kind for report in sync.reports] == ["adapter"] * 4
    # Whole adapters in peft's format, signed, and nothing of the merged-mode layout.
    for version in (2, 3):  # retention keeps the newest two (keep_anchors)
        directory = bucket / adapter_dir(version)
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_CONFIG + SIGNATURE_SUFFIX, ADAPTER_WEIGHTS + SIGNATURE_SUFFIX]
        )
    assert not list((bucket / adapter_dir(1)).glob("*")) and not (bucket / "anchors").exists()
    config = json.loads((bucket / adapter_dir(3) / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True
    names = set(load_file(str(bucket / adapter_dir(3) / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names and len(names) == 8
    latest = Latest.from_json((bucket / LATEST).read_bytes(), verify_key=key.verify_key, bucket=bucket.as_uri())
    assert latest.adapter == adapter_dir(3) and latest.version == 3 and latest.delta is None


def key_file(tmp_path, key: SigningKey) -> str:
    private, _ = key.save(tmp_path / "keys")
    return str(private)


@pytest.mark.parametrize("adapter_in_fp32", [True, False], ids=["fp32-adapter", "bf16-adapter"])
def test_adapters_are_stored_in_their_own_dtype_bit_exact(tmp_path, adapter_in_fp32):
    base, _ = build_tiny_model(dtype=torch.bfloat16)
    model = lora_model(base, autocast_adapter_dtype=adapter_in_fp32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    publisher = AdapterPublisher(tmp_path / "bucket", model, PublisherOptions(background=False))
    fetch = fetcher(tmp_path, None)
    for version in (1, 2):
        train_steps(model, optimizer, steps=1, seed=version)
        publisher.publish(version)
        fetched = fetch.fetch(tmp_path / "bucket")
        loaded = peft.PeftModel.from_pretrained(build_tiny_model(dtype=torch.bfloat16)[0], fetched.path)
        if not adapter_in_fp32:
            loaded = loaded.to(torch.bfloat16)  # peft's loader upcasts; the stored bits are bf16
        assert_same_adapter(model, loaded)
        stored = load_file(str(tmp_path / "bucket" / adapter_dir(version) / ADAPTER_WEIGHTS))
        assert {t.dtype for t in stored.values()} == {torch.float32 if adapter_in_fp32 else torch.bfloat16}
    publisher.close()


# -- (c) the option, and what adapter mode refuses ----------------------------------------------


def test_peft_publish_is_validated_and_named_in_the_error():
    assert DeltaSyncConfig(peft_publish="adapter").peft_publish is PeftPublish.ADAPTER
    assert DeltaSyncConfig().peft_publish is PeftPublish.MERGED
    with pytest.raises(ValueError, match=r"peft_publish must be 'merged' or 'adapter', got 'adapters'"):
        DeltaSyncConfig(peft_publish="adapters")
    with pytest.raises(ValueError, match=r"peft_publish must be 'merged' or 'adapter', got 3"):
        PublisherOptions(peft_publish=3)
    with pytest.raises(ValueError, match=r"adapter_name must be a non-empty string, got ''"):
        DeltaSyncConfig(peft_publish="adapter", adapter_name="")


def test_adapter_mode_refuses_a_model_without_an_adapter_at_train_begin_with_nothing_written(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    base, _ = build_tiny_model(dtype=torch.float32)
    bucket = tmp_path / "bucket"
    tokens = torch.randint(0, 500, (8, 16), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = Trainer(
        model=base,
        args=TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, report_to="none", save_strategy="no"
        ),
        train_dataset=Dataset.from_dict({"input_ids": tokens, "labels": tokens}),
        callbacks=[DeltaSyncCallback(bucket=str(bucket), peft_publish="adapter")],
    )
    with pytest.raises(UnservableModelError, match=r"holds no peft PeftModel.*peft_publish='merged'"):
        trainer.train()
    assert not bucket.exists() or not any(bucket.rglob("*"))
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**LORA, "use_dora": True}, r"adapter 'default' uses DoRA"),
        ({**LORA, "modules_to_save": ["lm_head"]}, r"adapter 'default' trains modules_to_save \['lm_head'\]"),
        ({"target_modules": ["q_proj"], "peft_type": "IA3"}, r"adapter 'default' is a IA3 adapter"),
    ],
    ids=["dora", "modules-to-save", "ia3"],
)
def test_adapters_vllm_cannot_load_as_they_are_are_refused(tmp_path, config, match):
    base, _ = build_tiny_model(dtype=torch.float32)
    if config.get("peft_type") == "IA3":
        model = peft.get_peft_model(
            base, peft.IA3Config(target_modules=config["target_modules"], feedforward_modules=[])
        )
    else:
        model = peft.get_peft_model(base, peft.LoraConfig(**config))
    with pytest.raises(UnservableModelError, match=match):
        AdapterPublisher(tmp_path / "bucket", model, PublisherOptions())
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").rglob("*"))


def test_an_old_pointer_parses_and_an_adapter_pointer_round_trips_signed():
    key = SigningKey.generate()
    old = b'{"version": 3, "anchor_version": 1, "run_id": "r", "anchor": "anchors/step_00000001.safetensors", '
    old += b'"delta": "deltas/step_00000003.safetensors", "model_checksum": "abc"}'
    assert Latest.from_json(old).adapter is None
    from delta_sync.version import VersionId

    pointer = Latest(
        VersionId(4, 4, "r", "e"), "", None, "f00d", sequence=7, written_at=1.0, bucket="b", adapter=adapter_dir(4)
    )
    parsed = Latest.from_json(pointer.to_json(key), verify_key=key.verify_key, bucket="b")
    assert parsed == pointer
    assert "adapter" not in json.loads(Latest(VersionId(1, 1, "r"), "a", None, "c").to_json())


# -- the replica's checks, without a server -------------------------------------------------------


@pytest.fixture
def signed_run(tmp_path):
    """A signed adapter-mode bucket with versions 1 and 2, and its key."""
    key = SigningKey.generate()
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    options = PublisherOptions(signing_key=key, background=False, bucket_id=BUCKET_ID)
    publisher = AdapterPublisher(tmp_path / "bucket", model, options)
    for version in (1, 2):
        train_steps(model, optimizer, steps=1, seed=version)
        publisher.publish(version)
    publisher.close()
    return tmp_path / "bucket", key, model


def tamper(bucket, version: int) -> None:
    """Rewrite an adapter file's weights (still a valid adapter), leaving its signature."""
    path = bucket / adapter_dir(version) / ADAPTER_WEIGHTS
    tensors = load_file(str(path))
    save_file({name: t * 2 for name, t in tensors.items()}, str(path), metadata={"format": "pt"})


def copy_of(bucket, tmp_path, name: str):
    copy = tmp_path / name
    shutil.copytree(bucket, copy)
    return copy


def test_the_fetcher_refuses_unsigned_tampered_and_merged_buckets(signed_run, tmp_path):
    bucket, key, _ = signed_run
    fetch = fetcher(tmp_path, key, BUCKET_ID)
    assert fetch.fetch(bucket).version == 2
    assert fetch.fetch(bucket, version=1).version == 1  # an older version of the run, still signed
    with pytest.raises(SignatureError, match=r"signed for bucket 'adapter-run', but it was read from 'file://"):
        fetcher(tmp_path / "other", key).fetch(copy_of(bucket, tmp_path, "copied"))
    longer = copy_of(bucket, tmp_path, "longer")
    path = longer / adapter_dir(2) / ADAPTER_WEIGHTS
    path.write_bytes(path.read_bytes() + b" ")
    with pytest.raises(SignatureError, match=r"adapter_model\.safetensors: larger than the .* bytes signed"):
        fetcher(tmp_path / "t1", key, BUCKET_ID).fetch(longer)
    same_size = copy_of(bucket, tmp_path, "same-size")
    tamper(same_size, 2)
    with pytest.raises(
        SignatureError, match=r"adapter_model\.safetensors: the file's SHA-256 .* is not the one signed"
    ):
        fetcher(tmp_path / "t2", key, BUCKET_ID).fetch(same_size)
    unsigned = copy_of(bucket, tmp_path, "unsigned")
    (unsigned / adapter_dir(2) / (ADAPTER_CONFIG + SIGNATURE_SUFFIX)).unlink()
    with pytest.raises(SignatureError, match=r"adapter_config\.json: not signed"):
        fetcher(tmp_path / "t3", key, BUCKET_ID).fetch(unsigned)
    # Without a key the weights must still be those latest.json records.
    with pytest.raises(FormatError, match=r"adapter_model\.safetensors: SHA-256 .* is not the .* latest\.json records"):
        fetcher(tmp_path / "t4", None).fetch(same_size)
    merged = tmp_path / "merged"
    from delta_sync import BF16ChangeDetector, Publisher

    base, _ = build_tiny_model(dtype=torch.float32)
    detector = BF16ChangeDetector(base, torch.optim.AdamW(base.parameters(), lr=1e-3))
    publisher = Publisher(merged, detector, background=False)
    publisher.publish(1)
    publisher.close()
    detector.close()
    with pytest.raises(FormatError, match=r"not as an adapter; this bucket is published in merged mode"):
        fetcher(tmp_path / "t5", None).fetch(merged)


def test_verify_checks_every_adapter_version_as_a_replica_would(signed_run, tmp_path, monkeypatch):
    bucket, key, _ = signed_run
    monkeypatch.setenv(BUCKET_ID_ENV, BUCKET_ID)
    report = verify_bucket(bucket, verify_key=key.verify_key, progress=False)
    assert report.ok and report.replayed_version == 2, report.to_dict()
    assert [step.path for step in report.steps] == [adapter_dir(1), adapter_dir(2), LATEST]
    tampered = copy_of(bucket, tmp_path, "tampered")
    tamper(tampered, 1)
    report = verify_bucket(tampered, verify_key=key.verify_key, progress=False)
    failed = [step for step in report.steps if not step.ok]
    assert not report.ok and [step.path for step in failed] == [adapter_dir(1)]
    assert "is not the one signed" in failed[0].message
    # Without a key, the newest version's weights must still be those latest.json records.
    tamper(tampered, 2)
    report = verify_bucket(tampered, progress=False)
    assert [step.path for step in report.steps if not step.ok] == [adapter_dir(2), LATEST]
    assert "latest.json records" in report.steps[1].message


def test_a_resumed_run_keeps_its_history_fetchable_and_verified(signed_run, tmp_path, monkeypatch):
    # A resume is a new epoch: versions before its first (the run's history) stay signed
    # for the old one, and are still the run's.
    bucket, key, model = signed_run
    run_id = Latest.from_json((bucket / LATEST).read_bytes()).run_id
    options = PublisherOptions(signing_key=key, background=False, bucket_id=BUCKET_ID, run_id=run_id)
    publisher = AdapterPublisher(bucket, model, options)
    publisher.publish(2)  # the resumed run stores version 2 again, in its own epoch
    publisher.close()
    latest = Latest.from_json((bucket / LATEST).read_bytes())
    assert latest.epoch_start == 2 and latest.version == 2
    assert fetcher(tmp_path, key, BUCKET_ID).fetch(bucket, version=1).version == 1
    monkeypatch.setenv(BUCKET_ID_ENV, BUCKET_ID)
    report = verify_bucket(bucket, verify_key=key.verify_key, progress=False)
    assert report.ok, report.to_dict()


def test_the_fetcher_refuses_an_older_pointer_put_back(signed_run, tmp_path):
    bucket, key, _ = signed_run
    older = (bucket / LATEST).read_bytes()
    fetch = fetcher(tmp_path, key, BUCKET_ID)
    run_id = Latest.from_json(older).run_id
    options = PublisherOptions(signing_key=key, background=False, run_id=run_id, bucket_id=BUCKET_ID)
    publisher = AdapterPublisher(bucket, lora_model(), options)
    publisher.publish(3)
    publisher.close()
    assert fetch.fetch(bucket).version == 3
    (bucket / LATEST).write_bytes(older)
    with pytest.raises(SignatureError, match=r"a pointer older than one this replica already accepted"):
        fetch.fetch(bucket)


# -- (b) a real CPU `vllm serve --enable-lora` ----------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(served_model, bucket_root, tmp_path_factory):
    """A real server on the base checkpoint with LoRA on: it loads adapters at run time,
    only signed ones (`vllm_server.SIGNING_KEY`), and guards its weight routes."""
    from vllm_server import API_TOKEN, SIGNING_KEY, serving

    with serving(
        served_model,
        tmp_path_factory.mktemp("vllm-lora"),
        allowed_buckets=bucket_root.as_uri(),
        api_token=API_TOKEN,
        extra_env={
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "DELTA_SYNC_VERIFY_KEY": SIGNING_KEY.verify_key.pem.decode(),
            "DELTA_SYNC_PREFETCH": "off",
        },
        extra_args=["--enable-lora", "--max-lora-rank", "8"],
    ) as server:
        yield server


def served_lora_model(served_model) -> nn.Module:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    return lora_model(base)


def reference_greedy(model: nn.Module) -> list[int]:
    """Greedy tokens of transformers + peft holding the adapter (unmerged)."""
    from vllm_server import PROMPT, greedy

    return greedy(copy.deepcopy(model).eval(), PROMPT)


def server_greedy(server, model_name: str) -> list[int]:
    from vllm_server import PROMPT

    response = server.post(
        "/v1/completions",
        json={
            "model": model_name,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_each_adapter_version_in_place_and_catches_up_after_a_restart(
    lora_server, served_model, bucket_root
):
    from vllm_server import API_TOKEN, SIGNING_KEY

    bucket = bucket_root / "lora-adapter"
    model = served_lora_model(served_model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    publisher = AdapterPublisher(bucket, model, PublisherOptions(signing_key=SIGNING_KEY, background=False))
    replica = Replica(lora_server.url, ReplicaOptions(token=API_TOKEN))
    base_tokens = server_greedy(lora_server, str(served_model))
    seen = []
    try:
        for version in (1, 2):
            train_steps(model, optimizer, steps=3, seed=10 * version)
            publisher.publish(version)
            loaded = replica.load_adapter(bucket.as_uri(), ADAPTER_NAME)
            assert loaded.version == version and loaded.model_checksum == publisher.reports[-1].model_checksum
            assert replica.adapter_status(ADAPTER_NAME).version == version
            expected = reference_greedy(model)
            assert server_greedy(lora_server, ADAPTER_NAME) == expected, lora_server.log_tail()
            seen.append(expected)
        # The adapter changes what is generated, and version 2 is not version 1: the
        # comparisons above could fail.
        assert seen[0] != base_tokens and seen[1] != seen[0]
        # The base model is still served under its own name.
        assert server_greedy(lora_server, str(served_model)) == base_tokens
        # Loading needs the weight-route token.
        refused = lora_server.post(
            "/v1/load_lora_adapter",
            headers={},
            json={"lora_name": ADAPTER_NAME, "lora_path": loaded.path, "load_inplace": True},
        )
        assert refused.status_code in (401, 403), refused.text

        # A restarted server serves no adapter; `delta-sync follow` gives it the newest.
        train_steps(model, optimizer, steps=3, seed=30)
        publisher.publish(3)
        lora_server.stop()
        lora_server.start()
        replica.close()
        replica = Replica(lora_server.url, ReplicaOptions(token=API_TOKEN))
        assert replica.adapter_status(ADAPTER_NAME) is None
        with Follower(bucket, lora_server.url, adapter_name=ADAPTER_NAME, token=API_TOKEN) as follower:
            caught_up = follower.poll_once()
            assert isinstance(caught_up, AdapterStatus) and caught_up.version == 3
            assert follower.poll_once() is None  # in step: nothing fetched or loaded again
        assert server_greedy(lora_server, ADAPTER_NAME) == reference_greedy(model)
    finally:
        publisher.close()
        replica.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_refuses_unsigned_and_tampered_adapters_and_keeps_serving(
    lora_server, served_model, bucket_root, tmp_path
):
    from vllm_server import API_TOKEN, SIGNING_KEY

    bucket = bucket_root / "lora-adapter-refusals"
    model = served_lora_model(served_model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    publisher = AdapterPublisher(bucket, model, PublisherOptions(signing_key=SIGNING_KEY, background=False))
    train_steps(model, optimizer, steps=3, seed=1)
    publisher.publish(1)
    replica = Replica(lora_server.url, ReplicaOptions(token=API_TOKEN))
    try:
        name = "guarded-policy"
        assert replica.load_adapter(bucket.as_uri(), name).version == 1
        expected = server_greedy(lora_server, name)
        assert expected == reference_greedy(model)

        # Version 2 lands, then its weights are rewritten in the bucket (same size, another adapter).
        train_steps(model, optimizer, steps=1, seed=2)
        publisher.publish(2)
        tamper(bucket, 2)
        # (vLLM replaces paths in the errors it relays with "<path>".)
        with pytest.raises(
            ReplicaError, match=r"refused the adapter: SignatureError: .*SHA-256 .* is not the one signed"
        ):
            replica.load_adapter(bucket.as_uri(), name)

        unsigned = bucket_root / "lora-adapter-unsigned"
        unsigned_model = served_lora_model(served_model)
        unsigned_publisher = AdapterPublisher(unsigned, unsigned_model, PublisherOptions(background=False))
        unsigned_publisher.publish(1)
        unsigned_publisher.close()
        with pytest.raises(ReplicaError, match=r"SignatureError: .*not signed, but this replica only trusts signed"):
            replica.load_adapter(unsigned.as_uri(), name)

        assert replica.adapter_status(name).version == 1
        assert server_greedy(lora_server, name) == expected
    finally:
        publisher.close()
        replica.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_generates_through_the_adapter_the_server_loads_for_it(lora_server, served_model, bucket_root, tmp_path):
    """TRL's GRPOTrainer in vLLM server mode, adapter mode: the callback publishes the
    adapter as training starts and after every step, the server loads each version in
    place, and TRL's generation requests name the adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_server import API_TOKEN, SIGNING_KEY

    name = "grpo-policy"
    sync = DeltaSyncCallback(
        bucket=str(bucket_root / "lora-grpo"),
        peft_publish="adapter",
        adapter_name=name,
        signing_key=key_file(tmp_path, SIGNING_KEY),
        vllm_token=API_TOKEN,
        sync_timeout=300,
        # Generation may run a version behind, but never before the server has an adapter
        # under the name (the first request would fail).
        max_staleness=1,
    )
    replica = Replica(lora_server.url, ReplicaOptions(token=API_TOKEN))

    class ServerCheck(TrainerCallback):
        def __init__(self) -> None:
            self.checked: list[int] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync.publisher.flush()
            assert not sync.replicas.wait(state.global_step, timeout=300), lora_server.log_tail()
            assert replica.adapter_status(name).version == state.global_step
            assert server_greedy(lora_server, name) == reference_greedy(model)
            self.checked.append(state.global_step)

    check = ServerCheck()
    trainer = grpo_trainer(
        tmp_path,
        [sync, check],
        steps=2,
        learning_rate=5e-2,
        model=AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32),
        tokenizer=AutoTokenizer.from_pretrained(served_model),
        peft_config=peft.LoraConfig(**LORA),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=lora_server.url,
        vllm_server_timeout=600,
    )
    # What TRL's client sends, read off its own session: the model each completion request names.
    named: list[str] = []

    def record(response, *args, **kwargs):
        if response.request.url.endswith("/v1/completions"):
            named.append(json.loads(response.request.body)["model"])
            assert response.status_code == 200, response.text

    sync._vllm_generation.vllm_client.session.hooks["response"].append(record)
    try:
        trainer.train()
    finally:
        replica.close()
    assert check.checked == [1, 2]
    assert [report.version for report in sync.reports] == [0, 1, 2]
    # One generation per step, the first before any optimizer step (on adapter version 0).
    assert len(named) >= 2 and set(named) == {name}


@pytest.mark.slow  # no server, but about 40 s on 2 cores: too long for the quick lane
def test_the_peft_benchmark_measures_both_modes_without_a_server(tmp_path):
    """`benchmarks/bench_peft.py --quick --no-vllm`: bytes and trainer time of both modes."""
    import sys

    from helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_peft
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert bench_peft.main(["--quick", "--no-vllm", "--out", str(tmp_path)]) == 0
    shape = json.loads((tmp_path / "results.json").read_text())["shapes"]["tiny"]
    means = shape["mean_after_first"]
    # The second version: the trained adapter, whole, against the merged delta of its change.
    assert means["adapter_bytes"] > 4 * shape["adapter_elements"]  # fp32 weights and the config
    assert 0 < means["merged_changed"] and means["compact_bytes"] < means["merged_bytes"]
    assert shape["merged_anchor_bytes"] > 10 * shape["adapter_version_bytes"]
    assert means["merged_update_seconds"] is None and shape["generation_64_tokens"] is None
