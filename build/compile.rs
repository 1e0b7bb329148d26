//! nvcc's compile jobs and their cache.
//!
//! - One nvcc invocation per .cu (never relocatable device code: ptxas would then ignore
//!   setmaxnreg and serialise wgmma); the build fails if nvcc warns C7504 or C7509.
//! - nvcc objects are cached under `<target>/groupmm-cuda-cache/<stem>-<hash>.o`, keyed on
//!   the source, the project headers it includes (transitively), the CUTLASS version and
//!   include path, nvcc's version and the flags, so release, test and clippy builds share
//!   them. Only missing objects are compiled, `NUM_JOBS` (default 2) at a time.

use crate::flags::Flags;
use crate::toolchain::Cuda;
use crate::{fail, files_in, stem};
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// One nvcc compile: `nvcc <args> -c <src> -o <obj>`, `obj` named by the cache key.
pub struct Job {
    pub src: PathBuf,
    pub args: Vec<String>,
    pub obj: PathBuf,
}

/// `<target>/groupmm-cuda-cache` (created), where `<target>` is `CARGO_TARGET_DIR`, else
/// the `target` directory above `OUT_DIR`.
pub fn cache_dir(out_dir: &Path) -> PathBuf {
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
    let cache = target.join("groupmm-cuda-cache");
    fs::create_dir_all(&cache)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", cache.display())));
    cache
}

/// The jobs for every `cuda/kernels/*.cu` (sm90 files first: the longest compiles start
/// first; skipped without 90a; `*_dev.cu` only in a development build) and every
/// `cuda/device/*.cu`, each with its cache path.
pub fn jobs(cuda_dir: &Path, flags: &Flags, cuda: &Cuda, cache: &Path) -> Vec<Job> {
    let mut key_base = Fnv::new();
    key_base.add(cuda.nvcc_version.as_bytes());
    key_base.add(cuda.cutlass_version.as_bytes());
    key_base.add(cuda.cutlass_inc.to_string_lossy().as_bytes());

    let mut sources = files_in(&cuda_dir.join("kernels"), ".cu");
    sources.sort_by_key(|p| !stem(p).starts_with("sm90_"));
    sources.extend(files_in(&cuda_dir.join("device"), ".cu"));
    let mut jobs = Vec::new();
    for src in sources {
        let name = stem(&src);
        let sm90_only = name.starts_with("sm90_");
        if (sm90_only && !flags.sm90a) || (name.ends_with("_dev") && !flags.dev_knobs) {
            continue;
        }
        let args = flags.for_file(sm90_only);
        let mut key = Fnv(key_base.0);
        key.add(&read(&src));
        let mut headers = Vec::new();
        project_includes(&src, cuda_dir, &mut headers);
        headers.sort();
        for h in &headers {
            key.add(h.to_string_lossy().as_bytes());
            key.add(&fs::read(h).unwrap_or_default());
        }
        for a in &args {
            key.add(a.as_bytes());
        }
        let obj = cache.join(format!("{name}-{}.o", key.hex()));
        jobs.push(Job { src, args, obj });
    }
    jobs
}

/// Compiles the jobs whose object is not in the cache, `NUM_JOBS` (default 2) at a time
/// in list order; reports each compile as a cargo warning; fails on any error.
pub fn run_missing(nvcc: &Path, jobs: &[Job]) {
    let todo: Vec<&Job> = jobs.iter().filter(|j| !j.obj.is_file()).collect();
    let threads: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .max(1);
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while let Some(job) = todo.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let result = compile_one(nvcc, job);
                    results.lock().unwrap().push(result);
                }
            });
        }
    });
    let mut errors = Vec::new();
    for result in results.into_inner().unwrap() {
        match result {
            Ok(warnings) => warnings.iter().for_each(|w| println!("cargo:warning={w}")),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        fail(&errors.join("\n\n"));
    }
}

/// Compiles one job into a temporary file, then moves it into the cache; returns the
/// lines to report (the time taken, nvcc's warnings and ptxas info).
fn compile_one(nvcc: &Path, job: &Job) -> Result<Vec<String>, String> {
    let file = job.src.file_name().unwrap().to_string_lossy();
    let tmp = job.obj.with_extension(format!("tmp{}", std::process::id()));
    let start = Instant::now();
    let out = Command::new(nvcc)
        .args(&job.args)
        .arg("-c")
        .arg(&job.src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        let cmdline = format!(
            "{} {} -c {}",
            nvcc.display(),
            job.args.join(" "),
            job.src.display()
        );
        return Err(format!("nvcc failed ({}):\n{cmdline}\n{text}", out.status));
    }
    if let Some(code) = ["C7504", "C7509"].into_iter().find(|c| text.contains(c)) {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "nvcc warned {code} (setmaxnreg ignored / wgmma serialised: relocatable device code or \
             a register-limit problem) for {}; refusing to build a slow kernel:\n{text}",
            job.src.display()
        ));
    }
    fs::rename(&tmp, &job.obj)
        .map_err(|e| format!("cannot move {} into the cache: {e}", tmp.display()))?;
    let mut lines = vec![format!(
        "groupmm: compiled {file} in {:.0} s",
        start.elapsed().as_secs_f64()
    )];
    lines.extend(
        text.lines()
            .filter(|l| l.contains("warning") || l.contains("ptxas info"))
            .map(|l| format!("{file}: {l}")),
    );
    Ok(lines)
}

fn read(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())))
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

/// 128-bit FNV-1a (two 64-bit lanes with different offsets): a stable cache key. Hand
/// written because the cache's file names are these digests: a hash crate would rename
/// (and so recompile) every cached object.
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
