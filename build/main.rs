//! Build script: compiles the CUDA part (`cuda/`) when a CUDA toolkit and the CUTLASS
//! headers are found, and the cxx bridge (`src/exec/ffi.rs` + `cuda/host/bridge.cc`).
//!
//! - `GROUPMM_CUDA=0|1` forces CUDA off/on (1 without nvcc or CUTLASS is a build error);
//!   unset, CUDA is on when both nvcc and CUTLASS are found (`toolchain.rs`).
//! - `GROUPMM_CUDA_ARCHS` (default `80;90a`): files named `sm90_*` compile for 90a only,
//!   the others for every listed arch; `GROUPMM_NVCC_FLAGS`: extra nvcc flags (e.g.
//!   `-Xptxas -v`), appended to every file (`flags.rs`);
//! - `GROUPMM_DEV_KNOBS=1`: a development build for kernel tuning and its tests: the
//!   `GROUPMM_SM90_*` environment overrides of `cuda/heuristics/` are read and the kernel
//!   configurations only they reach (`cuda/kernels/*_dev.cu`) are compiled. A product build
//!   (unset or 0) has neither; `groupmm.build_info()["dev_knobs"]` says which.
//!
//! Lists are written once, as files: nvcc compiles every `cuda/kernels/*.cu` and
//! `cuda/device/*.cu`, one invocation each, through a cache (`compile.rs`); the host
//! compiler every `cuda/host/*.cc` (but the bridge's) and `cuda/heuristics/*.cc`; all of
//! it goes into one archive, linked with the static CUDA runtime (`link.rs`), which also
//! writes the generated kernel list for the registry and the env record for
//! `scripts/cuda-harness.sh`.

mod compile;
mod flags;
mod link;
mod toolchain;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const ENV_VARS: &[&str] = &[
    "GROUPMM_CUDA",
    "GROUPMM_CUDA_ARCHS",
    "GROUPMM_NVCC_FLAGS",
    "GROUPMM_DEV_KNOBS",
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUTLASS_DIR",
    "PYO3_PYTHON",
    "PYTHON_SYS_EXECUTABLE",
    "NUM_JOBS",
    "CARGO_TARGET_DIR",
    "PYTHONPATH",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(groupmm_cuda)");
    println!("cargo::rustc-check-cfg=cfg(groupmm_dev_knobs)");
    println!("cargo:rerun-if-changed=build");
    for v in ENV_VARS {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let force = match env::var("GROUPMM_CUDA").ok().as_deref().map(str::trim) {
        Some("0") => Some(false),
        Some("1") => Some(true),
        Some("") | None => None,
        Some(other) => fail(&format!("GROUPMM_CUDA must be 0 or 1, found {other:?}")),
    };
    if force == Some(false) {
        return;
    }
    if let Some((nvcc, cutlass)) = toolchain::find(force == Some(true)) {
        build_cuda(&nvcc, &cutlass);
    }
}

/// The CUDA build, in order: flags, toolchain details, cached nvcc compiles, the kernel
/// list, one archive with the host code and the bridge, link lines, the harness's record.
fn build_cuda(nvcc: &Path, cutlass_inc: &Path) {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cuda_dir = manifest.join("cuda");
    let archs = flags::archs_from_env();
    let cuda = toolchain::Cuda::probe(nvcc, cutlass_inc);
    let flags = flags::Flags::new(&archs, cutlass_inc, &cuda_dir, dev_knobs());

    // Any change under cuda/ (a new kernel file too) reruns this script; unchanged nvcc
    // objects come from the cache.
    println!("cargo:rerun-if-changed={}", cuda_dir.display());
    let cache = compile::cache_dir(&out_dir);
    let jobs = compile::jobs(&cuda_dir, &flags, &cuda, &cache);
    compile::run_missing(nvcc, &jobs);

    let gen_dir = link::write_kernel_list(&out_dir, &cuda_dir, &jobs);
    let cxx_inc = link::archive(&cuda_dir, &out_dir, &gen_dir, &cuda, &jobs, flags.dev_knobs);
    link::emit_link_lines(&out_dir, &cuda.lib_dir);
    link::write_env_record(&cache, nvcc, &flags, &cxx_inc, &out_dir, &cuda.lib_dir);

    println!("cargo:rustc-cfg=groupmm_cuda");
    if flags.dev_knobs {
        println!("cargo:rustc-cfg=groupmm_dev_knobs");
    }
    println!("cargo:rustc-env=GROUPMM_CUDA_ARCHS={}", archs.join(";"));
    println!(
        "cargo:rustc-env=GROUPMM_CUTLASS_VERSION={}",
        cuda.cutlass_version
    );
    println!("cargo:rustc-env=GROUPMM_CUDA_RUNTIME={}", cuda.runtime);
}

/// `GROUPMM_DEV_KNOBS`: 1 for a development build (module docs), unset or 0 for a product one.
fn dev_knobs() -> bool {
    match env::var("GROUPMM_DEV_KNOBS").ok().as_deref().map(str::trim) {
        Some("1") => true,
        Some("0") | Some("") | None => false,
        Some(other) => fail(&format!(
            "GROUPMM_DEV_KNOBS must be 0 or 1, found {other:?}"
        )),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: groupmm build: {msg}");
    panic!("groupmm build: {msg}");
}

/// The files directly under `dir` whose names end with `ext`, sorted.
fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", dir.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(ext))
        .collect();
    v.sort();
    v
}

fn stem(p: &Path) -> String {
    p.file_stem().unwrap().to_string_lossy().to_string()
}
