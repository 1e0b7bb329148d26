"""MoE building blocks (groupmm.nn, groupmm.moe) against per-expert nn.Linear loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.moe import (
    MoELayer,
    TopKRouter,
    load_balancing_loss,
    permute,
    unpermute,
)
from groupmm.nn import GroupedExperts
from torch import nn

F64 = torch.float64
ACTS = ["swiglu", "gelu", "relu"]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tensors are tiny: extra intra-op threads only spin, and on a loaded
    2-core machine they slow the module down about 3x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- references


class LoopExpert(nn.Module):
    """One expert as plain nn.Linear layers (the independent reference)."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.activation = activation
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias, dtype=F64)
        self.up = nn.Linear(d_model, d_ff, bias=bias, dtype=F64)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            h = F.silu(self.fc1(x)) * self.up(x)
        elif self.activation == "gelu":
            h = F.gelu(self.fc1(x))
        else:
            h = F.relu(self.fc1(x))
        return self.fc2(h)


def loop_experts_from(ge: GroupedExperts) -> nn.ModuleList:
    """Per-expert nn.Linear copies of a GroupedExperts' weights."""
    d_ff, act = ge.d_ff, ge.activation
    bias = ge.b_in is not None
    experts = nn.ModuleList()
    with torch.no_grad():
        for e in range(ge.num_experts):
            m = LoopExpert(ge.d_model, d_ff, act, bias)
            m.fc1.weight.copy_(ge.w_in[e, :, :d_ff].T)
            m.fc2.weight.copy_(ge.w_out[e].T)
            if act == "swiglu":
                m.up.weight.copy_(ge.w_in[e, :, d_ff:].T)
            if bias:
                m.fc1.bias.copy_(ge.b_in[e, :d_ff])
                m.fc2.bias.copy_(ge.b_out[e])
                if act == "swiglu":
                    m.up.bias.copy_(ge.b_in[e, d_ff:])
            experts.append(m)
    return experts


def assert_expert_grads_match(ge: GroupedExperts, loop: nn.ModuleList) -> None:
    d_ff = ge.d_ff
    for e, m in enumerate(loop):
        torch.testing.assert_close(ge.w_in.grad[e, :, :d_ff], m.fc1.weight.grad.T)
        torch.testing.assert_close(ge.w_out.grad[e], m.fc2.weight.grad.T)
        if ge.activation == "swiglu":
            torch.testing.assert_close(ge.w_in.grad[e, :, d_ff:], m.up.weight.grad.T)
        if ge.b_in is not None:
            torch.testing.assert_close(ge.b_in.grad[e, :d_ff], m.fc1.bias.grad)
            torch.testing.assert_close(ge.b_out.grad[e], m.fc2.bias.grad)
            if ge.activation == "swiglu":
                torch.testing.assert_close(ge.b_in.grad[e, d_ff:], m.up.bias.grad)


def reference_moe(
    gate: torch.Tensor,
    top_k: int,
    normalize: bool,
    loop: nn.ModuleList,
    x: torch.Tensor,
) -> torch.Tensor:
    """Route token by token with plain ops and run each token through its experts."""
    probs = torch.softmax(x @ gate.T, dim=-1)
    top_p, ids = probs.topk(top_k, dim=-1)
    if normalize:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(top_k):
            acc = acc + top_p[t, j] * loop[int(ids[t, j])](x[t : t + 1])[0]
        rows.append(acc)
    return torch.stack(rows)


def offs_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.long).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------- GroupedExperts


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equals_linear_loop(activation: str, bias: bool) -> None:
    torch.manual_seed(0)
    counts = [3, 0, 5, 1, 0]  # empty experts in the middle and at the end
    tail = 2  # rows past offs[-1]
    ge = GroupedExperts(5, 6, 7, activation=activation, bias=bias, dtype=F64)
    loop = loop_experts_from(ge)
    x = torch.randn(sum(counts) + tail, 6, dtype=F64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    offs = offs_of(counts)

    y = ge(x, offs)
    parts, start = [], 0
    for e, c in enumerate(counts):
        parts.append(loop[e](x_ref[start : start + c]))
        start += c
    parts.append(torch.zeros(tail, 6, dtype=F64))
    y_ref = torch.cat(parts)
    torch.testing.assert_close(y, y_ref)
    assert torch.all(y[-tail:] == 0)

    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert torch.all(x.grad[-tail:] == 0)
    assert_expert_grads_match(ge, loop)
    # Empty experts get exactly zero gradient.
    for e in (1, 4):
        assert torch.all(ge.w_in.grad[e] == 0) and torch.all(ge.w_out.grad[e] == 0)


def test_grouped_experts_strided_input() -> None:
    torch.manual_seed(1)
    ge = GroupedExperts(3, 4, 5, activation="gelu", dtype=F64)
    base = torch.randn(8, 10, dtype=F64)
    x = base[:, ::2][:, :4]  # non-contiguous view
    offs = offs_of([2, 3, 3])
    torch.testing.assert_close(ge(x, offs), ge(x.contiguous(), offs))


def test_grouped_experts_init_like_linear() -> None:
    torch.manual_seed(0)
    d_model, d_ff = 64, 96
    ge = GroupedExperts(4, d_model, d_ff, bias=True)
    assert ge.w_in.shape == (4, d_model, 2 * d_ff)
    assert ge.w_out.shape == (4, d_ff, d_model)
    assert ge.b_in.shape == (4, 2 * d_ff) and ge.b_out.shape == (4, d_model)
    for w, fan_in in [
        (ge.w_in, d_model),
        (ge.w_out, d_ff),
        (ge.b_in, d_model),
        (ge.b_out, d_ff),
    ]:
        bound = 1 / math.sqrt(fan_in)
        assert w.abs().max() <= bound
        # uniform(-b, b) has std b/sqrt(3); nn.Linear's init gives the same.
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.1 * bound
    lin = nn.Linear(d_model, d_ff)
    assert abs(lin.weight.std().item() - ge.w_in.std().item()) < 0.1 / math.sqrt(d_model)
    assert not torch.equal(ge.w_in[0], ge.w_in[1])  # experts are not clones


def test_grouped_experts_dtype_device_and_repr() -> None:
    ge = GroupedExperts(2, 4, 8, activation="relu", device="cpu", dtype=torch.bfloat16)
    assert ge.w_in.dtype == torch.bfloat16 and ge.w_in.device.type == "cpu"
    assert ge.b_in is None and ge.w_in.shape == (2, 4, 8)
    assert repr(ge) == (
        "GroupedExperts(num_experts=2, d_model=4, d_ff=8, activation='relu', bias=False)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_experts_low_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    ge = GroupedExperts(3, 16, 32, bias=True, dtype=F64)
    x = torch.randn(12, 16, dtype=F64)
    offs = offs_of([5, 0, 7])
    ref = ge(x, offs)
    ge_lp = GroupedExperts(3, 16, 32, bias=True, dtype=dtype)
    ge_lp.load_state_dict({k: v.to(dtype) for k, v in ge.state_dict().items()})
    out = ge_lp(x.to(dtype), offs)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"num_experts": 2.5}, TypeError, "num_experts"),
        ({"d_model": -1}, ValueError, "d_model"),
        ({"d_ff": 0}, ValueError, "d_ff"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"bias": "yes"}, TypeError, "bias"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"dtype": "float32"}, TypeError, "dtype"),
    ],
)
def test_grouped_experts_bad_args(kwargs: dict, exc: type, name: str) -> None:
    args = {"num_experts": 2, "d_model": 4, "d_ff": 8} | kwargs
    with pytest.raises(exc, match=f"^{name}: "):
        GroupedExperts(**args)


def test_grouped_experts_bad_forward_args() -> None:
    ge = GroupedExperts(2, 4, 8, dtype=F64)
    x = torch.randn(3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"^x: expected shape \[T, d_model=4\], found \[3, 5\]"):
        ge(torch.randn(3, 5, dtype=F64), offs_of([1, 2]))
    with pytest.raises(ValueError, match=r"^offs: expected shape \[num_experts=2\]"):
        ge(x, offs_of([1, 1, 1]))
    with pytest.raises(TypeError, match="^offs: expected dtype torch.int32, found torch.int64"):
        ge(x, offs_of([1, 2]).long())
    with pytest.raises(TypeError, match="^x: expected dtype torch.float64"):
        ge(x.float(), offs_of([1, 2]))
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor, found ndarray"):
        ge(x.numpy(), offs_of([1, 2]))
    with pytest.raises(TypeError, match="^offs: expected a torch.Tensor, found list"):
        ge(x, [1, 2])
    with pytest.raises(RuntimeError, match="^x: expected a tensor on cpu"):
        ge(x.to("meta"), offs_of([1, 2]))


def test_grouped_experts_gradcheck() -> None:
    torch.manual_seed(3)
    ge = GroupedExperts(3, 3, 4, activation="swiglu", bias=True, dtype=F64)
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    offs = offs_of([2, 0, 3])  # one empty expert, one row past the end
    names = [n for n, _ in ge.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in ge.parameters()]

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(ge, dict(zip(names, ps)), (x, offs))

    assert torch.autograd.gradcheck(f, (x, *params))


def test_grouped_experts_double_backward() -> None:
    torch.manual_seed(13)
    ge = GroupedExperts(3, 2, 3, activation="swiglu", dtype=F64)
    x = torch.randn(5, 2, dtype=F64, requires_grad=True)
    offs = offs_of([2, 0, 2])
    w_in = ge.w_in.detach().clone().requires_grad_(True)
    w_out = ge.w_out.detach().clone().requires_grad_(True)

    def f(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(ge, {"w_in": w_in, "w_out": w_out}, (x, offs))

    assert torch.autograd.gradgradcheck(f, (x, w_in, w_out))


# ---------------------------------------------------------------- routing (groupmm._glue)


# placeholders are the transformers integration's, which never pads
@pytest.mark.parametrize(("placeholders", "pad_to"), [(False, None), (False, 4), (True, None)])
def test_routes_against_a_loop(placeholders: bool, pad_to: int | None) -> None:
    """The one routing of every MoE path, against a plain loop over the copies: groups in
    expert order, by token then slot within a group, placeholders (ids outside [0, E))
    after every group, padding rows at each group's end."""
    gen = torch.Generator().manual_seed(9)
    T, k, E = 13, 3, 5
    ids = torch.randint(0, E, (T, k), generator=gen)
    if placeholders:
        ids[0, 1], ids[4, 0], ids[7, 2] = E, E + 3, -1
    r = routes(ids, E, pad_to, counts=True, placeholders=placeholders)

    copies = [(t, j) for t in range(T) for j in range(k)]
    groups = [[c for c in copies if int(ids[c]) == e] for e in range(E)]
    extra = [c for c in copies if not 0 <= int(ids[c]) < E]
    m = pad_to or 1
    rows, ends, row_of = 0, [], {}
    for group in groups:
        for i, c in enumerate(group):
            row_of[c] = rows + i
        rows += -(-len(group) // m) * m
        ends.append(rows)
    for i, c in enumerate(extra):
        row_of[c] = rows + i
    assert r.offs.dtype == torch.int32 and r.offs.tolist() == ends
    assert r.counts is not None and r.counts.tolist() == [len(g) for g in groups]
    assert r.inverse.tolist() == [[row_of[(t, j)] for j in range(k)] for t in range(T)]
    assert r.capacity == (None if pad_to is None else T * k + E * (pad_to - 1))
    order = [c for g in groups for c in g] + extra  # the sorted positions
    assert r.src.tolist() == [t for t, _ in order]
    assert r.order.tolist() == [t * k + j for t, j in order]
    assert r.dest.tolist() == [row_of[c] for c in order]
    if placeholders:
        assert r.valid is not None
        assert r.valid.tolist() == [0 <= int(ids[c]) < E for c in copies]
    else:
        assert r.valid is None
    assert routes(ids.clamp(0, E - 1), E).counts is None  # only when asked (or padding)


# ---------------------------------------------------------------- permute / unpermute


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("pad_to", [None, 1, 8, 16, 128])
def test_permute_unpermute_round_trip(top_k: int, pad_to: int | None) -> None:
    torch.manual_seed(4)
    T, D, E = 11, 3, 6
    x = torch.randn(T, D, dtype=F64)
    # Only experts 0, 2 and 5 are used: 1, 3, 4 are empty.
    choices = torch.tensor([0, 2, 5])
    ids = torch.stack([torch.randperm(3)[:top_k] for _ in range(T)])
    ids = choices[ids]
    p = permute(x, ids, E, pad_to=pad_to)

    flat = ids.reshape(-1).tolist()
    counts = [flat.count(e) for e in range(E)]
    assert p.counts.tolist() == counts
    assert p.offs.dtype == torch.int32 and p.offs.shape == (E,)
    m = pad_to or 1
    padded = [-(-c // m) * m for c in counts]
    assert p.offs.tolist() == torch.tensor(padded).cumsum(0).tolist()
    assert p.tokens.shape == (T * top_k + (E * (m - 1) if m > 1 else 0), D)
    assert p.inverse.shape == (T, top_k)

    # Every group holds exactly its tokens, in token order, then zero padding.
    start = 0
    for e in range(E):
        mine = [t for t in range(T) for j in range(top_k) if int(ids[t, j]) == e]
        group = p.tokens[start : start + padded[e]]
        torch.testing.assert_close(group[: counts[e]], x[mine])
        assert torch.all(group[counts[e] :] == 0)
        start += padded[e]
    assert torch.all(p.tokens[start:] == 0)
    # inverse points each (token, slot) at its row.
    for t in range(T):
        for j in range(top_k):
            torch.testing.assert_close(p.tokens[p.inverse[t, j]], x[t])

    w = torch.rand(T, top_k, dtype=F64)
    torch.testing.assert_close(unpermute(p.tokens, p.inverse, w), w.sum(1, True) * x)
    torch.testing.assert_close(unpermute(p.tokens, p.inverse), top_k * x)


def test_permute_one_dim_ids_and_no_tokens() -> None:
    x = torch.arange(10.0, dtype=F64).view(5, 2)
    p = permute(x, torch.tensor([2, 0, 2, 2, 1], dtype=torch.int32), 3)
    assert p.offs.tolist() == [1, 2, 5] and p.inverse.shape == (5, 1)
    torch.testing.assert_close(p.tokens, x[[1, 4, 0, 2, 3]])
    torch.testing.assert_close(unpermute(p.tokens, p.inverse[:, 0]), x)

    layer = MoELayer(4, 8, 3, 2, bias=True, pad_to=8, dtype=F64)
    x0 = torch.zeros(0, 4, dtype=F64, requires_grad=True)
    y, aux = layer(x0, return_aux_loss=True)
    (y.sum() + aux).backward()
    assert y.shape == (0, 4) and aux.item() == 0.0
    assert torch.all(layer.experts.w_in.grad == 0)


def test_permute_is_differentiable() -> None:
    torch.manual_seed(5)
    x = torch.randn(7, 4, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 3, (7, 2))
    w = torch.rand(7, 2, dtype=F64, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        p = permute(x, ids, 3, pad_to=4)
        return unpermute(p.tokens * 2.0, p.inverse, w)

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("pad_to", [None, 4])
@pytest.mark.parametrize("weighted", [True, False])
def test_permute_unpermute_double_backward(pad_to: int | None, weighted: bool) -> None:
    torch.manual_seed(6)
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 3, (6, 2))
    w = torch.rand(6, 2, dtype=F64, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        p = permute(x, ids, 3, pad_to=pad_to)
        return unpermute(p.tokens * p.tokens, p.inverse, w if weighted else None)

    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(f, (x, w))


def test_moe_layer_backward_has_no_index_put() -> None:
    """The glue's backward is gathers, sums and one index_copy: no index_put (which sorts
    and adds atomically on GPU) and no scatter_add anywhere in forward or backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(7)
    layer = MoELayer(8, 16, 4, 2, aux_loss_coef=0.0, dtype=F64)
    x = torch.randn(10, 8, dtype=F64, requires_grad=True)
    with Ops():
        layer(x).square().sum().backward()
    assert seen and not [op for op in seen if "index_put" in op or "scatter_add" in op]
    ref = MoELayer(8, 16, 4, 2, aux_loss_coef=0.0, dtype=F64)
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_permute_bad_args() -> None:
    # the core's rule: the message starts with the argument's name; ValueError for
    # shapes/values, TypeError for types/dtypes, RuntimeError for devices
    x = torch.randn(4, 3)
    ids = torch.zeros(4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^expert_ids: expected shape \[T=4, k\]"):
        permute(x, torch.zeros(5, 1, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="^expert_ids: expected an integer dtype"):
        permute(x, torch.zeros(4, 1), 2)
    with pytest.raises(TypeError, match="^expert_ids: expected an integer dtype"):
        permute(x, torch.zeros(4, 1, dtype=torch.bool), 2)
    with pytest.raises(TypeError, match="^expert_ids: expected a torch.Tensor"):
        permute(x, [[0]] * 4, 2)
    with pytest.raises(RuntimeError, match="^expert_ids: expected a tensor on cpu"):
        permute(x, ids.to("meta"), 2)
    with pytest.raises(ValueError, match="^tokens: expected shape"):
        permute(x[0], ids, 2)
    with pytest.raises(TypeError, match="^num_experts: expected a positive int"):
        permute(x, ids, 2.0)
    with pytest.raises(ValueError, match="^pad_to: expected a positive int"):
        permute(x, ids, 2, pad_to=0)
    inv = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^gate_weights: expected shape \[4, 2\]"):
        unpermute(x, inv, torch.ones(4, 3))
    with pytest.raises(TypeError, match="^gate_weights: expected a torch.Tensor"):
        unpermute(x, inv, [1.0] * 4)
    with pytest.raises(ValueError, match="^expert_out: expected shape"):
        unpermute(x[0], inv)
    with pytest.raises(ValueError, match="^inverse: expected shape"):
        unpermute(x, inv[None])
    with pytest.raises(TypeError, match="^inverse: expected an integer dtype"):
        unpermute(x, inv.float())
    with pytest.raises(RuntimeError, match="^inverse: expected a tensor on cpu"):
        unpermute(x, inv.to("meta"))


# ---------------------------------------------------------------- router


def test_router_top_k_and_aux_loss() -> None:
    torch.manual_seed(6)
    r = TopKRouter(5, 4, 2, aux_loss_coef=0.5, dtype=F64)
    x = torch.randn(9, 5, dtype=F64)
    out = r(x)
    probs = torch.softmax(x @ r.gate.weight.detach().T, -1)
    torch.testing.assert_close(out.probs, probs)
    for t in range(9):
        order = sorted(range(4), key=lambda e: -float(probs[t, e]))[:2]
        assert out.expert_ids[t].tolist() == order
        raw = probs[t, order]
        torch.testing.assert_close(out.weights[t], raw / raw.sum())
    frac = torch.tensor([(out.expert_ids == e).sum().item() / 18 for e in range(4)], dtype=F64)
    torch.testing.assert_close(out.aux_loss, 0.5 * 4 * (frac * probs.mean(0)).sum())
    out.aux_loss.backward()
    assert r.gate.weight.grad is not None and r.gate.weight.grad.abs().sum() > 0

    # Uniform routing gives a balance loss of exactly 1.
    uniform = torch.full((8, 4), 0.25, dtype=F64)
    ids = torch.arange(8).remainder(4).unsqueeze(1)
    torch.testing.assert_close(load_balancing_loss(uniform, ids), torch.tensor(1.0, dtype=F64))


def test_router_top1_keeps_raw_probability() -> None:
    torch.manual_seed(7)
    r = TopKRouter(5, 4, 1, aux_loss_coef=0.0)
    out = r(torch.randn(6, 5))
    assert not r.normalize
    torch.testing.assert_close(out.weights[:, 0], out.probs.max(-1).values)
    assert out.aux_loss.item() == 0.0
    with pytest.raises(ValueError, match="^top_k: expected at most num_experts=4, found 5"):
        TopKRouter(5, 4, 5)
    with pytest.raises(ValueError, match="^aux_loss_coef: expected a float >= 0"):
        TopKRouter(5, 4, 1, aux_loss_coef=-0.5)
    with pytest.raises(ValueError, match="^aux_loss_coef: expected a float >= 0"):
        TopKRouter(5, 4, 1, aux_loss_coef=float("nan"))
    with pytest.raises(TypeError, match="^aux_loss_coef: expected a float >= 0"):
        TopKRouter(5, 4, 1, aux_loss_coef="0.1")
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        r([[0.0] * 5])
    with pytest.raises(ValueError, match=r"^x: expected shape \[T, d_model=5\]"):
        r(torch.randn(6, 4))


# ---------------------------------------------------------------- MoELayer


@pytest.mark.parametrize(
    ("top_k", "activation", "bias", "pad_to"),
    [
        (1, "swiglu", False, None),
        (2, "swiglu", False, None),
        (2, "gelu", True, 8),
        (1, "relu", True, 16),
        (3, "swiglu", False, 128),
    ],
)
def test_moe_layer_equals_loop(top_k: int, activation: str, bias: bool, pad_to: int | None) -> None:
    torch.manual_seed(8)
    layer = MoELayer(6, 10, 5, top_k, activation=activation, bias=bias, pad_to=pad_to, dtype=F64)
    loop = loop_experts_from(layer.experts)
    x = torch.randn(2, 7, 6, dtype=F64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    gate_ref = layer.router.gate.weight.detach().clone().requires_grad_(True)

    y = layer(x)
    assert y.shape == x.shape
    y_ref = reference_moe(gate_ref, top_k, layer.router.normalize, loop, x_ref.view(-1, 6))
    torch.testing.assert_close(y.view(-1, 6), y_ref)

    g = torch.randn_like(y_ref)
    (y.view(-1, 6) * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.router.gate.weight.grad, gate_ref.grad)
    assert_expert_grads_match(layer.experts, loop)
    assert layer.aux_loss is not None and layer.aux_loss.ndim == 0


def test_moe_layer_gradcheck() -> None:
    torch.manual_seed(9)
    layer = MoELayer(3, 4, 3, 2, pad_to=4, aux_loss_coef=0.1, dtype=F64)
    x = torch.randn(5, 3, dtype=F64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]

    def f(x: torch.Tensor, *ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.functional_call(
            layer, dict(zip(names, ps)), (x,), {"return_aux_loss": True}
        )

    assert torch.autograd.gradcheck(f, (x, *params))


def test_moe_layer_padding_does_not_change_result() -> None:
    torch.manual_seed(10)
    a = MoELayer(8, 16, 4, 2, dtype=F64)
    b = MoELayer(8, 16, 4, 2, pad_to=16, dtype=F64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(13, 8, dtype=F64)
    torch.testing.assert_close(a(x), b(x))


def _check_compiled_layer(backend: str) -> None:
    torch.manual_seed(11)
    torch._dynamo.reset()
    layer = MoELayer(8, 16, 4, 2, pad_to=8)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    x = torch.randn(12, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    y, aux = compiled(x, return_aux_loss=True)
    (y.square().sum() + aux).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    y_ref, aux_ref = layer(x_ref, return_aux_loss=True)
    (y_ref.square().sum() + aux_ref).backward()

    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, aux_ref)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, layer.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5)


def test_moe_layer_compile_fullgraph_trace() -> None:
    """Dynamo (fullgraph) + AOTAutograd tracing, forward and backward: no graph breaks."""
    _check_compiled_layer("aot_eager")


@pytest.mark.slow
def test_moe_layer_compile_fullgraph_inductor() -> None:
    """Same through Inductor code generation (tens of seconds on 2 cores)."""
    _check_compiled_layer("inductor")


@pytest.mark.cuda
@requires_cuda
def test_moe_layer_cuda_no_host_sync() -> None:
    torch.manual_seed(12)
    layer = MoELayer(16, 32, 8, 2, pad_to=8, device="cuda")
    x = torch.randn(64, 16, device="cuda", requires_grad=True)
    ref = MoELayer(16, 32, 8, 2, pad_to=8, dtype=F64)
    ref.load_state_dict({k: v.cpu().double() for k, v in layer.state_dict().items()})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux = layer(x, return_aux_loss=True)
        (y.square().sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(
        y.cpu().double(), ref(x.detach().cpu().double()), atol=1e-4, rtol=1e-4
    )


def _fwd_bwd(layer: MoELayer, x: torch.Tensor, go: torch.Tensor):
    """Output, aux loss, input gradient and every parameter's gradient of one training
    step of ``layer`` on ``x`` (output gradient ``go``)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, aux = layer(x, return_aux_loss=True)
    ((y * go).sum() + aux).backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return y.detach(), aux.detach(), x.grad, grads


@pytest.mark.cuda
@requires_cuda
def test_moe_layer_fused_default_cuda_bf16_no_host_sync() -> None:
    """The default layer (fused: ``expert_block``) in bf16 on CUDA: forward and backward,
    the aux loss and every parameter's gradient included, never synchronise with the host
    (after one warm-up step: module loading, workspace pools), and agree with the unfused
    layer (``fused=False``) with the same weights within bf16 rounding."""
    from conftest import TOL, rel_err

    torch.manual_seed(13)
    layer = MoELayer(128, 128, 8, 2, device="cuda", dtype=torch.bfloat16)
    assert layer.fused
    unfused = MoELayer(128, 128, 8, 2, fused=False, device="cuda", dtype=torch.bfloat16)
    unfused.load_state_dict(layer.state_dict())
    x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    go = torch.randn_like(x)
    _fwd_bwd(layer, x, go)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux, dx, grads = _fwd_bwd(layer, x, go)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_u, aux_u, dx_u, grads_u = _fwd_bwd(unfused, x, go)
    # the same router on the same input: the same experts and the same aux loss
    assert torch.equal(aux, aux_u)
    pairs = [("out", y, y_u), ("x.grad", dx, dx_u)]
    pairs += [(n, g, grads_u[n]) for n, g in grads.items()]
    for name, got, want in pairs:
        assert got is not None and want is not None, name
        err = rel_err(got, want)
        assert err <= 2 * TOL[torch.bfloat16], f"{name}: relative error {err:.2e}"
