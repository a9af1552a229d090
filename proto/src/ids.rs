//! The identities that cross the replica protocol, as types: [`ReplicaId`] (a replica's own
//! id, which it reports in its Info and which membership epochs list) and [`RequestId`] (one
//! data-stream request, matched to its answer).
//!
//! On the wire both are plain fields (a string and a u64); these types keep them from being
//! mixed up with addresses, names or other counters once they are inside a program.

use std::fmt;

/// A replica's id: made by the replica when its directory is created, kept in its metadata,
/// and named in every membership epoch it is part of. Not its address: a replica keeps its id
/// when it moves, and an address can come back serving another replica.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplicaId(pub String);

impl ReplicaId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for ReplicaId {
    fn from(s: String) -> ReplicaId {
        ReplicaId(s)
    }
}

impl From<&str> for ReplicaId {
    fn from(s: &str) -> ReplicaId {
        ReplicaId(s.to_string())
    }
}

/// One request on a replica data stream. An engine takes them from one counter per volume;
/// id 0 is the hello's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The id a data stream's hello is answered with.
    pub const HELLO: RequestId = RequestId(0);
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_show_as_people_read_them() {
        assert_eq!(ReplicaId::from("r-1a2b").to_string(), "r-1a2b");
        assert_eq!(RequestId(42).to_string(), "request 42");
        assert!(RequestId(1) > RequestId::HELLO);
    }
}
