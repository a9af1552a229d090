//! The gRPC server (in progress).
