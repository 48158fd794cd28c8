import ml_dtypes
import numpy as np
import pytest

from refcoll.core.errors import UsageError
from refcoll.core.ops import DTYPES, OPS, check_supported, exact_integer_limit, get_dtype, get_op


def test_unknown_op_and_dtype_name_the_choices():
    with pytest.raises(UsageError, match="choose one of sum, prod, min, max, avg"):
        get_op("mean")
    with pytest.raises(UsageError, match="unknown dtype"):
        get_dtype("float128x")
    with pytest.raises(UsageError, match="unsupported dtype"):
        get_dtype(np.complex64)


def test_float8_supports_only_sum_min_max():
    for name in ("float8_e4m3fn", "float8_e5m2"):
        for op in ("sum", "min", "max"):
            check_supported(get_op(op), DTYPES[name])
        for op in ("prod", "avg"):
            with pytest.raises(UsageError, match="float8"):
                check_supported(get_op(op), DTYPES[name])


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64"])
def test_integer_avg_truncates_toward_zero(dtype):
    buf = np.array([-7, -6, -1, 0, 1, 7, 8], dtype=dtype)
    OPS["avg"].finalize(buf, 2)
    assert buf.tolist() == [int(v / 2) for v in [-7, -6, -1, 0, 1, 7, 8]]
    extreme = np.array([np.iinfo(dtype).min, np.iinfo(dtype).max], dtype=dtype)
    OPS["avg"].finalize(extreme, 3)
    assert extreme.tolist() == [-(-int(np.iinfo(dtype).min) // 3), int(np.iinfo(dtype).max) // 3]


def test_integer_avg_over_more_ranks_than_the_type_holds_divides_the_wrapped_sum():
    """At p = 128 an int8 sum may wrap to -128, and -128 / 128 is -1: it was taken as 0."""
    buf = np.array([-128, 127, -127, 0], np.int8)
    OPS["avg"].finalize(buf, 128)
    assert buf.tolist() == [-1, 0, 0, 0]
    buf = np.array([-128, 127], np.int8)
    OPS["avg"].finalize(buf, 129)
    assert buf.tolist() == [0, 0]
    wide = np.array([255, 3], np.uint8)
    OPS["avg"].finalize(wide, 300)
    assert wide.tolist() == [0, 0]


def test_unsigned_avg_and_float_avg():
    buf = np.array([255, 7, 6], dtype=np.uint8)
    OPS["avg"].finalize(buf, 2)
    assert buf.tolist() == [127, 3, 3]
    f = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    OPS["avg"].finalize(f, 3)
    assert f.dtype == ml_dtypes.bfloat16
    assert f.tolist() == [ml_dtypes.bfloat16(1.0 / 3), ml_dtypes.bfloat16(2.0 / 3)]


def test_integer_sum_wraps_like_numpy():
    a = np.array([127], dtype=np.int8)
    out = np.empty_like(a)
    OPS["sum"].apply(a, a, out)
    assert out[0] == np.int8(-2)


def test_exact_integer_limit_matches_the_mantissa():
    assert exact_integer_limit(np.float32) == 2 ** 24
    assert exact_integer_limit(ml_dtypes.bfloat16) == 2 ** 8
    assert exact_integer_limit(ml_dtypes.float8_e4m3fn) == 16
    for dt in ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"):
        limit = exact_integer_limit(DTYPES[dt])
        values = np.arange(-limit, limit + 1, dtype=np.float64)
        assert np.array_equal(values.astype(DTYPES[dt]).astype(np.float64), values)


def test_ml_dtypes_is_loaded_on_first_need_not_at_start():
    # Loading ml_dtypes takes about half a second: refcoll and its command line start
    # without it, ask for it by name, and meet its types in a user's arrays (made after
    # the user imported it) as if it had been there all along.
    import subprocess
    import sys

    script = (
        "import sys, numpy as np, refcoll, refcoll.cli\n"
        "from refcoll.core import ops\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported at start'\n"
        "assert ops.is_float(np.float32) and ops.dtype_name(np.int8) == 'int8'\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported by a NumPy type'\n"
        "import ml_dtypes\n"
        "x = np.arange(6).astype(ml_dtypes.bfloat16)\n"
        "assert ops.dtype_name(x.dtype) == 'bfloat16' and ops.is_float(x.dtype)\n"
        "assert ops.get_dtype(x.dtype) == x.dtype and x.dtype in ops.DTYPE_NAMES\n"
        "assert ops.get_dtype('float8_e4m3fn').name == 'float8_e4m3fn'\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
    name = subprocess.run([sys.executable, "-c", "import sys\nfrom refcoll.core.ops import "
                           "get_dtype, finfo\nprint(get_dtype('bfloat16'), "
                           "finfo('bfloat16').nmant, 'ml_dtypes' in sys.modules)"],
                          capture_output=True, text=True)
    assert name.stdout.split() == ["bfloat16", "7", "True"], name.stdout + name.stderr
