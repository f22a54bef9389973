"""``cpu_capability.NoCudaScope``: the one helper behind ``no_cuda_capability`` /
``capability_around`` and ``speculative.no_cuda_sync`` / ``synchronize_around``."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_ascend_offload.sglang_plugin import cpu_capability
from sglang_ascend_offload.sglang_plugin.cpu_capability import NoCudaScope
from sglang_ascend_offload.sglang_plugin.speculative import eagle as speculative

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the scope only answers without CUDA")


def _original(*args, **kwargs):
    return ("called", args, kwargs)


@needs_no_cuda
def test_scope_answers_only_inside_and_restores_on_exit():
    scope = NoCudaScope("test_scope", answer=(7, 1))
    assert scope.around(_original, 3, k=4) == ("called", (3,), {"k": 4})
    with scope.active():
        assert scope.is_active()
        assert scope.around(_original, 3) == (7, 1)
        with scope.active():  # nesting: leaving the inner scope keeps the outer one
            pass
        assert scope.around(_original) == (7, 1)
    assert not scope.is_active()
    assert scope.around(_original) == ("called", (), {})
    with pytest.raises(ZeroDivisionError):
        with scope.active():
            _ = 1 / 0
    assert not scope.is_active()  # restored after an exception too


@needs_no_cuda
def test_scopes_are_independent_and_per_thread():
    a, b = NoCudaScope("a", "A"), NoCudaScope("b", "B")
    seen = []
    with a.active():
        assert b.around(_original)[0] == "called"
        worker = threading.Thread(target=lambda: seen.append(a.around(_original)[0]))
        worker.start()
        worker.join()
    assert seen == ["called"]  # a new thread starts outside the scope


def test_scope_calls_original_when_cuda_is_available(monkeypatch):
    scope = NoCudaScope("cuda", answer=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with scope.active():
        assert scope.around(_original, 1) == ("called", (1,), {})


@needs_no_cuda
def test_plugin_hooks_keep_their_behaviour():
    assert cpu_capability.capability_around(_original)[0] == "called"
    with cpu_capability.no_cuda_capability():
        assert cpu_capability.capability_around(_original) == cpu_capability.NO_CUDA_CAPABILITY == (0, 0)
        assert speculative.synchronize_around(_original)[0] == "called"  # the other scope is not entered
    with speculative.no_cuda_sync():
        assert speculative.synchronize_around(_original) is None
        assert cpu_capability.capability_around(_original)[0] == "called"
    calls = []

    def set_embed_and_head(self, embed, head):
        calls.append(speculative.synchronize_around(_original))
        return "done"

    assert speculative.set_embed_and_head_around(set_embed_and_head, object(), "e", "h") == "done"
    assert calls == [None]
