//! Starting and driving zebu-engine processes in tests (to be written).
