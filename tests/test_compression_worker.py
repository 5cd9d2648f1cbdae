"""The asynchronous compression worker (`confkv/engine/compression_worker.py`): plans on its own thread,
in inference mode, while the caller goes on; what it raises reaches the caller at `finish`."""

from __future__ import annotations

import threading

import pytest
import torch

from confkv.engine.compression_worker import CompressionWorker


def test_plans_on_its_own_thread_while_the_caller_goes_on():
    release, seen = threading.Event(), {}

    def plan(due):
        seen["thread"] = threading.current_thread().name
        seen["inference"] = torch.is_inference_mode_enabled()
        assert release.wait(10), "the caller never went on"
        return [f"plan of {seq}" for seq in due]

    worker = CompressionWorker(plan, torch.device("cpu"))
    job = worker.start(["a", "b"])
    assert not job.done()  # start did not wait for the plan
    release.set()  # the caller's own work (the forward pass) happens here
    plans, seconds = worker.finish(job)
    assert plans == ["plan of a", "plan of b"] and seconds >= 0.0
    assert seen["thread"].startswith("confkv-compress") and seen["thread"] != threading.current_thread().name
    assert seen["inference"] and not torch.is_inference_mode_enabled()


def test_a_failed_plan_raises_at_finish_and_the_worker_goes_on():
    calls = []

    def plan(due):
        calls.append(due)
        if due == ["bad"]:
            raise RuntimeError("no plan for this one")
        return due

    worker = CompressionWorker(plan, torch.device("cpu"))
    failed = worker.start(["bad"])
    with pytest.raises(RuntimeError, match="no plan"):
        worker.finish(failed)
    assert worker.finish(worker.start(["good"]))[0] == ["good"] and calls == [["bad"], ["good"]]
