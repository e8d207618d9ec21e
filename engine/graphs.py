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

Programmatic dependent launch (sm_90+, on unless MOE_STREAM_PDL=0): after capture, each kernel
-> kernel edge whose dependent is registered PDL-safe (kernels_numba.gpu_util.pdl_kernel)
becomes a programmatic edge, so that kernel is launched while its predecessor still runs and
issues what it may read early (weights) before it waits (griddepcontrol.wait). Between small
decode kernels this hides most of a launch's ramp.
"""
from __future__ import annotations

import os
import sys
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


def pdl_enabled() -> bool:
    """Programmatic edges in captured graphs: MOE_STREAM_PDL unset or not "0", sm_90 or later."""
    if os.environ.get("MOE_STREAM_PDL", "1") == "0":
        return False
    from numba import cuda
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:
        return False


def _dispatchers(disp):
    """disp and the dispatchers numba derived from it: specialize() (the expert launchers'
    per-argument kernels) and launch-configuration specializations each compile their own."""
    yield disp
    for d in list(getattr(disp, "specializations", {}).values()) + \
            list(getattr(disp, "_launch_config_specializations", {}).values()):
        yield from _dispatchers(d)


def _pdl_handles() -> set:
    """The CUkernel / CUfunction handles (as ints) of every compiled PDL-safe kernel."""
    from kernels_numba.gpu_util import PDL_KERNELS
    out = set()
    for disp in (d for k in PDL_KERNELS for d in _dispatchers(k)):
        for k in list(disp.overloads.values()):
            h = k._codelibrary.get_cufunc().handle
            out.add(int(h))
            ret = driver.cuKernelGetFunction(h)
            if ret[0] == driver.CUresult.CUDA_SUCCESS:
                out.add(int(ret[1]))
    return out


def _kernel_handles(node):
    """(func, kern) of a kernel node as ints, None for any other node."""
    kind = _check("cuGraphNodeGetType", driver.cuGraphNodeGetType(node))
    if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    p = _check("cuGraphKernelNodeGetParams", driver.cuGraphKernelNodeGetParams(node))
    return int(p.func), int(p.kern)


def _edge_call(name: str):
    """Edge data came with CUDA 12.3: cuda-bindings 12.x name those calls *_v2, 13.x plain."""
    return getattr(driver, name + "_v2", None) or getattr(driver, name)


def make_programmatic(graph, handles: set) -> int:
    """Turn every kernel -> kernel edge of graph whose dependent's kernel is in handles into a
    programmatic edge; returns how many."""
    n = _check("cuGraphGetEdges", _edge_call("cuGraphGetEdges")(graph, 0))[-1]
    if not n:
        return 0
    frm, to, data, n = _check("cuGraphGetEdges", _edge_call("cuGraphGetEdges")(graph, n))
    kinds = {}

    def handles_of(node):
        key = int(node)
        if key not in kinds:
            kinds[key] = _kernel_handles(node)
        return kinds[key]

    pick = []
    for i in range(int(n)):
        a, b = handles_of(frm[i]), handles_of(to[i])
        if a is None or b is None or not (b[0] in handles or b[1] in handles):
            continue
        if data[i].type != driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT:
            continue
        pick.append(i)
    if not pick:
        return 0
    f = [frm[i] for i in pick]
    t = [to[i] for i in pick]
    _check("cuGraphRemoveDependencies",
           _edge_call("cuGraphRemoveDependencies")(graph, f, t, [data[i] for i in pick],
                                                   len(pick)))
    new = []
    for _ in pick:
        e = driver.CUgraphEdgeData()
        e.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        e.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        new.append(e)
    _check("cuGraphAddDependencies",
           _edge_call("cuGraphAddDependencies")(graph, f, t, new, len(pick)))
    return len(pick)


_PDL_WARNED = []


def _with_programmatic(graph):
    """(a clone of graph with its PDL-safe kernels' edges made programmatic, how many), or
    (None, 0) with one warning on stderr where this driver or binding cannot make them (older
    than CUDA 12.3): graph itself is never touched, so it is never left half-converted."""
    try:
        clone = _check("cuGraphClone", driver.cuGraphClone(graph))
    except CudaGraphError as e:
        _warn_pdl(e)
        return None, 0
    try:
        n = make_programmatic(clone, _pdl_handles())
    except Exception as e:   # a binding without edge data raises TypeError / ValueError
        driver.cuGraphDestroy(clone)
        _warn_pdl(e)
        return None, 0
    return clone, n


def _warn_pdl(err) -> None:
    if not _PDL_WARNED:
        _PDL_WARNED.append(err)
        print(f"note: programmatic dependent launch unavailable ({err}); graphs keep plain "
              f"edges (MOE_STREAM_PDL=0 silences this)", file=sys.stderr)


class CudaGraph:
    """One captured graph and its executable instance."""

    def __init__(self):
        self.graph = None   # CUgraph
        self.exec = None    # CUgraphExec
        self.nodes = 0
        self.programmatic = 0   # edges made programmatic

    @contextmanager
    def capture(self, stream, mode: str = "thread_local", pdl: bool | None = None):
        """Capture the launches made on `stream` inside the block, then instantiate.

        Capturing again replaces the graph: the executable is updated in place when the
        topology matches (cuGraphExecUpdate), else re-instantiated. pdl (None: pdl_enabled())
        makes the edges into PDL-safe kernels programmatic."""
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
        self.nodes = int(n)
        self.programmatic = 0
        if pdl_enabled() if pdl is None else pdl:
            pg, k = _with_programmatic(graph)
            if pg is not None:
                if self._install(pg, strict=False):
                    _check("cuGraphDestroy", driver.cuGraphDestroy(graph))
                    self.programmatic = k
                    return
                driver.cuGraphDestroy(pg)
                _warn_pdl("cuGraphInstantiate refused the programmatic edges")
        self._install(graph, strict=True)

    def _install(self, graph, strict: bool) -> bool:
        """Make graph the one launched: the executable updated in place when the topology
        matches, else instantiated anew. Not strict: False (nothing changed) when that fails."""
        if self.exec is not None and self._try_update(graph):
            _check("cuGraphDestroy", driver.cuGraphDestroy(self.graph))
        else:
            ret = driver.cuGraphInstantiate(graph, 0)
            if ret[0] != driver.CUresult.CUDA_SUCCESS and not strict:
                return False
            exe = _check("cuGraphInstantiate", ret)
            self._destroy_exec()
            if self.graph is not None:
                _check("cuGraphDestroy", driver.cuGraphDestroy(self.graph))
            self.exec = exe
        self.graph = graph
        return True

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


def destroy_all(graphs) -> None:
    """Destroy the captured graphs of a dict (name -> CudaGraph), or of None: dropping the
    references alone leaves the driver's graphs and executables allocated. An executable still
    in flight is freed by the driver when it completes."""
    for g in (graphs or {}).values():
        g.destroy()


def capture_fn(fn, stream, warmup: bool = True, mode: str = "thread_local",
               pdl: bool | None = None) -> CudaGraph:
    """Run fn(stream) once eagerly (compiles and loads its kernels), then capture it."""
    if warmup:
        fn(stream)
        stream.synchronize()
    g = CudaGraph()
    with g.capture(stream, mode, pdl):
        fn(stream)
    return g
