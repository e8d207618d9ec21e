"""engine/graphs.py's capture logic on the CPU, against a stand-in for cuda-python's driver module:
which edges become programmatic, and that a driver or binding that cannot make them (or an
instantiate that refuses them) leaves a working graph with plain edges, never a half-converted one.
The real driver runs the same code in tests/test_graphs.py (GPU)."""
from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest

import engine.graphs as eg

OK = 0
_ids = itertools.count(1)


class Node:
    def __init__(self, kind, func=0):
        self.id = next(_ids)
        self.kind, self.func = kind, func

    def __int__(self):
        return self.id


class Graph:
    def __init__(self, nodes, edges):
        self.nodes, self.edges = nodes, edges     # edges: [from, to, EdgeData]


class EdgeData:
    def __init__(self):
        self.type, self.from_port, self.to_port = 0, 0, 0


class FakeDriver:
    """The calls engine/graphs.py makes, on Graph objects; `v2`: the 12.x names for edge data;
    `edge_data`: False for a binding whose edge calls take none; `refuse`: cuGraphInstantiate
    fails on a graph with programmatic edges."""
    CUresult = SimpleNamespace(CUDA_SUCCESS=OK)
    CUgraphNodeType = SimpleNamespace(CU_GRAPH_NODE_TYPE_KERNEL="kernel")
    CUgraphDependencyType = SimpleNamespace(CU_GRAPH_DEPENDENCY_TYPE_DEFAULT=0,
                                            CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC=1)
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1
    CUgraphEdgeData = EdgeData

    class CUstream:
        def __init__(self, v=0):
            self.v = v

    def __init__(self, graph, v2=False, edge_data=True, refuse=False):
        self.captured, self.refuse, self.destroyed, self.execs = graph, refuse, [], []
        if v2:
            self.cuGraphGetEdges_v2 = self._get_edges
            self.cuGraphAddDependencies_v2 = self._add
            self.cuGraphRemoveDependencies_v2 = self._remove
        elif edge_data:
            self.cuGraphGetEdges = self._get_edges
            self.cuGraphAddDependencies = self._add
            self.cuGraphRemoveDependencies = self._remove
        else:       # 12.x without the _v2 calls: no edge data in or out
            self.cuGraphGetEdges = lambda g, n: (OK, None, None, len(g.edges)) if n == 0 else \
                (OK, [e[0] for e in g.edges], [e[1] for e in g.edges], len(g.edges))
            self.cuGraphAddDependencies = lambda g, f, t, n: (OK,)
            self.cuGraphRemoveDependencies = lambda g, f, t, n: (OK,)

    def cuStreamBeginCapture(self, h, mode):
        return (OK,)

    def cuStreamEndCapture(self, h):
        return (OK, self.captured)

    def cuGraphGetNodes(self, g, n):
        return (OK, None, len(g.nodes))

    def cuGraphClone(self, g):
        nodes = {id(n): copy.copy(n) for n in g.nodes}
        edges = [[nodes[id(a)], nodes[id(b)], copy.copy(d)] for a, b, d in g.edges]
        return (OK, Graph(list(nodes.values()), edges))

    def _get_edges(self, g, n):
        if n == 0:
            return (OK, None, None, None, len(g.edges))
        return (OK, [e[0] for e in g.edges], [e[1] for e in g.edges], [e[2] for e in g.edges],
                len(g.edges))

    def _remove(self, g, f, t, d, n):
        for a, b in zip(f, t):
            g.edges = [e for e in g.edges if not (e[0] is a and e[1] is b)]
        return (OK,)

    def _add(self, g, f, t, d, n):
        g.edges += [[a, b, x] for a, b, x in zip(f, t, d)]
        return (OK,)

    def cuGraphNodeGetType(self, node):
        return (OK, node.kind)

    def cuGraphKernelNodeGetParams(self, node):
        return (OK, SimpleNamespace(func=node.func, kern=0))

    def cuGraphInstantiate(self, g, flags):
        if self.refuse and any(e[2].type for e in g.edges):
            return (1, None)
        self.execs.append(g)
        return (OK, ("exec", g))

    def cuGraphExecUpdate(self, exe, g):
        """Succeeds when g has exe's topology: the same node kinds and edge types in order."""
        def shape(x):
            return ([n.kind for n in x.nodes],
                    [(x.nodes.index(a), x.nodes.index(b), d.type) for a, b, d in x.edges])
        return (OK,) if shape(exe[1]) == shape(g) else (1,)

    def cuGraphDestroy(self, g):
        self.destroyed.append(g)
        return (OK,)

    def cuGraphExecDestroy(self, exe):
        self.destroyed.append(exe)
        return (OK,)

    def cuGetErrorString(self, err):
        return (OK, b"refused")


def _chain():
    """kernel(7) -> kernel(8) -> memcpy -> kernel(8) -> kernel(9): PDL-safe kernels 8 and 9."""
    n = [Node("kernel", 7), Node("kernel", 8), Node("memcpy"), Node("kernel", 8), Node("kernel", 9)]
    return Graph(n, [[a, b, EdgeData()] for a, b in zip(n, n[1:])])


def _capture(monkeypatch, fake):
    monkeypatch.setattr(eg, "driver", fake)
    monkeypatch.setattr(eg, "_pdl_handles", lambda: {8, 9})
    monkeypatch.setattr(eg, "_PDL_WARNED", [])
    g = eg.CudaGraph()
    with g.capture(SimpleNamespace(handle=fake.CUstream()), pdl=True):
        pass
    return g


@pytest.mark.parametrize("v2", [False, True])
def test_edges_into_pdl_kernels_become_programmatic(monkeypatch, v2):
    fake = FakeDriver(_chain(), v2=v2)
    g = _capture(monkeypatch, fake)
    assert g.programmatic == 2 and g.nodes == 5
    kinds = {(a.func, b.func, b.kind): d.type for a, b, d in g.graph.edges}
    # kernel -> PDL kernel: programmatic; into or out of the memcpy: plain
    assert kinds == {(7, 8, "kernel"): 1, (8, 0, "memcpy"): 0, (0, 8, "kernel"): 0,
                     (8, 9, "kernel"): 1}
    assert all(d.from_port == 1 for _, _, d in g.graph.edges if d.type)
    assert fake.captured in fake.destroyed and g.graph is not fake.captured   # the clone runs
    assert all(d.type == 0 for _, _, d in fake.captured.edges)                # untouched


def test_binding_without_edge_data_keeps_plain_edges(monkeypatch, capsys):
    fake = FakeDriver(_chain(), edge_data=False)
    g = _capture(monkeypatch, fake)
    assert g.programmatic == 0 and g.graph is fake.captured and g.exec is not None
    assert "programmatic dependent launch unavailable" in capsys.readouterr().err


def test_instantiate_refusing_programmatic_edges_falls_back(monkeypatch, capsys):
    fake = FakeDriver(_chain(), refuse=True)
    g = _capture(monkeypatch, fake)
    assert g.programmatic == 0 and g.graph is fake.captured and g.exec == ("exec", fake.captured)
    assert "cuGraphInstantiate refused" in capsys.readouterr().err
    assert len(fake.execs) == 1


def test_pdl_off_touches_nothing(monkeypatch):
    fake = FakeDriver(_chain())
    monkeypatch.setattr(eg, "driver", fake)
    g = eg.CudaGraph()
    with g.capture(SimpleNamespace(handle=fake.CUstream()), pdl=False):
        pass
    assert g.programmatic == 0 and g.graph is fake.captured and not fake.destroyed


def test_recapture_updates_in_place_or_reinstantiates(monkeypatch):
    """Capturing again into one CudaGraph: the same topology updates the executable in place
    and frees the graph it replaces; a different one (here: PDL off, plain edges) instantiates
    anew; nothing captured is left undestroyed but the graph in use."""
    fake = FakeDriver(_chain())
    g = _capture(monkeypatch, fake)
    first = g.graph
    fake.captured = _chain()
    with g.capture(SimpleNamespace(handle=fake.CUstream()), pdl=True):
        pass
    assert len(fake.execs) == 1 and g.programmatic == 2      # updated, not instantiated
    assert first in fake.destroyed and g.graph not in fake.destroyed
    fake.captured = _chain()
    with g.capture(SimpleNamespace(handle=fake.CUstream()), pdl=False):
        pass
    assert len(fake.execs) == 2 and g.programmatic == 0 and g.graph is fake.captured


def test_destroy_all_frees_graphs_and_executables(monkeypatch):
    """Dropping a decoder's graphs (a new run state, a larger logits buffer) destroys each
    graph and its executable; None is a no-op."""
    fake = FakeDriver(_chain())
    a = _capture(monkeypatch, fake)
    fake.captured = _chain()
    b = _capture(monkeypatch, fake)
    held = [(g.graph, g.exec) for g in (a, b)]
    eg.destroy_all({"token": a, ("dense", 0): b})
    for graph, exe in held:
        assert graph in fake.destroyed and exe in fake.destroyed
    assert a.graph is None and a.exec is None and b.graph is None and b.exec is None
    eg.destroy_all(None)
