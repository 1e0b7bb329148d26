//! The fused epilogues of a GroupedM product, one rule entry each ([`EPILOGUES`]): its
//! name, operands, outputs and shape rule, and what it computes element by element from
//! the product `p = a · b` (`[m, n]`, fp32). The engine, the bridge (by name and operand
//! position) and `_native.product` read them from here; the kernels' side of each is its
//! policy (cuda/kernels/varlen/epilogue/<name>.h, .cuh) and its lines in
//! cuda/kernels/varlen/fused.cuh.

use super::rules::{dgated, grouped_m, per_row, swiglu_pair};
use super::PARTIAL_COLS;
use crate::error::{Error, Result};
use crate::shape::epilogue::{EpilogueRule, OperandKind, OperandRule, OutputRule};
use crate::shape::rows::gate_up_half;

const fn input(name: &'static str, kind: OperandKind) -> OperandRule {
    OperandRule {
        name,
        optional: false,
        kind,
        out_may_be: false,
    }
}

const fn output(name: &'static str, shape: fn(usize, usize) -> [usize; 2]) -> OutputRule {
    OutputRule {
        name,
        shape,
        f32: false,
    }
}

/// The up projection and its activation (`n` even, `F = n / 2`): `c = p` (the
/// pre-activation `[gate | up]`, `[m, 2F]`) and `act[r, j] = silu(p[r, j]) * p[r, F + j]`
/// (`[m, F]`, contiguous, c's dtype). The weights are `b`'s columns `[gate | up]`, or with
/// `up`, `b` the gate's `[G, K, F]` and `up` the up projection's, of `b`'s shape and
/// strides (`p = a · [b | up]`, never concatenated).
pub const SWIGLU: EpilogueRule = EpilogueRule {
    name: "swiglu",
    a: "x",
    b_transposed: false,
    operands: &[OperandRule {
        optional: true,
        ..input("up", OperandKind::Weight)
    }],
    outputs: &[
        output("pre", |r, f| [r, 2 * f]),
        output("act", |r, f| [r, f]),
    ],
    plan: |s| match s.operands.first().copied().flatten() {
        None => {
            let product = grouped_m(s.a, s.b, s.src, s.offs_len)?;
            let f = gate_up_half("w", &s.b.shape)?;
            Ok((product, f))
        }
        Some(up) => swiglu_pair(s.a, s.b, up, s.src, s.offs_len),
    },
};

/// The dSwiGLU backward of a down projection (`F = n`; `p = dy · wᵀ`, `w [G, F, D]` read
/// transposed in place): `p` is the gradient of the activation before the router weight;
/// with `g = pre[r, j]`, `u = pre[r, F + j]`, `s = scale[r]`, `σ = sigmoid(g)`: `c` is
/// `dpre [m, 2F]` (contiguous): `c[r, j] = s·p·u·σ·(1 + g·(1 − σ))`,
/// `c[r, F + j] = s·p·g·σ`; `act[r, j] = s·silu(g)·u` (`[m, F]`, contiguous);
/// `partial[j / 64, r]` (f32, `[ceil(F / 64), m]`, contiguous) is the sum over the columns
/// `j` of that 64-column chunk of `p·silu(g)·u`, so that the router weight's gradient of
/// row `r` is `sum_i partial[i, r]` (no atomics: deterministic). `out` may be `pre`.
pub const DGATED: EpilogueRule = EpilogueRule {
    name: "dgated",
    a: "dy",
    b_transposed: true,
    operands: &[
        OperandRule {
            out_may_be: true,
            ..input("pre", OperandKind::Like)
        },
        input("scale", OperandKind::F32("the router weight of each row")),
    ],
    outputs: &[
        output("dpre", |r, f| [r, 2 * f]),
        output("act", |r, f| [r, f]),
        OutputRule {
            f32: true,
            ..output("partial", |r, f| [f.div_ceil(PARTIAL_COLS), r])
        },
    ],
    plan: |s| match s.operands {
        [Some(pre), Some(scale), ..] => dgated(s.a, s.b, pre, scale, s.src, s.offs_len),
        _ => Err(missing("dgated")),
    },
};

/// Each row of the product times its scale: `c[r, j] = scale[r] · p[r, j]` (rounded
/// once, from the fp32 product), `scale` float32 `[m]`.
pub const ROW_SCALE: EpilogueRule = EpilogueRule {
    name: "row_scale",
    a: "x",
    b_transposed: false,
    operands: &[input("scale", OperandKind::F32("the scale of each row"))],
    outputs: &[],
    plan: |s| {
        let product = grouped_m(s.a, s.b, s.src, s.offs_len)?;
        let scale = s
            .operands
            .first()
            .copied()
            .flatten()
            .ok_or_else(|| missing("row_scale"))?;
        per_row("scale", scale, product.m, s.src.is_some())?;
        Ok((product, 0))
    },
};

/// Every fused epilogue, by name.
pub static EPILOGUES: &[&EpilogueRule] = &[&SWIGLU, &DGATED, &ROW_SCALE];

/// The epilogue named `name`, or a message that lists the names.
pub fn epilogue(name: &str) -> Result<&'static EpilogueRule> {
    EPILOGUES
        .iter()
        .copied()
        .find(|e| e.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = EPILOGUES.iter().map(|e| e.name).collect();
            Error::Type(format!(
                "epilogue: expected one of {}, found {name:?}",
                names.join(", ")
            ))
        })
}

/// The engine checked every required operand before the rule (`check_operands`).
fn missing(name: &str) -> Error {
    Error::Type(format!("internal: the {name} rule without its operands"))
}

/// The required operands of `e` are given, and no more than it lists (before the rule).
pub fn check_operands<T>(e: &EpilogueRule, given: &[Option<T>]) -> Result<()> {
    if given.len() > e.operands.len() && given[e.operands.len()..].iter().any(Option::is_some) {
        let names: Vec<&str> = e.operands.iter().map(|o| o.name).collect();
        return Err(Error::Type(format!(
            "operands: the {} epilogue takes ({}), found {} operands",
            e.name,
            names.join(", "),
            given.iter().filter(|o| o.is_some()).count()
        )));
    }
    for (i, o) in e.operands.iter().enumerate() {
        if !o.optional && !matches!(given.get(i), Some(Some(_))) {
            return Err(Error::Type(format!(
                "operands: the {} epilogue needs {} (operand {i} of ({})), found none",
                e.name,
                o.name,
                e.operands
                    .iter()
                    .map(|o| o.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    Ok(())
}
