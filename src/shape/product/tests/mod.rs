//! The product rules' tests: the requests as the faces make them (the helpers here), the
//! gathered plain products (`gathered`) and the epilogues' (`epilogues`).

use super::*;

mod epilogues;
mod gathered;

fn c(shape: &[usize]) -> Layout {
    Layout::contiguous(shape)
}

/// The request of one product, as a face makes it.
fn request<'a>(
    form: Form,
    (a, b): (&'a Layout, &'a Layout),
    src: Option<(&'a Layout, Gathered)>,
    epilogue: Epilogue<&'a Layout>,
    offs_len: usize,
    transposed: bool,
) -> Result<ProductDims> {
    plan_product(&ProductShape {
        form,
        a,
        b,
        offs_len,
        src,
        epilogue,
        transposed,
    })
}

/// `gather_mm`'s rule.
fn plan_gather(x: &Layout, w: &Layout, src: &Layout, offs_len: usize) -> Result<PackedDims> {
    let src = Some((src, Gathered::A));
    request(
        Form::GroupedM,
        (x, w),
        src,
        Epilogue::plain(),
        offs_len,
        false,
    )
    .map(|d| d.product)
}

/// `gather_k_mm`'s rule.
fn plan_gather_k(
    a: &Layout,
    b: &Layout,
    src: &Layout,
    offs_len: usize,
    gathered_b: bool,
    transposed: bool,
) -> Result<PackedDims> {
    let gathered = if gathered_b { Gathered::B } else { Gathered::A };
    let d = request(
        Form::GroupedK,
        (a, b),
        Some((src, gathered)),
        Epilogue::plain(),
        offs_len,
        transposed,
    )?;
    assert_eq!((d.f, d.out_shapes(), d.is_empty()), (0, vec![], false));
    Ok(d.product)
}

/// The `swiglu` epilogue's rule.
fn plan_swiglu_mm(
    x: &Layout,
    w: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<ProductDims> {
    let src = src.map(|s| (s, Gathered::A));
    request(Form::GroupedM, (x, w), src, swiglu(None), offs_len, false)
}

/// The `dgated` epilogue's rule.
fn plan_dgated_mm(
    dy: &Layout,
    w: &Layout,
    pre: &Layout,
    scale: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<ProductDims> {
    let src = src.map(|s| (s, Gathered::A));
    let epilogue = Epilogue::new(rule("dgated"), [Some(pre), Some(scale)]);
    request(Form::GroupedM, (dy, w), src, epilogue, offs_len, false)
}

/// The rule entry named `name`.
fn rule(name: &str) -> &'static EpilogueRule {
    epilogue(name).unwrap()
}

/// The SwiGLU epilogue, over `w`'s columns or with `up`.
fn swiglu(up: Option<&Layout>) -> Epilogue<&Layout> {
    Epilogue::new(rule("swiglu"), [up])
}
