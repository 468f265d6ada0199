"""How late a timed wait may end in a test: the suite must pass on a loaded machine (a shared CI runner or node,
two busy processes per core: ``.ci/loaded``), where a process can be kept off the CPU for seconds.

A test that checks that a wait ends at its timeout asserts ``timeout <= elapsed < timeout + LATE_S``: the lower
bound is the behaviour (the wait lasted its timeout), the upper bound only catches a wait that did not end at its
timeout at all (JAX's own waits last 60-300 s, a hang forever), so it is generous.
"""

LATE_S = 30.0
