//! Compiles kernels/*.cu and embeds the results, twice: as compute_80 PTX (the driver JITs it for sm_80 and up),
//! and with programmatic dependent launch (`-DSTEPLLM_PDL`) as a fatbin of sm_90 machine code plus compute_90
//! PTX, which Hopper and newer load instead. The machine code spares an H100/H200 the JIT of every module on a
//! machine's first run (19-25 s measured on the H200, benchmarks/RESULTS.md); newer GPUs JIT the compute_90 PTX.
//!
//! nvcc is looked up in $NVCC, then in the PyPI package (`pip install "cuda-toolkit[nvcc,cccl]==13.0.*"`),
//! then on PATH. Without nvcc the build still succeeds: the CUDA backend then reports, at run time, that
//! it was built without kernels. That keeps CPU-only CI free of any CUDA dependency.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-env-changed=NVCC");
    // nvcc is also found through `python3` on PATH: a build from another shell (another venv) must look again,
    // or cargo reuses a kernel-less result and the wheel silently lacks the CUDA backend.
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    println!("cargo:rerun-if-env-changed=STEPLLM_NO_CUDA_KERNELS");

    let sources = cu_sources(&kernels);
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    let nvcc = if env::var_os("STEPLLM_NO_CUDA_KERNELS").is_some() { None } else { find_nvcc() };
    let modules = match &nvcc {
        Some(nvcc) => compile_all(nvcc, &kernels, &sources, &out_dir),
        None => {
            println!(
                "cargo:warning=nvcc not found: building without CUDA kernels (install \
                 cuda-toolkit[nvcc,cccl]==13.0.* with pip, or set NVCC, and rebuild to enable the CUDA backend)"
            );
            Vec::new()
        }
    };
    write_table(&out_dir, &modules);
}

fn cu_sources(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    v.sort();
    v
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    // The PyPI wheels put nvcc in site-packages/nvidia/cu13/bin; ask python where `nvidia` lives.
    for python in ["python3", "python"] {
        let script = "import nvidia,os\nfor p in nvidia.__path__: print(os.path.join(p,'cu13','bin','nvcc'))";
        if let Ok(out) = Command::new(python).args(["-c", script]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let p = PathBuf::from(line.trim());
                if p.is_file() {
                    return Some(p);
                }
            }
        }
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file())
}

/// The first bytes of a fatbin (0xBA55ED50, little-endian).
const FATBIN_MAGIC: [u8; 4] = [0x50, 0xED, 0x55, 0xBA];

/// nvcc's target for the Hopper image: sm_90 machine code, and compute_90 PTX for newer GPUs to JIT.
const SM90_WITH_PTX: &str = "arch=compute_90,code=[sm_90,compute_90]";

/// One module's images: (name, compute_80 PTX, sm_90 + compute_90 fatbin with PDL).
type Module = (String, PathBuf, PathBuf);

/// Compile every source for both targets in parallel (one nvcc per file and target).
fn compile_all(nvcc: &Path, include: &Path, sources: &[PathBuf], out_dir: &Path) -> Vec<Module> {
    let compile = |src: &Path, image: &Path, flags: &[&str]| {
        Command::new(nvcc)
            .args(["-O3", "-std=c++17"])
            .args(flags)
            .arg("-I")
            .arg(include)
            .arg("-o")
            .arg(image)
            .arg(src)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()))
    };
    let jobs: Vec<_> = sources
        .iter()
        .map(|src| {
            let name = src.file_stem().unwrap().to_string_lossy().into_owned();
            let base = out_dir.join(format!("{name}.ptx"));
            let pdl = out_dir.join(format!("{name}.sm90.fatbin"));
            let children = [
                compile(src, &base, &["--ptx", "-arch=compute_80"]),
                compile(src, &pdl, &["--fatbin", "-gencode", SM90_WITH_PTX, "-DSTEPLLM_PDL"]),
            ];
            (name, base, pdl, children)
        })
        .collect();
    jobs.into_iter()
        .map(|(name, base, pdl, children)| {
            for mut child in children {
                let status = child.wait().expect("nvcc did not run");
                assert!(status.success(), "nvcc failed on kernels/{name}.cu (see the error above)");
            }
            // The driver takes any image through one entry point; a PTX text where the fatbin belongs would load,
            // and silently bring back the first run's JIT.
            let magic = fs::read(&pdl).map(|b| b.get(..4) == Some(&FATBIN_MAGIC[..])).unwrap_or(false);
            assert!(magic, "nvcc wrote {} but it is not a fatbin", pdl.display());
            (name, base, pdl)
        })
        .collect()
}

fn write_table(out_dir: &Path, modules: &[Module]) {
    let mut code = String::from(
        "/// (module name, compute_80 PTX, sm_90 + compute_90 fatbin with PDL) for every kernels/*.cu;\n\
         /// empty without nvcc.\n",
    );
    code.push_str("pub const KERNEL_MODULES: &[(&str, &str, &[u8])] = &[\n");
    for (name, base, pdl) in modules {
        code.push_str(&format!(
            "    ({name:?}, include_str!({:?}), include_bytes!({:?})),\n",
            base.display().to_string(),
            pdl.display().to_string()
        ));
    }
    code.push_str("];\n");
    fs::write(out_dir.join("kernel_modules.rs"), code).unwrap();
}
