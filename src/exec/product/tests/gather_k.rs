//! `gather_k_mm` on the CPU: against its definition, into a slab of a larger output, and
//! its argument errors.

use super::super::*;
use crate::exec::vocab::Output;
use crate::layout::Layout;

/// `gather_k_mm`'s request.
#[allow(clippy::too_many_arguments)]
unsafe fn packed_gather_k<R: Runtime>(
    rt: &mut R,
    a: &Tensor,
    b: &Tensor,
    offs: &IntTensor,
    src: &IntTensor,
    gathered_b: bool,
    transposed: bool,
    out: Option<Output<R::Out>>,
) -> Result<R::Out> {
    let gathered = if gathered_b { Gathered::B } else { Gathered::A };
    let req = ProductRequest {
        form: Form::GroupedK,
        a,
        b,
        offs,
        src: Some((src, gathered)),
        epilogue: crate::shape::Epilogue::plain(),
        transposed,
        out_dtype: None,
        out,
    };
    unsafe { product(rt, req) }.and_then(plain)
}

/// Host float64 outputs filled with NaN (every element must be written); any other
/// loan fails the test.
struct Host;
impl Runtime for Host {
    type Out = Vec<f64>;
    fn alloc(&mut self, shape: &[usize], dtype: DType, device: Device) -> Result<Output<Vec<f64>>> {
        assert_eq!((dtype, device), (DType::F64, Device::Cpu));
        let v = vec![f64::NAN; shape.iter().product()];
        let t = tensor(v.as_ptr() as usize, shape, dtype, device);
        Ok((v, t))
    }
    fn contiguous(&mut self, _: usize) -> Result<(usize, Layout)> {
        panic!("copied")
    }
    fn int32(&mut self, _: usize) -> Result<usize> {
        panic!("converted")
    }
}

fn tensor(ptr: usize, shape: &[usize], dtype: DType, device: Device) -> Tensor {
    Tensor {
        ptr,
        dtype,
        layout: Layout::contiguous(shape),
        device,
        id: 0,
        transposed: false,
    }
}

fn index(v: &[i32], device: Device) -> IntTensor {
    IntTensor {
        ptr: v.as_ptr() as usize,
        layout: Layout::contiguous(&[v.len()]),
        device,
        id: 0,
        int32: true,
    }
}

/// `Σ a_rᵀ · b_r` per group, the rows as `gathered_b` says, from the definition.
fn reference(
    (a, k): (&[f64], usize),
    (b, n): (&[f64], usize),
    ends: &[i32],
    src: &[i32],
    gathered_b: bool,
) -> Vec<f64> {
    let mut out = vec![0.0; ends.len() * k * n];
    let mut start = 0;
    for (g, &end) in ends.iter().enumerate() {
        for (r, &s) in src.iter().enumerate().take(end as usize).skip(start) {
            let (ra, rb) = match gathered_b {
                false => (s as usize, r),
                true => (r, s as usize),
            };
            for i in 0..k {
                for j in 0..n {
                    out[(g * k + i) * n + j] += a[ra * k + i] * b[rb * n + j];
                }
            }
        }
        start = end as usize;
    }
    out
}

#[test]
fn gather_k_on_the_cpu_matches_the_definition() {
    let (k, n) = (3usize, 2usize);
    let src = [4i32, 0, 0, 2, 5, 1, 3];
    let ends = [2i32, 2, 6]; // an empty group, a row past the last group
    let (r, t) = (src.len(), 6usize);
    let (offs_v, cpu) = (ends.to_vec(), Device::Cpu);
    let vals = |len: usize, seed: f64| -> Vec<f64> {
        (0..len).map(|i| ((i as f64 + seed) * 0.37).sin()).collect()
    };
    for gathered_b in [false, true] {
        let (ta, tb) = if gathered_b { (r, t) } else { (t, r) };
        let (a, b) = (vals(ta * k, 1.0), vals(tb * n, 2.0));
        let at = tensor(a.as_ptr() as usize, &[ta, k], DType::F64, cpu);
        let bt = tensor(b.as_ptr() as usize, &[tb, n], DType::F64, cpu);
        let (offs, src_t) = (index(&offs_v, cpu), index(&src, cpu));
        // SAFETY: live host arrays of the shapes described.
        let out =
            unsafe { packed_gather_k(&mut Host, &at, &bt, &offs, &src_t, gathered_b, false, None) }
                .unwrap();
        let expect = reference((&a, k), (&b, n), &ends, &src, gathered_b);
        assert_eq!(out.len(), expect.len());
        for (o, e) in out.iter().zip(&expect) {
            assert!(
                (o - e).abs() <= 1e-12,
                "{o} != {e} (gathered_b {gathered_b})"
            );
        }
        assert!(
            out[k * n..2 * k * n].iter().all(|&v| v == 0.0),
            "empty group"
        );
    }
}

#[test]
fn gather_k_writes_a_slab_of_a_larger_output_in_place() {
    // out: rows 1..1+k of each group's [k+2, n] block (strides [(k+2)n, n, 1]); the
    // rows around the slab keep their sentinel
    let (k, n, t) = (3usize, 2usize, 5usize);
    let src = [4i32, 0, 0, 2, 1, 3];
    let ends = [2i32, 2, 6];
    let (r, cpu, g) = (src.len(), Device::Cpu, ends.len());
    let a: Vec<f64> = (0..t * k).map(|i| (i as f64 * 0.29).cos()).collect();
    let b: Vec<f64> = (0..r * n).map(|i| (i as f64 * 0.41).sin()).collect();
    let mut big = vec![7.0f64; g * (k + 2) * n];
    let at = tensor(a.as_ptr() as usize, &[t, k], DType::F64, cpu);
    let bt = tensor(b.as_ptr() as usize, &[r, n], DType::F64, cpu);
    let slab = Tensor {
        layout: Layout {
            shape: vec![g, k, n],
            strides: vec![((k + 2) * n) as isize, n as isize, 1],
        },
        ..tensor(
            big.as_mut_ptr() as usize + n * 8,
            &[g, k, n],
            DType::F64,
            cpu,
        )
    };
    let (offs, src_t) = (index(&ends, cpu), index(&src, cpu));
    // SAFETY: live host arrays of the shapes described; `big` outlives the call.
    let o = unsafe {
        packed_gather_k(
            &mut Host,
            &at,
            &bt,
            &offs,
            &src_t,
            false,
            false,
            Some((vec![-1.0], slab)),
        )
    }
    .unwrap();
    assert_eq!(o, vec![-1.0], "out's own object comes back");
    let expect = reference((&a, k), (&b, n), &ends, &src, false);
    for gi in 0..g {
        for row in 0..k + 2 {
            for j in 0..n {
                let got = big[(gi * (k + 2) + row) * n + j];
                let want = match row {
                    0 => 7.0,
                    _ if row == k + 1 => 7.0,
                    _ => expect[(gi * k + row - 1) * n + j],
                };
                assert!(
                    (got - want).abs() <= 1e-12,
                    "group {gi} row {row}: {got} != {want}"
                );
            }
        }
    }
}

#[test]
fn gather_k_errors_name_the_argument() {
    let (a, b, src, ends) = ([0.0f64; 12], [0.0f64; 8], [0i32, 1, 2, 3], [4i32]);
    let cpu = Device::Cpu;
    let run = |a: &Tensor, b: &Tensor, offs: &IntTensor, src: &IntTensor| {
        // SAFETY: live host arrays; the errors come before anything is read.
        unsafe { packed_gather_k(&mut Host, a, b, offs, src, false, false, None) }
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let at = tensor(a.as_ptr() as usize, &[4, 3], DType::F64, cpu);
    let bt = tensor(b.as_ptr() as usize, &[4, 2], DType::F64, cpu);
    let (offs, src_t) = (index(&ends, cpu), index(&src, cpu));
    let b32 = Tensor {
        dtype: DType::F32,
        ..bt.clone()
    };
    assert_eq!(
        run(&at, &b32, &offs, &src_t),
        "b: expected dtype torch.float64 (the dtype of a), found torch.float32"
    );
    let gpu = |i: &IntTensor| IntTensor {
        device: Device::Cuda(0),
        ..i.clone()
    };
    assert!(run(&at, &bt, &offs, &gpu(&src_t))
        .starts_with("src: expected a tensor on cpu (the device of a)"));
    assert!(run(&at, &bt, &gpu(&offs), &src_t)
        .starts_with("offs: expected a tensor on cpu (the device of a)"));
    let b3 = tensor(b.as_ptr() as usize, &[3, 2], DType::F64, cpu);
    assert!(run(&at, &b3, &offs, &src_t).starts_with("b: expected shape [R=4, N]"));
    // offs values: the GroupedK rule over the R routed rows
    let past = [5i32];
    assert!(run(&at, &bt, &index(&past, cpu), &src_t).starts_with("offs:"));
    // index values: the row ops' host rule
    let bad = [0i32, 4, 1, 2];
    assert_eq!(
        run(&at, &bt, &offs, &index(&bad, cpu)),
        "src/inverse: routing index 4 at position 1 is out of range: expected a row in [0, 4)"
    );
}
