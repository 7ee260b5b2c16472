"""Train a small GPT with PyTorch ops or tilelang_ops, eager or compiled, and compare the runs.

Modes (one model definition, one seeded init, one data order, so loss curves are comparable):
  torch            nn.Linear + GELU(tanh) + F.scaled_dot_product_attention, eager
  tileops          MLP up-projection -> tilelang_ops.nn.Linear(activation="gelu_tanh") (one fused
                   kernel, via tilelang_ops.nn.fuse_linear_activations), attention ->
                   tilelang_ops.flash_attn_qkvpacked, LayerNorm -> tilelang_ops.nn.LayerNorm writing bf16
                   (each feeds a Linear under bf16 autocast: the cast kernel goes away) with the
                   residual add before it in the same kernel (add_layer_norm); --ln torch keeps
                   PyTorch's. The other Linears keep cuBLAS's GEMMs with our bias gradient
                   (nn.Linear(backend="cublas"); --linears torch keeps nn.Linear). Embeddings stay PyTorch
  torch-compile    torch, then torch.compile(model, fullgraph=True)
  tileops-compile  tileops, then torch.compile(model, fullgraph=True)

Data: no downloads. The corpus is the bytes of this repository's own *.py and *.md files
(sorted by path, concatenated; byte-level vocabulary of 256). Its size and sha256 go into the
JSON, so two runs are comparable only when the sha256 matches. Batches are windows at offsets
drawn from a seeded generator, identical for every mode.

Usage (bf16 autocast on both devices; tileops modes need head dim dim/heads in 64/128/256):
  python examples/train_gpt.py --mode tileops --steps 300 --out runs/        # one mode, defaults
  python examples/train_gpt.py --compare --steps 300 --out runs/             # all four + loss.png
  python examples/train_gpt.py --compare --mode torch tileops --out runs/    # a subset
  python examples/train_gpt.py --replot --out runs/                          # plot/table from JSONs
  python examples/train_gpt.py --device cpu --layers 2 --dim 128 --heads 2 --seq 64 --steps 5
  torchrun --nproc-per-node 2 examples/train_gpt.py --mode tileops --dist ddp --out runs/     # or fsdp2
Writes OUT/<mode>.json (loss per step, tokens/s, graph breaks) and, with --compare, OUT/loss.png;
with --dist, OUT/<mode>-<ddp|fsdp2>-x<N>.json (rank 0; the loss is the mean over ranks).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import tilelang_ops
except ImportError:  # run from a checkout without `pip install`: the package sits next to examples/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import tilelang_ops

MODES = ("torch", "tileops", "torch-compile", "tileops-compile")
REPO = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- data
def load_corpus(root: pathlib.Path = REPO) -> tuple[torch.Tensor, dict]:
    """The repository's own .py/.md bytes as a uint8 tensor, plus a description for the JSON."""
    skip = {"build", "dist", "runs", "bench_results", "gpu_out", "csrc_generated"}  # outputs, not sources
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip and not x.startswith(".")]  # prune .git, caches, bundles
        files += [pathlib.Path(d, n) for n in names if n.endswith((".py", ".md"))]
    files.sort(key=lambda p: p.relative_to(root).as_posix())  # fixed order: the corpus is a function of the tree
    data = b"".join(p.read_bytes() for p in files)
    info = {"source": "repository *.py/*.md bytes", "files": len(files), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), info


def batches(data: torch.Tensor, batch: int, seq: int, seed: int, pin: bool = False):
    """Endless (inputs, targets) pairs of random windows; a private generator so every mode sees the same data.
    pin: in pinned host memory, so that `.to("cuda", non_blocking=True)` does not wait for the GPU
    (a copy from pageable memory synchronizes the stream first: the host could not queue the next
    step while the GPU finishes this one)."""
    gen = torch.Generator().manual_seed(seed)
    # int64 once, windows by one gather: a uint8 -> int64 conversion per step cost the host 3.3 ms
    # on the H200 machine (profile_train --host), time an eager step bound by its host cannot spare
    tokens, offsets = data.long(), torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        win = tokens[starts[:, None] + offsets]
        x, y = win[:, :-1], win[:, 1:]
        yield (x.contiguous().pin_memory(), y.contiguous().pin_memory()) if pin else (x, y)


# ---------------------------------------------------------------- model (GPT-2 style, pre-LN)
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.use_flash = heads, False
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        # (B, S, 3, H, D): flash-attn's packed layout; unbinding dim 2 gives q, k, v in (B, S, H, D).
        qkv = self.qkv(x).view(B, S, 3, self.heads, C // self.heads)
        if self.use_flash:
            # square causal: same mask as SDPA's. Packed: the backward writes one (B, S, 3, H, D)
            # gradient, where unbind + attention has autograd stack three (a copy of all of it)
            y = tilelang_ops.flash_attn_qkvpacked(qkv, causal=True)
        else:  # SDPA wants (B, H, S, D): transposed views, no copy
            q, k, v = qkv.unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(B, S, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        # A plain Sequential, so fuse_linear_activations can find the Linear -> GELU pair.
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x, branch=None):
        """x: the residual stream; branch: the previous block's MLP output, not yet added to it.
        Returns (stream, this block's MLP output): each residual add happens in add_norm, where
        tilelang_ops' LayerNorm fuses it with the norm that follows (the math is unchanged:
        x + attn(ln1(x)), then + mlp(ln2(.)))."""
        x, h = add_norm(self.ln1, x, branch)
        x, h = add_norm(self.ln2, x, self.attn(h))
        return x, self.mlp(h)


def add_norm(ln, x, branch):
    """(x + branch, ln(x + branch)); branch None: (x, ln(x)). tilelang_ops.nn.LayerNorm does both
    in one kernel (and one in the backward: no add, no cast of the branch's gradient)."""
    if branch is None:
        return x, ln(x)
    if isinstance(ln, tilelang_ops.nn.LayerNorm):
        return ln(x, branch)
    x = x + branch
    return x, ln(x)


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, seq: int, vocab: int = 256):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        # GPT-2 init; residual-branch outputs scaled by 1/sqrt(2 * layers) so the stream's variance stays put.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        branch = None
        for blk in self.blocks:
            x, branch = blk(x, branch)
        _, h = add_norm(self.ln_f, x, branch)
        logits = F.linear(h, self.wte.weight)  # tied input/output embedding
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # loss in fp32


def to_tileops(model: GPT, layer_norm: bool = True, linears: str = "cublas") -> None:
    """Swap in tilelang_ops in place; the parameters are the same objects, so the init is unchanged.

    Only where fusion saves memory traffic or our kernel is faster: Linear+GELU becomes one kernel
    (no separate GELU pass over the 4*dim activations), attention never materialises S x S scores
    (and takes the packed QKV projection, so its backward writes one gradient), and each LayerNorm
    reads the fp32 residual stream and writes the bf16 its Linear takes under autocast (one
    kernel instead of layer_norm + cast; its backward reads the bf16 gradient directly: 4 ms of
    GPU time less per step, benchmarks.profile_train) and takes the residual add before it into
    the same kernel (`add_norm`: add_layer_norm, whose backward also adds the stream's gradient
    and writes the branch's in bf16). `layer_norm=False` (`--ln torch`) keeps PyTorch's. The other
    Linears are plain GEMMs where cuBLAS is as fast or faster in the training step: the MLP's
    down-projection on ours took 8.10 ms per step against cuBLAS's 7.35 at 32 x 1024 tokens
    (`benchmarks.profile_train --batch 32`, session 15), though alone, in turns, its forward, dX and
    dW ran 1.07x, 1.02x and 1.03x cuBLAS (`sweep_gemm --group 'gpt_*'`); the attention's QKV
    (0.84x forward) and output projection (0.88-0.99x) lose even there. So their GEMMs stay
    cuBLAS's: `linears="cublas"` (`--linears`) makes them tilelang_ops.nn.Linear(backend="cublas"),
    PyTorch's GEMMs with our bias gradient (one read of the output gradient at copy bandwidth;
    PyTorch's column sum runs at about half of it, 1.8 ms per step at 32 x 1024 tokens);
    "torch" keeps nn.Linear.
    """
    report = tilelang_ops.nn.fuse_linear_activations(model)
    assert len(report.fused) == len(model.blocks), str(report)
    for blk in model.blocks:
        blk.attn.use_flash = True
        if linears == "cublas":
            blk.attn.qkv = tilelang_ops.nn.Linear.from_linear(blk.attn.qkv, backend="cublas")
            blk.attn.proj = tilelang_ops.nn.Linear.from_linear(blk.attn.proj, backend="cublas")
            blk.mlp[2] = tilelang_ops.nn.Linear.from_linear(blk.mlp[2], backend="cublas")
    if not layer_norm:
        return
    for blk in model.blocks:
        blk.ln1 = tilelang_ops.nn.LayerNorm.from_layer_norm(blk.ln1, out_dtype=torch.bfloat16)
        blk.ln2 = tilelang_ops.nn.LayerNorm.from_layer_norm(blk.ln2, out_dtype=torch.bfloat16)
    model.ln_f = tilelang_ops.nn.LayerNorm.from_layer_norm(model.ln_f, out_dtype=torch.bfloat16)


# ---------------------------------------------------------------- training
def build(args, mode: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(args.seed)  # same init in every mode (and on every rank)
    model = GPT(args.layers, args.dim, args.heads, args.seq).to(args.device)
    if mode.startswith("tileops"):
        to_tileops(model, layer_norm=args.ln == "tileops", linears=args.linears)
    if args.dist == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        index = torch.device(args.device).index
        model = DistributedDataParallel(model, device_ids=None if index is None else [index])
    elif args.dist == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:  # one all-gather / reduce-scatter group per block, then the rest
            fully_shard(blk)
        fully_shard(model)
    if mode.endswith("compile"):
        # "reduce-overhead": CUDA graphs (cudagraph trees) replay the compiled forward and backward,
        # so the host's per-kernel launch path leaves the step (`--compile-mode`).
        step_fn = torch.compile(model, fullgraph=True, **({} if args.compile_mode == "default" else {"mode": args.compile_mode}))
    else:
        step_fn = model
    return model, step_fn


def cudagraphs(args, mode: str) -> bool:
    return mode.endswith("compile") and args.compile_mode == "reduce-overhead"


def init_dist(args) -> tuple[int, int]:
    """(rank, world size). Under torchrun with --dist ddp|fsdp2: one process per GPU, NCCL."""
    if args.dist == "none":
        return 0, 1
    import torch.distributed as dist

    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: the CPU check in tests/
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"  # the ops must work on any device index, not only cuda:0
    return dist.get_rank(), dist.get_world_size()


def graph_breaks(model, x, y, autocast) -> dict:
    """Forward graph/break counts from torch._dynamo.explain (fullgraph=True would just raise on a break)."""
    with autocast:
        ex = torch._dynamo.explain(model)(x, y)
    torch._dynamo.reset()  # explain leaves compiled code behind; start the real compile clean
    return {"graph_count": ex.graph_count, "graph_break_count": ex.graph_break_count, "break_reasons": [str(r.reason) for r in ex.break_reasons]}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def train(args, mode: str, data: torch.Tensor, corpus: dict, rank: int = 0, world: int = 1) -> dict:
    model, step_fn = build(args, mode)
    dev = args.device
    # fused AdamW over FSDP2's DTensor parameters is not something to rely on: foreach there
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.startswith("cuda") and args.dist != "fsdp2")
    warm = max(1, min(10, args.steps // 10))  # steps excluded from tokens/s (compilation, autotuning, allocator)
    lr_warm = max(1, args.steps // 10)  # linear warm-up, then cosine to 10%: GPT-2 small at 6e-4 needs the ramp
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / lr_warm, 0.1 + 0.45 * (1 + math.cos(math.pi * s / args.steps))))
    autocast = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16)
    data_iter = batches(data, args.batch, args.seq, args.seed, pin=dev.startswith("cuda") and world == 1)  # ranks slice rows: pageable
    result = {"mode": mode, "device": dev, "dist": args.dist, "world_size": world, "config": {k: v for k, v in vars(args).items() if k not in ("mode", "out")}, "corpus": corpus, "torch": torch.__version__}
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(dev)
    if mode.endswith("compile"):
        x, y = next(batches(data, args.batch, args.seq, args.seed))
        result.update(graph_breaks(model, x.to(dev), y.to(dev), autocast))
        torch._dynamo.utils.counters.clear()  # from here on, count the training run's compilations only

    losses, t0 = [], None
    graphs = cudagraphs(args, mode)
    bar = progress(range(args.steps), desc=mode) if rank == 0 else _Quiet(range(args.steps))
    for step in bar:
        if step == warm:
            sync(dev)
            t0 = time.perf_counter()
        # Every rank draws the same global batch and keeps its share of the rows: the optimizer
        # sees the single-GPU batch, so the loss curve must match the single-GPU run.
        x, y = (t[rank::world].to(dev, non_blocking=True) for t in next(data_iter))
        if graphs:  # a new iteration: the previous replay's outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone() if graphs else loss.detach())  # a graph's output is overwritten by the next replay
        if step % 10 == 0 or step == args.steps - 1:  # .item() syncs: only now and then
            bar.set_postfix(loss=f"{loss.item():.3f}")
    sync(dev)
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = args.steps - warm
    losses = torch.stack(losses)
    if world > 1:  # the mean over ranks = the loss of the global batch
        import torch.distributed as dist

        dist.all_reduce(losses)
        losses /= world
    result["losses"] = [float(v) for v in losses.cpu()]
    result["tokens_per_s"] = timed * args.batch * args.seq / elapsed if timed > 0 else float("nan")
    result["timed_steps"], result["seconds"] = timed, elapsed
    if dev.startswith("cuda"):
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if mode.endswith("compile"):  # 1 = compiled once, no recompiles (e.g. the backward adds none here)
        result["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    del model, step_fn, opt
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    if mode.endswith("compile"):
        torch._dynamo.reset()
    return result


class _Quiet(list):
    """What ranks other than 0 iterate: no bar, no output."""

    def set_postfix(self, **kw):
        pass


def progress(it, desc):
    try:
        from tqdm import tqdm

        return tqdm(it, desc=desc, dynamic_ncols=True)
    except ImportError:  # the GPU host may lack tqdm: a plain iterator with the same interface
        class _Plain(list):
            def set_postfix(self, **kw):
                print(desc, kw, flush=True)
        return _Plain(it)


# ---------------------------------------------------------------- report
def report(results: list[dict], out: pathlib.Path) -> None:
    base = next((r["tokens_per_s"] for r in results if r["mode"] == "torch"), None)
    print(f"\n{'mode':<16} {'tokens/s':>12} {'x torch':>8} {'first loss':>11} {'last loss':>10} {'graph breaks':>13} {'graphs':>7}")
    for r in results:
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        gb, ng = r.get("graph_break_count", "-"), r.get("compiled_graphs", "-")
        print(f"{r['mode']:<16} {r['tokens_per_s']:>12,.0f} {ratio:>8} {r['losses'][0]:>11.4f} {r['losses'][-1]:>10.4f} {gb!s:>13} {ng!s:>7}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the JSONs are in", out, "; `--replot` draws it elsewhere)")
        return
    ref = next((r["losses"] for r in results if r["mode"] == "torch"), results[0]["losses"])
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
    for r in results:
        steps = range(1, len(r["losses"]) + 1)
        ax.plot(steps, r["losses"], label=f"{r['mode']} ({r['tokens_per_s']:,.0f} tok/s)", linewidth=1)
        # The difference to the reference run shows "agree within noise" better than overlapping curves.
        dax.plot(steps, [a - b for a, b in zip(r["losses"], ref)], linewidth=1)
    c = results[0]["config"]
    ax.set(ylabel="train loss (nats/byte)", title=f"GPT {c['layers']}L d={c['dim']} h={c['heads']} seq={c['seq']} batch={c['batch']} on {results[0]['device']}")
    dax.set(xlabel="step", ylabel=f"loss - {results[0]['mode'] if ref is results[0]['losses'] else 'torch'}")
    ax.legend()
    fig.savefig(out / "loss.png", dpi=120, bbox_inches="tight")
    print("wrote", out / "loss.png")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", nargs="+", choices=MODES, help="default: torch, or all four with --compare")
    p.add_argument("--compare", action="store_true", help="run the modes one after the other, print tokens/s, plot OUT/loss.png")
    p.add_argument("--replot", action="store_true", help="no training: table and plot from OUT/<mode>.json")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ln", choices=("tileops", "torch"), default="tileops", help="tileops modes: whose LayerNorm (default tileops)")
    p.add_argument("--linears", choices=("cublas", "torch"), default="cublas",
                   help="tileops modes: the Linears without activation as tilelang_ops.nn.Linear(backend='cublas') (default) or nn.Linear")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs"))
    p.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"), default="default",
                   help="torch.compile's mode in the *-compile modes (reduce-overhead: CUDA graphs)")
    p.add_argument("--dist", choices=("none", "ddp", "fsdp2"), default="none",
                   help="under torchrun --nproc-per-node N: data parallel over N GPUs (eager modes)")
    args = p.parse_args(argv)
    if args.dist != "none" and (args.compare or any(m.endswith("compile") for m in args.mode or ())):
        p.error("--dist runs one eager mode (torch or tileops), without --compare")
    if args.dist != "none" and args.batch % int(os.environ.get("WORLD_SIZE", 1)):
        p.error(f"--batch {args.batch} must divide by the number of processes")
    args.mode = args.mode or (list(MODES) if args.compare or args.replot else ["torch"])
    if any(m.startswith("tileops") for m in args.mode) and (args.dim % args.heads or args.dim // args.heads not in (64, 128, 256)):
        p.error(f"tileops modes need head dim (dim / heads) in 64, 128, 256; got {args.dim} / {args.heads}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = [json.loads((args.out / f"{m}.json").read_text()) for m in args.mode if (args.out / f"{m}.json").exists()]
    else:
        rank, world = init_dist(args)
        data, corpus = load_corpus()
        if rank == 0:
            print(f"corpus: {corpus['files']} files, {corpus['bytes']:,} bytes, sha256 {corpus['sha256'][:12]}")
        results = []
        for mode in args.mode:
            r = train(args, mode, data, corpus, rank, world)
            if rank == 0:
                name = mode if args.dist == "none" else f"{mode}-{args.dist}-x{world}"
                (args.out / f"{name}.json").write_text(json.dumps(r, indent=1))
            results.append(r)
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
            if rank:
                return results
    if (args.compare or args.replot) and results:
        report(results, args.out)
    for r in results if not (args.compare or args.replot) else ():
        print(f"{r['mode']}: {r['tokens_per_s']:,.0f} tokens/s, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    return results


if __name__ == "__main__":
    main()
