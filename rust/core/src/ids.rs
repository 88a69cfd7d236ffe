//! Identities. Dense execution rows are private; these are what callers see.

/// The caller's identity of a request; never zero for a real request.
pub type RequestId = u64;
/// Monotonic id of a committed step.
pub type StepId = u64;

/// Stable identity of a live sequence's resident state (its KV block-table row). Releasing the slot bumps the
/// epoch, so a ref kept after release is refused everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResidentRef {
    pub slot: u32,
    pub epoch: u32,
}

/// Who a sequence is: the caller's request id, the position that keys its finished result, and its resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SequenceIdentity {
    pub request_id: RequestId,
    pub original_index: u32,
    pub resident: ResidentRef,
}
