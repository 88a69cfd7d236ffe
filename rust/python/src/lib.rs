//! stepllm._core: PyO3 bindings over stepllm-core. Conversions, GIL release and error mapping only; every
//! rule lives in the core.

mod config;
mod coordinator;
mod engine;
mod errors;
mod hashing;
mod request;
mod types;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    types::register(m)?;
    request::register(m)?;
    config::register(m)?;
    coordinator::register(m)?;
    engine::register(m)?;
    Ok(())
}
