"""The planner: turns --vram-gb / --ram-gb into sizes for each tier, or says what would fit.

VRAM holds, in this order of need: the dense weights, the KV cache, the run state (activations,
attention partials), two slot banks of one layer's routed experts each (so the next layer's
copies overlap this layer's compute), then as many hot experts as the rest allows. The host
RAM cache gets the RAM budget (less the dense layers that stream from host RAM, when the dense
side does not fit in VRAM). Nothing here allocates: it is arithmetic, testable on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
RESERVE_BYTES = 256 << 20   # CUDA context, kernel modules, allocator slack


class PlanError(ValueError):
    """The budget cannot hold the minimum; the message says what minimum would."""


@dataclass(frozen=True)
class Plan:
    vram_budget: int
    ram_budget: int
    dense_bytes: int             # dense weights resident in VRAM
    kv_bytes: int                # KV cache (+ recurrent state) for max_context tokens
    run_state_bytes: int         # activations and scratch
    block_bytes: int             # one expert block
    bank_slots: int              # streaming slots: two banks of top_k each
    hot_slots: int               # experts kept resident by profile rank
    total_experts: int
    ram_slots: int               # host-RAM cache capacity in blocks
    notes: tuple = field(default=())
    dense_streamed: tuple = ()   # layers whose dense weights live in host RAM and are copied in
    dense_slot_bytes: int = 0    # each of the two device slots those layers are copied into
    dense_host_bytes: int = 0    # those layers' weights, pinned in host RAM (out of the RAM budget)

    @property
    def vram_slots(self) -> int:
        return self.bank_slots + self.hot_slots

    @property
    def vram_used(self) -> int:
        return (RESERVE_BYTES + self.dense_bytes + self.kv_bytes + self.run_state_bytes
                + self.vram_slots * self.block_bytes)

    @property
    def all_resident(self) -> bool:
        return self.hot_slots >= self.total_experts and not self.dense_streamed

    def describe(self) -> str:
        def gb(n):
            return f"{n / GB:.2f} GB"
        streamed = max(self.total_experts - self.hot_slots, 0)
        lines = [
            f"plan: VRAM {gb(self.vram_used)} of {gb(self.vram_budget)} | RAM cache "
            f"{gb(self.ram_slots * self.block_bytes)} of {gb(self.ram_budget)}",
            f"  VRAM: dense {gb(self.dense_bytes)}, KV cache {gb(self.kv_bytes)}, run state "
            f"{gb(self.run_state_bytes)}, slot banks 2 x {self.bank_slots // 2} experts "
            f"({gb(self.bank_slots * self.block_bytes)}), hot set {self.hot_slots} of "
            f"{self.total_experts} experts ({gb(self.hot_slots * self.block_bytes)})",
            f"  streamed: {streamed} experts ({gb(streamed * self.block_bytes)}) through a RAM cache "
            f"of {self.ram_slots} blocks ({min(self.ram_slots, streamed)} of them fit) from the arena",
        ]
        if self.dense_streamed:
            lines.append(f"  dense: {len(self.dense_streamed)} layers' weights "
                         f"({gb(self.dense_host_bytes)}, pinned) stream from host RAM "
                         f"through 2 slots of {gb(self.dense_slot_bytes)} (the rest stay in VRAM)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def stream_dense(layer_bytes: dict, room: int) -> tuple[tuple, int]:
    """Which layers' dense weights to stream so the rest fit in `room` bytes beside two slots of
    the largest streamed layer: the fewest layers, the last ones first. ((), 0) when all fit;
    None when even streaming every layer does not fit."""
    layers = sorted(layer_bytes)
    total = sum(layer_bytes.values())
    if total <= room:
        return (), 0
    streamed = []
    for l in reversed(layers):
        streamed.append(l)
        slot = max(layer_bytes[x] for x in streamed)
        if total - sum(layer_bytes[x] for x in streamed) + 2 * slot <= room:
            return tuple(sorted(streamed)), slot
    return None


def plan(*, vram_gb: float, ram_gb: float, dense_bytes: int, kv_bytes: int, run_state_bytes: int,
         block_bytes: int, top_k: int, total_experts: int, hot_limit: int | None = None,
         dense_layer_bytes: dict | None = None, dense_from_ram: bool = True,
         kv_halvable: bool = False) -> Plan:
    """Size every tier; raise PlanError naming the minimum when the budget is too small.

    dense_layer_bytes (layer -> bytes of its dense weights, part of dense_bytes): when given and
    the dense side does not fit, the layers that do not fit stream from host RAM like experts
    (dense weights come first: a token reads all of them, but only top-k of each layer's experts).
    dense_from_ram: those layers' host copies come out of ram_gb (a budget the user set; not
    when ram_gb is the engine's own default, sized for the experts alone).
    kv_halvable: the KV cache is float32, so the refusal also suggests --kv-cache bf16.
    """
    vram = int(vram_gb * GB)
    ram = int(ram_gb * GB)
    bank_slots = 2 * top_k
    fixed = RESERVE_BYTES + kv_bytes + run_state_bytes + bank_slots * block_bytes
    glob = dense_bytes - sum(dense_layer_bytes.values()) if dense_layer_bytes else dense_bytes
    dense_resident = dense_bytes
    streamed, slot = (), 0
    if fixed + dense_bytes > vram and dense_layer_bytes:
        got = stream_dense(dense_layer_bytes, vram - fixed - glob)
        if got is not None:
            streamed, slot = got
            dense_resident = dense_bytes - sum(dense_layer_bytes[x] for x in streamed) + 2 * slot
    need = fixed + dense_resident
    if need > vram:
        least = ""
        if dense_layer_bytes:
            least = (f"; streaming every layer's dense weights would need "
                     f"{(fixed + glob + 2 * max(dense_layer_bytes.values())) / GB:.2f} GB")
        raise PlanError(
            f"--vram-gb {vram_gb:g} cannot hold the minimum of {need / GB:.2f} GB: dense weights "
            f"{dense_bytes / GB:.2f} GB + KV cache {kv_bytes / GB:.2f} GB + run state "
            f"{run_state_bytes / GB:.2f} GB + two slot banks of {top_k} experts "
            f"{bank_slots * block_bytes / GB:.2f} GB + {RESERVE_BYTES / GB:.2f} GB reserve "
            f"(lower --max-context{' or pass --kv-cache bf16' if kv_halvable else ''} to "
            f"shrink the KV cache){least}")
    hot = min(total_experts, (vram - need) // block_bytes)
    if hot_limit is not None:
        hot = min(hot, hot_limit)
    # streamed dense layers stay packed in pinned host RAM: they come out of the RAM budget
    dense_host = sum(dense_layer_bytes[x] for x in streamed)
    ram_slots = max(ram - (dense_host if dense_from_ram else 0), 0) // block_bytes
    notes = []
    if hot >= total_experts:
        notes.append("every expert fits in VRAM: nothing is streamed after the first read")
    elif ram_slots < top_k:
        if not dense_from_ram:
            dense_host = 0
        dense_note = (f" beside the {dense_host / GB:.2f} GB of dense layers that stream from it"
                      if dense_host else "")
        raise PlanError(f"--ram-gb {ram_gb:g} holds {ram_slots} expert blocks{dense_note}; one "
                        f"layer's {top_k} routed experts need at least "
                        f"{(dense_host + top_k * block_bytes) / GB:.3f} GB")
    if streamed:
        notes.append(f"the dense weights ({dense_bytes / GB:.2f} GB) do not fit: "
                     f"{len(streamed)} of {len(dense_layer_bytes)} layers stream from host RAM")
    return Plan(vram, ram, dense_resident, kv_bytes, run_state_bytes, block_bytes, bank_slots,
                int(hot), total_experts, int(ram_slots), tuple(notes), streamed, slot, dense_host)
