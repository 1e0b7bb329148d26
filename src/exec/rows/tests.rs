//! The row ops through the engine on the host: their values against loops and finite
//! differences, the index rule, the argument messages, TopK's int64 output.

use super::*;
use crate::error::Error;
use crate::layout::Layout;

fn t(shape: &[usize], dtype: DType, data: &[f32]) -> (Vec<f32>, Tensor) {
    let v = data.to_vec();
    let tensor = Tensor {
        ptr: v.as_ptr() as usize,
        dtype,
        layout: Layout::contiguous(shape),
        device: Device::Cpu,
        id: 0,
        transposed: false,
    };
    (v, tensor)
}

/// Fresh float32 outputs filled with NaN (every element must be written).
struct Host;
impl Runtime for Host {
    type Out = Vec<f32>;
    fn alloc(&mut self, shape: &[usize], dtype: DType, device: Device) -> Result<Output<Vec<f32>>> {
        assert_eq!((dtype, device), (DType::F32, Device::Cpu));
        let (v, t) = t(shape, dtype, &vec![f32::NAN; shape.iter().product()]);
        Ok((v, t))
    }
}

fn index(data: &[i32], shape: &[usize]) -> (Vec<i32>, IntTensor) {
    let v = data.to_vec();
    let o = IntTensor {
        ptr: v.as_ptr() as usize,
        layout: Layout::contiguous(shape),
        device: Device::Cpu,
        id: 0,
        int32: true,
    };
    (v, o)
}

fn run(call: RowsCall<'_>) -> Vec<f32> {
    unsafe { super::run(&mut Host, call) }.unwrap()
}

#[test]
fn gather_sum_and_scatter_rows_against_loops() {
    // 2 tokens, k = 2, 4 rows of 3 columns.
    let (_y, y) = t(
        &[4, 3],
        DType::F32,
        &[1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
    );
    let (_i, inv) = index(&[2, 0, 1, 3], &[2, 2]);
    let (_w, w) = t(&[2, 2], DType::F32, &[0.5, 2.0, -1.0, 3.0]);
    let out = run(RowsCall::GatherSum {
        y: &y,
        inverse: &inv,
        weights: Some(&w),
    });
    // token 0: 0.5*row2 + 2*row0; token 1: -row1 + 3*row3
    assert_eq!(out, vec![5.5, 8.0, 10.5, 26.0, 28.0, 30.0]);

    let (_g, g) = t(&[2, 3], DType::F32, &[1., 2., 3., 4., 5., 6.]);
    let dy = run(RowsCall::ScatterRows {
        grad: &g,
        inverse: &inv,
        weights: Some(&w),
        rows: 4,
    });
    assert_eq!(
        dy,
        vec![2., 4., 6., -4., -5., -6., 0.5, 1., 1.5, 12., 15., 18.]
    );

    let dots = run(RowsCall::RowDots {
        grad: &g,
        y: &y,
        inverse: &inv,
        out_dtype: DType::F32,
    });
    assert_eq!(
        dots,
        vec![
            7. + 16. + 27.,
            1. + 4. + 9.,
            16. + 25. + 36.,
            40. + 55. + 72.
        ]
    );
}

/// An index outside `[0, rows)` is an error on the host, naming the index and its
/// position, for every op that reads one (never a silent zero row).
#[test]
fn routing_index_out_of_range_is_an_error() {
    let (_y, y) = t(&[4, 3], DType::F32, &[0.0; 12]);
    let (_g, g) = t(&[2, 3], DType::F32, &[0.0; 6]);
    for bad in [9, 4, -1] {
        let (_i, inv) = index(&[2, 0, 1, bad], &[2, 2]);
        let calls = [
            RowsCall::GatherSum {
                y: &y,
                inverse: &inv,
                weights: None,
            },
            RowsCall::ScatterRows {
                grad: &g,
                inverse: &inv,
                weights: None,
                rows: 4,
            },
            RowsCall::RowDots {
                grad: &g,
                y: &y,
                inverse: &inv,
                out_dtype: DType::F32,
            },
        ];
        for call in calls {
            let msg = match unsafe { super::run(&mut Host, call) } {
                Err(e) => e.to_string(),
                Ok(_) => panic!("index {bad} accepted"),
            };
            assert!(
                msg.contains(&format!("routing index {bad} at position 3")),
                "{msg}"
            );
            assert!(msg.contains("[0, 4)"), "{msg}");
        }
    }
}

#[test]
fn bad_dtypes_and_devices_name_the_argument() {
    let (_y, y) = t(&[4, 3], DType::F32, &[0.0; 12]);
    let (_i, inv) = index(&[0, 1, 2, 3], &[2, 2]);
    let (_w, w) = t(&[2, 2], DType::F64, &[0.0; 4]);
    let call = RowsCall::GatherSum {
        y: &y,
        inverse: &inv,
        weights: Some(&w),
    };
    let e = validate(&call).err().unwrap().to_string();
    assert_eq!(
        e,
        "weights: expected dtype torch.float32 (the dtype of y), found torch.float64"
    );
    let (_p, pre) = t(&[2, 6], DType::F64, &[0.0; 12]);
    let (_g, g) = t(&[2, 3], DType::F32, &[0.0; 6]);
    let call = RowsCall::SwigluBackward {
        grad: &g,
        pre: &pre,
    };
    let e = validate(&call).err().unwrap().to_string();
    assert_eq!(
        e,
        "pre: expected dtype torch.float32 (the dtype of grad), found torch.float64"
    );
    let mut on_gpu = inv.clone();
    on_gpu.device = Device::Cuda(0);
    let call = RowsCall::RowDots {
        grad: &g,
        y: &y,
        inverse: &on_gpu,
        out_dtype: DType::F32,
    };
    assert!(matches!(
        validate(&call).err().unwrap(),
        Error::Device(m) if m == "inverse: expected a tensor on cpu (the device of grad), found one on cuda:0"
    ));
    let call = RowsCall::Swiglu { pre: &g };
    let e = validate(&call).err().unwrap().to_string();
    assert!(e.starts_with("pre: expected an even last dimension"), "{e}");
}

/// TopK through the engine: its int64 output comes from `alloc_int64` (never `alloc`)
/// and every id is written; wide rows are refused on CUDA only, before anything runs.
#[test]
fn topk_through_the_engine() {
    struct Ids;
    impl Runtime for Ids {
        type Out = Vec<i64>;
        fn alloc(&mut self, _: &[usize], _: DType, _: Device) -> Result<Output<Vec<i64>>> {
            panic!("TopK's output is int64")
        }
        fn alloc_int64(&mut self, shape: &[usize], device: Device) -> Result<(Vec<i64>, usize)> {
            assert_eq!(device, Device::Cpu);
            let v = vec![-7i64; shape.iter().product()];
            let ptr = v.as_ptr() as usize;
            Ok((v, ptr))
        }
    }
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let rows = [
        [0.5, 2.0, -1.0, 2.0, nan], // NaN first, then the tie by column
        [-inf, -0.0, 0.0, inf, 1.0],
        [3.0, 2.0, 1.0, 0.0, -1.0],
    ];
    let (_s, scores) = t(&[3, 5], DType::F32, rows.as_flattened());
    let topk = |scores: &Tensor, k| unsafe { super::run(&mut Ids, RowsCall::TopK { scores, k }) };
    assert_eq!(topk(&scores, 3).unwrap(), vec![4, 1, 3, 3, 4, 1, 0, 1, 2]);
    let e = topk(&scores, 6).unwrap_err().to_string();
    assert!(e.starts_with("k: expected an integer in [1, 5]"), "{e}");

    let (_w, mut wide) = t(&[2, 1025], DType::F32, &[0.0; 2 * 1025]);
    assert_eq!(topk(&wide, 2).unwrap(), vec![0, 1, 0, 1]);
    wide.device = Device::Cuda(0);
    let e = validate(&RowsCall::TopK {
        scores: &wide,
        k: 2,
    })
    .err()
    .unwrap();
    assert!(matches!(e, Error::Shape(ref m)
        if m.starts_with("scores: expected at most 1024 columns on CUDA")));
}

#[test]
fn swiglu_and_its_backward_match_finite_differences() {
    let pre = [0.3f32, -1.2, 2.0, 0.7, 1.5, -0.4];
    let (_p, p) = t(&[1, 6], DType::F32, &pre);
    let act = run(RowsCall::Swiglu { pre: &p });
    let f = |v: &[f64]| -> Vec<f64> {
        (0..3)
            .map(|c| v[c] / (1.0 + (-v[c]).exp()) * v[3 + c])
            .collect()
    };
    let pre64: Vec<f64> = pre.iter().map(|&v| v as f64).collect();
    for (a, b) in act.iter().zip(f(&pre64)) {
        assert!((*a as f64 - b).abs() < 1e-6);
    }
    let grad = [1.0f32, -2.0, 0.5];
    let (_g, g) = t(&[1, 3], DType::F32, &grad);
    let d = run(RowsCall::SwigluBackward { grad: &g, pre: &p });
    for i in 0..6 {
        let (mut hi, mut lo) = (pre64.clone(), pre64.clone());
        hi[i] += 1e-6;
        lo[i] -= 1e-6;
        let fd: f64 = f(&hi)
            .iter()
            .zip(f(&lo))
            .zip(grad)
            .map(|((a, b), g)| (a - b) / 2e-6 * g as f64)
            .sum();
        assert!((d[i] as f64 - fd).abs() < 1e-4, "{i}: {} vs {fd}", d[i]);
    }
}
