"""A tritonclient calling identity_fp32 every 50 ms, each call within a deadline, until its stdin closes; then it
prints its calls, errors and slowest call as one JSON line. The attack tier's concurrent client runs as this
process: a thread in the test's own process waited for the GIL behind the test's 256 MiB bodies (1.4 s at load 10
here, 0.1-0.25 s for this process beside it), which timed the test, not the server.

Usage: python steady_client.py HOST:PORT DEADLINE_S"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> None:
    address, deadline = sys.argv[1], float(sys.argv[2])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    client = grpcclient.InferenceServerClient(address)
    data = np.arange(8, dtype=np.float32).reshape(1, 8)
    calls, errors, slowest = 0, [], 0.0
    print("calling", flush=True)
    while not stop.is_set():
        start = time.monotonic()
        try:
            tensor = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
            tensor.set_data_from_numpy(data)
            result = client.infer("identity_fp32", [tensor], client_timeout=deadline)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
            calls += 1
        except Exception as exc:
            errors.append(repr(exc)[:300])
        slowest = max(slowest, time.monotonic() - start)
        stop.wait(0.05)
    client.close()
    print(json.dumps({"calls": calls, "errors": errors, "slowest": slowest}), flush=True)


if __name__ == "__main__":
    main()
