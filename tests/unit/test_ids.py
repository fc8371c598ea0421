"""kvcoll.ids.as_keys, the one id validator: what it accepts, and what its refusals say."""

import numpy as np
import pytest

import kvcoll as kv
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
