//! Backends: the only code that knows the device.
pub mod cpu;
