"""torchtitan as bench_ep.py and bench_torchtitan.py call it: its import and set-up
(:func:`load_torchtitan`), its ``RoutedExperts`` on copies of groupmm's experts
(:func:`build_torchtitan`), their gradients in groupmm's layout (:func:`torchtitan_grads`)
and bench_torchtitan's models (:func:`setup_parallel`, :func:`build_models`). On gloo,
uneven ``all_to_all`` goes through ``all_to_all_single`` (:class:`_GlooDist`).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from harness.report import dist_version, error_text


class _GlooDist:
    """``torch.distributed`` for spmd_types on gloo: gloo's list-form ``all_to_all`` takes
    equal sizes only, so the uneven one of torchtitan's token exchange goes through
    ``all_to_all_single`` (the same data movement); everything else is torch's."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        send = torch.cat([t.reshape(-1) for t in input_tensor_list])
        sizes_out = [t.numel() for t in output_tensor_list]
        recv = send.new_empty(sum(sizes_out))
        sizes_in = [t.numel() for t in input_tensor_list]
        dist.all_to_all_single(recv, send, sizes_out, sizes_in, group=group)
        for t, piece in zip(output_tensor_list, recv.split(sizes_out)):
            t.copy_(piece.view_as(t))
        return None


def _non_strict_tracing() -> None:
    """torchtitan 0.3.0's dispatcher asks this of torch releases after 2.11; in an eager
    run nothing traces, which is this answer."""
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]


def load_torchtitan(backend: str, mesh, gloo: bool):
    """``(module namespace, None)`` or ``(None, why)``; sets torchtitan's SPMD backend and
    registers ``mesh`` as its sparse (EP) mesh as its trainer does."""
    try:
        from torchtitan.distributed import utils as tt_utils
        from torchtitan.distributed.spmd_types import set_spmd_meshes
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return None, f"import torchtitan failed: {error_text(e)}"
    tt_utils.set_spmd_backend(backend)
    _non_strict_tracing()
    if backend == "spmd_types":
        set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
        if gloo:
            import spmd_types._dist as spmd_dist

            spmd_dist.set_dist(_GlooDist())
    ns = argparse.Namespace(
        GroupedExperts=GroupedExperts,
        RoutedExperts=RoutedExperts,
        AllToAllTokenDispatcher=AllToAllTokenDispatcher,
    )
    return ns, None


def torchtitan_version():
    return dist_version(("torchtitan",), "torchtitan", unknown="unknown")


def build_torchtitan(TT, mesh, split, experts, E: int, k: int, dev, dtype):
    """torchtitan's ``RoutedExperts`` (dispatcher + grouped experts) with copies of
    groupmm's local experts (w1 = gate^T, w3 = up^T, w2 = w_out^T), the EP mesh wired."""
    e, d, f2 = experts.w_in.shape
    f = f2 // 2
    cfg = TT.RoutedExperts.Config(
        inner_experts=TT.GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=e),
        token_dispatcher=TT.AllToAllTokenDispatcher.Config(num_experts=E, top_k=k),
    )
    with torch.device(dev):
        routed = cfg.build()
    routed = routed.to(dtype=dtype)
    with torch.no_grad():
        w_in, w_out = experts.w_in.detach(), experts.w_out.detach()
        routed.inner_experts.w1_EFD.copy_(w_in[:, :, :f].transpose(1, 2))
        routed.inner_experts.w3_EFD.copy_(w_in[:, :, f:].transpose(1, 2))
        routed.inner_experts.w2_EDF.copy_(w_out.transpose(1, 2))
    routed.token_dispatcher.wire_meshes(ep_mesh=mesh)
    inner = routed.inner_experts
    inner.register_forward_pre_hook(lambda m, a: (split.mark(a[0], "f1", "b1"), *a[1:]))
    inner.register_forward_hook(lambda m, a, out: split.mark(out, "f2", "b2"))
    return routed


def torchtitan_grads(routed) -> tuple:
    """torchtitan's expert gradients in groupmm's layout: ``(w_in [e, d, 2F], w_out)``."""
    ex = routed.inner_experts
    g1, g3, g2 = ex.w1_EFD.grad, ex.w3_EFD.grad, ex.w2_EDF.grad
    if g1 is None or g2 is None or g3 is None:
        return None, None
    return torch.cat([g1.transpose(1, 2), g3.transpose(1, 2)], dim=2), g2.transpose(1, 2)


# ------------------------------------------------------------- bench_torchtitan's models


def torch_compat() -> list:
    """Names torchtitan 0.3.0's model packages import from torch that this torch lacks
    (``torch.distributed.fsdp.DataParallelMeshDims``, newer than torch 2.11), defined as
    placeholders (annotations and FSDP arguments; no FSDP runs): the names defined."""
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return added


def model_config(spec, layers: int, vocab: int, seq_len: int, attention: str):
    """torchtitan's Qwen3-MoE config of ``spec``'s sizes (its flavours' recipe)."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, hidden, experts, top_k, heads, kv_heads, head_dim = spec
    cfg = qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            **dict(n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads),
            **dict(head_dim=head_dim, moe_hidden_dim=hidden, num_experts=experts, top_k=top_k),
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1e6),
        ),
    )
    if attention == "sdpa":
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def setup_parallel(W: int, cpu: bool):
    """torchtitan's ParallelDims with EP = W (its partial_dtensor SPMD backend)."""
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.distributed.utils as tdu

    if cpu:
        pd.device_type = "cpu"  # torchtitan takes "cuda" when no accelerator is present
    _non_strict_tracing()
    tdu.set_spmd_backend("partial_dtensor")
    dims = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=W, world_size=W)
    pdims = pd.ParallelDims(**dims, spmd_backend="partial_dtensor")
    pdims.build_mesh()
    return pdims


def build_models(args, spec, pdims, impls, dev, dtype):
    """bench_torchtitan.py's ``{impl: model}`` from one set of weights, parallelized (EP >
    1) and compiled, and its notes."""
    added = torch_compat()
    from groupmm.integrations import torchtitan as tt
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    W = dist.get_world_size()
    cfg = model_config(spec, args.layers, args.vocab, args.seq_len, args.attention)
    if W > 1:
        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    torch.manual_seed(0)
    with torch.device(dev):
        base = cfg.build()
        base.init_states()
    with torch.no_grad():  # routing scores apart: the two implementations route alike
        for layer in base.layers.values():
            layer.moe.router.gate.weight.normal_(0, spec[0] ** -0.5)
    base = base.to(dtype)
    models, notes = {}, [f"placeholder for torchtitan: {n}" for n in added]
    for impl in impls:
        model = copy.deepcopy(base)
        if impl == "groupmm":
            tt.enable_moe(model)  # before parallelize, which wraps what it finds
        if W > 1:
            model.parallelize(pdims)
        if args.compile:
            no_tp = type("NoTP", (), {"tp_enabled": False})()
            config = CompileConfig(enable=True, backend=args.compile_backend)
            apply_compile(model, compile_config=config, parallel_dims=no_tp)
        models[impl] = model.train()
    return models, notes
