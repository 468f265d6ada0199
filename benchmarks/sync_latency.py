"""Latency of spmdcomm's coordination-service syncs across processes (run under the launcher).

    spmdcomm-launch -n 2 --devices-per-process 1 benchmarks/sync_latency.py

Process 0 prints the median and 90th percentile wall time per call, in milliseconds, of each sync.
"""

import time

import spmdcomm as sc

sc.initialize()

import numpy as np  # noqa: E402


def timed(name, fn, reps=50):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if sc.is_main_process():
        median, p90 = np.median(times), np.percentile(times, 90)
        print(f"{name:34s} median {median:7.2f} ms   p90 {p90:7.2f} ms", flush=True)


f = sc.spmd(lambda b: sc.psum(b, "data"), in_specs=sc.P("data"), out_specs=sc.P())
x = np.ones((sc.local_device_count(), 4), np.float32)  # this process's rows: one per local device
timed("barrier", lambda: sc.barrier("bench"))
timed("host_all_reduce (3 scalars)", lambda: sc.host_all_reduce({"a": 1.0, "b": 2, "c": 3.0}))
timed("host_all_reduce (1 MB)", lambda: sc.host_all_reduce(np.ones(2**18, np.float32)), reps=20)
timed("all_gather_object (small dict)", lambda: sc.all_gather_object({"rank": 1}))
timed("broadcast_object (small dict)", lambda: sc.broadcast_object({"seed": 1}))
timed("spmd psum call", lambda: f(x).block_until_ready())
sc.set_debug(True)
timed("spmd psum call, debug check on", lambda: f(x).block_until_ready())
sc.set_debug(False)
