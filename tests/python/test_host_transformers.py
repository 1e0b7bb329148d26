"""Host cost of the transformers integration (``groupmm.integrations.transformers``): the
per-call work it was cut to stays cut, and the shortcuts change no result.

- routing: ``_glue.routes`` with int32 indices gives the int64 routes' values; the
  placeholder keys (ids outside ``[0, E)`` to ``E``) of every index dtype are the plain
  formula's; the torch ops it launches stay within a budget (each costs host time, and a
  launch on CUDA);
- the experts forward calls no ``Tensor.to`` that would return its input;
- the layout read from the module (``_transformers_compat._layout``) keeps only what is
  derived from the module, keyed on everything it was derived from: replaced parameters,
  flags and shapes are seen at the next call, and the key holds no tensor;
- the fused path (the block's ops called directly, their checks done once per layout)
  gives ``groupmm.fused.expert_block``'s results bit for bit, and its errors name the
  module's parameters.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub

import pytest
import torch
from groupmm import fused
from groupmm._glue import _placeholder_keys, routes
from torch.profiler import ProfilerActivity, profile

tf = pytest.importorskip("transformers")
gt = pytest.importorskip("groupmm.integrations.transformers")
compat = pytest.importorskip("groupmm.integrations._transformers_compat")

F64 = torch.float64


def _experts(seed: int = 0, dtype=F64):
    """A Qwen3-MoE experts module (8 experts, hidden 32, intermediate 16) with random
    weights, switched to groupmm."""
    config = tf.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
    )
    config._experts_implementation = gt.NAME
    gt.register()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    experts = next(m for m in model.modules() if gt._is_experts(m))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return experts.to(dtype)


def _routing(tokens: int, top_k: int, num_experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    idx[0, 0], idx[2, 1], idx[3, 0] = num_experts, num_experts + 5, -1  # placeholders
    return idx, torch.rand(tokens, top_k, generator=gen, dtype=F64)


def _direct_ops(fn) -> list:
    """The aten ops ``fn()`` calls directly (not from inside another aten op)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = []
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            names.append(e.name)
    return names


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize(("placeholders", "pad_to"), [(False, None), (False, 4), (True, None)])
def test_int32_routes_equal_int64_routes(placeholders, pad_to):
    gen = torch.Generator().manual_seed(3)
    T, k, E = 11, 3, 5
    ids = torch.randint(0, E, (T, k), generator=gen)
    if placeholders:
        ids[0, 1], ids[4, 0], ids[7, 2] = E, E + 3, -1
    wide = routes(ids, E, pad_to, counts=True, placeholders=placeholders)
    narrow = routes(ids, E, pad_to, counts=True, placeholders=placeholders, index_dtype=torch.int32)
    for name in ("src", "inverse", "dest"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert a.dtype == torch.int64 and b.dtype == torch.int32, name
        assert torch.equal(a, b.long()), name
    for name in ("offs", "order", "keys", "counts", "valid"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert wide.capacity == narrow.capacity
    with pytest.raises(TypeError, match="index_dtype: expected"):
        routes(ids.clamp(0, E - 1), E, index_dtype=torch.int16)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_placeholder_keys_are_the_plain_formula(dtype):
    E = 7
    values = [0, 1, E - 1, E, E + 1, 100]
    if dtype.is_signed:
        values += [-1, -2, -100]
    if dtype == torch.int64:
        values += [2**40, -(2**40), 2**63 - 1, -(2**63)]
    if dtype == torch.int32:
        values += [2**31 - 1, -(2**31)]
    ids = torch.tensor(values, dtype=dtype)
    want = torch.where((ids >= 0) & (ids < E), ids, E)
    got = _placeholder_keys(ids, E)
    assert torch.equal(got.long(), want.long())


def test_routing_ops_within_budget():
    """The routing of one call: 14 torch ops (reshape, clamp and remainder for the
    placeholders, their mask, the int32 keys, sort, arange, searchsorted, the source
    rows and their int32 copy, arange, empty, scatter, view) and 2 for the weights'
    mask; no int32 conversion of ``inverse`` left to the block."""
    idx, w = _routing(9, 3, 8)
    ops = _direct_ops(lambda: routes(idx, 8, placeholders=True, index_dtype=torch.int32))
    assert len(ops) <= 14, ops
    ops = _direct_ops(lambda: gt._route(idx, w, 8))
    assert len(ops) <= 16, ops


def test_forward_calls_no_cast_that_returns_its_input():
    experts = _experts()
    x = torch.randn(9, 32, dtype=F64)
    idx, w = _routing(9, 3, 8)
    gt.groupmm_experts_forward(experts, x, idx, w)  # the layout derived once
    ops = _direct_ops(lambda: gt.groupmm_experts_forward(experts, x, idx, w))
    # the int32 keys of the sort and the int32 source rows; nothing else is converted
    assert ops.count("aten::to") == 2, ops


# --------------------------------------------------------------------------- layout


def test_layout_follows_replaced_parameters_flags_and_shapes():
    experts = _experts()
    x = torch.randn(9, 32, dtype=F64)
    idx, w = _routing(9, 3, 8)
    first = gt.groupmm_experts_forward(experts, x, idx, w)
    key = experts.__dict__[compat._CACHE].key
    assert not any(isinstance(v, torch.Tensor) for v in key)

    # a parameter replaced by another of the same shape: the new values are read
    fresh = copy.deepcopy(experts)
    with torch.no_grad():
        fresh.gate_up_proj.mul_(-1.5)
    experts.gate_up_proj = torch.nn.Parameter(fresh.gate_up_proj.detach().clone())
    got = gt.groupmm_experts_forward(experts, x, idx, w)
    want = gt.groupmm_experts_forward(fresh, x, idx, w)
    assert torch.equal(got, want) and not torch.equal(got, first)

    # stored transposed ([E, in, out]) with the flag flipped: derived again
    experts.gate_up_proj = torch.nn.Parameter(fresh.gate_up_proj.detach().transpose(1, 2).clone())
    experts.down_proj = torch.nn.Parameter(fresh.down_proj.detach().transpose(1, 2).clone())
    experts.is_transposed = True
    torch.testing.assert_close(gt.groupmm_experts_forward(experts, x, idx, w), want)
    # ... and without the flag, inferred from the shapes
    del experts.__dict__["is_transposed"]
    torch.testing.assert_close(gt.groupmm_experts_forward(experts, x, idx, w), want)
    assert experts.__dict__[compat._CACHE].transposed

    # a gate of the module's own: not fused any more, and used
    experts.is_transposed = True
    experts._apply_gate = lambda h: 2.0 * torch.nn.functional.silu(h[:, :16]) * h[:, 16:]
    doubled = gt.groupmm_experts_forward(experts, x, idx, w)
    torch.testing.assert_close(doubled, 2.0 * want)
    assert not experts.__dict__[compat._CACHE].fused


def test_fused_path_equals_expert_block_bit_for_bit():
    experts = _experts(seed=2, dtype=torch.float32)
    x = torch.randn(10, 32, requires_grad=True)
    idx, w = _routing(10, 3, 8, seed=4)
    w = w.float().requires_grad_(True)
    go = torch.randn(10, 32)
    out = gt.groupmm_experts_forward(experts, x, idx, w)
    grads = torch.autograd.grad(out, [x, w, experts.gate_up_proj, experts.down_proj], go)

    r = routes(idx, 8, placeholders=True)
    valid = r.valid.view(10, 3)
    masked = w.masked_fill(~valid, 0)
    w_in, w_out = experts.gate_up_proj, experts.down_proj
    ref = fused.expert_block(
        x, w_in.transpose(1, 2), w_out.transpose(1, 2), r.offs, r.src, r.inverse, masked
    )
    ref_grads = torch.autograd.grad(ref, [x, w, w_in, w_out], go)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_fused_path_errors_name_the_module_parameters():
    experts = _experts()
    x = torch.randn(6, 32, dtype=F64)
    idx, w = _routing(6, 3, 8)
    experts.num_experts = 9  # the weights hold 8
    with pytest.raises(ValueError, match=r"gate_up_proj: expected shape \[E=9, 2I, H=32\]"):
        gt.groupmm_experts_forward(experts, x, idx, w)
    experts.num_experts = 8
    experts.down_proj = torch.nn.Parameter(torch.zeros(8, 32, 15, dtype=F64))
    with pytest.raises(ValueError, match=r"down_proj: expected shape \[E=8, H=32, I=16\]"):
        gt.groupmm_experts_forward(experts, x, idx, w)
    experts.down_proj = torch.nn.Parameter(torch.zeros(8, 32, 16, dtype=F64))
    gt.groupmm_experts_forward(experts, x, idx, w)  # fixed: runs
    meta = x.to("meta")
    with pytest.raises(RuntimeError, match="gate_up_proj: expected a tensor on meta"):
        gt.groupmm_experts_forward(experts, meta, idx.to("meta"), w.to("meta"))


def test_layout_kept_on_the_module_makes_no_reference_cycle():
    """What the layout keeps on the module references no module back: a deleted module
    is freed at once (its parameters with it), not at the next garbage collection."""
    import gc
    import weakref

    experts = _experts()
    x = torch.randn(6, 32, dtype=F64)
    idx, w = _routing(6, 3, 8)
    gt.groupmm_experts_forward(experts, x, idx, w)
    assert compat._CACHE in experts.__dict__
    ref = weakref.ref(experts)
    gc.disable()
    try:
        del experts
        assert ref() is None
    finally:
        gc.enable()
