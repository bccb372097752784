"""Same inputs, same bits, run after run: the MoE layer and moe_ep.train, on GPUs and on CPU.

Reference-backend training on 2 GPUs used to drift from step 5 on between two runs: atomic adds in
the experts (index_add, autograd's index backward), nn.Embedding's backward and fused attention's
backward summed in a different order each run. On 2 GPUs (NCCL), at the issue's sizes, one MoE
layer's forward and backward over a few batches and a few training steps run twice on the reference
backend and once on the native one; outputs, every gradient, the losses and the final checkpoints
must agree bit for bit. On CPU (gloo): two reference runs of the layer with two threads per rank
agree bitwise, and the experts' fixed-order row sums give a serial index_add's bits.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import moe_ep
from moe_ep import MoE
from moe_ep.comm.row_sum import sum_rows
from moe_ep.moe.experts import GroupedExperts
from moe_ep.train import TrainConfig, rank_file, step_dir, train
from tests._dist import device as rank_device, requires_gpus, run_workers
from tests.oracle import assert_same_bits

RUNS = ("reference", "reference", "nvshmem")  # the first run is the one the others must repeat


@dataclass(frozen=True)
class LayerCase:
    hidden: int
    experts: int
    topk: int
    ffn: int
    tokens: int  # on rank 0; rank r has tokens - 100 * r
    steps: int
    dtype: torch.dtype


GPU_LAYER = LayerCase(2048, 32, 8, 1024, 8192, 3, torch.bfloat16)  # the MoE sizes
CPU_LAYER = LayerCase(128, 8, 4, 64, 300, 2, torch.float32)
# The model with narrower experts and dim (fast, small checkpoints); 8192 tokens per rank.
GPU_TRAIN = dict(steps=8, batch=32, seq_len=512, dim=512, heads=8, experts=32, top_k=8, ffn=512)


def _layer_run(rank: int, case: LayerCase, backend: str, device: str) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter gradient of case.steps forward + backward passes
    of one freshly seeded MoE layer (with router losses and a shared expert)."""
    n = case.tokens - 100 * rank
    buf = moe_ep.Buffer(None, device=rank_device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=case.tokens, backend=backend)
    torch.manual_seed(0)
    moe = MoE(buf, case.ffn, aux_loss_coef=0.01, z_loss_coef=1e-3, shared_ffn_hidden=case.ffn, dtype=case.dtype)
    got = {}
    for step in range(case.steps):
        g = torch.Generator(device).manual_seed(1000 * step + rank)
        x = torch.randn(n, case.hidden, generator=g, device=device).to(case.dtype).requires_grad_(True)
        grad_out = torch.randn(n, case.hidden, generator=g, device=device).to(case.dtype)
        out = moe(x, mode="normal")
        ((out * grad_out).float().sum() + moe.aux_loss).backward()
        got[f"step {step} out"], got[f"step {step} x.grad"] = out.detach(), x.grad
        for name, p in moe.named_parameters():
            got[f"step {step} {name}.grad"] = p.grad
        moe.zero_grad(set_to_none=True)
    buf.close()
    return got


def _assert_runs_agree(runs: list[dict[str, torch.Tensor]], labels: tuple[str, ...], what: str) -> None:
    """Every run has the first run's tensors, bit for bit."""
    for i in range(1, len(runs)):
        assert runs[i].keys() == runs[0].keys(), f"{what}: run {i} has other tensors"
        for key, want in runs[0].items():
            assert_same_bits(runs[i][key], want, f"{what}: {labels[i]} run {i} vs {labels[0]} run 0: {key}")


def _train_run(rank: int, world: int, backend: str, ckpt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of a short moe_ep.train run and this rank's final model state (from its checkpoint)."""
    cfg = TrainConfig(**GPU_TRAIN, backend=backend, device="cuda", ckpt=ckpt, progress=False, log_every=1000)
    losses = train(cfg)
    state = torch.load(os.path.join(step_dir(cfg, cfg.steps), rank_file(rank, world)), weights_only=True)
    return losses, state["model"]


def _gpu_worker(rank: int, world: int, root: str) -> None:
    layers = [_layer_run(rank, GPU_LAYER, backend, "cuda") for backend in RUNS]
    _assert_runs_agree(layers, RUNS, "MoE layer")
    trained = [_train_run(rank, world, backend, os.path.join(root, f"run{i}")) for i, backend in enumerate(RUNS)]
    for i, (losses, _) in enumerate(trained[1:], 1):
        assert losses == trained[0][0], f"train: {RUNS[i]} run {i} losses {losses} != run 0 {trained[0][0]}"
    _assert_runs_agree([state for _, state in trained], RUNS, "train: final model")


@requires_gpus()
def test_gpu_runs_repeat_bitwise(tmp_path) -> None:
    run_workers(2, _gpu_worker, str(tmp_path), backend="gpu")


def _cpu_worker(rank: int, world: int) -> None:
    torch.set_num_threads(2)  # multi-threaded CPU kernels (the harness runs one thread per rank)
    runs = [_layer_run(rank, CPU_LAYER, "reference", "cpu") for _ in range(2)]
    _assert_runs_agree(runs, ("reference", "reference"), "MoE layer on CPU")


def test_cpu_layer_runs_repeat_bitwise() -> None:
    run_workers(2, _cpu_worker)


def test_expert_row_sums_are_serial_and_repeat() -> None:
    """sum_rows has a serial index_add's bits (float32, one thread); with two threads the experts'
    float32 gradients repeat exactly (autograd's index backward would add them with atomics there)."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 50, (400,), generator=g)
    src = torch.randn(400, 24, generator=g)
    positions = [(rows == r).nonzero().flatten().tolist() for r in range(60)]  # ascending, by brute force
    width = max(len(p) for p in positions)
    slots = torch.tensor([p + [-1] * (width - len(p)) for p in positions])
    try:
        torch.set_num_threads(1)
        assert_same_bits(sum_rows(src, slots), torch.zeros(60, 24).index_add(0, rows, src), "row sums")

        torch.set_num_threads(2)
        experts = GroupedExperts(16, 8, 0, 128, 16)
        x = torch.randn(1000, 128, generator=g)
        idx = torch.randint(-1, 8, (1000, 8), generator=g)
        w, grad_out = torch.rand(1000, 8, generator=g), torch.randn(1000, 128, generator=g)
        grads = []
        for _ in range(4):
            xr = x.clone().requires_grad_(True)
            (experts(xr, idx, w) * grad_out).sum().backward()
            grads.append(xr.grad)
        for i, grad in enumerate(grads[1:], 1):
            assert_same_bits(grad, grads[0], f"experts x.grad, run {i} vs run 0")
    finally:
        torch.set_num_threads(threads)
