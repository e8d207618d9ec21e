"""CPU decode at synthetic model shapes, next to the DRAM bound measured in the same run.

asv treats lower as better, so throughput is tracked as milliseconds per token and the
distance from the bound as bound/achieved (1.0 = at the bound).
"""
import engine
from engine.bench import PRESETS, dram_read_bandwidth, synth_dir

EXPERTS = ["checkpoint", "nvfp4"]   # the bf16 checkpoint as built, and packed into an NVFP4 arena


class CpuDecode:
    params = [["small", "mid"], EXPERTS]
    param_names = ["preset", "experts"]
    timeout = 900
    number = 1
    repeat = 3

    def setup_cache(self):
        return {f"{p}/{e}": str(synth_dir(p, e)) for p in PRESETS for e in EXPERTS}

    def setup(self, dirs, preset, experts):
        self.m = engine.load(dirs[f"{preset}/{experts}"], device="cpu")
        self.m.generate([1, 2, 3], max_new_tokens=4)  # compile kernels outside the timings
        self.ids = [1, 2, 3, 4, 5, 6, 7, 8]

    def _decode_s_per_token(self):
        s = self.m.generate(self.ids, max_new_tokens=17, temperature=0).stats
        return s["decode_s"] / s["decode_tokens"]

    def time_generate_16(self, dirs, preset, experts):
        self.m.generate(self.ids, max_new_tokens=16, temperature=0)

    def track_decode_ms_per_token(self, dirs, preset, experts):
        return 1e3 * self._decode_s_per_token()
    track_decode_ms_per_token.unit = "ms/token"

    def track_bound_over_achieved(self, dirs, preset, experts):
        bound_s = self.m.weight_bytes_per_token() / (dram_read_bandwidth(1 << 28) * 1e9)
        return self._decode_s_per_token() / bound_s
    track_bound_over_achieved.unit = "x of DRAM bound"
