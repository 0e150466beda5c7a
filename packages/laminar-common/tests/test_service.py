import os
import signal
import threading

from laminar_common.service import Service, ServiceState


class Probe(Service):
    name = "probe"

    def __init__(self, crash=False):
        super().__init__()
        self.crash = crash
        self.closed_calls = 0
        self.ticks = 0

    def _start(self):
        self.spawn(self._loop, "loop")

    def _loop(self):
        while not self.stopping.wait(0.01):
            self.ticks += 1
            if self.crash and self.ticks > 2:
                raise RuntimeError("boom")

    def _close(self):
        self.closed_calls += 1


def test_close_is_idempotent():
    s = Probe().start()
    s.close("first")
    s.close("second")
    assert s.state == ServiceState.CLOSED
    assert s.close_reason == "first"
    assert s.closed_calls == 1


def test_failed_loop_fails_service():
    s = Probe(crash=True).start()
    assert s.wait_closed(5)
    assert s.state == ServiceState.FAILED
    assert isinstance(s.failure, RuntimeError)
    assert s.run_forever() == 1


def test_sigterm_closes_gracefully():
    s = Probe()
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    assert s.run_forever() == 0
    assert s.close_reason == "signal SIGTERM"
    assert s.closed_calls == 1
