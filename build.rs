//! Build script: compiles the CUDA kernels (cuda/*.cu) with nvcc when a CUDA toolkit and
//! the CUTLASS headers are found, and the cxx bridge (src/cuda.rs + cuda/bridge.cc).
//!
//! - `GROUPMM_CUDA=0|1` forces CUDA off/on (1 without nvcc or CUTLASS is a build error);
//!   unset, CUDA is on when both nvcc and CUTLASS are found.
//! - nvcc: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then `PATH`.
//! - CUTLASS: `$CUTLASS_DIR/include`, else `<cutlass_library>/source/include` of the
//!   `nvidia-cutlass` pip package, found by running `$PYO3_PYTHON`,
//!   `$PYTHON_SYS_EXECUTABLE`, `python3` or `python`.
//! - `GROUPMM_CUDA_ARCHS` (default `80;90a`): sm_90-only files compile for 90a only;
//!   the others for every listed arch.
//! - `GROUPMM_NVCC_FLAGS`: extra nvcc flags (e.g. `-Xptxas -v`), appended to every file.
//! - Objects are cached under `<target>/groupmm-cuda-cache/<hash>.o`, keyed on the
//!   source, every project header, the CUTLASS version, nvcc's version and the flags, so
//!   release, test and clippy builds share them.
//! - One nvcc invocation per .cu (never relocatable device code: ptxas would then ignore
//!   setmaxnreg and serialise wgmma); the build fails if nvcc warns C7504 or C7509.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

/// A CUDA translation unit and whether it is sm_90a-only.
const CUDA_SOURCES: &[(&str, bool)] = &[
    // Longest first: they start first when compiling in parallel.
    ("cuda/sm90_bf16_grouped.cu", true),
    ("cuda/sm90_f16_grouped.cu", true),
    ("cuda/sm90_bf16_grouped_128x128.cu", true),
    ("cuda/sm90_f16_grouped_128x128.cu", true),
    ("cuda/sm90_bf16_grouped_ping64x128.cu", true),
    ("cuda/sm90_f16_grouped_ping64x128.cu", true),
    ("cuda/sm80_bf16_grouped.cu", false),
    ("cuda/sm80_f16_grouped.cu", false),
    ("cuda/sm80_f32_f64_grouped.cu", false),
    ("cuda/dispatch.cu", false),
];

/// Project headers: part of every object's cache key.
const CUDA_HEADERS: &[&str] = &[
    "cuda/launch.h",
    "cuda/common.cuh",
    "cuda/args.cuh",
    "cuda/grouped_sm80.cuh",
    "cuda/grouped_sm90.cuh",
];

const ENV_VARS: &[&str] = &[
    "GROUPMM_CUDA",
    "GROUPMM_CUDA_ARCHS",
    "GROUPMM_NVCC_FLAGS",
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

const REBUILD_HINT: &str = "rebuild with nvcc on PATH (or NVCC / CUDA_HOME set, GROUPMM_CUDA=1) \
     and CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=<cutlass checkout>)";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(groupmm_cuda)");
    println!("cargo:rerun-if-changed=build.rs");
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
    let nvcc = match find_nvcc() {
        Some(p) => p,
        None if force == Some(true) => fail(&format!(
            "GROUPMM_CUDA=1 but nvcc was not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH); {REBUILD_HINT}"
        )),
        None => {
            println!("cargo:warning=groupmm: nvcc not found, building without CUDA ({REBUILD_HINT})");
            return;
        }
    };
    let cutlass = match find_cutlass() {
        Ok(p) => p,
        Err(why) if force == Some(true) => fail(&format!(
            "GROUPMM_CUDA=1 but the CUTLASS headers were not found: {why}; {REBUILD_HINT}"
        )),
        Err(why) => {
            println!(
                "cargo:warning=groupmm: CUTLASS headers not found ({why}), building without CUDA"
            );
            return;
        }
    };
    build_cuda(&nvcc, &cutlass);
}

fn fail(msg: &str) -> ! {
    eprintln!("error: groupmm build: {msg}");
    panic!("groupmm build: {msg}");
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Some(p)
        } else {
            which(&p.to_string_lossy())
        };
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env::var_os(var).filter(|p| !p.is_empty()) {
            let p = Path::new(&h).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    which("nvcc")
}

fn which(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Candidate CUDA toolkit roots (where `include/` and `lib64` or `lib` live):
/// `$CUDA_HOME`, `$CUDA_PATH`, the root nvcc itself reports (`TOP=` of `--dryrun`; nvcc
/// may be a wrapper script), and the parent of nvcc's real `bin/`.
fn cuda_roots(nvcc: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env::var_os(var).filter(|p| !p.is_empty()) {
            roots.push(PathBuf::from(h));
        }
    }
    if let Ok(out) = Command::new(nvcc)
        .args(["--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
        .output()
    {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some(top) = text.lines().find_map(|l| l.trim().strip_prefix("#$ TOP=")) {
            roots.push(PathBuf::from(top.trim()));
        }
    }
    let real = fs::canonicalize(nvcc).unwrap_or_else(|_| nvcc.to_path_buf());
    if let Some(root) = real.parent().and_then(Path::parent) {
        roots.push(root.to_path_buf());
    }
    roots
}

fn cuda_lib_dir(roots: &[PathBuf]) -> Option<PathBuf> {
    roots.iter().find_map(|root| {
        [
            "lib64",
            "lib",
            "targets/x86_64-linux/lib",
            "targets/sbsa-linux/lib",
        ]
        .iter()
        .map(|d| root.join(d))
        .find(|d| d.join("libcudart_static.a").is_file())
    })
}

fn find_cutlass() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("CUTLASS_DIR").filter(|p| !p.is_empty()) {
        let inc = Path::new(&dir).join("include");
        return if inc.join("cutlass/version.h").is_file() {
            Ok(inc)
        } else {
            Err(format!(
                "CUTLASS_DIR={} has no include/cutlass/version.h",
                inc.parent().unwrap().display()
            ))
        };
    }
    let mut pythons: Vec<String> = Vec::new();
    for var in ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        if let Ok(p) = env::var(var) {
            if !p.is_empty() {
                pythons.push(p);
            }
        }
    }
    pythons.push("python3".into());
    pythons.push("python".into());
    let script = "import os, cutlass_library; print(os.path.dirname(cutlass_library.__file__))";
    for py in &pythons {
        let Ok(out) = Command::new(py).args(["-c", script]).output() else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let inc = Path::new(&dir).join("source").join("include");
        if inc.join("cutlass/version.h").is_file() {
            return Ok(inc);
        }
    }
    Err(format!(
        "CUTLASS_DIR is unset and `import cutlass_library` failed with {}",
        pythons.join(", ")
    ))
}

fn cutlass_version(inc: &Path) -> String {
    let text = fs::read_to_string(inc.join("cutlass/version.h")).unwrap_or_default();
    let get = |name: &str| -> String {
        text.lines()
            .find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some("#define") && it.next() == Some(name))
                    .then(|| it.next().unwrap_or("?").to_string())
            })
            .unwrap_or_else(|| "?".into())
    };
    format!(
        "{}.{}.{}",
        get("CUTLASS_MAJOR"),
        get("CUTLASS_MINOR"),
        get("CUTLASS_PATCH")
    )
}

fn nvcc_version(nvcc: &Path) -> (String, String) {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run {} --version: {e}", nvcc.display())));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // "Cuda compilation tools, release 13.0, V13.0.88"
    let release = text
        .split("release ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or("unknown")
        .trim()
        .to_string();
    (release, text)
}

/// `-gencode` flags for one arch entry of GROUPMM_CUDA_ARCHS ("80", "86", "90a", ...).
fn gencode(arch: &str) -> String {
    format!("-gencode=arch=compute_{arch},code=sm_{arch}")
}

/// 128-bit FNV-1a (two 64-bit lanes with different offsets): a stable cache key.
struct Fnv([u64; 2]);
impl Fnv {
    fn new() -> Self {
        Fnv([0xcbf2_9ce4_8422_2325, 0x6c62_272e_07bb_0142])
    }
    fn add(&mut self, bytes: &[u8]) {
        for lane in &mut self.0 {
            for &b in bytes {
                *lane ^= u64::from(b);
                *lane = lane.wrapping_mul(0x0000_0100_0000_01b3);
            }
            // separator so that ("ab","c") != ("a","bc")
            *lane ^= bytes.len() as u64;
            *lane = lane.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.0[0], self.0[1])
    }
}

fn cache_dir(out_dir: &Path) -> PathBuf {
    let target = env::var_os("CARGO_TARGET_DIR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            out_dir
                .ancestors()
                .find(|a| a.file_name().is_some_and(|n| n == "target"))
                .map(Path::to_path_buf)
        })
        .unwrap_or_else(|| out_dir.to_path_buf());
    target.join("groupmm-cuda-cache")
}

struct Job {
    src: PathBuf,
    args: Vec<String>,
    obj: PathBuf,
}

fn build_cuda(nvcc: &Path, cutlass_inc: &Path) {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let archs_var = env::var("GROUPMM_CUDA_ARCHS").unwrap_or_else(|_| "80;90a".into());
    let archs: Vec<String> = archs_var
        .split([';', ',', ' '])
        .map(|s| s.trim().trim_start_matches("sm_").to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if archs.is_empty() {
        fail("GROUPMM_CUDA_ARCHS is empty");
    }
    for a in &archs {
        if !a.chars().all(|c| c.is_ascii_alphanumeric())
            || !a.starts_with(|c: char| c.is_ascii_digit())
        {
            fail(&format!(
                "GROUPMM_CUDA_ARCHS: bad entry {a:?} (expected e.g. 80;90a)"
            ));
        }
        let num: u32 = a
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse()
            .unwrap_or(0);
        if num < 80 {
            fail(&format!(
                "GROUPMM_CUDA_ARCHS: {a} is below sm_80, which groupmm needs"
            ));
        }
    }
    let has_sm90a = archs.iter().any(|a| a == "90a");
    let roots = cuda_roots(nvcc);
    let lib_dir = cuda_lib_dir(&roots).unwrap_or_else(|| {
        fail(&format!(
            "libcudart_static.a not found under {:?} (lib64, lib); set CUDA_HOME",
            roots
        ))
    });
    let (runtime, nvcc_text) = nvcc_version(nvcc);
    let cutlass_ver = cutlass_version(cutlass_inc);

    let mut common: Vec<String> = [
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        // CUTLASS then calls cuTensorMapEncodeTiled by name; cuda/dispatch.cu defines
        // it (hidden) on top of ONE cached cudaGetDriverEntryPointByVersion lookup, so
        // libcuda stays unlinked and the per-call string lookup CUTLASS would otherwise
        // do for every TMA descriptor is gone.
        "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
        "-Xcompiler=-fPIC",
        "-Xcudafe=--diag_suppress=177",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    common.push(format!("-I{}", cutlass_inc.display()));
    common.push(format!("-I{}", manifest.join("cuda").display()));
    if has_sm90a {
        common.push("-DGROUPMM_SM90_TMA=1".into());
    }
    let extra: Vec<String> = env::var("GROUPMM_NVCC_FLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();

    let mut key_base = Fnv::new();
    key_base.add(nvcc_text.as_bytes());
    key_base.add(cutlass_ver.as_bytes());
    key_base.add(cutlass_inc.to_string_lossy().as_bytes());
    for h in CUDA_HEADERS {
        let p = manifest.join(h);
        println!("cargo:rerun-if-changed={}", p.display());
        key_base.add(
            &fs::read(&p).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", p.display()))),
        );
    }
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("cuda/bridge.h").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("cuda/bridge.cc").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("src/cuda.rs").display()
    );

    let cache = cache_dir(&out_dir);
    fs::create_dir_all(&cache)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", cache.display())));

    let mut jobs = Vec::new();
    for (src, sm90_only) in CUDA_SOURCES {
        let path = manifest.join(src);
        println!("cargo:rerun-if-changed={}", path.display());
        if *sm90_only && !has_sm90a {
            continue;
        }
        let mut args = common.clone();
        if *sm90_only {
            args.push(gencode("90a"));
        } else {
            for a in &archs {
                args.push(gencode(a));
            }
            // PTX of the lowest listed non-"a" arch, for GPUs newer than any listed.
            if let Some(a) = archs.iter().find(|a| !a.ends_with('a')) {
                args.push(format!("-gencode=arch=compute_{a},code=compute_{a}"));
            }
        }
        args.extend(extra.iter().cloned());
        let mut key = Fnv(key_base.0);
        key.add(
            &fs::read(&path)
                .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display()))),
        );
        for a in &args {
            key.add(a.as_bytes());
        }
        let stem = Path::new(src)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .to_string();
        let obj = cache.join(format!("{stem}-{}.o", key.hex()));
        jobs.push(Job {
            src: path,
            args,
            obj,
        });
    }

    let njobs: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .max(1);
    let queue = Arc::new(Mutex::new(
        jobs.iter()
            .filter(|j| !j.obj.is_file())
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>(),
    ));
    let errors: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let warnings: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for _ in 0..njobs {
            let queue = Arc::clone(&queue);
            let errors = Arc::clone(&errors);
            let warnings = Arc::clone(&warnings);
            scope.spawn(move || loop {
                let Some(job) = queue.lock().unwrap().pop() else {
                    break;
                };
                if let Err(e) = compile_one(nvcc, job, &warnings) {
                    errors.lock().unwrap().push(e);
                }
            });
        }
    });
    for w in warnings.lock().unwrap().iter() {
        println!("cargo:warning={w}");
    }
    let errors = errors.lock().unwrap();
    if !errors.is_empty() {
        fail(&errors.join("\n\n"));
    }

    // Archive the objects into one static library.
    let mut lib = cc::Build::new();
    for j in &jobs {
        lib.object(&j.obj);
    }
    lib.cargo_metadata(false);
    lib.compile("groupmm_cuda_kernels");

    // The cxx bridge (host compiler, no CUDA headers needed). The bridge module is
    // `#[cfg(groupmm_cuda)]`, a cfg this script itself turns on (below); cxx_build
    // evaluates cfgs from CARGO_CFG_* variables, so set it for cxx_build here (the
    // compile threads above have finished: nothing else reads the environment now).
    env::set_var("CARGO_CFG_GROUPMM_CUDA", "");
    cxx_build::bridge("src/cuda.rs")
        .file("cuda/bridge.cc")
        .include(manifest.join("cuda"))
        .std("c++17")
        .compile("groupmm_cuda_bridge");

    // Link order: bridge (emitted by cxx_build above), kernels, static cudart, system libs.
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=groupmm_cuda_kernels");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-lib=dylib=rt");
    println!("cargo:rustc-link-lib=dylib=pthread");
    println!("cargo:rustc-link-lib=dylib=stdc++");

    println!("cargo:rustc-cfg=groupmm_cuda");
    println!("cargo:rustc-env=GROUPMM_CUDA_ARCHS={}", archs.join(";"));
    println!("cargo:rustc-env=GROUPMM_CUTLASS_VERSION={cutlass_ver}");
    println!("cargo:rustc-env=GROUPMM_CUDA_RUNTIME={runtime}");
}

fn compile_one(nvcc: &Path, job: &Job, warnings: &Mutex<Vec<String>>) -> Result<(), String> {
    let tmp = job.obj.with_extension(format!("tmp{}", std::process::id()));
    let start = std::time::Instant::now();
    let out = Command::new(nvcc)
        .args(&job.args)
        .arg("-c")
        .arg(&job.src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let cmdline = format!(
        "{} {} -c {}",
        nvcc.display(),
        job.args.join(" "),
        job.src.display()
    );
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!("nvcc failed ({}):\n{cmdline}\n{text}", out.status));
    }
    for code in ["C7504", "C7509"] {
        if text.contains(code) {
            let _ = fs::remove_file(&tmp);
            return Err(format!(
                "nvcc warned {code} (setmaxnreg ignored / wgmma serialised: relocatable device code or \
                 a register-limit problem) for {}; refusing to build a slow kernel:\n{text}",
                job.src.display()
            ));
        }
    }
    fs::rename(&tmp, &job.obj)
        .map_err(|e| format!("cannot move {} into the cache: {e}", tmp.display()))?;
    let mut w = warnings.lock().unwrap();
    w.push(format!(
        "groupmm: compiled {} in {:.0} s",
        job.src.file_name().unwrap().to_string_lossy(),
        start.elapsed().as_secs_f64()
    ));
    for line in text
        .lines()
        .filter(|l| l.contains("warning") || l.contains("ptxas info"))
    {
        w.push(format!(
            "{}: {line}",
            job.src.file_name().unwrap().to_string_lossy()
        ));
    }
    Ok(())
}
