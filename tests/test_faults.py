"""The pieces behind the fault handling, in one process: the watchdog, the stop-signal
record, and how a failing rank's error is classified (torchrun runs: test_faults_e2e.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from spconv_train.distributed import first_to_report, is_peer_failure
from spconv_train.train.preemption import Preempted, StopRequests
from spconv_train.train.watchdog import EXIT_HUNG, Watchdog, last_phase, process_group_timeout


def test_watchdog_fires_on_a_phase_that_lasts_too_long(capfd):
    fired, codes = threading.Event(), []

    def fake_exit(code: int) -> None:
        codes.append(code)
        fired.set()

    with Watchdog(0.3, rank=1, exit=fake_exit) as wd:
        for _ in range(4):  # phases shorter than the timeout: no alarm
            wd.beat("step 1: forward pass (halo exchanges)")
            time.sleep(0.15)
        assert not fired.is_set()
        wd.beat("step 2: stop-signal all-reduce")
        assert fired.wait(10)
    assert codes == [EXIT_HUNG]
    err = capfd.readouterr().err
    assert "[rank 1] error: watchdog: stuck for 0 s in step 2: stop-signal all-reduce" in err
    assert "parallel.timeout_s=0.3" in err
    assert last_phase() == "step 2: stop-signal all-reduce"


def test_watchdog_stays_quiet_without_a_phase_and_after_close():
    fired = threading.Event()
    wd = Watchdog(0.1, rank=0, exit=lambda code: fired.set())
    time.sleep(0.3)  # armed but no phase announced yet
    wd.beat("step 1: backward pass")
    wd.close()
    time.sleep(0.3)
    assert not fired.is_set()
    quiet = Watchdog(0.1, rank=0, enabled=False, exit=lambda code: fired.set())
    quiet.beat("step 1: forward pass")  # one process: only recorded
    time.sleep(0.3)
    quiet.close()
    assert not fired.is_set() and last_phase() == "step 1: forward pass"
    with pytest.raises(ValueError, match="positive"):
        Watchdog(0, rank=0)


def test_process_group_timeout_leaves_the_watchdog_first():
    for seconds in (1.0, 30.0, 600.0):
        assert process_group_timeout(seconds) > seconds


def test_stop_requests_record_the_first_signal_only_while_installed():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests() as stops:
        assert signal.getsignal(signal.SIGTERM) is before  # set-up: default action kept
        assert stops.agree(torch.device("cpu")) is None
        stops.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stops.received and time.monotonic() < deadline:
            time.sleep(0.01)  # python runs handlers between bytecodes of the main thread
        assert stops.agree(torch.device("cpu")) == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is before


def test_preempted_message_names_signal_step_checkpoint_and_resume():
    text = str(Preempted("SIGTERM", 7, 40, "runs/x/checkpoints/step-000007"))
    assert "SIGTERM after step 7 of 40" in text
    assert "runs/x/checkpoints/step-000007" in text and "--resume" in text and "3" in text


def test_peer_failures_are_told_apart_from_a_rank_s_own_errors():
    gloo = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:3991"
    assert is_peer_failure(RuntimeError(gloo))
    assert is_peer_failure(RuntimeError("checkpoint load failed on another rank: rank 1: ..."))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))  # not from a backend
    assert first_to_report("anything")  # no process group: always report
