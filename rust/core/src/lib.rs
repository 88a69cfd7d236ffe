//! stepllm-core: a stepped LLM inference runtime. Everything that matters lives here; the Python
//! binding crate only converts.

pub mod backend;
pub mod coordinator;
pub mod engine;
pub mod error;
pub mod ids;
pub mod intent;
pub mod model;
pub mod request;
pub mod sampling;
pub mod session;
pub mod state;
pub mod step;
pub mod stepped;
pub mod parallel;
pub mod prefill_group;
pub mod stepper;
pub mod stepper_handle;
pub mod text;
#[doc(hidden)]
pub mod test_support;

pub use error::{Error, Result};
