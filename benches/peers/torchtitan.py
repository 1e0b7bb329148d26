"""torchtitan, as bench_ep.py calls it: how it is imported and set up
(:func:`load_torchtitan`: its SPMD backend, the EP mesh registered as its trainer does;
optional: absent, the bench says why), its version, its ``RoutedExperts`` (its
``AllToAllTokenDispatcher`` + ``GroupedExperts``) built on copies of groupmm's local
experts (:func:`build_torchtitan`: w1 = gate^T, w3 = up^T, w2 = w_out^T) and its expert
gradients in groupmm's layout (:func:`torchtitan_grads`). On gloo its uneven list-form
``all_to_all`` (which gloo lacks) goes through ``all_to_all_single`` (:class:`_GlooDist`,
installed by ``spmd_types._dist.set_dist``, the hook spmd_types provides for that).
"""

from __future__ import annotations

import argparse

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
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's dispatcher asks this of torch releases after 2.11; in an eager
        # run nothing traces, which is this answer
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
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
