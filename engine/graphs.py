"""CUDA graphs over numba launches, through cuda-python's driver API.

A numba stream's `.handle` is already a `cuda.bindings.driver.CUstream`, so capture works on
the stream the kernels launch on:

    g = CudaGraph()
    with g.capture(stream):          # nothing may allocate or sync in here
        run_layer(stream)            # numba kernel launches on `stream`
    g.launch(stream)                 # replay; inputs change through device memory only

Kernels are compiled and their modules loaded at their first launch, which the driver forbids
while a stream captures; `capture_fn()` therefore runs the work once eagerly first (warm-up),
then captures it. The default capture mode, thread-local, turns an allocation or a sync inside
the capture into an error instead of a silently broken graph. Every driver call's status is
checked; a failure raises CudaGraphError naming the call.
"""
from __future__ import annotations

from contextlib import contextmanager

from cuda.bindings import driver

_MODES = {
    "global": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
    "thread_local": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "relaxed": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
}


class CudaGraphError(RuntimeError):
    pass


def _check(name: str, ret):
    """cuda-python returns (CUresult, *values): raise on an error, else return the values."""
    err = ret[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise CudaGraphError(f"{name} failed: {err.name} ({text})")
    if len(ret) == 1:
        return None
    return ret[1] if len(ret) == 2 else ret[1:]


def stream_handle(stream):
    """numba stream -> CUstream (its .handle; 0 / None means the legacy default stream)."""
    h = getattr(stream, "handle", stream)
    if isinstance(h, driver.CUstream):
        return h
    return driver.CUstream(int(getattr(h, "value", h) or 0))


def is_capturing(stream) -> bool:
    status = _check("cuStreamIsCapturing", driver.cuStreamIsCapturing(stream_handle(stream)))
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class CudaGraph:
    """One captured graph and its executable instance."""

    def __init__(self):
        self.graph = None   # CUgraph
        self.exec = None    # CUgraphExec
        self.nodes = 0

    @contextmanager
    def capture(self, stream, mode: str = "thread_local"):
        """Capture the launches made on `stream` inside the block, then instantiate.

        Capturing again replaces the graph: the executable is updated in place when the
        topology matches (cuGraphExecUpdate), else re-instantiated."""
        h = stream_handle(stream)
        _check("cuStreamBeginCapture", driver.cuStreamBeginCapture(h, _MODES[mode]))
        try:
            yield self
        except BaseException:
            ret = driver.cuStreamEndCapture(h)
            if ret[0] == driver.CUresult.CUDA_SUCCESS and ret[1] is not None:
                driver.cuGraphDestroy(ret[1])
            raise
        graph = _check("cuStreamEndCapture", driver.cuStreamEndCapture(h))
        _, n = _check("cuGraphGetNodes", driver.cuGraphGetNodes(graph, 0))
        if self.exec is not None and self._try_update(graph):
            _check("cuGraphDestroy", driver.cuGraphDestroy(self.graph))
        else:
            self._destroy_exec()
            if self.graph is not None:
                _check("cuGraphDestroy", driver.cuGraphDestroy(self.graph))
            self.exec = _check("cuGraphInstantiate", driver.cuGraphInstantiate(graph, 0))
        self.graph = graph
        self.nodes = int(n)

    def _try_update(self, graph) -> bool:
        ret = driver.cuGraphExecUpdate(self.exec, graph)
        return ret[0] == driver.CUresult.CUDA_SUCCESS

    def launch(self, stream) -> None:
        if self.exec is None:
            raise CudaGraphError("launch of a graph that was never captured")
        _check("cuGraphLaunch", driver.cuGraphLaunch(self.exec, stream_handle(stream)))

    def upload(self, stream) -> None:
        """Upload the executable ahead of its first launch (moves that cost out of timing)."""
        _check("cuGraphUpload", driver.cuGraphUpload(self.exec, stream_handle(stream)))

    def _destroy_exec(self) -> None:
        if self.exec is not None:
            _check("cuGraphExecDestroy", driver.cuGraphExecDestroy(self.exec))
            self.exec = None

    def destroy(self) -> None:
        self._destroy_exec()
        if self.graph is not None:
            _check("cuGraphDestroy", driver.cuGraphDestroy(self.graph))
            self.graph = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def capture_fn(fn, stream, warmup: bool = True, mode: str = "thread_local") -> CudaGraph:
    """Run fn(stream) once eagerly (compiles and loads its kernels), then capture it."""
    if warmup:
        fn(stream)
        stream.synchronize()
    g = CudaGraph()
    with g.capture(stream, mode):
        fn(stream)
    return g
