"""A Buffer's communication stream and the one rule every async call follows (DeepEP's semantics).

An async call (async_op=True) waits on the communication stream for `previous_event` (else for the
caller's current stream), runs all its work there, and returns an event recorded there, so the
caller's stream goes on at once; the caller orders later work with `event.wait()`. Tensors that
cross streams stay allocated until both streams are done with them (`record_stream`): the inputs
for the communication stream, the outputs for the caller's. A call that is not async runs on the
caller's stream after it waited for `previous_event`, as before. On the CPU there are no streams:
the arguments are accepted and everything runs in order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

from .types import EventHandle

_Result = TypeVar("_Result")


def tensors_in(obj: Any, seen: Optional[set[int]] = None) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through tuples, lists, dicts and dataclass fields (results,
    handles and their backend states), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name), seen)


def _keep_for(stream: torch.cuda.Stream, obj: Any) -> None:
    """Keep every CUDA tensor of `obj` allocated until `stream`'s work queued so far is done."""
    for t in tensors_in(obj):
        if t.is_cuda and t.untyped_storage().nbytes():
            t.record_stream(stream)


class CommStream:
    """The communication stream of one Buffer, created on first use (none on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Optional[torch.cuda.Stream] = None

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        """The stream async calls run on; None on the CPU."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def run(self, work: Callable[[], _Result], *, previous_event: Optional[EventHandle], async_op: bool,
            inputs: tuple[Any, ...] = ()) -> _Result:
        """`work()` under this module's rule: on the communication stream when async_op (after
        previous_event, else after the caller's stream; `inputs` kept alive for it, the result for the
        caller's stream), else on the caller's stream after previous_event. `work` records the
        call's event itself (backends.base.record_event records on the current stream)."""
        comm = self.stream if async_op else None
        if comm is None:
            if previous_event is not None:
                previous_event.wait()
            return work()
        caller = torch.cuda.current_stream(self.device)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(caller)
        _keep_for(comm, inputs)
        with torch.cuda.stream(comm):
            result = work()
        _keep_for(caller, result)
        return result
