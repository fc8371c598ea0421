"""kvcoll.data: the synthetic CTR set, the Criteo reader and the sharding helpers."""

import gzip
import itertools
import math

import numpy as np
import pytest

from kvcoll import InvalidArgumentError
from kvcoll.data import (
    CriteoFormatError,
    SyntheticCTR,
    auc,
    criteo_id,
    even_split,
    parse_criteo_lines,
    read_criteo,
    shard,
)
from kvcoll.data.synthetic import _Permutation

KEYS = ("categorical", "numeric", "label")


@pytest.fixture(scope="module")
def data():
    return SyntheticCTR(seed=7)


@pytest.fixture(scope="module")
def eval_50k(data):
    return data.eval_set(50_000)


def assert_same_batch(a, b):
    assert a.keys() == b.keys() == set(KEYS)
    for k in KEYS:
        assert a[k].dtype == b[k].dtype
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in KEYS}


# ---- synthetic: determinism and sharding --------------------------------------------

def test_batch_layout(data):
    b = data.batch(0, 64)
    assert b["categorical"].shape == (64, 26) and b["categorical"].dtype == np.int64
    assert b["numeric"].shape == (64, 13) and b["numeric"].dtype == np.float32
    assert b["label"].shape == (64,) and b["label"].dtype == np.float32
    assert set(np.unique(b["label"])) <= {0.0, 1.0}
    assert np.isfinite(b["numeric"]).all() and (b["numeric"] >= 0).all()


@pytest.mark.parametrize("size", [4096, 1001, 2])
def test_rank_slices_concatenate_to_the_world1_batch(data, size):
    full = data.batch(5, size)
    assert_same_batch(full, SyntheticCTR(seed=7).batch(5, size))    # same seed+step, new object
    for world in (1, 2, 3):
        parts = [data.batch(5, size, rank=r, world=world) for r in range(world)]
        sizes = [p["label"].size for p in parts]
        assert max(sizes) - min(sizes) <= 1
        assert_same_batch(concat(parts), full)


def test_samples_are_counter_based(data):
    # Any range of samples equals the same range cut out of a bigger one.
    big = data.samples(1000, 3000)
    assert_same_batch(data.samples(1700, 1710), {k: v[700:710] for k, v in big.items()})
    assert_same_batch(data.batch(2, 500), data.samples(1000, 1500))
    # bit for bit, one sample at a time too: no value depends on its place in a batch
    logits = data.planted_logit(big)
    for i in range(0, 2000, 37):
        one = data.samples(1000 + i, 1001 + i)
        assert_same_batch(one, {k: v[i:i + 1] for k, v in big.items()})
        assert data.planted_logit(one)[0] == logits[i]
    far = 2**40
    assert_same_batch(data.samples(far + 3, far + 5),
                      {k: v[3:] for k, v in data.samples(far, far + 5).items()})


def test_batches_iterates_steps(data):
    it = data.batches(100, rank=1, world=2, start_step=3, num_steps=2)
    got = list(it)
    assert len(got) == 2
    assert_same_batch(got[1], data.batch(4, 100, rank=1, world=2))


def test_distinct_seeds_and_steps_differ(data):
    a = data.batch(0, 256)
    b = SyntheticCTR(seed=8).batch(0, 256)
    c = data.batch(1, 256)
    for other in (b, c):
        assert (a["categorical"] != other["categorical"]).mean() > 0.5
        assert (a["numeric"] != other["numeric"]).mean() > 0.9


def test_eval_set_is_disjoint_from_training(data):
    train = data.samples(0, 20_000)
    ev = data.eval_set(5_000)
    rows = {r.tobytes() for r in np.concatenate(
        [train["categorical"].view(np.uint8).reshape(20_000, -1),
         train["numeric"].view(np.uint8).reshape(20_000, -1)], axis=1)}
    ev_rows = np.concatenate([ev["categorical"].view(np.uint8).reshape(5_000, -1),
                              ev["numeric"].view(np.uint8).reshape(5_000, -1)], axis=1)
    assert not any(r.tobytes() in rows for r in ev_rows)
    assert_same_batch(concat([data.eval_set(5_000, rank=r, world=3) for r in range(3)]), ev)
    assert_same_batch(data.eval_set(10, offset=4_990), {k: v[4_990:] for k, v in ev.items()})


# ---- synthetic: ids ------------------------------------------------------------------

def test_fields_have_disjoint_id_ranges():
    vocab = [5, 1000, 3, 2**20 + 1]
    d = SyntheticCTR(num_categorical=4, num_numeric=2, vocab=vocab, seed=3)
    np.testing.assert_array_equal(d.offsets, [0, 5, 1005, 1008])
    assert d.total_vocab == sum(vocab)
    cat = d.samples(0, 20_000)["categorical"]
    for f, v in enumerate(vocab):
        local = cat[:, f] - d.offsets[f]
        assert local.min() >= 0 and local.max() < v
    assert np.unique(cat[:, 0]).size == 5                 # a tiny field is fully covered


@pytest.mark.parametrize("vocab", [1, 2, 3, 7, 1000, 1024, 1025, 65_537])
def test_scrambling_is_a_bijection(vocab):
    perm = _Permutation(11, np.array([vocab]))
    ranks = np.arange(vocab, dtype=np.uint64)[:, None]
    ids = perm.forward(ranks)
    np.testing.assert_array_equal(np.sort(ids[:, 0]), ranks[:, 0])
    np.testing.assert_array_equal(perm.inverse(ids), ranks)
    if vocab >= 1000:   # frequent ids are not small integers but spread over the range
        assert (ids[:10, 0] >= vocab // 10).sum() >= 7


def test_ids_are_heavy_tailed(data, eval_50k):
    ids = eval_50k["categorical"][:, 3]
    _, counts = np.unique(ids, return_counts=True)
    counts = np.sort(counts)[::-1]
    top = counts[: max(1, counts.size // 100)].sum() / counts.sum()
    assert top > 0.4, f"top 1% of distinct ids hold only {top:.2f} of occurrences"
    assert counts[0] / counts.sum() > 0.03                # the hottest id is really hot
    assert counts.size > 5_000                            # and there is a long tail
    ranks = data.id_rank(eval_50k)
    assert np.median(ranks) < 1_000 and ranks.max() > 100_000


# ---- synthetic: planted model --------------------------------------------------------

def test_label_mean_is_ctr_like(eval_50k):
    assert 0.2 < eval_50k["label"].mean() < 0.3


def test_planted_model_explains_the_labels(data, eval_50k):
    p = data.planted_probability(eval_50k)
    y = eval_50k["label"]
    # calibrated: the labels were drawn from exactly these probabilities
    assert abs(p.mean() - y.mean()) < 0.01
    for lo, hi in ((0.0, 0.1), (0.3, 0.5), (0.7, 1.0)):
        sel = (p >= lo) & (p < hi)
        assert sel.sum() > 500
        assert abs(y[sel].mean() - p[sel].mean()) < 0.03
    assert 0.77 < data.planted_auc(eval_50k) < 0.84      # the documented range
    rng = np.random.default_rng(0)
    assert abs(auc(y, rng.permutation(p)) - 0.5) < 0.02


def test_planted_auc_is_stable_across_seeds():
    for seed in (0, 1):
        assert 0.77 < SyntheticCTR(seed=seed).planted_auc(20_000) < 0.84


def test_planted_logit_rejects_foreign_batches(data):
    b = data.batch(0, 8)
    bad = dict(b, categorical=b["categorical"].copy())
    bad["categorical"][2, 4] = 0                          # an id of field 0, not field 4
    with pytest.raises(InvalidArgumentError, match=r"\[2, 4\] = 0 is not an id of field 4"):
        data.planted_logit(bad)
    with pytest.raises(InvalidArgumentError, match="must be integer"):
        data.planted_logit(dict(b, categorical=b["categorical"][:, :5]))


@pytest.mark.parametrize("kwargs,match", [
    ({"seed": -1}, "seed must be a non-negative int"),
    ({"vocab": 0}, "vocab must be a positive int"),
    ({"vocab": [10, 20]}, "vocab must be a positive int or 26 of them"),
    ({"zipf_a": 0}, "zipf_a must be > 0"),
    ({"num_categorical": 0}, "num_categorical must be an int >= 1"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SyntheticCTR(**kwargs)


def test_bad_batch_arguments(data):
    with pytest.raises(InvalidArgumentError, match="rank < world"):
        data.batch(0, 10, rank=2, world=2)
    with pytest.raises(InvalidArgumentError, match="global_batch_size"):
        data.batch(0, 0)


# ---- synthetic: the C kernel against a numpy reference of the definitions ---------------

_G = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def ref_mix(x):
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def ref_unit(h):
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def ref_ranks(d, h):
    """Zipf ranks, with libm's pow / exp (Python's math module) like the kernel's."""
    u = ref_unit(h)
    if abs(d.zipf_a - 1.0) < 1e-9:
        x = np.frompyfunc(math.exp, 1, 1)(u * d._zipf_c)
    else:
        x = np.frompyfunc(math.pow, 2, 1)(1.0 + u * d._zipf_c, 1.0 / (1.0 - d.zipf_a))
    x = x.astype(np.float64)
    r = np.where((x >= 1.0) & (x < 2.0**62), x, 0.0).astype(np.uint64) - np.uint64(1)
    return np.minimum(r, d.vocab.astype(np.uint64) - np.uint64(1))    # x < 1 wraps, as numpy


def ref_scramble(p, x):
    """The per-field bijection, round by round (A B A B A)."""
    def low_mix(x, r):
        y = (x + p.add[r]) & p.mask
        y ^= y >> p.shift
        y = (y * p.mul[r]) & p.mask
        y ^= y >> p.shift
        return np.where(x <= p.mask, y, x)

    x = low_mix(x, 0)
    for r in range(1, p.ROUNDS):
        x = x + p.rot[r - 1]
        x = low_mix(np.where(x >= p.vocab, x - p.vocab, x), r)
    return x


def ref_numbers(d, h):
    f32 = np.float32
    u1 = ((h >> np.uint64(40)).astype(f32) + f32(0.5)) * f32(2.0**-24)
    u2 = (h & np.uint64(0xFFFFFF)).astype(f32) * f32(2 * math.pi / 2**24)
    z = np.sqrt(np.log(u1) * f32(-2.0)) * np.cos(u2) * d._sigma + d._mu
    return np.log1p(np.exp(z))


def ref_logit(d, ranks, numeric):
    """The planted logit in numpy float32 (row sums: numpy's pairwise reductions)."""
    decay = np.reciprocal(np.sqrt(ranks.astype(np.float32) * np.float32(1.0 / 200.0)
                                  + np.float32(1.0)))
    h = ref_mix(ranks * _G + d._param_keys)
    logit = (((h & np.uint64(0xFFFF)).astype(np.float32) * d._w_mul - d._w_sub) * decay).sum(axis=1)
    a, b = decay * d._v_mul, decay * d._v_sub
    pair = np.zeros(ranks.shape[0], np.float32)
    for shift in (16, 28, 40, 52):
        part = ((h >> np.uint64(shift)) & np.uint64(0xFFF)).astype(np.float32) * a - b
        pair += np.square(part.sum(axis=1))
        pair -= (part * part).sum(axis=1)
    logit += np.float32(0.5) * pair
    logit += ((numeric - d._center) * d._beta).sum(axis=1)
    return logit.astype(np.float64) + d._bias


@pytest.mark.parametrize("kwargs", [
    {"seed": 7},
    {"num_categorical": 4, "num_numeric": 2, "vocab": [5, 1000, 3, 2**20 + 1], "zipf_a": 1.0,
     "seed": 3},
    {"num_categorical": 3, "num_numeric": 0, "vocab": [2**40, 7, 2**61 + 1], "zipf_a": 0.6,
     "seed": 5},                                  # ranks beyond 2^52: libm decides them all
    {"num_categorical": 150, "num_numeric": 1, "vocab": 100, "zipf_a": 2.5, "seed": 1},
])
def test_kernel_matches_the_numpy_reference(kwargs):
    d = SyntheticCTR(**kwargs)
    lo, hi = 12_345, 13_845
    b = d.samples(lo, hi, stream="eval")
    nf, nd = d.num_categorical, d.num_numeric
    h = ref_mix(np.arange(lo, hi, dtype=np.uint64)[:, None] * _G + d._sample_keys[1])
    # the integer pipeline, exactly: hashes -> ranks -> scrambled ids + offsets
    ranks = ref_ranks(d, h[:, :nf])
    np.testing.assert_array_equal(d.id_rank(b), ranks.view(np.int64))
    np.testing.assert_array_equal(b["categorical"],
                                  ref_scramble(d._perm, ranks).view(np.int64) + d.offsets)
    # the numbers: the same float32 steps, each function within a few ulps of numpy's
    np.testing.assert_allclose(b["numeric"], ref_numbers(d, h[:, nf:nf + nd]), rtol=4e-6)
    # the logit, bit for bit numpy's float32 code on the same ranks and numbers, and the
    # labels drawn from it (libm's tanh, as the kernel)
    logit = ref_logit(d, ranks, b["numeric"])
    np.testing.assert_array_equal(d.planted_logit(b), logit)
    p = 0.5 * (1.0 + np.frompyfunc(math.tanh, 1, 1)(0.5 * logit).astype(np.float64))
    np.testing.assert_array_equal(b["label"], (ref_unit(h[:, -1]) < p).astype(np.float32))


def test_planted_logit_of_any_ids():
    # planted_logit works on any valid ids, not only generated ones: all ranks of a tiny
    # field and the extremes of a big one
    d = SyntheticCTR(num_categorical=2, num_numeric=1, vocab=[3, 10**7], seed=4)
    ranks = np.array([[0, 0], [1, 10**7 - 1], [2, 12345]], np.uint64)
    batch = {"categorical": d._perm.forward(ranks).view(np.int64) + d.offsets,
             "numeric": np.array([[0.5], [2.0], [7.0]], np.float32)}
    np.testing.assert_array_equal(d.id_rank(batch), ranks.view(np.int64))
    np.testing.assert_array_equal(d.planted_logit(batch),
                                  ref_logit(d, ranks, batch["numeric"]))


# ---- auc --------------------------------------------------------------------------------

def brute_force_auc(y, s):
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (pos.size * neg.size)


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_pair_count(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    y = rng.integers(0, 2, n)
    y[:2] = [0, 1]
    s = rng.integers(0, 5, n).astype(np.float64) if seed % 2 else rng.normal(size=n)  # ties
    assert auc(y, s) == pytest.approx(brute_force_auc(y, s), abs=1e-12)


def test_auc_edge_cases():
    assert auc([0, 1], [0.1, 0.9]) == 1.0
    assert auc([1, 0], [0.1, 0.9]) == 0.0
    assert auc([0, 1, 0, 1], [3, 3, 3, 3]) == 0.5
    with pytest.raises(InvalidArgumentError, match="both classes"):
        auc([1, 1], [0.1, 0.2])
    with pytest.raises(InvalidArgumentError, match="0 or 1"):
        auc([0, 2], [0.1, 0.2])
    with pytest.raises(InvalidArgumentError, match="differ in length"):
        auc([0, 1], [0.1])


# ---- criteo ---------------------------------------------------------------------------

def criteo_line(label, ints, cats, end="\n"):
    return "\t".join([str(label), *map(str, ints), *cats]) + end


LINES = [
    criteo_line(0, [1, "", 0, 5, 1382, 4, 15, 2, 181, 1, 2, "", 2],
                ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf",
                 "de7995b8", "1f89b562", "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164",
                 "2824a5f6", "1adce6ef", "8ba8b39a", "891b62e7", "e5ba7672", "f54016b9",
                 "21ddcdc9", "b1252a9d", "07b5194c", "", "3a171ecb", "c5c50484",
                 "e8b83407", "9727dd16"]),
    criteo_line(1, ["", -1, "", "", "", "", "", "", "", "", "", "", ""],
                [""] * 25 + ["FFFFFFFF"], end="\r\n"),
    criteo_line(0, [0] * 13, ["0"] * 26),
    criteo_line(1, [3] * 13, ["abc"] * 26, end=""),      # last line, no newline
]


def test_parse_criteo_values():
    b = parse_criteo_lines([ln.encode() for ln in LINES])
    np.testing.assert_array_equal(b["label"], [0, 1, 0, 1])
    assert b["numeric"].dtype == np.float32 and b["numeric"].shape == (4, 13)
    np.testing.assert_allclose(b["numeric"][0, :5], np.log1p([1, 0, 0, 5, 1382]), rtol=1e-6)
    np.testing.assert_allclose(b["numeric"][1, :2], [0, -np.log1p(1)], rtol=1e-6)  # missing, -1
    cat = b["categorical"]
    assert cat.dtype == np.int64 and cat.shape == (4, 26)
    assert cat[0, 0] == criteo_id(0, 0x68FD1E64) == 0x68FD1E64
    assert cat[0, 25] == criteo_id(25, 0x9727DD16) == (25 << 33) + 0x9727DD16
    assert cat[0, 21] == criteo_id(21, None) == (21 << 33) + 2**32      # missing
    assert cat[1, 25] == (25 << 33) + 0xFFFFFFFF                        # upper case hex
    assert cat[3, 7] == (7 << 33) + 0xABC
    assert cat[2, 0] == 0 and cat[2, 1] == 1 << 33                        # "0" is not missing
    # fields never share an id: the field is in the high bits
    np.testing.assert_array_equal(cat >> 33, np.broadcast_to(np.arange(26), (4, 26)))


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("world", [1, 2, 3])
def test_read_criteo_shards_each_global_batch(tmp_path, world):
    lines = [criteo_line(i % 2, [i] * 13, [format(i * 7919, "x")] * 26) for i in range(11)]
    path = write(tmp_path, "day.tsv", lines)
    full = list(read_criteo(path, batch_size=4))
    assert [b["label"].size for b in full] == [4, 4, 3]
    np.testing.assert_allclose(concat(full)["numeric"][:, 0], np.log1p(np.arange(11)), rtol=1e-6)
    per_rank = [list(read_criteo(str(path), 4, rank=r, world=world)) for r in range(world)]
    assert {len(p) for p in per_rank} == {3}                  # same number of steps everywhere
    for step in range(3):
        assert_same_batch(concat([p[step] for p in per_rank]), full[step])
    assert len(list(read_criteo(path, 4, drop_remainder=True))) == 2


def test_read_criteo_several_files_and_gzip(tmp_path):
    a = write(tmp_path, "a.tsv", LINES[:3])
    with gzip.open(tmp_path / "b.tsv.gz", "wt") as f:
        f.write("\n".join(LINES[3:] * 2))
    got = concat(list(read_criteo([a, tmp_path / "b.tsv.gz"], batch_size=2)))
    expect = parse_criteo_lines([ln.encode() for ln in LINES + LINES[3:]])
    assert_same_batch(got, expect)


def test_malformed_line_names_file_and_line(tmp_path):
    bad = "1\t2\t3\n"
    path = write(tmp_path, "bad.tsv", LINES[:3] + [bad] + LINES[:2])
    # line 4 is rank 1's (the second line of global batch 1): only the rank that parses
    # a line finds it bad; model.fit's step agreement raises it on every rank
    with pytest.raises(CriteoFormatError, match=r"bad\.tsv line 4: expected 40 tab-separated "
                                                r"columns .* got 3"):
        list(read_criteo(path, batch_size=2, rank=1, world=2))
    assert [b["label"].size for b in read_criteo(path, batch_size=2, rank=0, world=2)] == [1] * 3


@pytest.mark.parametrize("col,value,match", [
    (0, "2", "column 1: the label must be 0 or 1, got '2'"),
    (0, "", "column 1: the label must be 0 or 1, got ''"),
    (3, "x1", "column 4: 'x1' is not an integer of at most 18 digits"),
    (3, "-", "column 4: '-' is not an integer"),
    (3, "1.5", "column 4: '1.5' is not an integer"),
    (5, "1234567890123456789", "column 6: '1234567890123456789' is not an integer"),
    (20, "12345678a", "column 21: '12345678a' is not a hex string of at most 8 digits"),
    (39, "zz", "column 40: 'zz' is not a hex string"),
])
def test_bad_values_name_line_and_column(tmp_path, col, value, match):
    cols = LINES[0].rstrip("\n").split("\t")
    cols[col] = value
    path = write(tmp_path, "v.tsv", LINES[:2] + ["\t".join(cols) + "\n"] + LINES[2:3])
    with pytest.raises(CriteoFormatError, match=r"v\.tsv line 3: " + match):
        list(read_criteo(path, batch_size=10))


def test_read_criteo_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no such file"):
        read_criteo(tmp_path / "missing.tsv", 4)
    path = write(tmp_path, "ok.tsv", LINES)
    with pytest.raises(InvalidArgumentError, match="batch_size must be an int >= 1"):
        read_criteo(path, 0)
    with pytest.raises(InvalidArgumentError, match="rank < world"):
        read_criteo(path, 4, rank=3, world=3)


# ---- sharding ---------------------------------------------------------------------------

def test_even_split():
    assert [even_split(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [even_split(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for n, world in itertools.product(range(20), range(1, 6)):
        parts = [even_split(n, r, world) for r in range(world)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        sizes = [hi - lo for lo, hi in parts]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    with pytest.raises(InvalidArgumentError, match="rank < world"):
        even_split(5, -1, 2)


def test_shard_every_world_th_element():
    assert shard(list(range(10)), 1, 3) == [1, 4, 7]
    arr = np.arange(10)
    view = shard(arr, 0, 2)
    np.testing.assert_array_equal(view, [0, 2, 4, 6, 8])
    assert np.shares_memory(view, arr)
    gen = shard((i * i for i in range(10)), 2, 4)
    assert list(gen) == [4, 36]
    assert list(shard(iter(range(3)), 2, 3)) == [2]

    class FakeDataset:          # the tf.data.Dataset protocol: shard(num_shards, index)
        def shard(self, num_shards, index):
            return ("sharded", num_shards, index)
    assert shard(FakeDataset(), 1, 4) == ("sharded", 4, 1)


def test_shard_errors():
    with pytest.raises(InvalidArgumentError, match="rank < world"):
        shard([1, 2], 2, 2)
    with pytest.raises(InvalidArgumentError, match="both rank and world"):
        shard([1, 2], rank=0)
    with pytest.raises(InvalidArgumentError, match="str or bytes"):
        shard("abc", 0, 1)
    with pytest.raises(InvalidArgumentError, match="needs a dataset, a sequence or an iterable"):
        shard(42, 0, 1)
