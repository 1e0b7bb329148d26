//! Every check of a product request, before anything is read, allocated or written.

use super::request::ProductRequest;
use crate::error::Result;
use crate::exec::operands::check_out;
use crate::shape::{self, Epilogue, ProductDims};

/// The shape of `c`: the product's output, or an epilogue's first (`pre`, `dpre`).
pub(super) fn c_shape<'p>(plan: &'p ProductDims, shapes: &'p [[usize; 2]]) -> &'p [usize] {
    shapes.first().map_or(&plan.product.out_shape, |s| s)
}

/// Every check of a request: agreement with the first operand (dtype and device; `scale`
/// float32), the shape rule, then `out`. Nothing is read, allocated or written. Returns
/// the extents and the epilogue's output shapes ([`ProductDims::out_shapes`]).
pub(super) fn validate<O>(req: &ProductRequest<'_, O>) -> Result<(ProductDims, Vec<[usize; 2]>)> {
    let (a, like) = (req.a, req.a.reference());
    let [na, nb] = shape::operand_names(req.form, &req.epilogue);
    shape::check_like(nb, req.b.like(), na, like)?;
    if let Some((s, _)) = req.src {
        shape::check_like("src", (None, s.device), na, like)?;
    }
    shape::check_like("offs", (None, req.offs.device), na, like)?;
    if let Epilogue::SwiGLU { up: Some(up) } = req.epilogue {
        shape::check_like("up", up.like(), na, like)?;
    }
    let (pre, scale) = match req.epilogue {
        Epilogue::DGated { pre, scale } => {
            (Some(pre), Some((scale, "the router weight of each row")))
        }
        Epilogue::RowScale { scale } => (None, Some((scale, "the scale of each row"))),
        _ => (None, None),
    };
    if let Some(pre) = pre {
        shape::check_like("pre", pre.like(), na, like)?;
    }
    if let Some((scale, what)) = scale {
        shape::check_like("scale", (None, scale.device), na, like)?;
        shape::check_f32("scale", scale.dtype, what)?;
    }
    let scale = scale.map(|(s, _)| s);
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
        let inputs = [(na, a), (nb, req.b)].into_iter();
        let inputs = inputs.chain(scale.map(|s| ("scale", s)));
        check_out("out", t, shape, dtype, (na, a), inputs)?;
        if let Some(p) = pre {
            let (o, p) = (
                (t.ptr, &t.layout, t.byte_range()),
                (p.ptr, &p.layout, p.byte_range()),
            );
            shape::check_same_or_disjoint("out", o, "pre", p)?;
        }
    }
    Ok((plan, shapes))
}
