"""The compiled rANS coder and the compact stream it codes, against the plain reference in
`rans_reference.py`: each decodes what the other encodes (and both encode the same words),
on real training streams and random inputs; damaged coder streams raise `FormatError`."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import rans_reference as reference
import torch
from test_compact import adam_like_change, exponent_rate_change, random_change, random_previous

from delta_sync import BF16ChangeDetector, rans
from delta_sync.compact import SUFFIX, _class_table, _gap_table, _group_tables, decode_changes, encode_changes
from delta_sync.errors import FormatError
from delta_sync.format import SparseChange, index_dtype

from two_tower import TwoTower, train_step

pytestmark = pytest.mark.timeout(300)


# -- the coder --------------------------------------------------------------------------------------


Plan = list[tuple[list[int] | None, int]]  # per symbol: its table (None: raw bits) and its value or width


def random_symbols(rng: np.random.Generator, count: int) -> tuple[Plan, list[tuple[int, int, int]]]:
    """A mix of raw-bits symbols and symbols of three tables (skewed, flat, one symbol holding
    all but a sliver): per symbol its model and value, and its `(start, freq, scale)`."""
    tables = [
        reference.cumulative(reference.quantize([int(w) for w in rng.integers(0, 10**6, 30)], [True] * 30)),
        reference.cumulative([1 << (rans.PRECISION - 4)] * 16),
        reference.cumulative(reference.quantize([10**9, 1, 0], [True, True, True])),
    ]
    plan: Plan = []
    symbols = []
    for _ in range(count):
        kind = int(rng.integers(0, 4))
        if kind < 3:
            table = tables[kind]
            freqs = np.diff(table)
            s = int(rng.choice(len(freqs), p=freqs / freqs.sum()))
            plan.append((table, s))
            symbols.append((table[s], table[s + 1] - table[s], rans.PRECISION))
        else:
            width = int(rng.integers(0, rans.MAX_RAW_BITS + 1))
            value = int(rng.integers(0, 1 << width))
            plan.append((None, width))
            symbols.append((value, 1, width))
    return plan, symbols


def compiled_encode(symbols: list[tuple[int, int, int]], lanes: int = rans.LANES) -> np.ndarray:
    columns = np.array(symbols, np.int64).reshape(-1, 3)
    return rans.encode(*(np.ascontiguousarray(columns[:, c]) for c in range(3)), lanes)


def compiled_decode(plan: Plan, words: np.ndarray, where: str = "w.compact", lanes: int = rans.LANES) -> list[int]:
    """Each symbol of `plan`, decoded from `words` with the compiled decoder, which must end there."""
    decoder = rans.Decoder(words, where=where, lanes=lanes)
    out = []
    for table, value in plan:
        if table is None:
            out.append(int(decoder.raw(np.array([value]))[0]))
        else:
            out.append(int(decoder.symbols(np.array(table, np.int64), 1)[0]))
    decoder.finish()
    return out


def reference_decode(plan: Plan, words: list[int], lanes: int) -> list[int]:
    decoder = reference.Decoder(words, lanes)
    out = [decoder.bits(value) if table is None else decoder.symbol(table) for table, value in plan]
    decoder.finish()
    return out


@pytest.mark.parametrize("lanes", [1, 2, rans.LANES])
@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 1000, 20000])
def test_compiled_and_reference_coders_agree(count, lanes):
    plan, symbols = random_symbols(np.random.default_rng(count), count)
    expected = [start if table is None else value for (table, value), (start, _, _) in zip(plan, symbols)]
    words = compiled_encode(symbols, lanes)
    assert words.size >= 2 * lanes
    assert words.tolist() == reference.encode(symbols, lanes)
    # The compiled decoder reads the reference's words; the reference reads the compiled ones.
    assert compiled_decode(plan, np.array(reference.encode(symbols, lanes), np.uint32), lanes=lanes) == expected
    assert reference_decode(plan, words.tolist(), lanes) == expected


def test_table_symbols_round_trip():
    # The module's own example: a table from weights, symbols through it, and back.
    table = rans.cumulative(rans.quantize(np.array([700, 200, 100], np.int64), np.ones(3, np.bool_)))
    symbols = np.random.default_rng(8).choice(3, 5000, p=[0.7, 0.2, 0.1])
    words = rans.encode(*rans.table_symbols(table, symbols))
    assert words.tolist() == reference.encode(
        [(int(table[s]), int(table[s + 1] - table[s]), rans.PRECISION) for s in symbols]
    )
    decoder = rans.Decoder(words)
    assert np.array_equal(decoder.symbols(table, symbols.size), symbols)
    decoder.finish()
    assert 4 * words.size < 5000 * 1.16 / 8 * 1.02 + 8 * rans.LANES  # about the entropy, 1.157 bits each


def test_quantize_matches_the_reference_and_its_limits():
    rng = np.random.default_rng(1)
    for trial in range(300):
        n = int(rng.integers(1, 300))
        weights = rng.integers(0, [10, 10**6, 2**39][trial % 3], n)
        possible = rng.random(n) < 0.8
        possible[int(rng.integers(0, n))] = True
        freqs = rans.quantize(weights.astype(np.int64), possible)
        assert freqs.tolist() == reference.quantize(weights.tolist(), possible.tolist())
        assert freqs.sum() == 1 << rans.PRECISION
        assert (freqs[possible] >= 1).all() and (freqs[~possible] == 0).all()
    # One possible symbol takes the whole range; 2^PRECISION possible symbols get 1 each.
    only = rans.quantize(np.array([0, 5, 0], np.int64), np.array([False, True, False]))
    assert only.tolist() == [0, 1 << rans.PRECISION, 0]
    full = rans.quantize(np.arange(1 << rans.PRECISION, dtype=np.int64), np.ones(1 << rans.PRECISION, np.bool_))
    assert (full == 1).all()
    # Out of its limits: an empty table, which the decoder refuses.
    assert rans.quantize(np.array([1], np.int64), np.array([False])).size == 0
    assert (
        rans.quantize(np.ones((1 << rans.PRECISION) + 1, np.int64), np.ones((1 << rans.PRECISION) + 1, np.bool_)).size
        == 0
    )


def test_tables_at_their_limits_round_trip():
    rng = np.random.default_rng(2)
    certain = rans.cumulative(rans.quantize(np.array([0, 1, 0], np.int64), np.array([False, True, False])))
    flat = rans.cumulative(np.ones(1 << rans.PRECISION, np.int64))
    symbols = [(int(certain[1]), 1 << rans.PRECISION, rans.PRECISION)] * 50
    flat_symbols = rng.integers(0, 1 << rans.PRECISION, 500)
    symbols += [(int(s), 1, rans.PRECISION) for s in flat_symbols]
    words = compiled_encode(symbols)
    assert words.tolist() == reference.encode(symbols)
    decoder = rans.Decoder(words)
    assert (decoder.symbols(certain, 50) == 1).all()
    assert np.array_equal(decoder.symbols(flat, 500), flat_symbols)
    decoder.finish()
    # Symbols that cost nothing still need the coder's states: 8 words.
    assert compiled_encode(symbols[:50]).size == 2 * rans.LANES


def run_plan(rng: np.random.Generator, pairs: int, raw: int, width: int, singles: int):
    """Symbols in the runs the compact decoder reads them in: `pairs` alternating symbols of
    two tables, `raw` values of `width` bits, `singles` symbols of the first table."""
    first = reference.cumulative(reference.quantize([int(w) for w in rng.integers(0, 10**6, 65)], [True] * 65))
    second = reference.cumulative(reference.quantize([10**6, 10**4, 10**2, 1], [True] * 4))

    def draw(table: list[int], count: int) -> np.ndarray:
        freqs = np.diff(table)
        return rng.choice(len(freqs), count, p=freqs / freqs.sum())

    tops, classes, lows, rest = (
        draw(first, pairs),
        draw(second, pairs),
        rng.integers(0, 1 << width, raw),
        draw(first, singles),
    )
    symbols = []
    for top, c in zip(tops, classes):
        symbols += [
            (first[top], first[top + 1] - first[top], rans.PRECISION),
            (second[c], second[c + 1] - second[c], rans.PRECISION),
        ]
    symbols += [(int(v), 1, width) for v in lows]
    symbols += [(first[s], first[s + 1] - first[s], rans.PRECISION) for s in rest]
    tables = tuple(np.array(t, np.int64) for t in (first, second))
    return symbols, tables, (tops, classes, lows, rest)


def decode_runs(
    words: np.ndarray, lanes: int, tables, sizes: tuple[int, int, int, int], width: int
) -> tuple[int, list]:
    """Decode what `run_plan` codes through the run decoders: `(error, decoded)`."""
    first, second = tables
    ctx, error = rans.decoder_start(words, lanes)
    tops, classes = np.empty(sizes[0], np.int64), np.empty(sizes[1], np.int64)
    lows, rest = np.zeros(sizes[2], np.int64), np.empty(sizes[3], np.int64)
    for step in (
        lambda: rans.decode_pairs(ctx, words, first, rans.lookup(first), second, rans.lookup(second), tops, classes),
        lambda: rans.decode_bit_run(ctx, words, width, lows.size, lows, 0),
        lambda: rans.decode_symbols(ctx, words, first, rans.lookup(first), rest),
        lambda: rans.decoder_finish(ctx, words),
    ):
        if error != rans.OK:
            break
        error = step()
    return error, [tops, classes, lows, rest]


@pytest.mark.parametrize("lanes", [1, 2, 3, rans.LANES])
@pytest.mark.parametrize("pairs, raw, singles", [(0, 0, 0), (1, 0, 0), (0, 3, 2), (5, 7, 1), (2000, 1500, 777)])
def test_run_decoders_read_what_the_reference_encodes(lanes, pairs, raw, singles):
    # The compact decoder reads long runs of one kind of symbol with its lanes' states in
    # registers; every run must start on the lane where the one before it ended.
    rng = np.random.default_rng(pairs + 31 * raw + lanes)
    width = 11
    symbols, tables, expected = run_plan(rng, pairs, raw, width, singles)
    words = np.array(reference.encode(symbols, lanes), np.uint32)
    assert compiled_encode(symbols, lanes).tolist() == words.tolist()
    error, decoded = decode_runs(words, lanes, tables, (pairs, pairs, raw, singles), width)
    assert error == rans.OK
    for got, want in zip(decoded, expected):
        assert got.tolist() == [int(v) for v in want]
    if words.size > 2 * lanes:  # a word short: refused, by a run or at the end
        error, _ = decode_runs(words[:-1], lanes, tables, (pairs, pairs, raw, singles), width)
        assert error in (rans.ENDS_EARLY, rans.NOT_FINISHED)


def test_the_encoders_division_is_exact_at_its_limits():
    # The encoder divides by a frequency with a float multiplication and one correction:
    # exact only if the estimate is within one, checked here where it is tightest (the
    # largest states the encoder divides, frequencies that round worst).
    divide = rans._divide.py_func
    for scale in (12, 13, rans.PRECISION, 20, 31):
        for freq in (2, 3, 7, 255, 4093, 65521, 65535, (1 << rans.PRECISION) - 1):
            if freq >= 1 << scale:
                continue
            top = min(freq << (63 - scale), 1 << 63) - 1  # the largest state `encode` divides
            for state in (top, top - 1, top - freq + 1, freq * (top // freq), (1 << 31), (1 << 31) + freq - 1):
                assert divide(state, freq, scale) == divmod(state, freq), (state, freq, scale)
    compiled = numba.njit(lambda s, f, c: rans._divide(s, f, c))
    rng = np.random.default_rng(12)
    for _ in range(2000):
        scale = int(rng.integers(0, 32))
        freq = int(rng.integers(2, 1 << min(scale, 16) + 1)) if scale else 1
        if freq == 1:
            continue
        state = int(rng.integers(1 << 31, min(freq << (63 - scale), (1 << 63) - 1)))
        assert compiled(state, freq, scale) == divmod(state, freq), (state, freq, scale)


def test_damaged_coder_streams_raise_format_errors():
    plan, symbols = random_symbols(np.random.default_rng(3), 3000)
    words = compiled_encode(symbols)
    compiled_decode(plan, words)
    with pytest.raises(FormatError, match=r"w\.compact: .*(ends before|does not end|left over)"):
        compiled_decode(plan, words[:-1])
    with pytest.raises(FormatError, match="w.compact: the entropy-coded data ends before"):
        compiled_decode(plan, words[: 2 * rans.LANES - 1])
    with pytest.raises(FormatError, match="w.compact: words are left over"):
        compiled_decode(plan, np.concatenate([words, words[-1:]]))
    with pytest.raises(FormatError, match="w.compact: an initial coder state is out of range"):
        compiled_decode(plan, np.concatenate([np.zeros(2, np.uint32), words[2:]]))
    # A flipped bit is refused, or (where it falls among raw bits, which carry no redundancy)
    # decodes to other values, which the receiver's checksums then refuse; never to the same.
    rng = np.random.default_rng(4)
    expected = compiled_decode(plan, words)
    refused = 0
    for _ in range(100):
        damaged = words.copy()
        damaged[int(rng.integers(0, words.size))] ^= np.uint32(1 << int(rng.integers(0, 32)))
        try:
            assert compiled_decode(plan, damaged) != expected
        except FormatError as exc:
            assert "w.compact: " in str(exc) and "the stream is damaged" in str(exc)
            refused += 1
    assert refused > 25  # about half the bits of these symbols are raw
    for length in range(0, words.size, 97):
        with pytest.raises(FormatError, match="w.compact: .*the stream is damaged"):
            compiled_decode(plan, words[:length])


def test_a_malformed_table_is_refused():
    decoder = rans.Decoder(compiled_encode([(0, 1, 3)]), where="w.compact")
    with pytest.raises(FormatError, match="frequency table is malformed"):
        decoder.symbols(np.array([0, 5, 3], np.int64), 1)
    with pytest.raises(FormatError, match="frequency table is malformed"):
        decoder.raw(np.array([rans.MAX_RAW_BITS + 1]))
    with pytest.raises(FormatError, match="w.compact: the coder's lane count is not 1 to 4"):
        rans.Decoder(compiled_encode([(0, 1, 3)]), where="w.compact", lanes=rans.LANES + 1)


# -- the compact stream's models --------------------------------------------------------------------


def test_gap_tables_match_the_reference():
    # Trainer and replicas must build the same tables on any machine: integer arithmetic
    # only, equal to the reference's exact Python integers, also where products pass 2^32.
    rng = np.random.default_rng(5)
    counts = rng.integers(1, 10**10, 600)
    cases = [(int(n), int(k)) for n, k in zip(counts, np.minimum(rng.integers(1, 10**6, 600), counts))]
    cases += [(1, 1), (2, 1), (10**12, 1), (2**40, 2**39), (5, 2)]
    for count, coded in cases:
        table, shift = _gap_table(count, coded)
        assert shift == reference.gap_shift(count, coded)
        assert table.tolist() == reference.gap_table(count, coded), (count, coded)


def test_value_tables_match_the_reference():
    rng = np.random.default_rng(6)
    for size in range(1, 29):
        for _ in range(20):
            table_bytes = rng.integers(0, 256, size).astype(np.uint8)
            table_bytes[int(rng.integers(0, size))] = int(rng.integers(1, 256))
            assert _class_table(table_bytes).tolist() == reference.class_table(table_bytes.tolist())
    counts = np.zeros((256, 28), np.int64)
    values = [*range(1, 5000), *rng.integers(1, 2**31, 3000).tolist(), 2**31]
    for at, value in enumerate(values):
        counts[at % 256, at % 28] = value
        if at % (256 * 28) == 256 * 28 - 1 or at == len(values) - 1:
            quantized, sizes, _ = _group_tables(counts, np.zeros(0, np.int64))
            expected = [reference.log_byte(int(c)) if c else 0 for c in counts.sum(0)]
            assert quantized[0, : sizes[0]].tolist() == expected[: sizes[0]]
            counts[:] = 0


# -- compact streams against the reference ----------------------------------------------------------


def check_against_reference(previous: torch.Tensor, change: SparseChange) -> None:
    """The compiled encoder's stream decodes with the reference; the reference, coding in the
    same groups, writes the same bytes; and the compiled decoder decodes the reference's stream."""
    prev_bits = previous.reshape(-1).view(torch.int16).numpy()
    indices = change.indices.long().numpy()
    new_bits = change.values.view(torch.int16).numpy()
    stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX].numpy().tobytes()
    got_indices, got_bits = reference.decode_stream(stream, prev_bits)
    assert np.array_equal(got_indices, indices)
    assert np.array_equal(got_bits, new_bits)
    boundaries = list(stream[2 : 2 + stream[1] - 1])
    ours = reference.encode_stream(prev_bits, indices, new_bits, boundaries)
    assert ours == stream
    # The reference's own choice of groups, too; and versions 4 (one coder state below 16384
    # changes) and 3 (the decoder counts the groups' sizes).
    for groups, version in (([], 5), ([110, 118, 122], 5), (boundaries, 4), (boundaries, 3)):
        ours = reference.encode_stream(prev_bits, indices, new_bits, groups, version)
        entry = torch.frombuffer(bytearray(ours), dtype=torch.uint8)
        decoded = decode_changes({"w" + SUFFIX: entry}, {"w": previous}, {"w": tuple(previous.shape)}, source="x")["w"]
        assert torch.equal(decoded.indices.long(), change.indices.long())
        assert torch.equal(decoded.values.view(torch.int16), change.values.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-masters"])
def test_reference_on_training_steps(dtype):
    torch.manual_seed(0)
    model = TwoTower(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    checked = 0
    for step in range(1, 3):
        train_step(model, optimizer, seed=step)
        change_set = detector.changes()
        for name, change in change_set.changes.items():
            before = detector.snapshot[name].clone()
            before.view(-1)[change.indices.long()] = change_set.old_values[name]
            check_against_reference(before, change)
            checked += 1
    detector.close()
    assert checked


@pytest.mark.parametrize(
    "numel,density,previous_kind,values",
    [
        (1, 1.0, "weights", "ulps"),  # one element
        (1, 1.0, "bits", "random"),
        (3000, 1.0, "weights", "ulps"),  # all changed
        (3000, 1.0, "special", "special"),  # NaN, Inf, -0.0 before and after
        (20000, 0.999, "weights", "random"),
        (20000, 0.6, "special", "special"),
        (50000, 0.00004, "weights", "ulps"),  # long gaps: escapes
        (60000, 0.02, "special", "random"),  # wide values
    ],
)
def test_reference_on_random_changes(numel, density, previous_kind, values):
    generator = torch.Generator().manual_seed(numel + int(density * 100))
    previous = random_previous(generator, numel, previous_kind)
    check_against_reference(previous, random_change(generator, previous, density, values))


def test_reference_in_many_groups():
    generator = torch.Generator().manual_seed(7)
    previous = (torch.randn(200_000, generator=generator) * 0.02).to(torch.bfloat16)
    change = exponent_rate_change(generator, previous, {0: 1.0, 112: 0.6, 114: 0.05, 116: 0.001, 117: 0.0})
    check_against_reference(previous, change)
    change = adam_like_change(generator, previous, 1e-4)
    check_against_reference(previous, change)


def test_reference_with_nothing_changed():
    previous = torch.randn(1000).to(torch.bfloat16)
    nothing = SparseChange(indices=torch.zeros(0, dtype=index_dtype(1000)), values=torch.zeros(0, dtype=torch.bfloat16))
    check_against_reference(previous, nothing)


def test_version_4_streams_with_one_coder_state_still_decode():
    # From 1024 to 16383 changes, version 5 codes with 4 coder states where version 4 coded
    # with one: the decoder picks the count by the stream's version.
    generator = torch.Generator().manual_seed(11)
    previous = (torch.randn(40_000, generator=generator) * 0.02).to(torch.bfloat16)
    change = random_change(generator, previous, 0.1, "ulps")
    assert 1024 <= len(change) < 16384
    prev_bits = previous.view(torch.int16).numpy()
    indices, new_bits = change.indices.long().numpy(), change.values.view(torch.int16).numpy()
    streams = {version: reference.encode_stream(prev_bits, indices, new_bits, [118], version) for version in (4, 5)}
    assert streams[4][1:] != streams[5][1:]  # the same header, other coder words
    for version, stream in streams.items():
        entry = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        decoded = decode_changes({"w" + SUFFIX: entry}, {"w": previous}, {"w": (40_000,)}, source="x")["w"]
        assert torch.equal(decoded.indices.long(), change.indices.long()), version
        assert torch.equal(decoded.values.view(torch.int16), change.values.view(torch.int16)), version


def test_reference_on_a_tensor_in_two_groups():
    # A large tensor with few changes, all among its largest weights (an embedding's rows):
    # two groups, whose passes are compiled for one group edge rather than seven.
    generator = torch.Generator().manual_seed(3)
    previous = (torch.randn(300_000, generator=generator) * 0.02).to(torch.bfloat16)
    change = exponent_rate_change(generator, previous, {0: 0.0, 119: 0.02})
    stream = encode_changes({"w": change}, {"w": previous})["w" + SUFFIX]
    assert stream[1] == 2  # groups
    check_against_reference(previous, change)
