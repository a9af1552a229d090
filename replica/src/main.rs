//! `zebu-replica`: serve one replica directory over gRPC, or print its info.
fn main() {}
