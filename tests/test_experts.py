"""GroupedExperts (fused gate/up weights, scaled SwiGLU, written-out backward) against an unfused
per-expert SwiGLU written here in float64, plus what the fused layout must keep: the per-expert
state dict, recompute_swiglu giving the same bits, expert-sorted input skipping the permutation,
run-to-run identical bits. The Triton kernels (moe_ep.moe.expert_kernels) are checked against the torch
versions on CUDA, or in Triton's interpreter on the CPU when Triton is installed.
Inputs are fresh each run; the seed is in every failure message.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import pytest
import torch
import torch.nn.functional as F

from moe_ep.comm import row_sum
from moe_ep.moe import expert_kernels as ek
from moe_ep.moe.experts import GroupedExperts, _Groups, grouped_mm_supported, route

E, E_L, FIRST, H, FFN = 12, 5, 4, 32, 24


def _seed() -> int:
    return random.randrange(1 << 30)


def _routing(g: torch.Generator, m: int, k: int, e_l: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids without repeats per row, ~30 % -1 (experts elsewhere); weights 0 there."""
    idx = torch.rand(m, e_l + 2, generator=g).argsort(1)[:, :k] - 2  # ids -2, -1 stand for other ranks
    idx[idx < 0] = -1
    w = torch.rand(m, k, generator=g) * (idx >= 0)
    return idx.to(device), w.to(device)


def _experts(g: torch.Generator, dtype: torch.dtype, device: str = "cpu", **kw) -> GroupedExperts:
    ex = GroupedExperts(E, E_L, FIRST, H, FFN, dtype=dtype, device=torch.device(device), **kw)
    with torch.no_grad():
        for p in (ex.w1, ex.w3, ex.w2):
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return ex


def _unfused(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
    """sum_k w[m, k] * w2_e (silu(w1_e x_m) * (w3_e x_m)), e = idx[m, k], one (k, expert) at a time."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype)
    for k in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            rows = (idx[:, k] == e).nonzero().squeeze(1)
            h = F.silu(x[rows] @ w1[e].t()) * (x[rows] @ w3[e].t())
            out = out.index_add(0, rows, (h @ w2[e].t()) * w[rows, k, None])
    return out


def _weight_grad_scale(x: torch.Tensor, idx: torch.Tensor, probe: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """[M, K]: the size of the terms that d/dweights[m, k] sums, sum_f |h_f| |(w2_e^T probe_m)_f| with
    h = silu(w1_e x_m) * (w3_e x_m), e = idx[m, k] (0 where -1). The sum cancels, so its bf16 error is
    bounded relative to this, not to the sum itself (one pair's sum may be near 0)."""
    scale = torch.zeros(idx.shape, dtype=x.dtype)
    for k in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            rows = (idx[:, k] == e).nonzero().squeeze(1)
            h = F.silu(x[rows] @ w1[e].t()) * (x[rows] @ w3[e].t())
            scale[rows, k] = (h.abs() * (probe[rows] @ w2[e]).abs()).sum(1)
    return scale


def _run(ex: GroupedExperts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
         probe: torch.Tensor) -> list[torch.Tensor]:
    """[output, d/dx, d/dweights, d/dw1, d/dw3, d/dw2] of sum(out * probe)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = ex(x, idx, w)
    grads = torch.autograd.grad((out.to(probe.dtype) * probe).sum(), [x, w, ex.w1, ex.w3, ex.w2])
    return [out.detach(), *grads]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_backward_match_unfused(dtype: torch.dtype, tol: float) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ex = _experts(g, dtype)
    for m, k in ((37, 3), (1, 1), (20, 5), (0, 2)):
        x = torch.randn(m, H, generator=g).to(torch.bfloat16)
        idx, w = _routing(g, m, k, E_L)
        probe = torch.randn(m, H, generator=g)
        got = _run(ex, x, idx, w, probe)
        ref_w = [p.detach().double().requires_grad_() for p in (ex.w1, ex.w3, ex.w2)]
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        want = _unfused(xr, idx, wr, *ref_w)
        want = [want.detach(), *torch.autograd.grad((want * probe.double()).sum(), [xr, wr, *ref_w])]
        names = ("out", "x.grad", "weights.grad", "w1.grad", "w3.grad", "w2.grad")
        scale = _weight_grad_scale(xr.detach(), idx, probe.double(), *[p.detach() for p in ref_w])
        for name, a, b in zip(names, got, want):
            assert a.shape == b.shape, f"seed {seed}, M={m}: {name} shape"
            bound = max(tol, 4e-3) if name == "x.grad" else tol  # x.grad comes in x's dtype, bf16
            if name == "weights.grad":  # elementwise, against the size of the terms each one sums
                err = (a.double() - b).abs()
                assert (err <= tol * scale + 1e-12).all(), \
                    f"seed {seed}, M={m}, K={k}: weights.grad error {float((err / scale.clamp_min(1e-30)).max()):.2e}"
            elif b.any():
                assert _rel(a, b) <= bound, f"seed {seed}, M={m}, K={k}: {name} rel err {_rel(a, b):.2e}"
            else:
                assert not a.any(), f"seed {seed}, M={m}: {name} should be 0"
        assert not got[2][idx < 0].any(), f"seed {seed}: gradient of a -1 slot"


def test_recompute_same_bits_and_repeatable() -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ex = _experts(g, torch.float32)
    x = torch.randn(41, H, generator=g).to(torch.bfloat16)
    idx, w = _routing(g, 41, 4, E_L)
    probe = torch.randn(41, H, generator=g)
    kept = _run(ex, x, idx, w, probe)
    again = _run(ex, x, idx, w, probe)
    ex.recompute_swiglu = True
    recomputed = _run(ex, x, idx, w, probe)
    for a, b, c in zip(kept, again, recomputed):
        assert torch.equal(a, b), f"seed {seed}: not repeatable"
        assert torch.equal(a, c), f"seed {seed}: recompute_swiglu changed the bits"


def test_expert_sorted_rows_skip_the_permutation() -> None:
    """Rows grouped by expert with one pair each: forward_sorted equals the routed forward, bit for bit."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ex = _experts(g, torch.float32)
    counts = torch.randint(0, 6, (E_L,), generator=g)
    counts[1] = 0
    p = int(counts.sum())
    idx = torch.repeat_interleave(torch.arange(E_L), counts).unsqueeze(1)
    x, w = torch.randn(p, H, generator=g).to(torch.bfloat16), torch.rand(p, 1, generator=g)
    probe = torch.randn(p, H, generator=g)
    routed = _run(ex, x, idx, w, probe)
    xs, ws = x.clone().requires_grad_(), w.view(-1).clone().requires_grad_()
    out = ex.forward_sorted(xs, counts, ws)
    grads = torch.autograd.grad((out * probe).sum(), [xs, ws, ex.w1, ex.w3, ex.w2])
    for name, a, b in zip(("out", "x", "w", "w1", "w3", "w2"), routed, [out, *grads]):
        assert torch.equal(a.view(b.shape), b), f"seed {seed}: {name} differs"


def test_route_against_brute_force() -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    idx, _ = _routing(g, 29, 4, E_L)
    r = route(idx, E_L)
    want = [(e, m, k) for e in range(E_L) for m in range(29) for k in range(4) if idx[m, k] == e]
    assert [(int(idx.view(-1)[p]), int(p) // 4, int(p) % 4) for p in r.pairs] == want, f"seed {seed}"
    assert torch.equal(r.rows, r.pairs // 4)
    assert r.counts.tolist() == [sum(1 for t in want if t[0] == e) for e in range(E_L)]
    for m in range(29):
        for k in range(4):
            s = int(r.slots[m, k])
            assert (s == -1) if idx[m, k] < 0 else int(r.pairs[s]) == m * 4 + k, f"seed {seed}"


def _grouped_mm_on(device: str) -> bool:
    try:
        torch._grouped_mm(torch.zeros(8, 8, device=device), torch.zeros(2, 8, 8, device=device),
                          offs=torch.tensor([4, 8], dtype=torch.int32, device=device))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU torch._grouped_mm")
def test_grouped_gemms_match_the_loop() -> None:
    """The grouped-GEMM calls (strided gate/up halves, offsets on K, empty groups) equal the loop's."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    sizes = [3, 0, 5, 8, 0]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    loop, grouped = _Groups(offs, sizes), _Groups(offs, None)
    a, b = torch.randn(16, 2 * 8, generator=g), torch.randn(5, 16, 12, generator=g)
    xs = torch.randn(16, 12, generator=g)
    torch.testing.assert_close(grouped.mm(a, b), loop.mm(a, b), msg=f"seed {seed}")
    for part in (a[:, :8], a[:, 8:]):
        got = grouped.mm_t(part, xs)
        torch.testing.assert_close(got, loop.mm_t(part, xs), msg=f"seed {seed}")
        assert not got[1].any() and not got[4].any(), f"seed {seed}: empty groups must give 0"


def test_fused_layout_and_state_dict() -> None:
    """w1 and w3 share one [E_l, 2F, H] allocation (also after .to()); per-expert keys round-trip."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ex = _experts(g, torch.float32)
    fused = ex.fused_w13
    assert fused.data_ptr() == ex.w1.data_ptr() and torch.equal(fused[:, FFN:], ex.w3)
    state = ex.state_dict()
    assert set(state) == {f"{e}.{n}" for e in range(FIRST, FIRST + E_L) for n in ("w1", "w2", "w3")}
    for e in range(E_L):
        assert torch.equal(state[f"{FIRST + e}.w3"], ex.w3[e]), f"seed {seed}"
    other = _experts(torch.Generator().manual_seed(seed + 1), torch.float64)
    assert other.fused_w13.data_ptr() == other.w1.data_ptr()
    other.load_state_dict(state)
    for n in ("w1", "w2", "w3"):
        assert torch.equal(getattr(other, n), getattr(ex, n).double()), f"seed {seed}: {n}"
    moved = other.to(torch.float32)
    assert moved.fused_w13.data_ptr() == moved.w1.data_ptr(), ".to() must keep w1 and w3 in one allocation"
    x = torch.randn(9, H, generator=g).to(torch.bfloat16)
    idx, w = _routing(g, 9, 2, E_L)
    assert torch.equal(moved(x, idx, w), ex(x, idx, w)), f"seed {seed}"


# ---- Triton kernels ------------------------------------------------------------------------------------
def _triton_check(device: str, seed: int) -> None:
    """The Triton launchers against the torch versions; recompute gives the forward's bits."""
    g = torch.Generator().manual_seed(seed)
    for p, f, h, k in ((37, 24, 40, 3), (5, 3000, 8, 1), (0, 16, 16, 2)):
        h13 = (torch.randn(p, 2 * f, generator=g) * 3).to(torch.bfloat16).to(device)
        scale = torch.rand(p, generator=g).to(device)
        da = torch.randn(p, f, generator=g).to(torch.bfloat16).to(device)
        a = ek._swiglu_triton(h13, scale)
        torch.testing.assert_close(a, ek._swiglu_torch(h13, scale), msg=f"seed {seed}")
        dh, ds, again = ek._swiglu_backward_triton(h13, da, scale, True)
        want_dh, want_ds, _ = ek._swiglu_backward_torch(h13, da, scale, False)
        torch.testing.assert_close(dh, want_dh, msg=f"seed {seed}")
        torch.testing.assert_close(ds, want_ds, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
        assert torch.equal(again, a), f"seed {seed}: recomputed activation differs"
        idx, _ = _routing(g, max(p // k, 1) if p else 0, k, E_L)
        slots = route(idx, E_L).slots.to(device)
        src = torch.randn(int((slots >= 0).sum()), h, generator=g).to(torch.bfloat16).to(device)
        got, want = row_sum._sum_rows_triton(src, slots, torch.bfloat16, None), row_sum._sum_rows_torch(src, slots, torch.bfloat16, None)
        if device == "cuda":  # the same float32 sums, rounded to nearest even by both
            assert torch.equal(got, want), f"seed {seed}: sum_rows"
        else:  # Triton's interpreter rounds float32 -> bf16 ties its own way
            torch.testing.assert_close(got, want, rtol=8e-3, atol=0, msg=f"seed {seed}: sum_rows")
        # weighted (an expert-major combine's pair_weights): Triton may fuse the product into the add
        weights = torch.randn(src.shape[0], generator=g).to(device)
        got = row_sum._sum_rows_triton(src.float(), slots, torch.float32, weights)
        want = row_sum._sum_rows_torch(src.float(), slots, torch.float32, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}: weighted sum_rows")


def _triton_importable() -> bool:
    return ek.triton is not None or subprocess.run([sys.executable, "-c", "import triton"],
                                                   capture_output=True).returncode == 0


@pytest.mark.skipif(not torch.cuda.is_available() and not _triton_importable(), reason="needs CUDA or Triton")
def test_triton_kernels_match_torch() -> None:
    _on_cuda_or_interpreted("_triton_check")


def _on_cuda_or_interpreted(check: str) -> None:
    """Run tests.test_experts.<check>(device, seed) on CUDA, else on the CPU in Triton's interpreter (a subprocess:
    TRITON_INTERPRET must be set before Triton loads)."""
    seed = _seed()
    if torch.cuda.is_available():
        globals()[check]("cuda", seed)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"from tests.test_experts import {check}; {check}('cpu', {seed})"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the grouped-GEMM path needs CUDA sm90")
def test_cuda_grouped_path_matches_cpu_loop() -> None:
    """bf16 on sm90 (grouped GEMMs, Triton) against the same experts in float64 on the CPU; repeatable bits."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cpu = _experts(g, torch.float64)
    cuda = GroupedExperts(E, E_L, FIRST, H, FFN, dtype=torch.bfloat16, device=torch.device("cuda"))
    cuda.load_state_dict(cpu.state_dict())
    x = torch.randn(300, H, generator=g).to(torch.bfloat16)
    idx, w = _routing(g, 300, 3, E_L)
    idx[idx == 2] = -1  # an expert without rows: its weight gradient is 0
    probe = torch.randn(300, H, generator=g)
    assert grouped_mm_supported(x.cuda())
    for recompute in (False, True):
        cuda.recompute_swiglu = recompute
        got = _run(cuda, x.cuda(), idx.cuda(), w.cuda(), probe.cuda())
        assert all(torch.equal(a, b) for a, b in zip(got, _run(cuda, x.cuda(), idx.cuda(), w.cuda(), probe.cuda())))
        want = _run(cpu, x, idx, w.double(), probe.double())
        for name, a, b in zip(("out", "x", "w", "w1", "w3", "w2"), got, want):
            assert _rel(a.cpu(), b) <= 2e-2, f"seed {seed}: {name} rel err {_rel(a.cpu(), b):.2e}"
        assert not got[3][2].any() and not got[5][2].any(), f"seed {seed}: empty expert's gradient"


def _decode_check(device: str, seed: int) -> None:
    """decode_experts.run (the low-latency experts over each expert's counted rows) against float64 experts on
    the CPU, row by counted row, at random counts (0 and all C included) and tile shapes; twice the same bits.
    On the CPU (Triton's interpreter, which has no bf16 dot) in float32."""
    from moe_ep.moe import decode_experts
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for e, c, h, f, tiles in ((3, 16, 32, 24, decode_experts.DecodeTiles(16, 16, 16)),
                              (4, 40, 256, 128, decode_experts.TILES),
                              (2, 70, 160, 96, decode_experts.DecodeTiles(64, 32, 64, 4, 2))):
        w13 = torch.randn(e, 2 * f, h, generator=g, dtype=torch.float64) * h ** -0.5
        w2 = torch.randn(e, h, f, generator=g, dtype=torch.float64) * f ** -0.5
        x = torch.randn(e, c, h, generator=g, dtype=torch.float64)
        counts = torch.randint(0, c + 1, (e,), generator=g, dtype=torch.int32)
        counts[0], counts[-1] = c, 0
        w13_d, w2_d, x_d = (t.to(dtype).to(device) for t in (w13, w2, x))
        args = (x_d, w13_d[:, :f], w13_d[:, f:], w2_d, counts.to(device), tiles)
        got, again = decode_experts.run(*args), decode_experts.run(*args)
        assert all(torch.equal(got[i, :n], again[i, :n]) for i, n in enumerate(counts.tolist())), \
            f"seed {seed}: bits differ run to run"
        xw, w13w, w2w = (t.to(dtype).double() for t in (x, w13, w2))  # the inputs as the kernel sees them
        act = F.silu(xw @ w13w[:, :f].transpose(1, 2)) * (xw @ w13w[:, f:].transpose(1, 2))
        want = act.to(dtype).double() @ w2w.transpose(1, 2)
        for i, n in enumerate(counts.tolist()):
            assert _rel(got[i, :n].cpu().double(), want[i, :n]) <= 2e-2, f"seed {seed}: expert {i} of {e} ({n} rows)"


@pytest.mark.skipif(not torch.cuda.is_available() and not _triton_importable(), reason="needs CUDA or Triton")
def test_decode_kernel_matches_float64() -> None:
    _on_cuda_or_interpreted("_decode_check")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="bf16 decode kernel on CUDA")
def test_forward_padded_counts_on_cuda() -> None:
    """forward_padded with counts (the decode kernel) on CUDA bf16 against forward_padded without them (every
    slot, batched matmul) on the counted rows, in float64 on the CPU: the same function of each row."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cpu = _experts(g, torch.float64)
    cuda = GroupedExperts(E, E_L, FIRST, H, FFN, dtype=torch.bfloat16, device=torch.device("cuda"))
    cuda.load_state_dict(cpu.state_dict())
    x = torch.randn(E_L, 33, H, generator=g).to(torch.bfloat16)
    counts = torch.randint(0, 34, (E_L,), generator=g, dtype=torch.int32)
    got = cuda.forward_padded(x.cuda(), counts.cuda())
    want = cpu.forward_padded(x.double())
    for i, n in enumerate(counts.tolist()):
        assert _rel(got[i, :n].cpu().double(), want[i, :n]) <= 2e-2, f"seed {seed}: expert {i} ({n} rows)"
