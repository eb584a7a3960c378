"""A second stream for a decode graph's capture copies: off the forward's critical path.

Recorded into a decode CUDA graph on the forward's stream, each capture copy is one more
node in the graph's single chain: every replay runs it between the model's kernels and
waits for it (about 2 µs a node, 28 a step for ``hidden-states`` on Qwen3-0.6B). Copies
recorded on a second stream instead form a branch beside that chain: *forked* after the
work that computed their source (the side stream waits for the forward's stream), run
while the model's next kernels run, *joined* (the forward's stream waits for the side
stream) only where the model is about to change their source in place, and at the end
of the forward (a graph capture must end with every forked stream joined).

Only captures whose source the model keeps unchanged until a point that calls
:meth:`SideStream.join` go there: the residual stream
(:data:`~dmi_sglang.domain.hooks.RESIDUAL_STREAM`), which only the next fused
add+RMSNorm changes (the capture points join before it), and the arena's and the
``last`` slots' own buffers (the landing moves). Eager forwards do not use it.

The work (and so the tensors it reads) is kept alive until its join: the caching
allocator knows a block only by the stream that allocated it, so a source the model
drops (SGLang's residual buffer is freed when its model's ``forward`` returns, before the
logits are computed) could otherwise be handed to the next kernel on the forward's
stream while the side stream still reads it. Freed after the join, its reuse is ordered
after the copy.

On CPU (the tests) there is no stream: work is held until :meth:`join` and runs there,
so a copy whose source changed before its join copies the changed values, as a device
that runs the branch late would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SideStream", "on"]


class SideStream:
    """Fork/join of capture copies onto a second stream (see the module docstring).

    Args:
        device: the transport's device; on CPU work is held until :meth:`join`.
    """

    __slots__ = ("_held", "_pending", "_stream", "forked", "joined")

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._held: list[Callable[[], object]] = []
        self.forked = 0
        """Work forked so far (each :meth:`run`)."""
        self.joined = 0
        """Joins that had forked work to wait for."""
        self._pending = False

    @property
    def pending(self) -> bool:
        """True while forked work has not been joined."""
        return self._pending

    def run(self, work: Callable[[], object]) -> None:
        """Queue ``work`` (device operations) on the side stream, after everything
        queued on the current stream so far."""
        self.forked += 1
        self._pending = True
        self._held.append(work)  # its tensors live until the join (module docstring)
        stream = self._stream
        if stream is None:
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            work()

    def join(self) -> None:
        """Make the current stream's later work wait for everything forked so far
        (nothing when nothing is pending)."""
        if not self._pending:
            return
        self._pending = False
        self.joined += 1
        held, self._held = self._held, []
        stream = self._stream
        if stream is None:
            for work in held:
                work()
            return
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        del held  # sources may be freed now: their reuse follows the wait


def on(side: SideStream | None, work: Callable[[], object]) -> None:
    """Run ``work`` on ``side`` (forked, see :meth:`SideStream.run`), or now without."""
    if side is None:
        work()
    else:
        side.run(work)
