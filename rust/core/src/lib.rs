//! stepllm-core: a stepped LLM inference runtime. Everything that matters lives here; the Python
//! binding crate only converts.

pub mod backend;
pub mod error;
pub mod ids;
pub mod model;
pub mod request;
pub mod sampling;
pub mod step;
pub mod text;

pub use error::{Error, Result};
