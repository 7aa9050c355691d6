"""frontends/transport/busy_poll.BusyPoll: the loop polls after requests for an adaptive time, then sleeps; and a server that
polls by default stops using the CPU once its requests stop."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from helpers import NaiadProcess

from naiad.frontends.transport.busy_poll import BusyPoll
from naiad.scheduling.pool import InstancePool

US = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def request_then_idle(poll: BusyPoll, clock: Clock, idle_us: int) -> int:
    """A turn starts a request; then none comes for `idle_us`. The limit as the request found it."""
    poll.kick()
    limit = poll.limit_ns // US
    await turns(4)
    clock.now += idle_us * US
    await turns(4)
    return limit


async def test_polling_goes_on_until_the_limit_after_the_last_request_then_stops():
    clock = Clock()
    poll = BusyPoll(asyncio.get_running_loop(), 200, clock)
    assert await request_then_idle(poll, clock, 100) == 0  # nothing learnt yet: no polling
    assert not poll.polling
    assert await request_then_idle(poll, clock, 30) == 50  # it slept 100 µs: polling 50 µs is a start
    assert poll.polling  # 30 µs after the request, still polling
    await turns(20)  # the clock stands still: polling does not stop on its own
    assert poll.polling
    assert await request_then_idle(poll, clock, 49) == 50  # caught while polling: the limit stays
    assert poll.polling  # 49 µs after that request
    clock.now += 1 * US
    await turns(3)
    assert not poll.polling


async def test_the_limit_grows_while_gaps_fit_under_the_maximum_and_halves_when_they_do_not():
    clock = Clock()
    poll = BusyPoll(asyncio.get_running_loop(), 200, clock)
    limits = [await request_then_idle(poll, clock, 150) for _ in range(5)]
    assert limits == [0, 50, 100, 200, 200]  # from the fourth on, polling catches every request
    # sparse traffic: polling does not pay (the first request still came while the loop polled)
    limits = [await request_then_idle(poll, clock, 5000) for _ in range(5)]
    assert limits == [200, 100, 50, 0, 0]


async def test_no_polling_while_a_model_executes_on_an_instance_thread(monkeypatch):
    """Polls take the GIL; a thread that releases it (numpy, ONNX Runtime) would wait to get it back."""
    clock = Clock()
    poll = BusyPoll(asyncio.get_running_loop(), 200, clock)
    for _ in range(3):
        await request_then_idle(poll, clock, 100)
    assert poll.limit_ns > 0
    poll.kick()
    await turns(2)
    assert poll.polling
    monkeypatch.setattr(InstancePool, "running_off_loop", 1)
    await turns(2)
    assert not poll.polling  # stopped at the next turn
    poll.kick()
    await turns(2)
    assert not poll.polling  # and a request does not start it again until the thread is done
    monkeypatch.setattr(InstancePool, "running_off_loop", 0)
    poll.kick()
    assert poll.polling


async def test_zero_turns_polling_off_and_a_negative_time_is_refused():
    clock = Clock()
    poll = BusyPoll(asyncio.get_running_loop(), 0, clock)
    poll.kick()
    assert not poll.polling
    with pytest.raises(ValueError):
        BusyPoll(asyncio.get_running_loop(), -1)


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_polling_server_stops_using_the_cpu_when_requests_stop(naiad, protocol):
    """The session server polls by default (200 µs): after a burst of requests it must go back to sleeping."""
    import numpy as np

    if protocol == "http":
        client = httpclient.InferenceServerClient(naiad.http)
        mod = httpclient
    else:
        client = grpcclient.InferenceServerClient(naiad.grpc)
        mod = grpcclient
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    inp = mod.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(data)
    for _ in range(200):
        assert np.array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), data)
    proc = psutil.Process(naiad.proc.pid)
    time.sleep(0.2)
    before = cpu_seconds(proc)
    time.sleep(1.0)
    used = cpu_seconds(proc) - before
    client.close()
    # polling forever would be ~1 s; the metrics thread and timers use a few ms
    assert used < 0.25, f"the server used {used:.2f} CPU seconds in 1 s without requests"


def test_busy_poll_flag_is_checked_and_zero_serves_as_before(tmp_path, model_repo):
    bad = NaiadProcess(model_repo, "--busy-poll-us", "-5")
    with pytest.raises(RuntimeError, match="--busy-poll-us must be >= 0"):
        bad.start()
    with NaiadProcess(model_repo, "--busy-poll-us", "0", "--strict-readiness", "false") as off:
        client = httpclient.InferenceServerClient(off.http)
        inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        import numpy as np

        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        assert client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0").tolist() == [[1.0, 1.0]]
        client.close()
