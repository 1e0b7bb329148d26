//! Build script: compiles the CUDA part (`cuda/`) when a CUDA toolkit and the CUTLASS
//! headers are found, and the cxx bridge (`src/exec/ffi.rs` + `cuda/host/bridge.cc`).
//!
//! - `GROUPMM_CUDA=0|1` forces CUDA off/on (1 without nvcc or CUTLASS is a build error);
//!   unset, CUDA is on when both nvcc and CUTLASS are found.
//! - nvcc: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then `PATH`.
//! - CUTLASS: `$CUTLASS_DIR/include`, else `<cutlass_library>/source/include` of the
//!   `nvidia-cutlass` pip package, found by running `$PYO3_PYTHON`,
//!   `$PYTHON_SYS_EXECUTABLE`, `python3` or `python`.
//! - `GROUPMM_CUDA_ARCHS` (default `80;90a`): files named `sm90_*` compile for 90a only,
//!   the others for every listed arch.
//! - `GROUPMM_NVCC_FLAGS`: extra nvcc flags (e.g. `-Xptxas -v`), appended to every file.
//!
//! Lists are written once, as files: nvcc compiles every `cuda/kernels/*.cu` and
//! `cuda/device/*.cu`, the host compiler every `cuda/host/*.cc` (but the bridge's) and
//! `cuda/heuristics/*.cc`. The kernel registry (`cuda/host/registry.cc`) learns which
//! kernel files were compiled from a generated list,
//! `$OUT_DIR/cuda-gen/groupmm_kernel_files.inc` (one `GMM_KERNEL_FILE(<stem>)` line each).
//!
//! - One nvcc invocation per .cu (never relocatable device code: ptxas would then ignore
//!   setmaxnreg and serialise wgmma); the build fails if nvcc warns C7504 or C7509.
//! - nvcc objects are cached under `<target>/groupmm-cuda-cache/<stem>-<hash>.o`, keyed on
//!   the source, the project headers it includes (transitively), the CUTLASS version,
//!   nvcc's version and the flags, so release, test and clippy builds share them.
//! - The nvcc and host objects go into ONE archive (`groupmm_cuda`), so the linker
//!   resolves references between them in both directions; the bridge's archive links
//!   before it, the static CUDA runtime after (libcuda is never linked).
//! - `<target>/groupmm-cuda-build.env` records the nvcc command line and the archive of
//!   the last build; `scripts/cuda-harness.sh` builds the C++ harness through it.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

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

/// The project headers `file` includes (`#include "..."`, resolved against `cuda/` and
/// the file's own directory), transitively; system and CUTLASS headers are not followed
/// (the CUTLASS version and path are part of every key).
fn project_includes(file: &Path, cuda_dir: &Path, seen: &mut Vec<PathBuf>) {
    let text = fs::read_to_string(file)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", file.display())));
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix("#include") else {
            continue;
        };
        let Some(name) = rest
            .trim()
            .strip_prefix('"')
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let here = file.parent().unwrap().join(name);
        let found = [cuda_dir.join(name), here]
            .into_iter()
            .find(|p| p.is_file());
        if let Some(p) = found {
            let p = fs::canonicalize(&p).unwrap_or(p);
            if !seen.contains(&p) {
                seen.push(p.clone());
                project_includes(&p, cuda_dir, seen);
            }
        }
    }
}

/// Include directories of the CUDA toolkit, as nvcc itself reports them (`INCLUDES=` of
/// `--dryrun`), else `<root>/include` of the candidate roots.
fn cuda_include_dirs(nvcc: &Path, roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(out) = Command::new(nvcc)
        .args(["--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
        .output()
    {
        let text = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        if let Some(inc) = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("#$ INCLUDES="))
        {
            dirs.extend(
                inc.split_whitespace()
                    .filter_map(|w| w.trim_matches('"').strip_prefix("-I"))
                    .map(|d| PathBuf::from(d.trim_matches('"'))),
            );
        }
    }
    dirs.extend(roots.iter().map(|r| r.join("include")));
    dirs.retain(|d| d.join("cuda_runtime_api.h").is_file());
    if dirs.is_empty() {
        fail(&format!(
            "cuda_runtime_api.h not found (nvcc --dryrun INCLUDES, {roots:?}/include); set CUDA_HOME"
        ));
    }
    dirs
}

/// A word for a shell script (single-quoted).
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn build_cuda(nvcc: &Path, cutlass_inc: &Path) {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cuda_dir = manifest.join("cuda");
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
    let cuda_inc = cuda_include_dirs(nvcc, &roots);
    let (runtime, nvcc_text) = nvcc_version(nvcc);
    let cutlass_ver = cutlass_version(cutlass_inc);

    // Any change under cuda/ (a new kernel file too) reruns this script; unchanged nvcc
    // objects come from the cache.
    println!("cargo:rerun-if-changed={}", cuda_dir.display());

    let mut common: Vec<String> = [
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        // CUTLASS then calls cuTensorMapEncodeTiled by name; cuda/host/driver_shim.cc
        // defines it (hidden) on top of ONE cached cudaGetDriverEntryPointByVersion lookup,
        // so libcuda stays unlinked and the per-call string lookup CUTLASS would otherwise
        // do for every TMA descriptor is gone.
        "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
        "-Xcompiler=-fPIC",
        "-Xcudafe=--diag_suppress=177",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    common.push(format!("-I{}", cutlass_inc.display()));
    common.push(format!("-I{}", cuda_dir.display()));
    if has_sm90a {
        common.push("-DGROUPMM_SM90_TMA=1".into());
    }
    let extra: Vec<String> = env::var("GROUPMM_NVCC_FLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut all_archs: Vec<String> = archs.iter().map(|a| gencode(a)).collect();
    // PTX of the lowest listed non-"a" arch, for GPUs newer than any listed.
    if let Some(a) = archs.iter().find(|a| !a.ends_with('a')) {
        all_archs.push(format!("-gencode=arch=compute_{a},code=compute_{a}"));
    }

    let mut key_base = Fnv::new();
    key_base.add(nvcc_text.as_bytes());
    key_base.add(cutlass_ver.as_bytes());
    key_base.add(cutlass_inc.to_string_lossy().as_bytes());

    let cache = cache_dir(&out_dir);
    fs::create_dir_all(&cache)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", cache.display())));

    // nvcc sources: sm90 kernels first (the longest compiles start first).
    let mut sources = files_in(&cuda_dir.join("kernels"), ".cu");
    sources.sort_by_key(|p| !stem(p).starts_with("sm90_"));
    sources.extend(files_in(&cuda_dir.join("device"), ".cu"));
    let mut jobs = Vec::new();
    let mut kernel_files = Vec::new();
    for path in sources {
        let name = stem(&path);
        let sm90_only = name.starts_with("sm90_");
        if sm90_only && !has_sm90a {
            continue;
        }
        if path.parent() == Some(&cuda_dir.join("kernels")) {
            kernel_files.push(name.clone());
        }
        let mut args = common.clone();
        if sm90_only {
            args.push(gencode("90a"));
        } else {
            args.extend(all_archs.iter().cloned());
        }
        args.extend(extra.iter().cloned());
        let mut key = Fnv(key_base.0);
        key.add(
            &fs::read(&path)
                .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display()))),
        );
        let mut headers = Vec::new();
        project_includes(&path, &cuda_dir, &mut headers);
        headers.sort();
        for h in &headers {
            key.add(h.to_string_lossy().as_bytes());
            key.add(&fs::read(h).unwrap_or_default());
        }
        for a in &args {
            key.add(a.as_bytes());
        }
        let obj = cache.join(format!("{name}-{}.o", key.hex()));
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

    // The kernel files this build holds, for the registry.
    let gen_dir = out_dir.join("cuda-gen");
    fs::create_dir_all(&gen_dir)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", gen_dir.display())));
    let mut list = String::from(
        "// Generated by build.rs: the compiled cuda/kernels/*.cu files (see kernels/registry.h).\n",
    );
    for k in &kernel_files {
        list.push_str(&format!("GMM_KERNEL_FILE({k})\n"));
    }
    fs::write(gen_dir.join("groupmm_kernel_files.inc"), list)
        .unwrap_or_else(|e| fail(&format!("cannot write the kernel list: {e}")));

    // The cxx bridge: generates groupmm/src/exec/ffi.rs.h (which the host code includes)
    // now, compiles its glue below. The bridge's extern block is `#[cfg(groupmm_cuda)]`, a
    // cfg this script itself turns on (below); cxx_build evaluates cfgs from CARGO_CFG_*
    // variables, so set it for cxx_build here (the compile threads above have finished:
    // nothing else reads the environment now).
    env::set_var("CARGO_CFG_GROUPMM_CUDA", "");
    let mut bridge = cxx_build::bridge("src/exec/ffi.rs");
    let cxx_inc = out_dir.join("cxxbridge").join("include");

    // Host code and nvcc objects: one archive.
    let mut lib = cc::Build::new();
    lib.cpp(true)
        .std("c++17")
        .include(&cuda_dir)
        .include(&cxx_inc)
        .include(&gen_dir)
        .includes(&cuda_inc)
        .cargo_metadata(false);
    let mut host = files_in(&cuda_dir.join("host"), ".cc");
    host.retain(|p| stem(p) != "bridge");
    host.extend(files_in(&cuda_dir.join("heuristics"), ".cc"));
    lib.files(&host);
    for j in &jobs {
        lib.object(&j.obj);
    }
    lib.compile("groupmm_cuda");

    bridge
        .file(cuda_dir.join("host/bridge.cc"))
        .include(&cuda_dir)
        .includes(&cuda_inc)
        .std("c++17")
        .compile("groupmm_cuda_bridge");

    // Link order: the bridge (emitted by its compile above), the CUDA archive, the static
    // CUDA runtime, system libraries.
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=groupmm_cuda");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-lib=dylib=rt");
    println!("cargo:rustc-link-lib=dylib=pthread");
    println!("cargo:rustc-link-lib=dylib=stdc++");

    // What the C++ harness needs to build exactly as this build did.
    let mut flags = common.clone();
    flags.extend(all_archs.iter().cloned());
    flags.extend(extra.iter().cloned());
    flags.push(format!("-I{}", cxx_inc.display()));
    let env_file = cache.parent().unwrap().join("groupmm-cuda-build.env");
    let words = |v: &[String]| v.iter().map(|w| sh_quote(w)).collect::<Vec<_>>().join(" ");
    let text = format!(
        "# Written by groupmm's build.rs: the nvcc command line and the archive of the last\n\
         # CUDA build (sourced by scripts/cuda-harness.sh).\n\
         GROUPMM_NVCC={}\nGROUPMM_NVCC_FLAGS=({})\nGROUPMM_CUDA_ARCHIVE={}\nGROUPMM_CUDA_LIB_DIR={}\n",
        sh_quote(&nvcc.to_string_lossy()),
        words(&flags),
        sh_quote(&out_dir.join("libgroupmm_cuda.a").to_string_lossy()),
        sh_quote(&lib_dir.to_string_lossy()),
    );
    fs::write(&env_file, text)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", env_file.display())));

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
