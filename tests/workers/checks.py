"""What the worker scripts share: recording NumPy-checked results and expected errors (imported from the
script's own folder, which Python puts on the path)."""

import numpy as np

checks: list[str] = []


def check(name, got, want):
    """Asserts ``got`` equals ``want`` exactly and records the check (workers print how many passed)."""
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    checks.append(name)


def expect(name, error_type, fn):
    """Runs ``fn``, which must raise ``error_type``; prints ``CAUGHT <name>: <message>`` for the test to read."""
    try:
        fn()
    except error_type as e:
        print(f"CAUGHT {name}: {e}", flush=True)
    else:
        raise AssertionError(f"{name}: no {error_type.__name__} raised")
