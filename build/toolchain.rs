//! Finding the toolchain: nvcc, the CUTLASS headers, and the CUDA toolkit's runtime
//! library, include directories and version.
//!
//! - nvcc: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then `PATH`.
//! - CUTLASS: `$CUTLASS_DIR/include`, else `<cutlass_library>/source/include` of the
//!   `nvidia-cutlass` pip package, found by running `$PYO3_PYTHON`,
//!   `$PYTHON_SYS_EXECUTABLE`, `python3` or `python`.

use crate::fail;
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const REBUILD_HINT: &str = "rebuild with nvcc on PATH (or NVCC / CUDA_HOME set, GROUPMM_CUDA=1) \
     and CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=<cutlass checkout>)";

/// nvcc and the CUTLASS include directory, or `None` (with a cargo warning) when either is
/// missing; with `forced` (GROUPMM_CUDA=1) a missing one is a build error.
pub fn find(forced: bool) -> Option<(PathBuf, PathBuf)> {
    let Some(nvcc) = find_nvcc() else {
        if forced {
            fail(&format!(
                "GROUPMM_CUDA=1 but nvcc was not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH); {REBUILD_HINT}"
            ));
        }
        println!("cargo:warning=groupmm: nvcc not found, building without CUDA ({REBUILD_HINT})");
        return None;
    };
    match find_cutlass() {
        Ok(cutlass) => Some((nvcc, cutlass)),
        Err(why) if forced => fail(&format!(
            "GROUPMM_CUDA=1 but the CUTLASS headers were not found: {why}; {REBUILD_HINT}"
        )),
        Err(why) => {
            println!(
                "cargo:warning=groupmm: CUTLASS headers not found ({why}), building without CUDA"
            );
            None
        }
    }
}

/// What the build needs to know about the CUDA toolkit and CUTLASS once nvcc is found.
pub struct Cuda {
    /// CUTLASS's include directory (a cache key ingredient).
    pub cutlass_inc: PathBuf,
    /// The directory holding `libcudart_static.a`.
    pub lib_dir: PathBuf,
    /// The toolkit's include directories (for the host compiler).
    pub include_dirs: Vec<PathBuf>,
    /// The release nvcc reports ("13.0").
    pub runtime: String,
    /// nvcc's whole `--version` text (a cache key ingredient).
    pub nvcc_version: String,
    /// "major.minor.patch" from `cutlass/version.h`.
    pub cutlass_version: String,
}

impl Cuda {
    pub fn probe(nvcc: &Path, cutlass_inc: &Path) -> Cuda {
        let dryrun = nvcc_dryrun(nvcc);
        let roots = cuda_roots(nvcc, &dryrun);
        let lib_dir = cuda_lib_dir(&roots).unwrap_or_else(|| {
            fail(&format!(
                "libcudart_static.a not found under {roots:?} (lib64, lib); set CUDA_HOME"
            ))
        });
        let include_dirs = cuda_include_dirs(&dryrun, &roots);
        let (runtime, nvcc_version) = nvcc_version(nvcc);
        Cuda {
            cutlass_inc: cutlass_inc.to_path_buf(),
            lib_dir,
            include_dirs,
            runtime,
            nvcc_version,
            cutlass_version: cutlass_version(cutlass_inc),
        }
    }
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
    let mut pythons: Vec<String> = ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"]
        .iter()
        .filter_map(|var| env::var(var).ok().filter(|p| !p.is_empty()))
        .collect();
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

/// The lines nvcc prints for `--dryrun` (stdout and stderr), empty if it cannot run.
fn nvcc_dryrun(nvcc: &Path) -> String {
    Command::new(nvcc)
        .args(["--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
        })
        .unwrap_or_default()
}

/// Candidate CUDA toolkit roots (where `include/` and `lib64` or `lib` live):
/// `$CUDA_HOME`, `$CUDA_PATH`, the root nvcc itself reports (`TOP=` of `--dryrun`; nvcc
/// may be a wrapper script), and the parent of nvcc's real `bin/`.
fn cuda_roots(nvcc: &Path, dryrun: &str) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|var| env::var_os(var).filter(|p| !p.is_empty()))
        .map(PathBuf::from)
        .collect();
    if let Some(top) = dryrun
        .lines()
        .find_map(|l| l.trim().strip_prefix("#$ TOP="))
    {
        roots.push(PathBuf::from(top.trim()));
    }
    let real = fs::canonicalize(nvcc).unwrap_or_else(|_| nvcc.to_path_buf());
    if let Some(root) = real.parent().and_then(Path::parent) {
        roots.push(root.to_path_buf());
    }
    roots
}

fn cuda_lib_dir(roots: &[PathBuf]) -> Option<PathBuf> {
    let subdirs = [
        "lib64",
        "lib",
        "targets/x86_64-linux/lib",
        "targets/sbsa-linux/lib",
    ];
    roots.iter().find_map(|root| {
        subdirs
            .iter()
            .map(|d| root.join(d))
            .find(|d| d.join("libcudart_static.a").is_file())
    })
}

/// Include directories of the CUDA toolkit, as nvcc itself reports them (`INCLUDES=` of
/// `--dryrun`), else `<root>/include` of the candidate roots.
fn cuda_include_dirs(dryrun: &str, roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(inc) = dryrun
        .lines()
        .find_map(|l| l.trim().strip_prefix("#$ INCLUDES="))
    {
        dirs.extend(
            inc.split_whitespace()
                .filter_map(|w| w.trim_matches('"').strip_prefix("-I"))
                .map(|d| PathBuf::from(d.trim_matches('"'))),
        );
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

/// The release nvcc reports ("13.0") and its whole `--version` text.
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
    let [major, minor, patch] = ["CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"].map(get);
    format!("{major}.{minor}.{patch}")
}
