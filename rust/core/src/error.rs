//! One error type for the whole core. The binding crate maps each variant family to a Python exception:
//! `InvalidRequest` -> ValueError subclass, `Protocol`/`StaleRef` -> RuntimeError subclass, the rest -> StepllmError.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// The caller's input can never be served as given (bad prompt, bad sampling value, too long...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// An operation arrived in the wrong order or in the wrong state.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A ResidentRef whose slot was released (epoch bumped) or never existed.
    #[error("stale resident ref (slot {slot}, epoch {epoch}): {why}")]
    StaleRef { slot: u32, epoch: u32, why: String },
    /// Model files missing, corrupt or of an unsupported kind.
    #[error("model load error: {0}")]
    Load(String),
    /// The compute device failed or is unavailable.
    #[error("device error: {0}")]
    Device(String),
    /// A bug: an internal invariant was broken.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub fn invalid<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::InvalidRequest(msg.into()))
}

pub fn protocol<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Protocol(msg.into()))
}

pub fn load_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Load(msg.into()))
}

/// A load error with `context` (which file, tensor or rank) put before its message; other errors as they are.
pub fn with_context(e: Error, context: &str) -> Error {
    match e {
        Error::Load(msg) => Error::Load(format!("{context}: {msg}")),
        other => other,
    }
}
