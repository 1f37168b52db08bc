"""The compact encoding: bit-exact round trips on real and random deltas, and damaged streams
refused with a `FormatError` (never another exception, a hang, or a large allocation)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from rans_reference import varint

from delta_sync import BF16ChangeDetector, compact
from delta_sync.bitmasks import FAST_BIT_GATHER
from delta_sync.compact import ENCODING, SUFFIX, decode_changes, encode_changes, entry_names
from delta_sync.errors import ApplyError, FormatError
from delta_sync.format import SparseChange, index_dtype
from delta_sync.parallel import THREADS_ENV

from helpers import raw_bits
from two_tower import TwoTower, train_step

# The first test in a process may compile the codec (about a minute; more on a busy machine).
pytestmark = pytest.mark.timeout(300)

SOURCE = "deltas/step_00000002.safetensors"
VERSION = 5  # first byte of a compact stream


def round_trip(changes: dict[str, SparseChange], previous: dict[str, torch.Tensor]) -> dict[str, SparseChange]:
    entries = encode_changes(changes, previous)
    assert sorted(entries) == sorted(entry_names(name)[0] for name in changes)
    # Coding from the tensors after the change and the old values (the publisher's way) gives
    # the same bytes.
    after, old_values = {}, {}
    for name, change in changes.items():
        after[name] = previous[name].clone()
        flat = raw_bits(after[name]).reshape(-1)
        old_values[name] = flat[change.indices.long()].view(torch.bfloat16)
        flat[change.indices.long()] = raw_bits(change.values)
    patched = encode_changes(changes, after, old_values=old_values)
    for name, entry in entries.items():
        assert torch.equal(patched[name], entry), name
    held = {name: tensor.clone() for name, tensor in previous.items()}
    shapes = {name: tuple(previous[name].shape) for name in changes}
    decoded = decode_changes(entries, held, shapes, source=SOURCE)
    for name, tensor in previous.items():
        assert torch.equal(raw_bits(held[name]), raw_bits(tensor)), "decoding must not modify the held weights"
    assert sorted(decoded) == sorted(changes)
    for name, change in changes.items():
        got = decoded[name]
        assert got.indices.dtype == index_dtype(previous[name].numel())
        assert torch.equal(got.indices.long(), change.indices.long()), name
        assert torch.equal(raw_bits(got.values), raw_bits(change.values)), name
    return decoded


def test_constants():
    assert ENCODING == "compact"
    assert entry_names("model.norm.weight") == ("model.norm.weight" + SUFFIX,)


# -- real training streams ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-masters"])
@pytest.mark.parametrize("lr", [1e-3, 1e-4])
def test_round_trip_on_training_steps(dtype, lr):
    torch.manual_seed(0)
    model = TwoTower(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    detector = BF16ChangeDetector(model, optimizer)
    encoded_any = False
    for step in range(1, 5):
        train_step(model, optimizer, seed=step)
        change_set = detector.changes()
        # The detector has advanced its snapshot; put the old values back to get the state before.
        previous = {}
        for name, tensor in detector.snapshot.items():
            before = tensor.clone()
            if name in change_set.changes:
                before.view(-1)[change_set.changes[name].indices.long()] = change_set.old_values[name]
            previous[name] = before
        round_trip(change_set.changes, previous)
        encoded_any |= bool(change_set.changes)
    detector.close()
    assert encoded_any


def test_smaller_than_raw_on_a_training_step():
    torch.manual_seed(0)
    model = TwoTower(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    train_step(model, optimizer, seed=1)
    before = {name: tensor.clone() for name, tensor in detector.snapshot.items()}
    change_set = detector.changes()
    entries = encode_changes(change_set.changes, before)
    compact = sum(entry.numel() for entry in entries.values())
    raw = 6 * change_set.changed_elements
    assert compact < raw / 2
    detector.close()


# -- random masks and values ------------------------------------------------------------------------


SPECIAL = torch.tensor(
    [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 3.0e38], dtype=torch.bfloat16
).view(torch.int16)


def random_previous(generator: torch.Generator, numel: int, kind: str) -> torch.Tensor:
    if kind == "weights":
        tensor = (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16)
    elif kind == "bits":
        tensor = torch.randint(-32768, 32768, (numel,), generator=generator, dtype=torch.int32)
        tensor = tensor.to(torch.int16).view(torch.bfloat16)
    else:  # weights sprinkled with NaN, Inf, +-0.0, subnormals
        tensor = (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16)
        picks = torch.randint(0, numel, (max(1, numel // 10),), generator=generator)
        choice = torch.randint(0, SPECIAL.numel(), picks.shape, generator=generator)
        tensor.view(torch.int16)[picks] = SPECIAL[choice]
    return tensor


def random_change(generator: torch.Generator, previous: torch.Tensor, density: float, values: str) -> SparseChange:
    numel = previous.numel()
    if density >= 1:
        indices = torch.arange(numel)
    else:
        indices = torch.nonzero(torch.rand(numel, generator=generator) < density).squeeze(1)
        if indices.numel() == 0:
            indices = torch.randint(0, numel, (1,), generator=generator)
    old = previous.reshape(-1).view(torch.int16)[indices].to(torch.int32)
    if values == "ulps":
        steps = torch.randint(1, 4, indices.shape, generator=generator) * (
            torch.randint(0, 2, indices.shape, generator=generator) * 2 - 1
        )
        new = old + steps
    elif values == "special":
        new = SPECIAL[torch.randint(0, SPECIAL.numel(), indices.shape, generator=generator)].to(torch.int32)
    else:
        new = torch.randint(-32768, 32768, indices.shape, generator=generator, dtype=torch.int32)
    # Keep int16 wrap-around (e.g. 0x7FFF + 1) and make sure every listed element changes.
    new = ((new + 32768) % 65536 - 32768).to(torch.int16)
    same = new == old.to(torch.int16)
    new[same] = new[same] ^ 1
    return SparseChange(indices=indices.to(index_dtype(numel)), values=new.view(torch.bfloat16))


def adam_like_change(generator: torch.Generator, previous: torch.Tensor, lr: float) -> SparseChange:
    """Steps of about `lr` in random directions: whether the bf16 value moves depends on its exponent."""
    step = lr * (
        torch.randn(previous.shape, generator=generator).sign() + 0.3 * torch.randn(previous.shape, generator=generator)
    )
    new = (previous.float() + step).to(torch.bfloat16)
    indices = torch.nonzero(new.view(torch.int16).reshape(-1) != previous.view(torch.int16).reshape(-1)).squeeze(1)
    return SparseChange(indices=indices.to(index_dtype(previous.numel())), values=new.reshape(-1)[indices])


@pytest.mark.parametrize("lr", [1e-5, 1e-4, 1e-3])
def test_round_trip_exponent_dependent_changes(lr):
    generator = torch.Generator().manual_seed(1)
    previous = random_previous(generator, 300000, "special").reshape(300, 1000)
    change = adam_like_change(generator, previous, lr)
    round_trip({"w": change}, {"w": previous})
    stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX]
    assert stream[1] > 1, "changes that follow the exponent are coded in several groups"


def exponent_rate_change(generator: torch.Generator, previous: torch.Tensor, rates: dict[int, float]) -> SparseChange:
    """Each element changes by 1-3 ULPs with a probability set by the exponent of its value
    (`rates[e]`, or the rate of the nearest listed exponent below)."""
    bits = previous.reshape(-1).view(torch.int16)
    exponents = (bits.to(torch.int32) >> 7) & 0xFF
    table = torch.zeros(256)
    rate = 0.0
    for exponent in range(256):
        rate = rates.get(exponent, rate)
        table[exponent] = rate
    chosen = torch.rand(bits.numel(), generator=generator) < table[exponents]
    indices = torch.nonzero(chosen).squeeze(1)
    steps = torch.randint(1, 4, indices.shape, generator=generator) * (
        torch.randint(0, 2, indices.shape, generator=generator) * 2 - 1
    )
    new = (bits[indices].to(torch.int32) + steps + 32768) % 65536 - 32768
    return SparseChange(indices=indices.to(torch.int32), values=new.to(torch.int16).view(torch.bfloat16))


@pytest.mark.parametrize(
    "rates",
    [
        {0: 0.97, 112: 0.6, 113: 0.2, 114: 0.05, 115: 0.01, 116: 0.001, 117: 0.0},  # a run of groups
        {0: 1.0, 114: 0.5, 116: 0.0005},  # all changed, then dense, then sparse
        {0: 0.0, 113: 0.9999, 115: 0.0},  # changes in the middle only
    ],
)
def test_round_trip_in_many_groups(rates):
    generator = torch.Generator().manual_seed(len(rates))
    previous = (torch.randn(400_000, generator=generator) * 0.02).to(torch.bfloat16)
    change = exponent_rate_change(generator, previous, rates)
    round_trip({"w": change}, {"w": previous})
    stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX]
    assert stream[1] > 2, "changes whose rate follows the exponent are coded in several groups"


@pytest.mark.skipif(
    not FAST_BIT_GATHER, reason="this machine has no fast bit deposit (x86-64 BMI2): only one select pass runs"
)
@pytest.mark.parametrize("numel", [64, 1000, 400_003])
@pytest.mark.parametrize(
    "rates",
    [
        {0: 0.97, 112: 0.6, 113: 0.2, 114: 0.05, 115: 0.01, 116: 0.001, 117: 0.0},
        {0: 1.0, 114: 0.5, 116: 0.0005},
        {0: 0.0, 113: 0.9999, 115: 0.0},
        {0: 0.0},
    ],
)
@pytest.mark.parametrize("boundaries", [[112, 113, 114, 115, 116, 117], [114]], ids=["seven-edges", "one-edge"])
def test_both_select_passes_find_the_same_members(numel, rates, boundaries):
    # The decoder's select pass with a bit deposit (where the machine has one) and without
    # it, on the same ranks: every group, dense and sparse, members at the tensor's end;
    # compiled for seven group edges, and for one (a tensor in two groups).
    generator = torch.Generator().manual_seed(numel + len(rates))
    previous = (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16)
    change = exponent_rate_change(generator, previous, rates)
    prev_bits = raw_bits(previous).numpy()
    boundaries = np.array(boundaries, np.int64)
    limits = tuple(np.int16(limit) for limit in compact._limits(boundaries))[: 1 if boundaries.size == 1 else 7]
    counts = compact._group_counts(prev_bits, boundaries)
    group_of = compact._group_table(boundaries)[(prev_bits.astype(np.int64) >> 7) & 0xFF]
    indices = change.indices.long().numpy()
    ranks, changed = [], []
    for group in range(boundaries.size + 1):
        members = np.flatnonzero(group_of == group)
        ranks.append(np.flatnonzero(np.isin(members, indices)))
        changed.append(ranks[-1].size)
    ends = np.cumsum(changed)
    ranks = np.concatenate(ranks).astype(np.int64)
    # Each change's code, laid out as the ranks are (group after group).
    zigzag = torch.randint(1, 1 << 16, (ranks.size,), generator=generator).numpy().astype(np.uint16)
    difference = (zigzag.astype(np.int32) >> 1) ^ -(zigzag.astype(np.int32) & 1)
    order = np.argsort(group_of[indices], kind="stable")
    expected_values = np.empty(indices.size, np.int16)
    expected_values[order] = (prev_bits[indices[order]].astype(np.int32) + difference).astype(np.int16)  # wrapping
    for select in (compact._select, compact._select_by_deposit):
        positions, values = np.empty(ranks.size, np.int32), np.empty(ranks.size, np.int16)
        found, members = select(
            prev_bits, boundaries, limits, ranks, zigzag, ends - changed, ends, counts, positions, values
        )
        assert found == ranks.size and np.array_equal(members, counts)
        assert np.array_equal(positions, indices)
        assert np.array_equal(values, expected_values)  # held bits changed by each one's own code


@pytest.mark.skipif(not FAST_BIT_GATHER, reason="this machine has no fast bit deposit (x86-64 BMI2)")
def test_the_deposit_select_pass_files_no_more_than_its_ranks_when_groups_are_larger_than_claimed():
    # Held weights whose groups are larger than the header claims (another version, or a
    # damaged stream): past its claimed size, group 0 reads group 1's wanted ranks, which
    # group 1's own members read again. The pass files at most one element per rank, and
    # counts the members it saw, which the decoder compares with the claimed sizes.
    previous = torch.zeros(10_000, dtype=torch.bfloat16)
    previous[5_000:] = 1.0  # exponent 127: group 1
    prev_bits = raw_bits(previous).numpy()
    boundaries = np.array([100], np.int64)
    claimed = np.array([64, 64], np.int64)
    ranks = np.concatenate([np.arange(64), np.arange(64)]).astype(np.int64)  # every claimed member wanted
    starts, ends = np.array([0, 64], np.int64), np.array([64, 128], np.int64)
    zigzag = np.full(ranks.size, 2, np.uint16)  # +1 on every element
    positions, values = np.full(ranks.size + 1, -1, np.int32), np.zeros(ranks.size + 1, np.int16)
    limits = (np.int16((100 << 7) - 1),)
    found, members = compact._select_by_deposit(
        prev_bits, boundaries, limits, ranks, zigzag, starts, ends, claimed, positions[:-1], values[:-1]
    )
    assert found == ranks.size and positions[-1] == -1  # nothing past the ranks' room
    assert np.all(np.diff(positions[:found]) > 0)
    assert np.array_equal(values[:found], prev_bits[positions[:found]] + 1)
    assert members.tolist() == [5_000, 5_000]


@pytest.mark.parametrize("offset", [1, 3])
def test_round_trip_from_a_view_that_starts_mid_word(offset):
    """The rank pass reads the previous tensor four elements (one 64-bit word) at a time: a
    tensor that starts at any element of its storage, and ends inside a word, codes the same."""
    generator = torch.Generator().manual_seed(offset)
    storage = (torch.randn(400_003 + offset, generator=generator) * 0.02).to(torch.bfloat16)
    previous = storage[offset : offset + 400_001]
    change = exponent_rate_change(generator, previous, {0: 0.97, 113: 0.3, 115: 0.02, 117: 0.0})
    round_trip({"w": change}, {"w": previous})
    assert encode_changes({"w": change}, {"w": previous})["w" + SUFFIX][1] > 2


@pytest.mark.parametrize("numel", [1, 5, 4099, 100_000, 2_000_003])
@pytest.mark.parametrize("patched", [False, True])
def test_the_sample_counts_each_sampled_element_by_its_previous_exponent(numel, patched):
    # The encoder chooses its groups from a histogram of a sample (runs spread over the
    # tensor), counted four elements at a time; with `patched`, the changed elements count
    # with their old exponents.
    rng = np.random.default_rng(numel)
    prev_bits = raw_bits((torch.randn(numel) * 0.02).to(torch.bfloat16)).numpy()
    positions = np.sort(rng.choice(numel, max(1, numel // 50), replace=False)).astype(np.int64)
    old = rng.integers(-(2**15), 2**15, positions.size).astype(np.int16)
    runs = max(compact._SAMPLE_RUNS, numel // (compact._SAMPLE_EVERY * compact._SAMPLE_RUN))
    if numel <= runs * compact._SAMPLE_RUN:
        sampled = np.arange(numel)
    else:
        step = (numel - compact._SAMPLE_RUN) // (runs - 1)
        sampled = np.concatenate([np.arange(r * step, r * step + compact._SAMPLE_RUN) for r in range(runs)])
    expected = np.bincount((prev_bits[sampled].astype(np.int64) >> 7) & 0xFF, minlength=256)
    if patched:
        for j in np.flatnonzero(np.isin(positions, sampled)):
            expected[(int(prev_bits[positions[j]]) >> 7) & 0xFF] -= 1
            expected[(int(old[j]) >> 7) & 0xFF] += 1
    assert compact._sample_counts(prev_bits, positions, old, patched).tolist() == expected.tolist()


def test_round_trip_with_exponents_far_apart():
    # Magnitudes spread over a few exponents only, with nothing in between.
    generator = torch.Generator().manual_seed(4)
    magnitudes = torch.tensor([1e-30, 1e-3, 0.25, 3.0e4])
    picks = torch.randint(0, 4, (200_000,), generator=generator)
    signs = torch.randint(0, 2, (200_000,), generator=generator) * 2 - 1
    jitter = 1 + 0.5 * torch.rand(200_000, generator=generator)
    previous = (magnitudes[picks] * signs * jitter).to(torch.bfloat16)
    change = exponent_rate_change(generator, previous, {0: 0.9, 110: 0.3, 120: 0.01, 135: 0.0001})
    round_trip({"w": change}, {"w": previous})


CASES = [
    (1, 1.0, "weights", "ulps"),
    (1, 1.0, "bits", "random"),
    (2, 0.5, "special", "special"),
    (17, 1.0, "special", "random"),
    (1000, 0.01, "weights", "ulps"),
    (5000, 0.3, "special", "special"),
    (20000, 1.0, "weights", "ulps"),
    (20000, 0.999, "weights", "random"),
    (20000, 0.97, "special", "ulps"),
    (50000, 0.02, "weights", "ulps"),
    (50000, 0.5, "bits", "random"),
    (100000, 0.00002, "weights", "ulps"),
    (100000, 0.0005, "special", "random"),
    (200000, 0.05, "weights", "ulps"),
]


@pytest.mark.parametrize("numel,density,previous_kind,values", CASES)
def test_round_trip_random(numel, density, previous_kind, values):
    generator = torch.Generator().manual_seed(numel * 7 + int(density * 1000))
    previous = random_previous(generator, numel, previous_kind)
    change = random_change(generator, previous, density, values)
    round_trip({"w": change}, {"w": previous})


def test_round_trip_many_seeds():
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        numel = int(torch.randint(1, 30000, (1,), generator=generator))
        density = float(torch.rand(1, generator=generator)) ** 3
        kind = ["weights", "bits", "special"][seed % 3]
        values = ["ulps", "random", "special"][(seed // 3) % 3]
        previous = random_previous(generator, numel, kind).reshape(-1)
        if numel % 4 == 0:
            previous = previous.reshape(4, numel // 4)
        round_trip({f"p{seed}": random_change(generator, previous, density, values)}, {f"p{seed}": previous})


def test_threads_share_out_the_tensors_by_the_decoders_work_on_them(monkeypatch):
    # The changes weigh most: an output layer with most of a step's changes gets a thread of
    # its own, where sharing by size alone would add half of the layers to it.
    monkeypatch.setenv(THREADS_ENV, "2")
    numel = {"lm_head": 8 << 20, "embed": 8 << 20, **{f"layer{i}": 1 << 20 for i in range(8)}}
    changes = {"lm_head": 300_000, "embed": 2_000, **{f"layer{i}": 25_000 for i in range(8)}}
    shares = compact.shares(numel, lambda name: compact._work(numel[name], changes[name]))
    assert sorted(map(sorted, shares)) == [["embed", *sorted(f"layer{i}" for i in range(8))], ["lm_head"]]
    # A tensor coded in one group is never passed over: only its changes count.
    assert compact._work(1 << 20, 100) == 100 * compact._CHANGE_WORK


def test_nothing_changed_and_several_tensors():
    generator = torch.Generator().manual_seed(3)
    previous = {
        "a": random_previous(generator, 4096, "weights").reshape(64, 64),
        "b": random_previous(generator, 10, "special"),
        "c": random_previous(generator, 70000, "weights"),
    }
    changes = {
        "a": SparseChange(indices=torch.zeros(0, dtype=torch.int32), values=torch.zeros(0, dtype=torch.bfloat16)),
        "b": random_change(generator, previous["b"], 1.0, "special"),
        "c": random_change(generator, previous["c"], 0.01, "ulps"),
    }
    decoded = round_trip(changes, previous)
    assert len(decoded["a"]) == 0


def test_encoder_refuses_misaligned_old_values():
    previous = (torch.randn(100) * 0.02).to(torch.bfloat16)
    change = SparseChange(indices=torch.tensor([1, 5], dtype=torch.int32), values=previous[[1, 5]] * 2)
    with pytest.raises(ValueError, match="old values"):
        encode_changes({"w": change}, {"w": previous}, old_values={"w": previous[:3]})


@pytest.mark.parametrize("indices", [[3, 2], [2, 2], [-1, 4], [4, 10], [5, 1 << 30, 6]])
@pytest.mark.parametrize("patched", [False, True], ids=["previous", "advanced+old_values"])
def test_encoder_refuses_indices_not_strictly_ascending_in_range(indices, patched):
    # The encoder checks the positions before it reads the previous tensor at them, or, given
    # the old values, as it classifies the changes: either way a ValueError, nothing read out of range.
    previous = torch.zeros(10, dtype=torch.bfloat16)
    values = torch.ones(len(indices), dtype=torch.bfloat16)
    change = SparseChange(indices=torch.tensor(indices, dtype=torch.int32), values=values)
    old_values = {"w": torch.zeros(len(indices), dtype=torch.bfloat16)} if patched else None
    with pytest.raises(ValueError, match="strictly ascending"):
        encode_changes({"w": change}, {"w": previous}, old_values=old_values)


# -- damaged streams --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoded():
    generator = torch.Generator().manual_seed(11)
    previous = random_previous(generator, 60000, "special")
    change = adam_like_change(generator, previous, 1e-4)
    stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX]
    assert stream[1] > 1
    return previous, change, stream


def decode_damaged(previous: torch.Tensor, stream: torch.Tensor) -> SparseChange | None:
    """Decode; a FormatError is the expected refusal (None), any other exception fails the test."""
    try:
        return decode_changes({"w" + SUFFIX: stream}, {"w": previous}, {"w": tuple(previous.shape)}, source=SOURCE)["w"]
    except FormatError as exc:
        assert SOURCE in str(exc) and "w" + SUFFIX in str(exc)
        return None


def check_well_formed(previous: torch.Tensor, decoded: SparseChange | None) -> None:
    if decoded is not None:
        # Decoding may yield other weights (the receiver's checksums refuse those), but always a
        # well-formed change: ascending in-range indices and one value each.
        indices = decoded.indices.long()
        assert indices.numel() == decoded.values.numel()
        assert indices.numel() <= previous.numel()
        if indices.numel():
            assert int(indices[0]) >= 0 and int(indices[-1]) < previous.numel()
            assert bool((indices[1:] > indices[:-1]).all())


def test_truncations_are_refused(encoded):
    previous, change, stream = encoded
    for length in sorted({*range(0, 40), *np.linspace(40, stream.numel() - 1, 60).astype(int).tolist()}):
        assert decode_damaged(previous, stream[:length].clone()) is None, f"truncated to {length} bytes"


def test_flipped_bytes_never_crash(encoded):
    previous, change, stream = encoded
    generator = np.random.default_rng(5)
    refused = 0
    for trial in range(150):
        damaged = stream.clone()
        if trial % 2:
            position = int(generator.integers(0, stream.numel()))
            damaged[position] ^= int(generator.integers(1, 256))
        else:  # the header, where counts and tables live
            damaged[int(generator.integers(0, 40))] = int(generator.integers(0, 256))
        decoded = decode_damaged(previous, damaged)
        refused += decoded is None
        check_well_formed(previous, decoded)
    assert refused > 75


def read_both_ways(stream: np.ndarray, numel: int) -> tuple[bool, bool]:
    """Whether the compiled header reader takes `stream`'s header and whether `_Header` reads
    it; where both do, the compiled reader's fields are checked against `_Header`'s."""
    boundaries, members = np.zeros((1, 7), np.int64), np.full((1, 8), -1, np.int64)
    changed, sizes, quantized = np.zeros((1, 8), np.int64), np.zeros((1, 8), np.int64), np.zeros((1, 8, 28), np.uint8)
    groups, lanes, words = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 2), np.int64)
    located = np.array([[stream.ctypes.data, stream.size]], np.int64)
    fields = (boundaries, groups, members, changed, quantized, sizes, lanes, words)
    read = bool(compact._read_headers(located, np.array([numel]), *fields)[0])
    reader = compact._Reader(stream, "x")
    try:
        header = compact._Header.read(reader, numel)
        reader.check_words(header.words)
    except FormatError:
        return read, False
    if read:
        g = len(header.changed)
        assert groups[0] == g and lanes[0] == header.lanes and words[0].tolist() == [reader.pos, header.words]
        assert boundaries[0, : g - 1].tolist() == header.boundaries
        assert members[0, :g].tolist() == (header.members or [-1] * g)
        assert changed[0, :g].tolist() == header.changed
        for group, table in enumerate(header.tables):
            assert sizes[0, group] == (0 if table is None else table.size)
            if table is not None:
                assert quantized[0, group, : table.size].tolist() == table.tolist()
    return read, True


def test_the_compiled_header_reader_reads_what_the_python_one_reads(encoded):
    # The decoder reads headers in compiled code and leaves to `_Header` only those it does
    # not take: it must take no header `_Header` refuses, and read the same fields.
    previous, change, stream = encoded
    streams = [stream.numpy()] + [stream.numpy()[:length] for length in range(60)]
    generator = np.random.default_rng(9)
    for _ in range(400):
        damaged = stream.numpy().copy()
        damaged[int(generator.integers(0, 48))] = int(generator.integers(0, 256))
        streams.append(damaged)
    taken = 0
    for data in streams:
        read, readable = read_both_ways(np.ascontiguousarray(data), previous.numel())
        assert readable or not read, "the compiled reader took a header that _Header refuses"
        taken += read
    assert taken > 1  # the undamaged stream, and damaged ones whose header still reads
    # A change count as a 10-byte varint (of value 0): left to `_Header`, which reads it, and
    # the stream decodes (to no change: 2 coder words, the one state back at 2^31).
    long_count = np.array([VERSION, 1, *[0x80] * 9, 0, 2, 0, 0, 0, 0x80, 0, 0, 0, 0], np.uint8)
    assert read_both_ways(long_count, previous.numel()) == (False, True)
    decoded = decode_changes(
        {"w" + SUFFIX: torch.from_numpy(long_count)}, {"w": previous}, {"w": tuple(previous.shape)}, source=SOURCE
    )
    assert decoded["w"].indices.numel() == 0


def test_appended_bytes_are_refused(encoded):
    previous, _, stream = encoded
    for extra in (1, 3, 4, 8):
        longer = torch.cat([stream, torch.full((extra,), 7, dtype=torch.uint8)])
        assert decode_damaged(previous, longer) is None


def test_wrong_entry_layout_is_refused(encoded):
    previous, _, stream = encoded
    shapes = {"w": tuple(previous.shape)}
    with pytest.raises(FormatError, match="1-D uint8"):
        decode_changes({"w" + SUFFIX: stream.view(torch.int8)}, {"w": previous}, shapes, source=SOURCE)
    with pytest.raises(FormatError, match="1-D uint8"):
        decode_changes({"w" + SUFFIX: stream[:40].reshape(4, 10)}, {"w": previous}, shapes, source=SOURCE)
    with pytest.raises(FormatError, match="missing"):
        decode_changes({}, {"w": previous}, shapes, source=SOURCE)
    with pytest.raises(FormatError, match="unexpected"):
        decode_changes({"w" + SUFFIX: stream, "w.indices": stream}, {"w": previous}, shapes, source=SOURCE)
    with pytest.raises(ApplyError, match="not among the held weights"):
        decode_changes({"w" + SUFFIX: stream}, {}, shapes, source=SOURCE)
    with pytest.raises(ApplyError, match="held as"):
        decode_changes({"w" + SUFFIX: stream}, {"w": previous[:-1]}, shapes, source=SOURCE)
    with pytest.raises(ApplyError, match="held as"):
        decode_changes({"w" + SUFFIX: stream}, {"w": previous.float()}, shapes, source=SOURCE)


def header(
    groups: int, boundaries: list[int], counts: list[bytes], tables: list[bytes], sizes: list[int] = ()
) -> torch.Tensor:
    """A stream's header (the sizes of groups `0..groups - 2` given by `sizes`) and a few words."""
    data = bytes([VERSION, groups, *boundaries]) + b"".join(varint(size) for size in sizes)
    data += b"".join(count + table for count, table in zip(counts, tables))
    return torch.frombuffer(bytearray(data + b"\x02" + bytes(8)), dtype=torch.uint8)


def test_header_fields_are_validated():
    previous = torch.zeros(1000, dtype=torch.bfloat16)
    cases = {
        "version 9 is not supported": torch.tensor([9, 1, 0], dtype=torch.uint8),
        # Version 2 (constriction's coder) is not read: its streams name the version.
        "version 2 is not supported .this library reads 3, 4 and 5.": torch.tensor([2, 1, 0, 0], dtype=torch.uint8),
        "group count is 0": torch.tensor([VERSION, 0], dtype=torch.uint8),
        "group count is 9": header(9, list(range(1, 9)), [b"\0"] * 9, [b""] * 9),
        "not strictly ascending": header(3, [5, 5], [b"\0"] * 3, [b""] * 3),
        "size of group 1 is 600, more than the 400 possible": header(3, [5, 6], [b"\0"] * 3, [b""] * 3, [600, 600]),
        "more than the": header(1, [], [varint(1001)], [b"\x00\x01"]),
        "at most 28": header(1, [], [varint(3)], [bytes([40]) + bytes(41)]),
        "value table of group 0 is empty": header(1, [], [varint(3)], [b"\x01\x00\x00"]),
        "not a valid varint": torch.tensor([VERSION, 1, *([0xFF] * 12)], dtype=torch.uint8),
    }
    for message, stream in cases.items():
        with pytest.raises(FormatError, match=message):
            decode_changes({"w" + SUFFIX: stream}, {"w": previous}, {"w": (1000,)}, source=SOURCE)


def test_a_group_claiming_more_changes_than_members_is_refused_naming_its_tensor(encoded):
    # Every tensor of a file decodes in one compiled call: the error still names the one at fault.
    previous, _, stream = encoded
    held = torch.zeros(1000, dtype=torch.bfloat16)  # every element in group 0 (exponent 0)
    bad = header(2, [100], [varint(0), varint(3)], [b"", b"\x01\x05\x05"], [1000])
    entries = {"w" + SUFFIX: stream, "bad" + SUFFIX: bad}
    shapes = {"w": tuple(previous.shape), "bad": (1000,)}
    with pytest.raises(FormatError, match=r"bad\.compact: group 1 claims 3 changes among 0 elements"):
        decode_changes(entries, {"w": previous, "bad": held}, shapes, source=SOURCE)


def test_a_stream_for_other_weights_is_refused_by_its_group_sizes(encoded):
    # The header gives each group's size in the weights the delta was coded against; held
    # weights whose groups differ (a replica holding another version) are refused by name,
    # not decoded into wrong positions.
    previous, change, stream = encoded
    other = previous.clone()
    unchanged = np.setdiff1d(np.arange(previous.numel()), change.indices.long().numpy())[:50]
    raw_bits(other)[torch.from_numpy(unchanged)] = 0x3F80  # 1.0: into the highest group
    boundaries = stream[2 : 2 + int(stream[1]) - 1].tolist()
    assert any(int(raw_bits(previous)[i]) >> 7 & 0xFF < boundaries[-1] for i in unchanged)
    with pytest.raises(FormatError, match=r"w\.compact: group \d+ has \d+ members in the held tensor, not the size"):
        decode_changes({"w" + SUFFIX: stream}, {"w": other}, {"w": tuple(previous.shape)}, source=SOURCE)


def test_a_huge_claimed_count_is_refused_before_allocating():
    previous = torch.zeros(1000, dtype=torch.bfloat16)
    stream = header(1, [], [varint(2**40)], [b"\x01\x05\x05"])
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="more than the 1000 possible"):
            decode_changes({"w" + SUFFIX: stream}, {"w": previous}, {"w": (1000,)}, source=SOURCE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_every_bit_flip_of_streams_whose_groups_mostly_changed_stays_inside_the_output():
    # Where more than half a group changed, its stream codes the unchanged members, and the
    # decoder writes the changed ones between them: gaps that jump past members once wrote more
    # ranks than the group has changes (a heap overflow, the process killed by glibc). Every
    # single-bit flip must be refused or decode to a well-formed change; the bounds-checked
    # lane of CI (NUMBA_BOUNDSCHECK=1) runs this too, where a write out of range is an IndexError.
    generator = torch.Generator().manual_seed(23)
    for numel, lr in ((3000, 3e-2), (3000, 1e-2)):
        previous = random_previous(generator, numel, "special")
        change = adam_like_change(generator, previous, lr)
        stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX]
        assert 2 * change.indices.numel() > numel, "a group must code its unchanged members"
        refused = 0
        for byte in range(stream.numel()):
            for bit in range(8):
                damaged = stream.clone()
                damaged[byte] ^= 1 << bit
                decoded = decode_damaged(previous, damaged)
                refused += decoded is None
                check_well_formed(previous, decoded)
        assert refused > stream.numel()  # a flip in the coded words may decode to other weights
