//! NBD server (in progress).
