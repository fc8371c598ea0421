"""kvcoll.ids: as_keys, the one id validator (what it accepts, what its refusals say);
hash_strings, whose XXH64 keys are pinned (existing checkpoints hold them) and whose
FarmHash Fingerprint64 keys equal tf.fingerprint's bit for bit, in every layout; and the
run's hash (the id_hash setting, a checkpoint's hash adopted or refused)."""

import numpy as np
import pytest

import kvcoll as kv
from kvcoll import InvalidArgumentError
from kvcoll.ids import as_keys, hash_strings


def test_int64_passes_as_it_is_and_int32_is_widened():
    k = np.array([3, -1, 2**40], np.int64)
    assert as_keys(k) is k
    got = as_keys(np.array([3, -1], np.int32))
    assert got.dtype == np.int64 and got.tolist() == [3, -1]
    strided = np.arange(10, dtype=np.int64)[::2]
    assert as_keys(strided).flags.c_contiguous and as_keys(strided).tolist() == [0, 2, 4, 6, 8]


def test_strings_are_hashed_and_an_empty_list_is_an_empty_batch():
    words = ["a", "bc"]
    np.testing.assert_array_equal(as_keys(words), hash_strings(words))
    np.testing.assert_array_equal(as_keys(np.array(words, dtype=object)), hash_strings(words))
    for empty in ([], np.asarray([]), np.array([], str), np.array([], object)):
        got = as_keys(empty)
        assert got.dtype == np.int64 and got.shape == (0,)


@pytest.mark.parametrize("values,match", [
    (np.array([1.0], np.float32), r"^ids must be int64 or int32, got float32 \(string ids "
                                  r"are accepted too: they are hashed with "
                                  r"kvcoll\.ids\.hash_strings\)"),
    (np.array([1], np.uint32), r"got uint32; cast them with \.astype\(np\.int64\)"),
    (np.array([1], np.uint64), r"got uint64; if they are opaque 64-bit values, view them as "
                               r"int64 with \.view\(np\.int64\)"),
    (np.zeros((2, 2), np.int64), r"^ids must be 1-D, got shape \(2, 2\); flatten them"),
    (np.array(["a", 1], dtype=object), r"str or bytes"),
], ids=["float32", "uint32", "uint64", "2-D", "mixed strings"])
def test_refusals_name_the_dtype_or_shape_and_the_fix(values, match):
    with pytest.raises(kv.InvalidArgumentError, match=match):
        as_keys(values)


def test_refusals_name_the_table_or_what():
    with pytest.raises(kv.InvalidArgumentError, match=r"^table 'user': ids must be int64"):
        as_keys(np.array([0.5]), table="user")
    with pytest.raises(kv.InvalidArgumentError, match=r"^table 'user': string ids must all be"):
        as_keys(np.array(["a", None], dtype=object), table="user")
    with pytest.raises(kv.InvalidArgumentError, match=r"^feature 'f' ids must be 1-D"):
        as_keys(np.zeros((1, 1), np.int32), "feature 'f' ids")


# -- string ids: a hash's keys never change (checkpoints hold them) ---------------------

# XXH64, seed 0, of each id's UTF-8 bytes: the keys kvcoll.ids.hash_strings gave before
# its C fast paths (one Python encode per id, then kv_hash_strings), and the published
# xxHash64 values for "", "a" and "abc". Lengths cross every branch of XXH64 (the
# 4- and 8-byte tails, the 32-byte stripes).
PINNED = [
    ("", 0xEF46DB3751D8E999),
    ("a", 0xD24EC4F1A98C6E5B),
    ("ab", 0x65F708CA92D04A61),
    ("abc", 0x44BC2CF5AD770999),
    ("abcd", 0xDE0327B0D25D92CC),
    ("abcde", 0x07E3670C0C8DC7EB),
    ("abcdefg", 0x1860940E2902822D),
    ("abcdefgh", 0x3AD351775B4634B7),
    ("abcdefghi", 0x27F1A34FDBB95E13),
    ("0123456789abcdef0123456789abcde", 0x1FDFC63FEBACFDE7),
    ("0123456789abcdef0123456789abcdef", 0x642A94958E71E6C5),
    ("0123456789abcdef0123456789abcdef0", 0xE87684F08D6D0816),
    ("68fd1e64", 0x5D3CCD85C9C22FE4),
    ("user_12345", 0x071E7C883A565B2B),
    ("ümlaut", 0x9B49FF9A3532FE3C),
    ("日本語", 0x7179A19F3719F5E1),
    ("🙂 emoji", 0x288B1989A726BA28),
    ("x" * 100, 0x92F0DE5A88A3C094),
    ("tab\there", 0x6C1B38A603EADA1A),
    ("nul\x00inside", 0xD85A5C9C848258E8),
]
WORDS = [w for w, _ in PINNED]
WANT = np.array([k for _, k in PINNED], np.uint64).view(np.int64)


def _layouts():
    """The same ids in every layout hash_strings takes."""
    import pyarrow as pa

    u = np.array(WORDS)
    yield "list of str", WORDS
    yield "numpy U", u
    yield "numpy U, big-endian", u.astype(u.dtype.newbyteorder(">"))
    yield "numpy U, strided", np.repeat(u, 2)[::2]
    yield "numpy S (UTF-8)", np.array([w.encode() for w in WORDS], dtype=object).astype("S")
    yield "object str", np.array(WORDS, dtype=object)
    yield "object bytes", np.array([w.encode() for w in WORDS], dtype=object)
    yield "object mixed", np.array([w.encode() if i % 2 else w for i, w in enumerate(WORDS)],
                                   dtype=object)
    for t in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary(), pa.string_view()):
        yield f"arrow {t}", pa.array([w.encode() for w in WORDS], t)
    yield "arrow dictionary", pa.array(WORDS + WORDS[:5]).dictionary_encode()
    yield "arrow sliced", pa.array(["pad", "pad2"] + WORDS).slice(2)
    yield "arrow chunked", pa.chunked_array([pa.array(WORDS[:7]), pa.array(WORDS[7:])])


@pytest.mark.parametrize("name,values", list(_layouts()), ids=lambda x: x if isinstance(x, str) else "")
def test_string_keys_equal_the_pinned_values_in_every_layout(name, values):
    got = hash_strings(values, "xxh64")
    np.testing.assert_array_equal(got[:len(WORDS)], WANT, err_msg=name)
    assert got.dtype == np.int64


def _tf_fingerprints(ids: list) -> np.ndarray:
    """What a SavedModel computes: tf.fingerprint of a 1-D string tensor, as int64."""
    import tensorflow as tf

    return tf.bitcast(tf.fingerprint(tf.constant(ids, tf.string)), tf.int64).numpy()


@pytest.mark.parametrize("name,values", list(_layouts()), ids=lambda x: x if isinstance(x, str) else "")
def test_farmhash64_keys_equal_tf_fingerprint_in_every_layout(name, values):
    want = _tf_fingerprints([w.encode() for w in WORDS])
    got = hash_strings(values, "farmhash64")
    np.testing.assert_array_equal(got[:len(WORDS)], want, err_msg=name)


def test_farmhash64_equals_tf_fingerprint_on_many_ids():
    """Every length 0..300 (each FarmHash path and every tail), random bytes (not UTF-8),
    unicode, long ids and a million-byte one: C and TensorFlow agree bit for bit."""
    g = np.random.default_rng(5)
    ids = [bytes(g.integers(0, 256, n, dtype=np.uint8)) for n in range(301)]
    ids += [bytes(g.integers(0, 256, g.integers(0, 200), dtype=np.uint8)) for _ in range(3000)]
    ids += [w.encode() for w in ("ümlaut", "日本語", "🙂 emoji", "user_12345", "")]
    ids += [b"a" * n for n in (1000, 4096, 65537)] + [bytes(g.integers(0, 256, 1 << 20,
                                                                      dtype=np.uint8))]
    want = _tf_fingerprints(ids)
    np.testing.assert_array_equal(hash_strings(np.array(ids, dtype=object), "farmhash64"), want)
    np.testing.assert_array_equal(
        hash_strings(np.array([i.rstrip(b"\0") for i in ids[:301]], "S"), "farmhash64"),
        _tf_fingerprints([i.rstrip(b"\0") for i in ids[:301]]))
    text = ["".join(chr(c) for c in g.integers(32, 0x2FFF, n)) for n in range(70)]
    np.testing.assert_array_equal(hash_strings(np.array(text), "farmhash64"),
                                  _tf_fingerprints([t.encode() for t in text]))


def test_the_two_hashes_differ_and_unknown_ones_are_refused():
    assert (hash_strings(WORDS, "farmhash64") != hash_strings(WORDS, "xxh64")).all()
    with pytest.raises(InvalidArgumentError, match="id hash 'md5' is unknown; use one of "
                                                   "farmhash64, xxh64"):
        hash_strings(WORDS, "md5")


def test_fixed_width_strings_drop_trailing_nuls_only():
    # numpy's own rule: 'S'/'U' items end at their trailing NULs; inner NULs count
    s = np.array([b"ab", b"ab\x00c"], dtype="S6")
    np.testing.assert_array_equal(hash_strings(s),
                                  hash_strings(np.array([b"ab", b"ab\x00c"], dtype=object)))
    assert hash_strings(np.array([""], "U0"), "xxh64")[0] == WANT[0]
    assert hash_strings(np.zeros(3, "S4"), "xxh64").tolist() == [int(WANT[0])] * 3


def test_arrow_nulls_and_bad_string_ids_are_named():
    import pyarrow as pa

    from kvcoll.ids import arrow_keys

    keys, valid = arrow_keys(pa.array(["a", None, "abc"]), "xxh64")
    assert valid.tolist() == [True, False, True]
    assert keys[[0, 2]].tolist() == [int(WANT[1]), int(WANT[3])]
    with pytest.raises(InvalidArgumentError, match="got a null at index 1"):
        hash_strings(pa.array(["a", None]))
    with pytest.raises(InvalidArgumentError, match="must all be str or bytes, got NoneType"):
        hash_strings(np.array(["a", None], dtype=object))
    with pytest.raises(InvalidArgumentError, match="must all be str or bytes, got int 1"):
        hash_strings(np.array([1, "a"], dtype=object))
    with pytest.raises(InvalidArgumentError, match=r"id 1 \('\\ud800'\).*lone surrogate"):
        hash_strings(np.array(["a", "\ud800"]))
    with pytest.raises(InvalidArgumentError, match="valid text"):
        hash_strings(np.array(["\ud800"], dtype=object))
    with pytest.raises(InvalidArgumentError, match="pyarrow string or binary array, got int64"):
        hash_strings(pa.array([1, 2]))


# -- the run's hash ----------------------------------------------------------------------

@pytest.fixture()
def fresh_run():
    """kvcoll.ids, its run state as a new process has it (tests/unit/conftest.py)."""
    from kvcoll import ids

    return ids


def test_a_new_run_hashes_with_farmhash64_and_the_setting_can_choose(fresh_run, monkeypatch):
    ids = fresh_run
    assert ids.id_hash() == "farmhash64"
    np.testing.assert_array_equal(as_keys(np.array(WORDS)), hash_strings(WORDS, "farmhash64"))
    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    monkeypatch.setenv("KVCOLL_ID_HASH", "xxh64")
    np.testing.assert_array_equal(as_keys(np.array(WORDS)), WANT)
    monkeypatch.setenv("KVCOLL_ID_HASH", "sha1")
    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    with pytest.raises(InvalidArgumentError, match="id_hash 'sha1' is unknown; use one of "
                                                   "auto, farmhash64, xxh64"):
        ids.id_hash()


def test_a_checkpoint_hash_is_adopted_only_while_the_run_is_open(fresh_run):
    ids = fresh_run
    where = "ckpt-0000000004"
    assert ids.id_hash_conflict("farmhash64", where) is None
    assert ids.id_hash_conflict("xxh64", where) is None     # default, nothing hashed yet
    ids.adopt_id_hash("xxh64", where)
    assert ids.id_hash() == "xxh64"
    np.testing.assert_array_equal(hash_strings(WORDS), WANT)  # now it is used
    err = ids.id_hash_conflict("farmhash64", where)
    assert err.startswith("ckpt-0000000004 was written with id_hash 'farmhash64', but this "
                          "run hashes string ids with 'xxh64' (this process already hashed "
                          "string ids with it)")
    assert "--id-hash farmhash64 (or KVCOLL_ID_HASH=farmhash64" in err
    with pytest.raises(kv.KvcollError, match="would not match"):
        ids.adopt_id_hash("farmhash64", where)
    assert ids.id_hash() == "xxh64"
    assert "does not know" in ids.id_hash_conflict("sha1", where)


def test_a_set_hash_refuses_another_checkpoint_hash(fresh_run):
    ids = fresh_run
    ids.configure("farmhash64")
    assert "(the id_hash setting says so)" in ids.id_hash_conflict("xxh64", "c")
    ids.configure("auto")                       # keeps what is set
    assert ids.id_hash() == "farmhash64"
    hash_strings(["a"])
    with pytest.raises(InvalidArgumentError, match="already hashed string ids with "
                                                   "'farmhash64' before kv.init"):
        ids.configure("xxh64")
    ids.configure("farmhash64")                 # the same: fine
