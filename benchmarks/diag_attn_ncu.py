"""One attention call to profile under Nsight Compute: ours or cuDNN's, forward or backward.

    ncu --section WarpStateStats --section SourceCounters -k regex:NAME -c 1 -o FILE \\
        python3 -m benchmarks.diag_attn_ncu [--fwd] [--causal] [--cudnn] [--shape B,S,H,D]

Two calls of the chosen pass after the inputs are built (the first loads the kernel from the
cache); `-k` picks the kernel to profile: ours `flash_bwd_fused_kernel_1` (the backward's main
kernel) or `flash_fwd`, cuDNN's `bprop` / `fprop`. docs/tilelang_notes.md has the commands that
read the per-instruction stall samples back (nineteenth session)."""
from __future__ import annotations

import argparse

import torch


def report(sass_csv: str | None, raw_csv: str | None, top: int = 30) -> None:
    """Summaries of `ncu --import F --page source --csv --print-source sass` (the instructions
    with the most stall samples, and their top reasons) and of `--page raw --csv` (the kernel's
    stall reasons, `smsp__pcsamp_warps_issue_stalled_*`)."""
    import csv

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    if raw_csv:
        hdr, _, vals = list(csv.reader(open(raw_csv)))[:3]
        pre = "smsp__pcsamp_warps_issue_stalled_"
        st = {h[len(pre):]: num(v) for h, v in zip(hdr, vals) if h.startswith(pre) and not h.endswith("not_issued")}
        total = sum(st.values()) or 1.0
        for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:12]:
            print(f"{k:28s} {v / total * 100:5.1f}%")
    if sass_csv:
        rows = list(csv.reader(open(sass_csv)))
        hdr, data = rows[1], rows[2:]
        col = {h: i for i, h in enumerate(hdr)}
        samples = col["Warp Stall Sampling (All Samples)"]
        reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(num(r[samples]) for r in data) or 1.0
        for i in sorted(sorted(range(len(data)), key=lambda i: -num(data[i][samples]))[:top]):
            r = data[i]
            why = sorted(((num(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:2]
            print(f"{i:5d} {num(r[samples]) / total * 100:5.1f}%  {r[1][:64]:64s} {', '.join(w for v, w in why if v)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs=2, metavar=("SASS_CSV", "RAW_CSV"), help="summarize ncu's CSV pages instead (no GPU)")
    ap.add_argument("--fwd", action="store_true", help="the forward (default: the backward)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cudnn", action="store_true", help="SDPA's cuDNN backend instead of ours")
    ap.add_argument("--shape", default="8,4096,32,128", help="B,S,H,D")
    a = ap.parse_args()
    if a.report:
        return report(*(f if f != "-" else None for f in a.report))
    B, S, H, D = map(int, a.shape.split(","))
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2).requires_grad_(not a.fwd) for t in (q, k, v))

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)

        out = fwd()
        dout = torch.randn_like(out)
        for _ in range(2):
            fwd() if a.fwd else torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)
    else:
        import tilelang_ops  # noqa: F401

        out, lse = torch.ops.tileops.flash_attn_with_lse(q, k, v, a.causal)
        dout = torch.randn_like(out)
        for _ in range(2):
            if a.fwd:
                torch.ops.tileops.flash_attn_with_lse(q, k, v, a.causal)
            else:
                torch.ops.tileops.flash_attn_backward(dout, q, k, v, out, lse, a.causal)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
