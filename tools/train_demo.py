"""Train the embedded demo model: a small qwen3_moe on the Python standard library's own source.

Development only (torch + transformers + tokenizers, matplotlib for the plot); the engine never
imports it. Deterministic given --seed on one Python version (the corpus is that version's stdlib).

    python tools/train_demo.py train  --out build/demo [--steps N] [--device cpu|cuda]
    python tools/train_demo.py train  --init build/demo --out build/demo2 --steps N --lr X \
                                      --split-prob 0.05      # continue (docs/demo-model.md)
    python tools/train_demo.py export --out build/demo            # pack -> engine/data/demo
    python tools/train_demo.py report --out build/demo            # docs/demo-loss.png, numbers

`train` writes OUT/hf (a Hugging Face folder in bfloat16, byte-level BPE tokenizer, chat-free
generation_config.json) and OUT/loss.json. `export` packs OUT/hf with NVFP4 experts into
engine/data/demo/ and copies the bf16 folder to tests/data/demo-hf/ for the parity test. `report`
measures held-out perplexity (transformers on the bf16 folder, the engine on the pack), routing
statistics with the engine, saves tests/data/demo-trace.npz, draws docs/demo-loss.png and writes
OUT/report.json (the figures docs/demo-model.md quotes) and engine/data/demo/eval.json.

Corpus: every *.py under sysconfig's stdlib path, outside site-packages and test folders, read as
UTF-8, in sorted order. Held out: files whose crc32(relative path) % 20 == 0, plus PPL_FILE (the
fixed file of the perplexity test).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PACK_DIR = ROOT / "engine" / "data" / "demo"
TEST_HF_DIR = ROOT / "tests" / "data" / "demo-hf"
TRACE_FILE = ROOT / "tests" / "data" / "demo-trace.npz"
PPL_FILE = "textwrap.py"          # the fixed held-out file of tests/test_demo_model.py
PPL_TOKENS = 512                  # its first PPL_TOKENS tokens
HOLDOUT_MOD = 20                  # crc32(relpath) % HOLDOUT_MOD == 0 -> validation
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SPECIALS = ("<|pad|>", "<|bos|>", "<|endoftext|>")   # ids 0, 1, 2


@dataclass(frozen=True)
class DemoConfig:
    """Model and run sizes; the defaults fit ~25 minutes on 2 shared CPU cores and a < 10 MB pack."""
    vocab: int = 4096             # byte-level BPE; small so embeddings stay a minor share
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 16
    top_k: int = 2
    moe_intermediate: int = 128   # 16 x 3 x 256 x 128 per layer: 3.7 MB of NVFP4 blocks in all
    tie_embeddings: bool = True   # saves 1M parameters (2 MB bf16)
    aux_loss_coef: float = 0.01   # load balancing, so every expert is used
    seq: int = 256
    batch: int = 16
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    steps: int = 240
    seed: int = 0
    # a word token " foo" becomes " " + "foo" with this probability, so a prompt that ends in a
    # space (the CLI's default "def ") continues as the text would: BPE never shows a lone " "
    # before a word otherwise
    split_prob: float = 0.0

    def hf_config(self):
        import transformers as tf
        return tf.Qwen3MoeConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=4 * self.hidden,
            moe_intermediate_size=self.moe_intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, num_experts=self.experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=2048, tie_word_embeddings=self.tie_embeddings,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=self.aux_loss_coef,
            output_router_logits=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# ---- corpus ----------------------------------------------------------------------------------

def stdlib_files() -> tuple[Path, list[str]]:
    """(stdlib root, sorted relative paths of the corpus files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return root, sorted(out)


def split(rels: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation) relative paths; PPL_FILE always in validation."""
    val = [r for r in rels if zlib.crc32(r.encode()) % HOLDOUT_MOD == 0 or r == PPL_FILE]
    held = set(val)
    return [r for r in rels if r not in held], val


def read_text(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), min_frequency=2,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, tr)
    return tk


def encode_stream(tk, texts: list[str], eos: int) -> np.ndarray:
    """All texts, each followed by EOS, as one uint16 stream."""
    parts = []
    for enc in tk.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts)


# ---- train -----------------------------------------------------------------------------------

def lr_at(step: int, cfg: DemoConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def boundary_splitter(tk):
    """(split_to int [V]: the id of " foo"'s "foo" or -1, the id of " ") for the byte-level vocab."""
    space = tk.token_to_id("\u0120")                   # "Ġ": the byte-level spelling of " "
    split_to = np.full(tk.get_vocab_size(), -1, np.int64)
    for s, i in tk.get_vocab().items():
        if len(s) > 1 and s[0] == "\u0120" and s[1:].isidentifier():
            split_to[i] = tk.token_to_id(s[1:]) if tk.token_to_id(s[1:]) is not None else -1
    return split_to, space


def split_boundaries(x: np.ndarray, split_to: np.ndarray, space: int, p: float, rng) -> np.ndarray:
    """x int [B, S] -> [B, S]: some " foo" tokens replaced by " ", "foo"; each row cut back to S."""
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        row = x[b]
        pick = (split_to[row] >= 0) & (rng.random(len(row)) < p)
        pieces = [np.array([space, split_to[t]]) if k else np.array([t]) for t, k in zip(row, pick)]
        out[b] = np.concatenate(pieces)[:x.shape[1]]
    return out


def train(out: Path, cfg: DemoConfig, device: str, threads: int, init: Path | None = None) -> None:
    """Train from scratch, or (init) continue from a folder this command wrote, with its tokenizer."""
    import torch
    import transformers as tf
    torch.manual_seed(cfg.seed)
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    root, rels = stdlib_files()
    train_rel, val_rel = split(rels)
    t0 = time.perf_counter()
    train_txt = [t for t in (read_text(root, r) for r in train_rel) if t]
    val_txt = [t for t in (read_text(root, r) for r in val_rel) if t]
    if init is None:
        tk = train_tokenizer(train_txt, cfg.vocab)
    else:
        from tokenizers import Tokenizer
        tk = Tokenizer.from_file(str(init / "hf" / "tokenizer.json"))
    eos = tk.token_to_id("<|endoftext|>")
    assert [tk.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    data = encode_stream(tk, train_txt, eos)
    val = encode_stream(tk, val_txt, eos)
    print(f"corpus: {len(train_txt)} train files ({len(data):,} tokens), {len(val_txt)} held out "
          f"({len(val):,} tokens), tokenizer {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    if init is None:
        model = tf.Qwen3MoeForCausalLM(cfg.hf_config()).to(device)
    else:   # bf16 weights upcast: the continuation trains in float32 like the first run
        model = tf.Qwen3MoeForCausalLM.from_pretrained(init / "hf", dtype=torch.float32).to(device)
    split_to, space = boundary_splitter(tk)
    model.config.output_router_logits = True           # adds the load-balancing loss to .loss
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(cfg.seed)
    vrng = np.random.default_rng(cfg.seed + 1)
    val_starts = vrng.integers(0, len(val) - cfg.seq - 1, size=4 * cfg.batch)

    def batch(starts, stream):
        x = np.stack([stream[s:s + cfg.seq + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(x).to(device)

    def val_loss() -> float:
        model.eval()
        tot = 0.0
        with torch.no_grad():
            for i in range(0, len(val_starts), cfg.batch):
                x = batch(val_starts[i:i + cfg.batch], val)
                o = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
                tot += float(o.loss - cfg.aux_loss_coef * o.aux_loss)
        model.train()
        return tot / (len(val_starts) // cfg.batch)

    log = {"config": asdict(cfg), "device": device, "threads": torch.get_num_threads(),
           "params": n_params, "train_tokens": int(len(data)), "val_tokens": int(len(val)),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": tf.__version__, "steps": [], "val": [], "phases": []}
    step0 = 0
    if init is not None:   # the curve continues from the first run's
        prev = json.loads((init / "loss.json").read_text())
        log["phases"] = prev.get("phases") or [{"config": prev["config"], "steps": len(prev["steps"]),
                                               "train_s": prev["train_s"], "init": None}]
        log["steps"], log["val"] = prev["steps"], prev["val"]
        step0 = log["steps"][-1]["step"]
    phase = {"config": asdict(cfg), "steps": cfg.steps, "init": str(init) if init else None}
    print(f"model: {n_params / 1e6:.2f} M parameters; {cfg.steps} steps of {cfg.batch} x {cfg.seq} "
          f"tokens on {device}", file=sys.stderr)
    model.train()
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(rng.integers(0, len(data) - cfg.seq - 1, size=cfg.batch), data)
        if cfg.split_prob > 0:
            x = torch.from_numpy(split_boundaries(x.cpu().numpy(), split_to, space, cfg.split_prob,
                                                  rng)).to(device)
        # labels are shifted inside the model: labels = inputs
        o = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        ce = float(o.loss.detach() - cfg.aux_loss_coef * o.aux_loss.detach())
        el = time.perf_counter() - t_start
        log["steps"].append({"step": step0 + step + 1, "loss": ce, "aux": float(o.aux_loss.detach()), "lr": lr,
                             "grad_norm": gn, "elapsed_s": el})
        if (step + 1) % 10 == 0 or step == 0:
            print(f"step {step + 1:5d}  loss {ce:.4f}  aux {float(o.aux_loss.detach()):.3f}  lr {lr:.2e}  "
                  f"{el / (step + 1):.2f} s/step", file=sys.stderr, flush=True)
        if (step + 1) % 100 == 0 or step + 1 == cfg.steps:
            v = val_loss()
            log["val"].append({"step": step0 + step + 1, "loss": v})
            print(f"  held-out loss {v:.4f} (ppl {math.exp(v):.2f})", file=sys.stderr, flush=True)
        (out / "loss.json").write_text(json.dumps(log)) if (step + 1) % 50 == 0 else None
    phase["train_s"] = time.perf_counter() - t_start
    log["phases"].append(phase)
    log["train_s"] = sum(ph["train_s"] for ph in log["phases"])
    (out / "loss.json").write_text(json.dumps(log, indent=1))
    save_hf(model, tk, out / "hf")
    print(f"trained in {log['train_s'] / 60:.1f} min; wrote {out / 'hf'}", file=sys.stderr)


def save_hf(model, tk, dst: Path) -> None:
    """bfloat16 weights (the pack writes dense weights in the checkpoint's dtype), tokenizer files,
    a chat-free generation_config.json."""
    import torch
    model.config.output_router_logits = False
    model = model.to("cpu", torch.bfloat16).eval()
    if dst.exists():
        shutil.rmtree(dst)
    model.save_pretrained(dst)
    tk.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
         "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "add_bos_token": False,
         "model_max_length": 2048}, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2))


# ---- export ----------------------------------------------------------------------------------

def export(out: Path) -> None:
    from engine.pack import pack
    pack(out / "hf", PACK_DIR, experts="nvfp4", force=True)
    # the manifest names the source folder; ship the tool's name, not this machine's path
    man = json.loads((PACK_DIR / "manifest.json").read_text())
    man["source"] = "tools/train_demo.py train (bf16 Hugging Face folder)"
    (PACK_DIR / "manifest.json").write_text(json.dumps(man))
    if TEST_HF_DIR.exists():
        shutil.rmtree(TEST_HF_DIR)
    TEST_HF_DIR.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(out / "hf", TEST_HF_DIR)
    for d in (PACK_DIR, TEST_HF_DIR):
        size = sum(p.stat().st_size for p in d.iterdir())
        print(f"{d.relative_to(ROOT)}: {size / 1e6:.2f} MB", file=sys.stderr)


# ---- report ----------------------------------------------------------------------------------

def gini(counts: np.ndarray) -> float:
    """0 = every expert equally popular, 1 = one expert takes everything."""
    x = np.sort(np.asarray(counts, np.float64))
    n = len(x)
    return float((2 * np.arange(1, n + 1) - n - 1) @ x / (n * x.sum()))


def val_docs(tk, n_files: int, n_tokens: int) -> list[tuple[str, list[int]]]:
    """The first n_tokens tokens of the first n_files held-out files (sorted), BOS-free."""
    root, rels = stdlib_files()
    _, val_rel = split(rels)
    out = []
    for r in val_rel:
        t = read_text(root, r)
        if not t:
            continue
        ids = tk.encode(t, add_special_tokens=False).ids[:n_tokens]
        if len(ids) >= 64:
            out.append((r, ids))
        if len(out) == n_files:
            break
    return out


def nll_sum(logits: np.ndarray, ids) -> tuple[float, int]:
    """Sum of -log p(ids[t+1] | ids[..t]) over t, from float logits [T, V]."""
    lg = np.asarray(logits, np.float64)[:-1]
    lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
    return float((lse - lg[np.arange(len(lg)), np.asarray(ids[1:])]).sum()), len(lg)


def as_f32(w: np.ndarray) -> np.ndarray:
    """A dense weight as the CPU backend holds it (float32, or bf16 bits in uint16) -> float32."""
    w = np.asarray(w)
    return (w.astype(np.uint32) << 16).view(np.float32) if w.dtype == np.uint16 else w.astype(np.float32)


def speculative_hits(h_by_layer: dict, routers: dict, true_ids: np.ndarray, k: int) -> list[float]:
    """Per layer pair (L, L+1): the share of L+1's true top-k that L+1's router picks from
    layer L's MoE input (the post-norm hidden state routed at L)."""
    out = []
    for l in range(len(routers) - 1):
        logits = h_by_layer[l] @ routers[l + 1].T                         # [T, E]
        pred = np.argsort(-logits, axis=1, kind="stable")[:, :k]          # [T, K]
        true = true_ids[:, l + 1]                                         # [T, K]
        hit = [len(set(p) & set(t)) for p, t in zip(pred.tolist(), true.tolist())]
        out.append(float(np.sum(hit)) / true.size)
    return out


def report(out: Path, n_files: int, n_tokens: int) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer

    import engine
    from engine.runtime import TraceRecorder
    from engine.trace import save_trace, simulate
    torch.set_num_threads(2)
    log = json.loads((out / "loss.json").read_text())
    tk = Tokenizer.from_file(str(PACK_DIR / "tokenizer.json"))
    docs = val_docs(tk, n_files, n_tokens)
    res = {"held_out_files": len(docs), "tokens_per_file": n_tokens}

    # perplexity: transformers on the bf16 folder (float32 compute), the engine on the NVFP4 pack
    hf = tf.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    m = engine.load(PACK_DIR, device="cpu")
    c = m.config
    hf_nll = eng_nll = 0.0
    n = 0
    rec = TraceRecorder(c.moe_layers)
    m.model.on_route = rec
    h_by_layer = {l: [] for l in c.moe_layers}
    moe = m.model.moe

    def moe_hook(l, h):   # the MoE input of layer l, for the speculative router
        h_by_layer[l].append(np.array(h, np.float32))
        return moe(l, h)

    m.model.moe = moe_hook
    t0 = time.perf_counter()
    per_file = []
    for rel, ids in docs:
        with torch.no_grad():
            lg = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
        a, k = nll_sum(lg, ids)
        b, _ = nll_sum(m.logits(ids), ids)
        hf_nll, eng_nll, n = hf_nll + a, eng_nll + b, n + k
        per_file.append({"file": rel, "tokens": len(ids), "ppl_bf16": math.exp(a / k),
                         "ppl_nvfp4": math.exp(b / k)})
    res["ppl_bf16_transformers"] = math.exp(hf_nll / n)
    res["ppl_nvfp4_engine"] = math.exp(eng_nll / n)
    res["scored_tokens"] = n
    res["per_file"] = per_file
    print(f"held-out ppl over {n} tokens: bf16 (transformers) {res['ppl_bf16_transformers']:.3f}, "
          f"nvfp4 (engine) {res['ppl_nvfp4_engine']:.3f} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)

    # the perplexity test's figure: PPL_FILE, first PPL_TOKENS tokens, engine on the pack
    root, _ = stdlib_files()
    ppl_ids = tk.encode(read_text(root, PPL_FILE), add_special_tokens=False).ids[:PPL_TOKENS]
    m.model.on_route = None
    m.model.moe = moe
    a, k = nll_sum(m.logits(ppl_ids), ppl_ids)
    eval_rec = {"file": PPL_FILE, "python": platform.python_version(), "tokens": len(ppl_ids),
                "ppl_nvfp4_engine": math.exp(a / k), "ids": ppl_ids,
                "note": "first tokens of the stdlib file, held out from training; "
                        "tests/test_demo_model.py recomputes the perplexity with the engine"}
    (PACK_DIR / "eval.json").write_text(json.dumps(eval_rec))
    res["ppl_file"] = {kk: v for kk, v in eval_rec.items() if kk != "ids"}

    # routing statistics (engine, held-out text)
    ids = rec.array()                                                    # [T, L, K]
    t_, l_, k_ = ids.shape
    counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=c.n_experts) for l in range(l_)])
    res["tokens_routed"] = int(t_)
    res["gini_per_layer"] = [gini(x) for x in counts]
    res["expert_share_per_layer"] = (counts / counts.sum(1, keepdims=True)).round(4).tolist()
    # overlap of consecutive tokens' routed sets, within a file (a new file restarts the context)
    bounds = np.cumsum([len(d[1]) for d in docs])
    same_doc = np.ones(t_ - 1, bool)
    same_doc[bounds[:-1] - 1] = False
    ov = np.array([[len(set(ids[t, l]) & set(ids[t + 1, l])) / k_ for l in range(l_)]
                   for t in range(t_ - 1)])
    res["consecutive_overlap_per_layer"] = ov[same_doc].mean(0).tolist()
    res["consecutive_overlap_random"] = k_ / c.n_experts
    total = l_ * c.n_experts
    caps = sorted({max(k_ * l_, int(total * f)) for f in (0.125, 0.25, 0.5, 0.75)})
    res["cache"] = []
    for cap in caps:
        row = {"slots": cap, "share": cap / total}
        for p in ("lru", "belady"):
            row[p] = simulate(ids, cap, p, "layer")["hit_rate"]
        res["cache"].append(row)
    routers = {l: as_f32(m._weight("router", l)) for l in c.moe_layers}                  # [E, H]
    h = {l: np.concatenate(v) for l, v in h_by_layer.items()}
    res["speculative_router_hits"] = speculative_hits(h, routers, ids, k_)
    save_trace(TRACE_FILE, ids, {"model": "engine/data/demo", "top_k": k_,
                                 "n_experts": c.n_experts, "moe_layers": list(c.moe_layers),
                                 "block_bytes": m.experts.block_bytes,
                                 "text": f"first {n_tokens} tokens of {len(docs)} held-out stdlib "
                                         f"files (Python {platform.python_version()})",
                                 "doc_lengths": [len(d[1]) for d in docs]})
    res["trace"] = {"file": str(TRACE_FILE.relative_to(ROOT)), "bytes": TRACE_FILE.stat().st_size}

    # a sample, the loss curve
    g = m.generate(m.encode("def "), 48)
    res["sample_def"] = g.text
    res["train"] = {k2: log[k2] for k2 in ("params", "train_tokens", "val_tokens", "python", "torch",
                                            "transformers", "device", "threads", "train_s")}
    res["train"]["steps"] = len(log["steps"])
    res["train"]["final_loss_avg20"] = float(np.mean([s["loss"] for s in log["steps"][-20:]]))
    res["train"]["val"] = log["val"]
    res["sizes"] = {d.name: sum(p.stat().st_size for p in d.iterdir()) for d in (PACK_DIR, TEST_HF_DIR)}
    plot_loss(log, ROOT / "docs" / "demo-loss.png")
    (out / "report.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k2: v for k2, v in res.items() if k2 not in ("per_file", "expert_share_per_layer")},
                     indent=1))


def plot_loss(log: dict, dst: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    st = np.array([s["step"] for s in log["steps"]])
    loss = np.array([s["loss"] for s in log["steps"]])
    w = 10
    smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(st, loss, lw=0.6, alpha=0.4, color="C0", label="train (per step)")
    ax.plot(st[w - 1:], smooth, lw=1.5, color="C0", label=f"train ({w}-step mean)")
    if log["val"]:
        ax.plot([v["step"] for v in log["val"]], [v["loss"] for v in log["val"]], "o-", color="C3",
                label="held-out stdlib files")
    ends = np.cumsum([ph["steps"] for ph in log.get("phases", [])])[:-1]
    for i, e in enumerate(ends):   # a continuation run (train --init) starts here
        ax.axvline(e, color="grey", ls="--", lw=0.8,
                   label="continued: lr re-warmed, ' '+word splits" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    cfg = log["config"]
    ax.set_title(f"demo qwen3_moe: {cfg['layers']} layers, {cfg['experts']} experts top-{cfg['top_k']}, "
                 f"{cfg['batch']}x{cfg['seq']} tokens/step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/train_demo.py", description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=("train", "export", "report"))
    p.add_argument("--out", type=Path, default=ROOT / "build" / "demo")
    p.add_argument("--device", default="cpu", help="torch device for training (cpu, cuda)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--seed", type=int, default=DemoConfig.seed)
    p.add_argument("--lr", type=float, default=DemoConfig.lr)
    p.add_argument("--warmup", type=int, default=DemoConfig.warmup)
    p.add_argument("--split-prob", type=float, default=DemoConfig.split_prob)
    p.add_argument("--init", type=Path, help="train: continue from this OUT folder (its hf/, loss.json)")
    p.add_argument("--files", type=int, default=16, help="report: held-out files scored")
    p.add_argument("--tokens", type=int, default=512, help="report: first tokens of each file")
    a = p.parse_args(argv)
    if a.cmd == "train":
        train(a.out, DemoConfig(steps=a.steps, seed=a.seed, lr=a.lr, warmup=a.warmup,
                                split_prob=a.split_prob), a.device, a.threads, a.init)
    elif a.cmd == "export":
        export(a.out)
    else:
        report(a.out, a.files, a.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
