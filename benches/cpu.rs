//! CPU benchmarks of groupmm on MoE-like shapes: the packed `[T, K] x [E, K, N]` form
//! and the list form, forward and forward + backward, in f32 and bf16, against a
//! simple loop of one `ndarray` matmul per expert (single `dot` per group, which is
//! `matrixmultiply` underneath, without groupmm's parallel tiling).
//!
//! Throughput is reported as elements/s where one element is one floating-point
//! operation: criterion's `Gelem/s` reads as GFLOP/s.
//!
//! Run: `GROUPMM_CUDA=0 cargo bench --bench cpu` (add `-- --quick` for a fast pass, or a
//! filter such as `-- e8_`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use groupmm::api::{grouped_mm, grouped_mm_backward, grouped_mm_list, grouped_mm_list_backward};
use groupmm::gradcheck::SplitMix64;
use groupmm::Element;
use half::bf16;
use ndarray::{aview1, s, Array2, Array3, ArrayView2, Axis};
use std::hint::black_box;
use std::time::Duration;

/// One MoE expert layer: T routed tokens of width K through E experts `[K, N]`.
struct Shape {
    name: &'static str,
    t: usize,
    k: usize,
    n: usize,
    /// Tokens per expert.
    counts: Vec<usize>,
}

impl Shape {
    fn balanced(name: &'static str, e: usize, t: usize, k: usize, n: usize) -> Self {
        let counts = (0..e).map(|i| t / e + usize::from(i < t % e)).collect();
        Shape {
            name,
            t,
            k,
            n,
            counts,
        }
    }

    /// Skewed routing: expert i gets a share proportional to 1/(i+1)² (Zipf-like), and
    /// every fourth expert gets nothing.
    fn skewed(name: &'static str, e: usize, t: usize, k: usize, n: usize) -> Self {
        let w: Vec<f64> = (0..e)
            .map(|i| {
                if i % 4 == 3 {
                    0.0
                } else {
                    1.0 / ((i + 1) * (i + 1)) as f64
                }
            })
            .collect();
        let total: f64 = w.iter().sum();
        let mut counts: Vec<usize> = w.iter().map(|x| (x / total * t as f64) as usize).collect();
        let short = t - counts.iter().sum::<usize>();
        counts[0] += short;
        Shape {
            name,
            t,
            k,
            n,
            counts,
        }
    }

    fn offs(&self) -> Vec<i32> {
        let mut end = 0;
        self.counts
            .iter()
            .map(|c| {
                end += c;
                end as i32
            })
            .collect()
    }

    /// Floating-point operations of the forward: 2·T·K·N.
    fn flops(&self) -> u64 {
        2 * (self.t * self.k * self.n) as u64
    }

    fn experts(&self) -> usize {
        self.counts.len()
    }
}

fn shapes() -> Vec<Shape> {
    vec![
        Shape::balanced("e8_t2048_k512_n512", 8, 2048, 512, 512),
        Shape::balanced("e64_t4096_k256_n256", 64, 4096, 256, 256),
        Shape::skewed("skew_e16_t2048_k512_n512", 16, 2048, 512, 512),
    ]
}

struct Data<T> {
    x: Array2<T>,
    w: Array3<T>,
    dy: Array2<T>,
    offs: Vec<i32>,
}

fn data<T: Element>(sh: &Shape) -> Data<T> {
    let mut r = SplitMix64::new(7);
    let e = sh.experts();
    Data {
        x: Array2::from_shape_simple_fn((sh.t, sh.k), || T::from_f64(r.uniform())),
        w: Array3::from_shape_simple_fn((e, sh.k, sh.n), || T::from_f64(r.uniform() * 0.05)),
        dy: Array2::from_shape_simple_fn((sh.t, sh.n), || T::from_f64(r.uniform())),
        offs: sh.offs(),
    }
}

/// Per-expert views of the packed data, for the list form.
struct Split<'a, T> {
    xs: Vec<ArrayView2<'a, T>>,
    ws: Vec<ArrayView2<'a, T>>,
    dys: Vec<ArrayView2<'a, T>>,
}

fn split<T>(d: &Data<T>) -> Split<'_, T> {
    let mut sp = Split {
        xs: vec![],
        ws: vec![],
        dys: vec![],
    };
    let mut start = 0;
    for (g, &end) in d.offs.iter().enumerate() {
        let end = end as usize;
        sp.xs.push(d.x.slice(s![start..end, ..]));
        sp.dys.push(d.dy.slice(s![start..end, ..]));
        sp.ws.push(d.w.index_axis(Axis(0), g));
        start = end;
    }
    sp
}

/// The baseline: a sequential loop of one `ndarray` `dot` per expert.
struct Baseline<T> {
    fwd: fn(&Split<T>) -> Vec<Array2<T>>,
    fwd_bwd: fn(&Split<T>) -> Vec<Array2<T>>,
}

fn loop_fwd<T: ndarray::LinalgScalar>(sp: &Split<T>) -> Vec<Array2<T>> {
    sp.xs.iter().zip(&sp.ws).map(|(x, w)| x.dot(w)).collect()
}

fn loop_fwd_bwd<T: ndarray::LinalgScalar>(sp: &Split<T>) -> Vec<Array2<T>> {
    let mut out = Vec::with_capacity(3 * sp.xs.len());
    for ((x, w), dy) in sp.xs.iter().zip(&sp.ws).zip(&sp.dys) {
        out.push(x.dot(w)); // y
        out.push(dy.dot(&w.t())); // dX
        out.push(x.t().dot(dy)); // dW
    }
    out
}

fn bench_dtype<T: Element>(c: &mut Criterion, dtype: &str, baseline: Option<Baseline<T>>) {
    for sh in shapes() {
        let d = data::<T>(&sh);
        let offs = aview1(&d.offs);
        let sp = split(&d);
        let (xs, ws, dys) = (&sp.xs, &sp.ws, &sp.dys);
        let mut grp = c.benchmark_group(format!("{}/{dtype}", sh.name));
        grp.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));

        grp.throughput(Throughput::Elements(sh.flops()));
        grp.bench_function(BenchmarkId::new("packed_2d_3d", "fwd"), |b| {
            b.iter(|| black_box(grouped_mm(d.x.view(), d.w.view(), Some(offs)).unwrap()))
        });
        grp.bench_function(BenchmarkId::new("list", "fwd"), |b| {
            b.iter(|| black_box(grouped_mm_list(xs, ws).unwrap()))
        });
        if let Some(base) = &baseline {
            grp.bench_function(BenchmarkId::new("loop_ndarray_dot", "fwd"), |b| {
                b.iter(|| black_box((base.fwd)(&sp)))
            });
        }

        // forward + backward (y, dX and dW): 3 × the forward's flops
        grp.throughput(Throughput::Elements(3 * sh.flops()));
        grp.bench_function(BenchmarkId::new("packed_2d_3d", "fwd+bwd"), |b| {
            b.iter(|| {
                let y = grouped_mm(d.x.view(), d.w.view(), Some(offs)).unwrap();
                let g = grouped_mm_backward(
                    d.dy.view(),
                    d.x.view(),
                    d.w.view(),
                    Some(offs),
                    true,
                    true,
                )
                .unwrap();
                black_box((y, g))
            })
        });
        grp.bench_function(BenchmarkId::new("list", "fwd+bwd"), |b| {
            b.iter(|| {
                let y = grouped_mm_list(xs, ws).unwrap();
                let g = grouped_mm_list_backward(dys, xs, ws, true, true).unwrap();
                black_box((y, g))
            })
        });
        if let Some(base) = &baseline {
            grp.bench_function(BenchmarkId::new("loop_ndarray_dot", "fwd+bwd"), |b| {
                b.iter(|| black_box((base.fwd_bwd)(&sp)))
            });
        }
        grp.finish();
    }
}

fn f32_benches(c: &mut Criterion) {
    let base = Baseline {
        fwd: loop_fwd::<f32>,
        fwd_bwd: loop_fwd_bwd::<f32>,
    };
    bench_dtype::<f32>(c, "f32", Some(base));
}

/// bf16 has no `LinalgScalar`, so no ndarray baseline: groupmm only.
fn bf16_benches(c: &mut Criterion) {
    bench_dtype::<bf16>(c, "bf16", None);
}

criterion_group!(benches, f32_benches, bf16_benches);
criterion_main!(benches);
