"""moe_ep.train on CPU (gloo, reference backend): the loss falls, EP=2 follows EP=1, resume is exact;
sync_gradients against a hand computation over ranks, and one plain-SGD step at EP=2 against EP=1 (SGD
moves each weight by lr times its gradient, so a gradient off by a factor shows, unlike under AdamW)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe_ep.train
from moe_ep import Buffer
from moe_ep.data import VOCAB, CharCorpus, decode, generate_text
from moe_ep.launch import plan
from moe_ep.moe.experts import GroupedExperts
from moe_ep.train import MoELM, TrainConfig, parse_args, step_dir, sync_gradients, train, train_step
from tests._dist import requires_gpus, run_workers

STEPS = 30
# Losses of EP=1 and EP=2 on the same global batches differ only by bf16 rounding in the combine
# (each rank rounds its partial sum before the cross-rank sum; gradients cross ranks in bf16) and
# float32 summation order; over 30 steps the curves stay within this distance.
EP_TOL = 1e-2


def _config(tmp: str, **kw) -> TrainConfig:
    base = TrainConfig(steps=STEPS, batch=8, seq_len=32, dim=32, layers=2, heads=2, experts=4, top_k=2, ffn=64,
                       lr=1e-2, warmup=5, backend="reference", device="cpu", ckpt=tmp, progress=False,
                       log_every=1000)
    return replace(base, **kw)


def _worker(rank: int, world: int, root: str) -> None:
    result: dict = {}
    result["losses"] = train(_config(os.path.join(root, f"run{world}")))
    if world == 2:
        # same seed -> same data -> same losses; a run resumed from step 6 continues bit for bit
        straight = train(_config(os.path.join(root, "straight"), steps=12, save_every=6, expert_bias_rate=1e-3,
                                 shared_ffn=16))
        resumed_dir = os.path.join(root, "resumed")
        if rank == 0:
            shutil.copytree(os.path.join(root, "straight", "step000006"), os.path.join(resumed_dir, "step000006"))
        dist.barrier()
        resumed = train(_config(resumed_dir, steps=12, expert_bias_rate=1e-3, shared_ffn=16, resume=True))
        again = train(_config(os.path.join(root, "again"), steps=12, save_every=6, expert_bias_rate=1e-3,
                              shared_ffn=16))
        result.update(straight=straight, resumed=resumed, again=again)
        with_capacity = train(_config(os.path.join(root, "capacity"), steps=3, capacity_factor=0.5))
        result["capacity"] = with_capacity
    if rank == 0:
        Path(root, f"result{world}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    root = tmp_path_factory.mktemp("train")
    run_workers(1, _worker, str(root))
    run_workers(2, _worker, str(root))
    return (json.loads((root / "result1.json").read_text()), json.loads((root / "result2.json").read_text()), root)


def test_loss_falls(results) -> None:
    for res in results[:2]:
        losses = res["losses"]
        assert len(losses) == STEPS
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 0.3, f"loss did not fall enough: {first:.3f} -> {last:.3f}"


def test_ep2_matches_ep1(results) -> None:
    ep1, ep2 = results[0]["losses"], results[1]["losses"]
    worst = max(abs(a - b) for a, b in zip(ep1, ep2))
    assert worst <= EP_TOL, f"EP=2 losses left EP=1's by {worst:.4f}"


def test_resume_and_determinism(results) -> None:
    res, root = results[1], results[2]
    assert res["again"] == res["straight"]
    assert res["resumed"] == res["straight"]
    for step in (6, 12):
        files = sorted(os.listdir(step_dir(_config(str(root / "straight")), step)))
        assert files == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]


def test_training_with_capacity_factor_runs(results) -> None:
    assert len(results[1]["capacity"]) == 3


class _TwoKinds(nn.Module):
    """A replicated layer, this rank's experts, and a parameter that gets no gradient."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.dense = nn.Linear(5, 4)
        self.experts = GroupedExperts(2 * world, 2, 2 * rank, 4, 3)
        self.unused = nn.Parameter(torch.zeros(3))


def _sync_worker(rank: int, world: int) -> None:
    """sync_gradients against float64 by hand: replicated gradients -> their mean over ranks, expert
    gradients -> this rank's / R, norm over both (experts of every rank), then clipping by clip / norm."""
    model = _TwoKinds(rank, world)
    replicated = [model.dense.weight, model.dense.bias]
    local = list(model.experts.parameters())
    for clip in (0.0, 1.0):
        g = torch.Generator().manual_seed(17 * rank + int(clip))
        for p in replicated + local:
            p.grad = torch.randn(p.shape, generator=g) * 3
        mine = [p.grad.double().clone() for p in replicated + local]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        mean = [sum(r[i] for r in everyone) / world for i in range(len(replicated))]
        own = [t / world for t in mine[len(replicated):]]
        norm = sum(t.square().sum() for t in mean)
        norm += sum(t.square().sum() for r in everyone for t in r[len(replicated):]) / world ** 2
        norm = float(norm.sqrt())
        got = sync_gradients(model, world, clip)
        assert abs(got - norm) <= 1e-5 * norm, (got, norm)
        factor = clip / (norm + 1e-6) if 0 < clip < norm else 1.0
        assert clip == 0 or factor < 1, "the clipped case must clip"
        for p, want in zip(replicated + local, mean + own):
            torch.testing.assert_close(p.grad.double(), want * factor, rtol=1e-5, atol=1e-6)
        assert model.unused.grad is None


@pytest.mark.parametrize("world", [1, 3])
def test_sync_gradients_by_hand(world: int) -> None:
    run_workers(world, _sync_worker)


def _sgd_worker(rank: int, world: int, root: str) -> None:
    """One train_step with plain SGD (no clipping) from the weights EP=1 started with; rank 0 writes
    every parameter's change (experts under global ids)."""
    cfg = _config(root, clip=0.0, layers=1)
    local_batch = cfg.batch // world
    corpus = CharCorpus(cfg.seed)
    torch.manual_seed(cfg.seed)
    buffer = Buffer(dist.group.WORLD, hidden=cfg.dim, num_experts=cfg.experts, num_topk=cfg.top_k,
                    max_tokens_per_rank=local_batch * cfg.seq_len, backend="reference")
    model = MoELM(cfg, corpus.vocab_size, buffer, torch.float32, torch.device("cpu"))
    init = Path(root, "init.pt")
    if world == 1:
        torch.save(model.state_dict(), init)
    model.load_state_dict(torch.load(init))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, targets = corpus.batch(0, cfg.batch, cfg.seq_len)
    rows = slice(rank * local_batch, (rank + 1) * local_batch)
    train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=1.0), inputs[rows], targets[rows], world)
    delta = {k: v - before[k] for k, v in model.state_dict().items()}
    parts: list = [None] * world
    dist.all_gather_object(parts, delta)
    if rank == 0:
        torch.save({k: v for part in parts for k, v in part.items()}, Path(root, f"sgd{world}.pt"))
    buffer.close()


def test_sgd_step_ep2_matches_ep1(tmp_path: Path) -> None:
    run_workers(1, _sgd_worker, str(tmp_path))
    run_workers(2, _sgd_worker, str(tmp_path))
    ep1, ep2 = torch.load(tmp_path / "sgd1.pt"), torch.load(tmp_path / "sgd2.pt")
    assert ep1.keys() == ep2.keys() and any(k.startswith("blocks.0.moe.experts.") for k in ep1)
    for name, want in ep1.items():
        scale = float(want.abs().max())
        assert scale > 0, f"{name}: SGD did not move it"
        err = float((ep2[name] - want).abs().max())
        assert err <= 2e-2 * scale + 1e-7, f"{name}: EP=2's step differs from EP=1's by {err:.3e} (step max {scale:.3e})"


def test_data_is_deterministic() -> None:
    assert generate_text(3, 500) == generate_text(3, 500) != generate_text(4, 500)
    a, b = CharCorpus(5, 5_000), CharCorpus(5, 5_000)
    x1, y1 = a.batch(7, 4, 16)
    x2, y2 = b.batch(7, 4, 16)
    assert x1.equal(x2) and y1.equal(y2) and not x1.equal(a.batch(8, 4, 16)[0])
    assert x1[:, 1:].equal(y1[:, :-1])
    assert set(decode(a.tokens)) <= set(VOCAB)
    for line in generate_text(9, 2_000).splitlines():
        if "+" in line:
            lhs, rhs = line.split("=")
            assert sum(map(int, lhs.split("+"))) == int(rhs)
        else:
            op, rest = line.split(" ")
            word, answer = rest.split("|")
            assert answer == {"copy": word, "rev": word[::-1], "sort": "".join(sorted(word))}[op]


def test_cli_flags() -> None:
    cfg = parse_args(["--steps", "7", "--capacity-factor", "1.25", "--no-progress", "--backend", "reference"])
    assert (cfg.steps, cfg.capacity_factor, cfg.progress, cfg.backend) == (7, 1.25, False, "reference")
    assert parse_args([]) == TrainConfig()


class _Stop(Exception):
    """Ends moe_ep.train.main once it asked for its placement."""


def test_ranks_per_gpu_reaches_the_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """--ranks-per-gpu goes to init_distributed (a recording stand-in here); on CPU the real placement
    refuses it with a clear error."""
    asked: list = []

    def placement(device: str, ranks_per_gpu: object) -> None:
        asked.append((device, ranks_per_gpu))
        raise _Stop

    monkeypatch.setattr(moe_ep.train, "init_distributed", placement)
    with pytest.raises(_Stop):
        moe_ep.train.main(["--ranks-per-gpu", "3", "--device", "cuda"])
    assert asked == [("cuda", 3)]
    with pytest.raises(ValueError, match="ranks_per_gpu needs CUDA devices"):
        plan(0, 2, 0, "cpu", 2)


def _torchrun(tmp_path: Path, *flags: str) -> str:
    """Run `torchrun --nproc-per-node 2 -m moe_ep.train FLAGS`; returns its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moe_ep.train", "--ckpt", str(tmp_path / "ckpt"), *flags]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_torchrun_command(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, "--device", "cpu", "--steps", "4", "--batch", "4", "--seq-len", "16", "--dim", "16",
                    "--ffn", "16", "--layers", "1", "--log-every", "2")
    assert "backend reference" in out and "step     4 | loss" in out and "done: 4 steps" in out
    assert sorted(os.listdir(tmp_path / "ckpt" / "step000004")) == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]


@requires_gpus()
def test_torchrun_ranks_per_gpu(tmp_path: Path) -> None:
    """--ranks-per-gpu 2: both ranks on the first GPU over gloo, whatever the GPU count."""
    out = _torchrun(tmp_path, "--ranks-per-gpu", "2", "--steps", "4", "--batch", "4", "--seq-len", "16", "--dim", "64",
                    "--ffn", "64", "--layers", "1", "--log-every", "2", "--no-progress")
    assert "(2 ranks per GPU)" in out and "done: 4 steps" in out, out[-2000:]


@requires_gpus()
def test_torchrun_on_gpus(tmp_path: Path) -> None:
    """The default model on 2 GPUs (NCCL, native backend, bf16 grouped GEMM): the loss falls."""
    out = _torchrun(tmp_path, "--steps", "60", "--log-every", "10", "--no-progress")
    assert "backend nvshmem" in out and "cuda" in out
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
