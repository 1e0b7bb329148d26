//! nvcc's flags: the arch list (`GROUPMM_CUDA_ARCHS`, default `80;90a`), the flags every
//! file shares, and the extra ones of `GROUPMM_NVCC_FLAGS`.

use crate::fail;
use std::env;
use std::path::Path;

/// The entries of `GROUPMM_CUDA_ARCHS` ("80", "86", "90a", ...), checked: sm_80 or newer.
pub fn archs_from_env() -> Vec<String> {
    let var = env::var("GROUPMM_CUDA_ARCHS").unwrap_or_else(|_| "80;90a".into());
    let archs: Vec<String> = var
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
    archs
}

pub struct Flags {
    /// Whether 90a is listed (files named `sm90_*` compile only then, for 90a only).
    pub sm90a: bool,
    /// Every file's flags: optimisation, defines, the CUTLASS and `cuda/` include paths.
    pub common: Vec<String>,
    /// `-gencode` for every listed arch, plus PTX for GPUs newer than any listed.
    pub all_archs: Vec<String>,
    /// `GROUPMM_NVCC_FLAGS`, appended to every file's flags.
    pub extra: Vec<String>,
    /// A development build (`GROUPMM_DEV_KNOBS=1`, main.rs): the `*_dev.cu` kernel files
    /// are compiled too. The nvcc flags stay those of a product build, so the two share
    /// every other cached object; only the host code reads the define (link.rs).
    pub dev_knobs: bool,
}

impl Flags {
    pub fn new(archs: &[String], cutlass_inc: &Path, cuda_dir: &Path, dev_knobs: bool) -> Flags {
        let sm90a = archs.iter().any(|a| a == "90a");
        let mut common: Vec<String> = [
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-DNDEBUG",
            // CUTLASS then calls cuTensorMapEncodeTiled by name; cuda/host/driver_shim.cc
            // defines it (hidden) on top of ONE cached cudaGetDriverEntryPointByVersion
            // lookup, so libcuda stays unlinked and the per-call string lookup CUTLASS
            // would otherwise do for every TMA descriptor is gone.
            "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
            "-Xcompiler=-fPIC",
            "-Xcudafe=--diag_suppress=177",
        ]
        .map(String::from)
        .to_vec();
        common.push(format!("-I{}", cutlass_inc.display()));
        common.push(format!("-I{}", cuda_dir.display()));
        if sm90a {
            common.push("-DGROUPMM_SM90_TMA=1".into());
        }
        let mut all_archs: Vec<String> = archs.iter().map(|a| gencode(a)).collect();
        // PTX of the lowest listed non-"a" arch, for GPUs newer than any listed.
        if let Some(a) = archs.iter().find(|a| !a.ends_with('a')) {
            all_archs.push(format!("-gencode=arch=compute_{a},code=compute_{a}"));
        }
        let extra = env::var("GROUPMM_NVCC_FLAGS")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect();
        Flags {
            sm90a,
            common,
            all_archs,
            extra,
            dev_knobs,
        }
    }

    /// One file's nvcc flags: `sm90_*` files for 90a only, the others for every arch.
    pub fn for_file(&self, sm90_only: bool) -> Vec<String> {
        let mut args = self.common.clone();
        if sm90_only {
            args.push(gencode("90a"));
        } else {
            args.extend(self.all_archs.iter().cloned());
        }
        args.extend(self.extra.iter().cloned());
        args
    }

    /// The flags of a file built for every arch (what the C++ harness compiles with).
    pub fn all(&self) -> Vec<String> {
        self.for_file(false)
    }
}

/// `-gencode` flags for one arch entry of GROUPMM_CUDA_ARCHS ("80", "86", "90a", ...).
fn gencode(arch: &str) -> String {
    format!("-gencode=arch=compute_{arch},code=sm_{arch}")
}
