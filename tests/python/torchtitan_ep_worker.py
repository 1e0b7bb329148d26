"""Multi-process checks of ``groupmm.integrations.torchtitan`` on gloo (CPU), run by
``test_integration_torchtitan.py`` as ``python torchtitan_ep_worker.py CASE WORLD OUT``.

Cases (each rank writes ``OUT/rank<r>.json``: named relative errors, or ``error``):

- ``dtensor``: the stand-in's weights as DTensors sharded over the experts (``Shard(0)``
  on a ``WORLD``-rank mesh, as torchtitan's expert parallelism leaves them); each rank
  runs its local experts on its own rows, eagerly and under ``torch.compile``
  (``fullgraph``, ``aot_eager``), against a float64 reference on its slice of the full
  weights. Needs no torchtitan.
- ``torchtitan``: torchtitan's own expert parallelism: an ``MoE`` built from torchtitan's
  config helpers with ``set_moe_sharding_config(enable_ep=True)``, ``ParallelDims(ep=
  WORLD)`` and ``MoE.parallelize`` (weights become ``Shard(0)`` DTensors, the
  ``AllToAllTokenDispatcher`` gets the EP mesh), the experts switched to groupmm's fused
  block, and the whole layer converted by ``enable_moe`` before ``parallelize`` (groupmm's
  ``expert_parallel_block`` over the EP mesh's group, float64 compute; ``enable_moe``
  after ``parallelize`` refuses); against a single-process float64 reference of the same
  layer on every rank's tokens, and against torchtitan's own forward. Runs with torchtitan's
  ``partial_dtensor`` SPMD backend: the default ``spmd_types`` backend sends uneven
  splits through ``dist.all_to_all`` of tensor lists, which gloo refuses ("invalid
  tensor size"); and with ``torchtitan.distributed.parallel_dims.device_type`` set to
  ``"cpu"``, since torchtitan takes ``"cuda"`` when no accelerator is present.

Every rank ends with a barrier, a flush and ``os._exit`` (gloo's teardown may abort
after collectives on this machine).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
F64 = torch.float64


def rel(x, ref) -> float:
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 1e-30 else 1.0)


def swiglu_reference(x, w1, w2, w3, ids, scores=None):
    """float64 ``sum_k scores[t, k] * expert_{ids[t, k]}(x[t])`` (``ids [T, K]``)."""
    x = x.to(F64)
    w1, w2, w3 = w1.to(F64)[ids], w2.to(F64)[ids], w3.to(F64)[ids]  # [T, K, ...]
    h = F.silu(torch.einsum("tkfd,td->tkf", w1, x)) * torch.einsum("tkfd,td->tkf", w3, x)
    y = torch.einsum("tkdf,tkf->tkd", w2, h)
    if scores is not None:
        y = y * scores.to(F64).unsqueeze(-1)
    return y.sum(1)


# --------------------------------------------------------------------------- dtensor


def case_dtensor(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    sys.path.insert(0, str(HERE))
    from groupmm.integrations import torchtitan as tt
    from test_integration_torchtitan import StandInGroupedExperts

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    experts, dim, hidden = 2 * world, 12, 8
    full = StandInGroupedExperts(dim, hidden, experts, dtype=torch.float32, seed=0)
    module = copy.deepcopy(full)
    for name, p in full.named_parameters():
        dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
        setattr(module, name, torch.nn.Parameter(dt))
    tt.enable(module, fused=True)
    module.groupmm_dtype = F64  # float64 compute, float32 in and out
    local = slice(rank * 2, rank * 2 + 2)
    gen = torch.Generator().manual_seed(20 + rank)
    counts = torch.tensor([4 + rank, 0 if rank == 0 else 3])  # an empty expert on rank 0
    rows = int(counts.sum()) + 2  # two padding rows
    x = torch.randn(rows, dim, generator=gen)
    go = torch.randn(rows, dim, generator=gen)
    ids = torch.repeat_interleave(torch.arange(2), counts).view(-1, 1)
    ws = {n: p.detach()[local].double().requires_grad_(True) for n, p in full.named_parameters()}
    xr = x.double().requires_grad_(True)
    n = int(counts.sum())
    ref = swiglu_reference(xr[:n], ws["w1_EFD"], ws["w2_EDF"], ws["w3_EFD"], ids)
    ref = torch.cat([ref, ref.new_zeros(2, dim)])
    ref.backward(go.double())
    out = {}
    for mode in ("eager", "compiled"):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        run = (
            module
            if mode == "eager"
            else torch.compile(module, fullgraph=True, backend="aot_eager")
        )
        y = run(xi, counts)
        y.backward(go)
        out[f"{mode}/out"] = rel(y, ref)
        out[f"{mode}/dx"] = rel(xi.grad, xr.grad)
        out[f"{mode}/padding"] = float(y.detach()[n:].abs().max() + xi.grad[n:].abs().max())
        for name, p in module.named_parameters():
            assert isinstance(p.grad, DTensor), type(p.grad)
            out[f"{mode}/{name}"] = rel(p.grad.to_local(), ws[name].grad)
    out["dtype"] = str(y.dtype)
    return out


# --------------------------------------------------------------------------- torchtitan


def _moe_config(experts: int, dim: int, hidden: int, top_k: int):
    from torch.distributed.tensor import Shard
    from torchtitan.models.common import config_utils as cu
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    init = functools.partial(torch.nn.init.normal_, std=0.3)
    cfg = cu.make_moe_config(
        num_experts=experts,
        router=cu.make_router_config(
            dim=dim,
            num_experts=experts,
            gate_param_init={"weight": init},
            top_k=top_k,
            score_func="softmax",
        ),
        routed_experts=cu.make_routed_experts_config(
            dim=dim,
            hidden_dim=hidden,
            num_experts=experts,
            top_k=top_k,
            param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
            comm_backend="standard",
        ),
        load_balance_coeff=None,
    )
    layout = {"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)}
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout=layout)
    return cfg


def case_torchtitan(rank: int, world: int) -> dict:
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.distributed.utils as tdu
    from groupmm.integrations import torchtitan as tt
    from torch.distributed.tensor import DTensor

    pd.device_type = "cpu"  # torchtitan takes "cuda" when no accelerator is present
    tdu.set_spmd_backend("partial_dtensor")
    experts, dim, hidden, top_k, tokens = 2 * world, 16, 8, 2, 6
    cfg = _moe_config(experts, dim, hidden, top_k)
    torch.manual_seed(0)
    base = cfg.build()
    base.init_states()
    base.eval()  # no tokens_per_expert bookkeeping
    reference = copy.deepcopy(base)  # one process: full weights, no parallelism
    pdims = pd.ParallelDims(
        dp_replicate=1,
        dp_shard=-1,
        cp=1,
        tp=1,
        pp=1,
        ep=world,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    pdims.build_mesh()
    models = {}
    for name in ("own", "bf16", "f64", "moe"):
        model = copy.deepcopy(base)
        if name == "bf16":
            tt.enable(model, fused=True)  # before parallelize: torchtitan wraps it
        if name == "moe":  # the whole layer on groupmm's EP block, float64 compute
            tt.enable_moe(model, dtype=F64)
        model.parallelize(pdims)
        if name == "f64":
            tt.enable(model, fused=True)  # after: the experts' wrapper is dropped
            model.routed_experts.inner_experts.groupmm_dtype = F64
        models[name] = model
    try:  # parallelized already: enable_moe refuses, nothing changes
        tt.enable_moe(models["own"])
        raise AssertionError("enable_moe after parallelize did not raise")
    except ValueError as e:
        assert "call enable_moe before parallelize" in str(e), e
    assert type(models["own"].routed_experts).__name__ == "RoutedExperts"
    ie = models["f64"].routed_experts.inner_experts
    assert isinstance(ie.w1_EFD, DTensor) and ie.w1_EFD.to_local().shape[0] == 2
    assert type(ie).__name__ == "GroupmmFusedGroupedExperts", type(ie)
    assert type(models["own"].routed_experts.inner_experts).__name__ == "GroupedExperts"
    mine = slice(rank * 2, rank * 2 + 2)

    calls = []
    real = tt.grouped_experts_forward
    tt.grouped_experts_forward = lambda *a, **k: calls.append(str(k["dtype"])) or real(*a, **k)
    ep_calls = []
    real_ep = tt.expert_parallel_block

    def spy_ep(x, ids, weights, w_in, w_out, group):
        ep_calls.append([str(x.dtype), dist.get_world_size(group), int(w_in[0].shape[0])])
        return real_ep(x, ids, weights, w_in, w_out, group)

    tt.expert_parallel_block = spy_ep

    def tokens_of(r):
        gen = torch.Generator().manual_seed(100 + r)
        x = torch.randn(1, tokens, dim, generator=gen)
        return x, torch.randn(1, tokens, dim, generator=gen)

    def skewed_routing(r):
        """Every token of every rank to experts 0 and 1 (rank 0's): rank 1 receives no
        rows, its experts none."""
        ids = torch.tensor([0, 1]).expand(1, tokens, top_k).contiguous()
        gen = torch.Generator().manual_seed(7 + r)
        return torch.rand(1, tokens, top_k, generator=gen), ids

    # the float64 reference of the layer over every rank's tokens: each rank's output
    # and dx, and the weight gradients summed over all ranks
    refs = {}
    for scenario in ("router", "skewed"):
        w = {n: p.detach().double().requires_grad_(True) for n, p in _expert_params(reference)}
        outs = []
        for r in range(world):
            x, go = tokens_of(r)
            x.requires_grad_(True)
            if scenario == "router":
                scores, ids, _ = reference.router(x, reference.expert_bias_E)
            else:
                scores, ids = skewed_routing(r)
            y = swiglu_reference(
                x.view(tokens, dim),
                w["w1_EFD"],
                w["w2_EDF"],
                w["w3_EFD"],
                ids.reshape(tokens, top_k),
                scores.reshape(tokens, top_k),
            )
            y.backward(go.view(tokens, dim).double())
            outs.append((y.detach().view(1, tokens, dim), x.grad))
        refs[scenario] = (outs[rank], {n: t.grad[mine] for n, t in w.items()})

    out: dict = {}
    x, go = tokens_of(rank)
    results = {}
    for name, model in models.items():
        for scenario in ("router", "skewed"):
            if scenario == "skewed" and name not in ("f64", "moe"):
                continue
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            if scenario == "router":
                y = model(xi)
            else:
                scores, ids = skewed_routing(rank)
                counts = torch.bincount(ids.reshape(-1), minlength=experts)
                y = model.routed_experts(xi, scores, ids, counts)
            y.backward(go)
            (ref_y, ref_dx), ref_w = refs[scenario]
            key = f"{scenario}/{name}"
            results[key] = (y.detach(), xi.grad)
            out[f"{key}/out"] = rel(y, ref_y)
            out[f"{key}/dx"] = rel(xi.grad, ref_dx)
            for pname, p in _expert_params(model):
                grad = p.grad.to_local()
                if ref_w[pname].abs().max() == 0:  # skewed, rank 1: no rows, zero grads
                    out[f"{key}/{pname}/zero"] = float(grad.abs().max())
                else:
                    out[f"{key}/{pname}"] = rel(grad, ref_w[pname])
                if name != "own":
                    out[f"{key}/{pname}/contiguous"] = bool(grad.is_contiguous())
    out["fused_calls"] = calls
    out["ep_calls"] = ep_calls
    tt.expert_parallel_block = real_ep
    out["bf16_vs_own/out"] = rel(results["router/bf16"][0], results["router/own"][0])
    out["bf16_vs_own/dx"] = rel(results["router/bf16"][1], results["router/own"][1])
    tt.grouped_experts_forward = real
    return out


def _expert_params(model):
    ie = model.routed_experts.inner_experts
    return [(n, getattr(ie, n)) for n in ("w1_EFD", "w2_EDF", "w3_EFD")]


# --------------------------------------------------------------------------- driver


def worker(rank: int, case: str, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = {"dtensor": case_dtensor, "torchtitan": case_torchtitan}[case](rank, world)
    except Exception:
        result = {"error": traceback.format_exc()}
        code = 1
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        dist.barrier()
    except Exception:
        pass
    os._exit(code)


def main() -> None:
    case, world, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(case, world, port, out_dir), nprocs=world)


if __name__ == "__main__":
    main()
