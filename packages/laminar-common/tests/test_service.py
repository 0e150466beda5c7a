import os
import signal
import threading

from laminar_common.config import LaminarModel, LoggingConfig
from laminar_common.errors import LaminarError
from laminar_common.service import Service, ServiceState, serve


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


class _Cfg(LaminarModel):
    job: str = "unit"
    size: int = 1
    logging: LoggingConfig = LoggingConfig()


def test_serve_exits_2_on_a_bad_config_and_prints_only_when_asked(capsys):
    ran = []
    code = serve("prog", _Cfg, None, ["size=big"], print_only=False,
                 member=lambda c, ctx: "m", run=lambda c, ctx: ran.append(c) or 0)
    assert code == 2 and not ran
    assert capsys.readouterr().err.startswith("prog: ")
    code = serve("prog", _Cfg, None, ["size=3"], print_only=True,
                 member=lambda c, ctx: "m", run=lambda c, ctx: ran.append(c) or 0,
                 checks=lambda c: [f"WARNING: size {c.size}"])
    out = capsys.readouterr()
    assert code == 0 and not ran and "size: 3" in out.out and "WARNING: size 3" in out.err


def test_serve_runs_with_its_context_and_closes_it_whatever_happens(capsys):
    class Ctx:
        closed = 0

        def close(self):
            Ctx.closed += 1

    def fail(config, ctx):
        raise LaminarError("it broke")

    assert serve("prog", _Cfg, None, [], print_only=False, context=lambda c: Ctx(),
                 member=lambda c, ctx: "m", run=lambda c, ctx: 7 if isinstance(ctx, Ctx) else 0
                 ) == 7
    assert serve("prog", _Cfg, None, [], print_only=False, context=lambda c: Ctx(),
                 member=lambda c, ctx: "m", run=fail, failed=1) == 1
    assert Ctx.closed == 2
    assert "prog: error: it broke" in capsys.readouterr().err
