//! Every check of a product request, before anything is read, allocated or written.

use super::request::ProductRequest;
use crate::error::Result;
use crate::exec::operands::check_out;
use crate::shape::{self, OperandKind, ProductDims};

/// The shape of `c`: the product's output, or an epilogue's first (e.g. `pre`, `dpre`).
pub(super) fn c_shape<'p>(plan: &'p ProductDims, shapes: &'p [[usize; 2]]) -> &'p [usize] {
    shapes.first().map_or(&plan.product.out_shape, |s| s)
}

/// Every check of a request: agreement with the first operand (dtype and device; an
/// epilogue's float32 operands float32), the shape rule, then `out`. Nothing is read, allocated or written. Returns
/// the extents and the epilogue's output shapes ([`ProductDims::out_shapes`]).
pub(super) fn validate<O>(req: &ProductRequest<'_, O>) -> Result<(ProductDims, Vec<[usize; 2]>)> {
    let (a, like) = (req.a, req.a.reference());
    let [na, nb] = shape::operand_names(req.form, &req.epilogue);
    shape::check_like(nb, req.b.like(), na, like)?;
    if let Some((s, _)) = req.src {
        shape::check_like("src", (None, s.device), na, like)?;
    }
    shape::check_like("offs", (None, req.offs.device), na, like)?;
    for (rule, t) in req.epilogue.listed() {
        match rule.kind {
            OperandKind::Like | OperandKind::Weight => {
                shape::check_like(rule.name, t.like(), na, like)?;
            }
            OperandKind::F32(what) => {
                shape::check_like(rule.name, (None, t.device), na, like)?;
                shape::check_f32(rule.name, t.dtype, what)?;
            }
        }
    }
    let plan = shape::plan_product(&shape::ProductShape {
        form: req.form,
        a: &a.layout,
        b: &req.b.layout,
        offs_len: shape::offs_len(&req.offs.layout)?,
        src: req.src.map(|(s, g)| (&s.layout, g)),
        epilogue: req.epilogue.map(|t| &t.layout),
        transposed: req.transposed,
    })?;
    let shapes = plan.out_shapes();
    if let Some((_, t)) = &req.out {
        // A transposed result is the view of `c` with its last two dimensions swapped
        // (GroupedK: `[G, N, K]`).
        let (swapped, c) = (&mut [0; 3], c_shape(&plan, &shapes));
        let shape = match (req.transposed, c) {
            (true, &[g, n, k]) => {
                *swapped = [g, k, n];
                &swapped[..]
            }
            _ => c,
        };
        let dtype = req.out_dtype.unwrap_or(a.dtype);
        let listed = || req.epilogue.listed();
        let inputs = [(na, a), (nb, req.b)].into_iter();
        let inputs = inputs.chain(
            listed()
                .filter(|(r, _)| !r.out_may_be)
                .map(|(r, t)| (r.name, *t)),
        );
        check_out("out", t, shape, dtype, (na, a), inputs)?;
        for (r, p) in listed().filter(|(r, _)| r.out_may_be) {
            let (o, p) = (
                (t.ptr, &t.layout, t.byte_range()),
                (p.ptr, &p.layout, p.byte_range()),
            );
            shape::check_same_or_disjoint("out", o, r.name, p)?;
        }
    }
    Ok((plan, shapes))
}
